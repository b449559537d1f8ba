"""Colocate on one GPU: sleep frees most of vLLM's memory, and after wake + a weight load through vLLM's reload path
the engine samples from the trainer's (changed) weights: its log-probs match the trainer's within 0.02 mean absolute.
Without sleep mode, and with tensor parallelism over 2 GPUs under torchrun (tests/gpu/dist_colocate_tp.py), the same.
vLLM allows one sleep-mode engine per process, so run each test in a process of its own:

    pytest tests/gpu/test_colocate.py -q -k sleep_wake      # 1 GPU
    pytest tests/gpu/test_colocate.py -q -k without_sleep   # 1 GPU
    pytest tests/gpu/test_colocate.py -q -k tensor_parallel # 2 GPUs (runs torchrun itself)
"""

import os
import subprocess
import sys
import time

import pytest
import torch
from gpu_helpers import MODEL, QUESTIONS, change_weights, mean_abs_diff, record, trainer_logprobs
from transformers import AutoModelForCausalLM, AutoTokenizer

import vllm_utils


def test_colocate_sleep_wake_sync():
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).cuda()  # as grpo.py: fp32 + bf16 autocast
    free_start = torch.cuda.mem_get_info()[0]
    t0 = time.perf_counter()
    llm = vllm_utils.colocate_engine(MODEL, gpu_memory_utilization=0.3, max_model_len=512, enable_sleep_mode=True)
    startup_s = time.perf_counter() - t0
    free_awake = torch.cuda.mem_get_info()[0]
    t0 = time.perf_counter()
    llm.sleep(level=2)
    sleep_s = time.perf_counter() - t0
    torch.cuda.empty_cache()
    free_asleep = torch.cuda.mem_get_info()[0]
    vllm_bytes = free_start - free_awake
    freed = free_asleep - free_awake
    assert freed > 0.8 * vllm_bytes, f"sleep freed {freed / 2**30:.1f} GiB of vLLM's {vllm_bytes / 2**30:.1f} GiB"

    # change the trainer's weights so that the engine's checkpoint weights would be visibly wrong
    change_weights(model, tokenizer)
    t0 = time.perf_counter()
    llm.wake_up(tags=["weights"])
    vllm_utils.sync_weights({"mode": "colocate", "llm": llm}, model)  # reload every weight, reset the prefix cache
    llm.wake_up(tags=["kv_cache"])
    wake_load_s = time.perf_counter() - t0

    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        for q in QUESTIONS
    ]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    fields = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "max_tokens": 32}
    completion_ids, vllm_lp = vllm_utils.colocate_generate(llm, prompts, 4, fields)
    assert len(completion_ids) == 12 and all(len(c) == len(lp) for c, lp in zip(completion_ids, vllm_lp))
    trainer_lp, mask = trainer_logprobs(model, [p for p in prompts for _ in range(4)], completion_ids, 1.0)
    mean_diff, max_diff = mean_abs_diff(trainer_lp, vllm_lp, mask)
    llm.sleep(level=2)
    record(
        "colocate_sleep",
        {
            "model": MODEL,
            "startup_s": startup_s,
            "vllm_gib": vllm_bytes / 2**30,
            "freed_by_sleep_gib": freed / 2**30,
            "sleep_s": sleep_s,
            "wake_load_s": wake_load_s,
            "logprob_mean_abs_diff": mean_diff,
            "logprob_max_abs_diff": max_diff,
        },
    )
    assert mean_diff < 0.02


def test_colocate_without_sleep_mode_loads_through_the_reload_path():
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).cuda()
    engine = {
        "mode": "colocate",
        "sleep": False,
        "tp_group": None,
        "n": 4,
        "llm": vllm_utils.colocate_engine(MODEL, gpu_memory_utilization=0.3, max_model_len=512),
        "fields": {
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "max_tokens": 32,
        },
    }
    change_weights(model, tokenizer)
    t0 = time.perf_counter()
    vllm_utils.sync_weights(engine, model)
    sync_s = time.perf_counter() - t0
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        for q in QUESTIONS
    ]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    completion_ids, vllm_lp = vllm_utils.generate(engine, prompts)
    trainer_lp, mask = trainer_logprobs(model, [p for p in prompts for _ in range(4)], completion_ids, 1.0)
    mean_diff, max_diff = mean_abs_diff(trainer_lp, vllm_lp, mask)
    record(
        "colocate_no_sleep",
        {"model": MODEL, "sync_s": sync_s, "logprob_mean_abs_diff": mean_diff, "logprob_max_abs_diff": max_diff},
    )
    assert mean_diff < 0.02


def test_colocate_tensor_parallel_over_two_gpus():
    if torch.cuda.device_count() < 2 or not os.path.exists(os.environ.get("VLLM_TEST_TP_MODEL", "/tmp/bench-qwen05b")):
        pytest.skip("needs two GPUs and $VLLM_TEST_TP_MODEL (default /tmp/bench-qwen05b)")
    script = os.path.join(os.path.dirname(__file__), "dist_colocate_tp.py")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0 and "COLOCATE TP OK" in result.stdout, result.stdout[-3000:] + result.stderr[-5000:]
