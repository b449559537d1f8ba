"""The LM head's share of a training step, variant by variant: log pi(token) and the entropy of each completion token
from the final hidden states, forward and backward, as the scripts' per_token_logprobs computes them chunk by chunk.

The profile of a bench-0.5b step (benchmarks/results/profile_train_bench.txt) puts much of the forward/backward in this
part: fp32 copies of vocabulary-wide logits, the log-softmax, the gather's backward (a zeroed vocabulary-wide gradient
per chunk) and the entropy. Each variant here computes the same numbers; `--check` (CPU is enough) verifies that
against the scripts' own function, and the default run times them on a GPU at the bench's sizes.

    python benchmarks/logprob_variants.py --check      # exactness of every variant against log-softmax + gather
    python benchmarks/logprob_variants.py              # GPU: ms per step (65,536 tokens, vocabulary 151,936)
"""

import argparse
import os
import sys
import time

import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo  # noqa: E402


class _Config:  # no final-logit transform (Qwen2, Llama): grpo.final_logits is the identity
    def get_text_config(self):
        return self

    model_type = "qwen2"


def scripts_version(hidden, targets, weight, chunk):
    """grpo.py's TokenLogprobs, which runs the chunks itself, as per_token_logprobs calls it."""
    return grpo.TokenLogprobs.apply(hidden, weight, None, targets, _Config(), 1.0, True, chunk, False)


def _log_softmax_chunk(hidden, targets, weight):
    logits = torch.nn.functional.linear(hidden, weight).float()
    all_logprobs = logits.log_softmax(-1)
    logprobs = all_logprobs.gather(-1, targets[:, None]).squeeze(-1)
    return logprobs, -(all_logprobs.exp() * all_logprobs).sum(-1).detach()


def checkpointed_version(hidden, targets, weight, chunk):
    """The scripts' implementation before TokenLogprobs: log-softmax + gather under activation checkpointing."""
    outs = [
        checkpoint(_log_softmax_chunk, h, t, weight, use_reentrant=False)
        for h, t in zip(hidden.split(chunk), targets.split(chunk))
    ]
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


def _lse_chunk(hidden, targets, weight):
    logits = torch.nn.functional.linear(hidden, weight).float()
    lse = logits.logsumexp(-1)
    logprobs = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    with torch.no_grad():
        entropy = lse - (logits.softmax(-1) * logits).sum(-1)
    return logprobs, entropy


def logsumexp_version(hidden, targets, weight, chunk):
    """log pi = z_t - logsumexp(z): no saved log-softmax; the entropy outside the autograd graph."""
    outs = [
        checkpoint(_lse_chunk, h, t, weight, use_reentrant=False)
        for h, t in zip(hidden.split(chunk), targets.split(chunk))
    ]
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


