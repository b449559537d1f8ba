"""Server mode on two GPUs: a stock `vllm serve` on GPU 1, the trainer on GPU 0. After an NCCL sync of changed
weights, the server's log-probs of its own samples match the trainer's within 0.02 mean absolute (and before the
sync they do not)."""
import os
import subprocess
import sys
import time

import pytest
import torch
from gpu_helpers import MODEL, QUESTIONS, change_weights, mean_abs_diff, record, trainer_logprobs
from transformers import AutoModelForCausalLM, AutoTokenizer

import vllm_utils

PORT = int(os.environ.get("VLLM_TEST_PORT", "8011"))


@pytest.fixture(scope="module")
def server():
    if os.environ.get("VLLM_TEST_SERVER_URL"):  # a server already started on other GPUs (benchmarks/gpu_phase.sh)
        yield os.environ["VLLM_TEST_SERVER_URL"], float("nan")
        return
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (or VLLM_TEST_SERVER_URL of a server on GPUs this process does not see)")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "1", "VLLM_SERVER_DEV_MODE": "1"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", MODEL, "--port", str(PORT),
           "--weight-transfer-config", '{"backend": "nccl"}', "--logprobs-mode", "processed_logprobs",
           "--max-logprobs", "-1", "--max-model-len", "1024", "--gpu-memory-utilization", "0.5"]
    log = open(os.path.join(os.environ.get("GPU_RESULTS_DIR", "/tmp"), "test_server_vllm.log"), "w")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{PORT}"
    try:
        vllm_utils.wait_for_server(url, 400, MODEL)
        yield url, time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(60)


def test_server_sync_matches_trainer(server):
    url, startup_s = server
    torch.cuda.set_device(0)
    model_id, max_len = vllm_utils.check_server(url, MODEL)
    vllm_utils.check_gpu_not_shared(url)
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).cuda()  # as grpo.py: fp32 + bf16 autocast
    group = vllm_utils.server_init_weight_sync(url, 51216)

    change_weights(model, tokenizer)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
               for q in QUESTIONS]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    fields = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "max_tokens": 32}
    repeated = [p for p in prompts for _ in range(4)]

    ids_before, lp_before = vllm_utils.server_generate(url, model_id, prompts, 4, fields)
    trainer_before, mask_before = trainer_logprobs(model, repeated, ids_before, 1.0)
    before, _ = mean_abs_diff(trainer_before, lp_before, mask_before)
    t0 = time.perf_counter()
    vllm_utils.server_sync_weights(url, group, model)
    sync_s = time.perf_counter() - t0
    ids_after, lp_after = vllm_utils.server_generate(url, model_id, prompts, 4, fields)
    trainer_lp, mask = trainer_logprobs(model, repeated, ids_after, 1.0)
    after, max_after = mean_abs_diff(trainer_lp, lp_after, mask)
    record("server_sync", {"model": MODEL, "server_startup_s": startup_s, "sync_s": sync_s,
                           "synced_gb": sum(t.numel() * t.element_size() for _, t in vllm_utils.named_weights(model)) / 1e9,
                           "logprob_mean_abs_diff_before_sync": before, "logprob_mean_abs_diff_after_sync": after,
                           "logprob_max_abs_diff_after_sync": max_after})
    assert before > 0.05 and before > 3 * after, "the changed weights should give visibly different log-probs before the sync"
    assert after < 0.02
