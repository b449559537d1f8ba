"""The trainer's share of a bench-0.5b step, without generation: one GRPO optimizer step on a synthetic round (256
completions of 256 tokens after ~70-token prompts, like the bench) through grpo.py's own functions, timed per variant,
plus a torch.profiler table of the default one. Usage (GPU host): python benchmarks/profile_train.py MODEL OUT.txt
[memory [SCRIPT_DIR] | probe | lean]: `memory` times only the rows that set the trainer's peak memory (with and without
gradient checkpointing), with grpo.py from SCRIPT_DIR (default: this checkout), e.g. an older commit's for a
before/after; `probe` profiles the default step, then times smaller LM-head chunks and torch.compile'd decoder layers;
`lean` times the compiled layers with and without gradient checkpointing, the LM head's gradient into .grad or not, at
several micro-batch sizes."""

import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM

variants = sys.argv[3] if len(sys.argv) > 3 else "all"
sys.path.insert(0, sys.argv[4] if len(sys.argv) > 4 else os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo  # noqa: E402

model_path, out = sys.argv[1], sys.argv[2]
device = torch.device("cuda")
model = (
    AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device).train()
)  # checkpointing needs it
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, 150000, (70,), generator=g).tolist() for _ in range(32) for _ in range(8)]
completions = [torch.randint(0, 150000, (256,), generator=g).tolist() for _ in range(256)]
advantages = torch.randn(256, device=device)


def step(budget=11520, chunk_tokens=1024, with_entropy=True, forward_only=False, **into_grad):
    batches = grpo.token_budget_batches(range(256), [70] * 256, [256] * 256, budget)
    optimizer.zero_grad(set_to_none=True)
    for mb in batches:
        ids, attn, pos, cmask, P = grpo.collate([prompts[i] for i in mb], [completions[i] for i in mb], device, 0)
        with torch.autocast("cuda", torch.bfloat16, cache_enabled=False), torch.set_grad_enabled(not forward_only):
            out = grpo.per_token_logprobs(model, ids, attn, pos, cmask, P, 1.0, chunk_tokens, with_entropy, **into_grad)
            logprobs = out[0] if with_entropy else out
            if forward_only:
                continue
            loss = -(torch.exp(logprobs - logprobs.detach()) * advantages[mb, None] * cmask).sum() / 65536
        loss.backward()
    if not forward_only:
        optimizer.step()


def timed(name, **kwargs):
    for _ in range(2):
        step(**kwargs)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(3):
        step(**kwargs)
    torch.cuda.synchronize()
    line = (
        f"{name}: {(time.perf_counter() - t0) / 3:.3f} s/step, peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
    )
    print(line, flush=True)
    return line


if variants == "lean":  # --torch-compile's layers with and without checkpointing, the LM head's gradient into .grad
    for layer in grpo.decoder_layers(model):  # as the scripts' --torch-compile does
        layer.forward = torch.compile(layer.forward, dynamic=True)
    lines = []
    for checkpointing, budget, into_grad in (
        (False, 16384, False),
        (False, 16384, True),
        (True, 16384, False),
        (True, 16384, True),
        (True, 11520, True),
        (True, 8192, True),
        (True, 32768, True),
    ):
        model.gradient_checkpointing_disable()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        name = f"compiled layers, checkpointing {checkpointing}, budget {budget}, into_grad {into_grad}"
        lines.append(timed(name, budget=budget, into_grad=into_grad))
        open(out, "w").write("\n".join(lines) + "\n")
    sys.exit()
if variants == "probe":  # candidates for a cheaper trainer step: smaller LM-head chunks, compiled decoder layers
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(budget=16384)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60)
    lines = [timed("budget 16384 (the scripts' default)", budget=16384)]
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for budget, chunk in ((11520, 1024), (11520, 512), (11520, 256), (8192, 512)):
        lines.append(
            timed(f"gradient checkpointing, budget {budget}, chunk {chunk}", budget=budget, chunk_tokens=chunk)
        )
    model.gradient_checkpointing_disable()
    for layer in model.model.layers:
        layer.compile(dynamic=True)
    lines.append(timed("compiled decoder layers, budget 16384", budget=16384))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lines.append(timed("compiled decoder layers, gradient checkpointing, budget 11520", budget=11520))
    open(out, "w").write("\n".join(lines) + "\n\n" + table)
    sys.exit()
if variants == "memory":
    lines = [
        f"# grpo.py from {os.path.dirname(grpo.__file__)}",
        timed("budget 16384 (the scripts' default)", budget=16384),
    ]
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for budget in (16384, 11520, 8192):  # 11520: about TRL's micro-batch (32 sequences) in its bench
        lines.append(timed(f"gradient checkpointing, budget {budget}", budget=budget))
    open(out, "w").write("\n".join(lines) + "\n")
    sys.exit()
lines = [
    timed("budget 11520, chunk 1024, entropy"),
    timed("budget 16384 (the scripts' default)", budget=16384),
    timed("no entropy", with_entropy=False),
    timed("chunk 4096", chunk_tokens=4096),
    timed("budget 23040", budget=23040),
    timed("forward only, no grad", forward_only=True),
]
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
for budget in (11520, 16384, 32768):
    lines.append(timed(f"gradient checkpointing, budget {budget}", budget=budget))
lines.append(timed("gradient checkpointing, budget 11520, chunk 512", chunk_tokens=512))
model.gradient_checkpointing_disable()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    step()
    torch.cuda.synchronize()
table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=35, max_name_column_width=60)
open(out, "w").write("\n".join(lines) + "\n\n" + table)
print(table)
