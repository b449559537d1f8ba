"""GPU tests: real vLLM on real GPUs. Skipped unless CUDA and vLLM are present and the test model exists.
Model: $VLLM_TEST_MODEL (default /tmp/smol, SmolLM2-135M-Instruct on the H200 hosts). Numbers measured here are
written as JSON into $GPU_RESULTS_DIR when it is set."""
import json
import os

import pytest
import torch

MODEL = os.environ.get("VLLM_TEST_MODEL", "/tmp/smol")

try:
    import vllm  # noqa: F401

    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False


def pytest_collection_modifyitems(config, items):
    reason = None
    if not torch.cuda.is_available():
        reason = "needs a CUDA GPU"
    elif not HAVE_VLLM:
        reason = "needs vLLM"
    elif not os.path.exists(os.path.join(MODEL, "config.json")):
        reason = f"needs the test model at {MODEL} (set VLLM_TEST_MODEL)"
    for item in items:
        if reason and "tests/gpu" in str(item.fspath):
            item.add_marker(pytest.mark.skip(reason=reason))


def record(name, values):
    """Write measured numbers to $GPU_RESULTS_DIR/<name>.json (the benchmark script collects them)."""
    out = os.environ.get("GPU_RESULTS_DIR")
    print(name, json.dumps(values))
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump(values, f, indent=2)


def trainer_logprobs(model, prompt_ids, completion_ids, temperature):
    """The trainer's log-probs (grpo.per_token_logprobs) of the given completions; returns (B, C) and the mask."""
    import grpo

    ids, attn, pos, mask, P = grpo.collate(prompt_ids, completion_ids, model.device, pad_id=0)
    with torch.no_grad():
        return grpo.per_token_logprobs(model, ids, attn, pos, mask, P, temperature), mask


def mean_abs_diff(trainer_lp, vllm_lp, mask):
    """Mean |trainer - vLLM| log-prob over real completion tokens."""
    padded = torch.zeros_like(trainer_lp)
    for i, lps in enumerate(vllm_lp):
        padded[i, : len(lps)] = torch.tensor([float("nan") if v is None else v for v in lps], device=padded.device)
    diff = (trainer_lp - padded).abs()[mask.bool()]
    return diff.nanmean().item(), diff.nan_to_num(0).max().item()
