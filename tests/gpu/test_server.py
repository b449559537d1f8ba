"""Server mode on two GPUs: a stock `vllm serve` on GPU 1, the trainer on GPU 0. After an NCCL sync of changed
weights (checked against the served model first, the server paused around it), the server's log-probs of its own
samples match the trainer's within 0.02 mean absolute (and before the sync they do not). A failed update leaves the
server serving the weights it had; an update left active by a dead trainer is explained.

    pytest tests/gpu/test_server.py -q    # 2 GPUs; or VLLM_TEST_SERVER_URL of a server on GPUs this process cannot see
"""

import os
import subprocess
import time

import pytest
import requests
import torch
from gpu_helpers import MODEL, QUESTIONS, change_weights, mean_abs_diff, record, trainer_logprobs
from tiny_models import serve_args
from transformers import AutoModelForCausalLM, AutoTokenizer

import vllm_utils

PORT = int(os.environ.get("VLLM_TEST_PORT", "8011"))


@pytest.fixture(scope="module")
def server():
    if os.environ.get("VLLM_TEST_SERVER_URL"):  # a server already started on other GPUs
        yield os.environ["VLLM_TEST_SERVER_URL"], float("nan")
        return
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (or VLLM_TEST_SERVER_URL of a server on GPUs this process does not see)")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "1", "VLLM_SERVER_DEV_MODE": "1"}
    cmd = serve_args(MODEL, PORT, memory="0.5", eager=False)  # compiled, as a real server: its startup is timed
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


def _prompts(tokenizer):
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        for q in QUESTIONS
    ]
    return [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]


def _server_vs_trainer(url, model_id, model, prompts):
    """Mean |server - trainer| log-prob of the server's samples (4 per prompt, temperature 1)."""
    fields = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "max_tokens": 32}
    ids, lps = vllm_utils.server_generate(url, model_id, prompts, 4, fields, chunk_size=2)
    trainer_lp, mask = trainer_logprobs(model, [p for p in prompts for _ in range(4)], ids, 1.0)
    return mean_abs_diff(trainer_lp, lps, mask)[0]


def test_server_sync_matches_trainer(server):
    url, startup_s = server
    torch.cuda.set_device(0)
    info = vllm_utils.check_server(url, MODEL)
    model_id = info["model_id"]
    vllm_utils.check_transport(url, info, MODEL)  # NCCL: a server on this GPU is refused as the group forms, below
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).cuda()  # as grpo.py: fp32 + bf16 autocast
    vllm_utils.check_same_model(info, model, MODEL)  # raises if the server serves something else
    group = vllm_utils.server_init_weight_sync(url, None, version=info["version"])  # a free port

    change_weights(model, tokenizer)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        for q in QUESTIONS
    ]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    fields = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "max_tokens": 32}
    repeated = [p for p in prompts for _ in range(4)]

    ids_before, lp_before = vllm_utils.server_generate(url, model_id, prompts, 4, fields)
    trainer_before, mask_before = trainer_logprobs(model, repeated, ids_before, 1.0)
    before, _ = mean_abs_diff(trainer_before, lp_before, mask_before)
    t0 = time.perf_counter()
    vllm_utils.server_sync_weights(url, group, model, info["version"], name=MODEL)
    sync_s = time.perf_counter() - t0
    ids_after, lp_after = vllm_utils.server_generate(url, model_id, prompts, 4, fields)
    trainer_lp, mask = trainer_logprobs(model, repeated, ids_after, 1.0)
    after, max_after = mean_abs_diff(trainer_lp, lp_after, mask)
    record(
        "server_sync",
        {
            "model": MODEL,
            "server_startup_s": startup_s,
            "sync_s": sync_s,
            "synced_gb": sum(t.numel() * t.element_size() for _, t in vllm_utils.named_weights(model)) / 1e9,
            "logprob_mean_abs_diff_before_sync": before,
            "logprob_mean_abs_diff_after_sync": after,
            "logprob_max_abs_diff_after_sync": max_after,
        },
    )
    assert before > 0.05 and before > 3 * after, (
        "the changed weights should give visibly different log-probs before the sync"
    )
    assert after < 0.02


def test_a_failed_update_leaves_the_server_serving_its_weights_and_an_active_one_is_finished(server, monkeypatch):
    """Both sides fail before any NCCL call (the server rejects the update message after /start_weight_update moved its
    layers to the meta device; the trainer's producer raises): the trainer's restore gives the layers their weights
    back, so the server's log-probs still match the trainer's weights of the last good sync. Then an update left
    active (as a dead trainer leaves it) is finished by the next sync, which goes on and syncs."""
    from vllm.distributed.weight_transfer import packed_tensor

    url, _ = server
    torch.cuda.set_device(0)
    info = vllm_utils.check_server(url, MODEL)
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).cuda()
    group = vllm_utils.server_init_weight_sync(url, None, version=info["version"])
    change_weights(model, tokenizer)
    vllm_utils.server_sync_weights(url, group, model, info["version"], name=MODEL)
    prompts = _prompts(tokenizer)
    synced = _server_vs_trainer(url, info["model_id"], model, prompts)

    messages = vllm_utils.weight_sync_messages
    monkeypatch.setattr(
        vllm_utils, "weight_sync_messages", lambda *a: (messages(*a)[0], {**messages(*a)[1], "bogus": 1})
    )
    monkeypatch.setattr(packed_tensor, "packed_nccl_broadcast_producer", lambda *a: 1 / 0)
    with pytest.raises(RuntimeError, match="The server at .* was restored"):
        vllm_utils.server_sync_weights(url, group, model, info["version"], name=MODEL)
    after_failure = _server_vs_trainer(url, info["model_id"], model, prompts)

    monkeypatch.undo()  # a working trainer again (nothing went over NCCL: the group is intact)
    requests.post(f"{url}/start_weight_update", json={}, timeout=60).raise_for_status()  # a trainer that died here
    vllm_utils.server_sync_weights(url, group, model, info["version"], name=MODEL)  # finishes that update, then syncs
    after_active = _server_vs_trainer(url, info["model_id"], model, prompts)
    record(
        "server_failures",
        {
            "model": MODEL,
            "logprob_mean_abs_diff_synced": synced,
            "after_failed_update": after_failure,
            "after_active_update_finished": after_active,
        },
    )
    assert synced < 0.02 and after_failure < 0.02 and after_active < 0.02
    assert requests.get(f"{url}/is_paused", timeout=10).json()["is_paused"] is False  # resumed every time
