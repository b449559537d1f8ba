"""Shared helpers of the GPU tests."""

import json
import os

import torch

MODEL = os.environ.get("VLLM_TEST_MODEL", "/tmp/smol")
# prompts of the addition task (benchmarks/make_tasks.py), sampled at temperature 1 as in training
QUESTIONS = [f"What is {a} + {b}? Reply with only the number." for a, b in [(28, 13), (25, 29), (3, 17)]]


def change_weights(model, tokenizer, lr=3e-4, steps=3):
    """Change the weights the way training does (a few AdamW steps of supervised fine-tuning), so that stale weights
    in vLLM would show while the model stays a sane language model."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    batch = tokenizer(["The answer is 42. I like numbers."] * 4, return_tensors="pt").to(model.device)
    for _ in range(steps):
        with torch.autocast("cuda", torch.bfloat16):
            loss = model(**batch, labels=batch["input_ids"]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


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
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        return grpo.per_token_logprobs(model, ids, attn, pos, mask, P, temperature), mask


def mean_abs_diff(trainer_lp, vllm_lp, mask):
    """Mean |trainer - vLLM| log-prob over real completion tokens."""
    padded = torch.zeros_like(trainer_lp)
    for i, lps in enumerate(vllm_lp):
        padded[i, : len(lps)] = torch.tensor([float("nan") if v is None else v for v in lps], device=padded.device)
    diff = (trainer_lp - padded).abs()[mask.bool()]
    return diff.nanmean().item(), diff.nan_to_num(0).max().item()
