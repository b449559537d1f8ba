"""Where a colocated bench-0.5b step could get faster: variants of its two halves, timed alone on the GPU host.

    python benchmarks/speed_probe.py gen MODEL OUT.json     # colocated vLLM: 32 prompts x 8 x 256 tokens, per variant
    python benchmarks/speed_probe.py gen MODEL OUT.json gc  # the garbage collector on / off in turn, 3 times each
    python benchmarks/speed_probe.py train MODEL OUT.json   # one GRPO optimizer step on a synthetic round, per variant

gen: colocate_generate's settings before fa34d52 (logprobs=0 as dicts, detokenize=False) against flat log-probs (the
scripts' since), no log-probs, detokenizing, and the garbage collector off. train: grpo.py's own functions (as
benchmarks/profile_train.py) with fp32 weights under bf16 autocast (the scripts), bf16 weights, and each decoder layer
torch.compile'd. Three timed repetitions after two warm-ups; prints and writes the medians."""

import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
mode, model_path, out = sys.argv[1:4]
results = {"mode": mode, "model": model_path}


def timed(name, fn, reps=3, warmup=2):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    results[name] = {"s": round(statistics.median(times), 3), "all": [round(t, 3) for t in times]}
    results[name]["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    print(name, results[name], flush=True)
    json.dump(results, open(out, "w"), indent=1)


if mode == "gen":
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    import vllm_utils

    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()
    tok = AutoTokenizer.from_pretrained(model_path)
    prompts = [tok(" ".join(words[(7 * i + j) % 19] for j in range(60)) + f" {i}").input_ids for i in range(32)]
    t0 = time.perf_counter()
    llm = vllm_utils.colocate_engine(model_path, max_model_len=512, max_num_seqs=256, gpu_memory_utilization=0.3)
    results["engine_start_s"] = round(time.perf_counter() - t0, 1)
    results["async_scheduling"] = llm.llm_engine.vllm_config.scheduler_config.async_scheduling
    fields = dict(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=256)
    requests = [{"prompt_token_ids": p} for p in prompts]

    def run(flat=False, logprobs=0, detokenize=False, no_gc=False):
        params = SamplingParams(n=8, logprobs=logprobs, detokenize=detokenize, flat_logprobs=flat, **fields)
        if no_gc:
            gc.disable()
        outputs = llm.generate(requests, params, use_tqdm=False)
        samples = [s for o in outputs for s in o.outputs]
        if logprobs is not None and flat:
            lps = [list(s.logprobs.logprobs) for s in samples]
        elif logprobs is not None:
            lps = [[step[t].logprob for t, step in zip(s.token_ids, s.logprobs)] for s in samples]
        if no_gc:
            gc.enable()
        assert sum(len(s.token_ids) for s in samples) > 0
        if logprobs is not None:
            assert all(len(lp) == len(s.token_ids) for lp, s in zip(lps, samples))

    if len(sys.argv) > 4 and sys.argv[4] == "gc":  # the collector on / off in turn, with a trainer's model loaded too
        from transformers import AutoModelForCausalLM

        trainer_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).cuda()
        for i in (1, 2, 3):
            timed(f"flat_logprobs, gc on ({i})", lambda: run(flat=True), reps=5)
            timed(f"flat_logprobs, gc off ({i})", lambda: run(flat=True, no_gc=True), reps=5)
        sys.exit()
    timed("dict log-probs (the scripts before fa34d52)", run)
    timed("flat_logprobs (the scripts since)", lambda: run(flat=True))
    timed("flat_logprobs, gc off", lambda: run(flat=True, no_gc=True))
    timed("no logprobs", lambda: run(logprobs=None))
    timed("detokenize=True", lambda: run(detokenize=True))
    timed("dict log-probs again", run)
else:
    from transformers import AutoModelForCausalLM

    import grpo

    device = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 150000, (70,), generator=g).tolist() for _ in range(256)]
    completions = [torch.randint(0, 150000, (256,), generator=g).tolist() for _ in range(256)]
    advantages = torch.randn(256, device=device)

    def make(dtype):
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).train()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)

    def step(model, optimizer, budget=16384, autocast=True):
        optimizer.zero_grad(set_to_none=True)
        for mb in grpo.token_budget_batches(range(256), [70] * 256, [256] * 256, budget):
            ids, attn, pos, cmask, P = grpo.collate([prompts[i] for i in mb], [completions[i] for i in mb], device, 0)
            with torch.autocast("cuda", torch.bfloat16, cache_enabled=False, enabled=autocast):
                logprobs, _ = grpo.per_token_logprobs(model, ids, attn, pos, cmask, P, 1.0, 1024, True)
                loss = -(torch.exp(logprobs - logprobs.detach()) * advantages[mb, None] * cmask).sum() / 65536
            loss.backward()
        optimizer.step()

    model, optimizer = make(torch.float32)
    timed("fp32 weights, autocast, 16384 (scripts)", lambda: step(model, optimizer))
    timed("fp32 weights, autocast, 32768", lambda: step(model, optimizer, 32768))
    for layer in model.model.layers:
        layer.compile(dynamic=True)
    t0 = time.perf_counter()
    step(model, optimizer)
    results["compile_first_step_s"] = round(time.perf_counter() - t0, 1)
    timed("fp32 weights, autocast, compiled layers, 16384", lambda: step(model, optimizer))
    timed("fp32 weights, autocast, compiled layers, 32768", lambda: step(model, optimizer, 32768))
    del model, optimizer
    torch.cuda.empty_cache()
    model, optimizer = make(torch.bfloat16)
    timed("bf16 weights, 16384", lambda: step(model, optimizer, autocast=False))