class _FusedChunk(torch.autograd.Function):
    """One chunk: forward keeps only (n,) tensors; backward recomputes the logits and writes their gradient once,
    -g * (softmax - onehot), in the matmul's dtype (no vocabulary-wide zeros, no saved log-softmax)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets):
        logits = (hidden @ weight.T).float()
        lse = logits.logsumexp(-1)
        logprobs = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
        entropy = lse - (logits.softmax(-1) * logits).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):
        hidden, weight, targets, lse = ctx.saved_tensors
        logits = (hidden @ weight.T).float()
        grad = logits.sub_(lse[:, None]).exp_().mul_(-grad_logprobs[:, None])  # -g * softmax, in place
        grad[torch.arange(len(targets), device=grad.device), targets] += grad_logprobs
        grad = grad.to(hidden.dtype)
        return grad @ weight, grad.T @ hidden, None


def fused_version(hidden, targets, weight, chunk):
    """A custom autograd function per chunk (single-GPU sketch: FSDP2's sharded LM head is not handled here)."""
    outs = [_FusedChunk.apply(h, weight, t) for h, t in zip(hidden.split(chunk), targets.split(chunk))]
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


def _stats(raw, targets):
    """One chunk's log-sum-exp, log pi(target) and entropy from its LM-head output, in float32: one fused kernel."""
    z = raw.float()
    lse = z.logsumexp(-1)
    log_softmax = z - lse[:, None]
    return lse, z.gather(-1, targets[:, None]).squeeze(-1) - lse, -(log_softmax.exp() * log_softmax).sum(-1)


def _logit_grad(raw, lse, grad_logprobs, targets):
    """g * (onehot(t) - softmax(z)) in the LM head's dtype, written once (the one-hot is a comparison in the kernel)."""
    onehot = torch.arange(raw.shape[-1], device=raw.device) == targets[:, None]
    return (grad_logprobs[:, None] * (onehot.float() - (raw.float() - lse[:, None]).exp())).to(raw.dtype)


_compiled = {}


class _CompiledChunks(torch.autograd.Function):
    """The scripts' TokenLogprobs with each chunk's elementwise work (float copy, log-sum-exp, gather, entropy; in the
    backward softmax, one-hot and the cast) torch.compile'd into one kernel each, instead of ~8 vocabulary-wide passes."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk):
        for fn in (_stats, _logit_grad):
            _compiled.setdefault(fn, torch.compile(fn, dynamic=True))
        lse, logprobs, entropy = (torch.empty(len(hidden), device=hidden.device) for _ in range(3))
        for rows in (slice(s, s + chunk) for s in range(0, len(hidden), chunk)):
            lse[rows], logprobs[rows], entropy[rows] = _compiled[_stats](hidden[rows] @ weight.T, targets[rows])
        ctx.chunk = chunk
        ctx.save_for_backward(hidden, weight, targets, lse)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):
        hidden, weight, targets, lse = ctx.saved_tensors
        grad_hidden, grad_weight = torch.empty_like(hidden), torch.zeros_like(weight, dtype=torch.float32)
        for rows in (slice(s, s + ctx.chunk) for s in range(0, len(hidden), ctx.chunk)):
            h = hidden[rows]
            grad = _compiled[_logit_grad](h @ weight.T, lse[rows], grad_logprobs[rows], targets[rows])
            grad_hidden[rows] = grad @ weight
            grpo.add_matmul(grad_weight, grad.T, h)
        return grad_hidden, grad_weight.to(weight.dtype), None, None


def compiled_version(hidden, targets, weight, chunk):
    """As the scripts, with torch.compile'd elementwise work per chunk (a candidate, not in the scripts)."""
    return _CompiledChunks.apply(hidden, weight, targets, chunk)


VARIANTS = {
    "scripts": scripts_version,
    "checkpointed": checkpointed_version,
    "logsumexp": logsumexp_version,
    "fused": fused_version,
    "compiled": compiled_version,
}


def run(variant, hidden, targets, weight, chunk, grad):
    hidden, weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    logprobs, entropy = VARIANTS[variant](hidden, targets, weight, chunk)
    (logprobs * grad).sum().backward()
    return logprobs.detach(), entropy.detach(), hidden.grad, weight.grad


def check():
    """Every variant against plain log-softmax + gather, in float32 on the CPU: values and gradients (to float32 rounding)."""
    g = torch.Generator().manual_seed(0)
    n, h, v = 300, 32, 1000
    hidden, weight = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g)
    targets, grad = torch.randint(0, v, (n,), generator=g), torch.randn(n, generator=g)
    reference = run("checkpointed", hidden, targets, weight, 128, grad)
    for name in VARIANTS:
        for a, b, what in zip(
            run(name, hidden, targets, weight, 128, grad), reference, ("logprobs", "entropy", "d hidden", "d weight")
        ):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"{name}: {what}")
        print(f"{name}: logprobs, entropy and both gradients equal log-softmax + gather's")


def time_variants(tokens=65536, hidden_size=896, vocab=151936, chunks=(1024, 4096)):
    device = torch.device("cuda")
    hidden = torch.randn(tokens, hidden_size, device=device, dtype=torch.bfloat16)
    weight = torch.randn(vocab, hidden_size, device=device, dtype=torch.bfloat16) * 0.02
    targets = torch.randint(0, vocab, (tokens,), device=device)
    grad = torch.randn(tokens, device=device)
    for chunk in chunks:
        for name in VARIANTS:
            for _ in range(2):
                run(name, hidden, targets, weight, chunk, grad)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            for _ in range(3):
                run(name, hidden, targets, weight, chunk, grad)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() / 2**30
            print(f"chunk {chunk} {name}: {(time.perf_counter() - t0) / 3 * 1000:.0f} ms per step, peak {peak:.1f} GiB")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--check", action="store_true", help="verify every variant against log-softmax + gather (CPU is enough)"
    )
    check() if parser.parse_args().check else time_variants()
