"""How fast a stock `vllm serve` generates one bench-0.5b round (32 prompts x 8 x 256 tokens, with each sampled
token's log-prob) for each way of asking it, measured on one GPU: the server's generation is the async step's floor.

Usage (GPU host, after `source .gpu/setup.sh`, a `vllm serve /tmp/bench-qwen05b` as benchmarks/vs_trl.sh starts it):
    python benchmarks/server_gen.py PORT OUT.json [ROUNDS]
Variants: "completions-<k>": the scripts' own requests (vllm_utils.server_generate: POST /v1/completions, k prompts per
request; the server detokenizes every token and decodes each sampled token again for its log-prob entry);
"completions-8-nologprobs": the same without log-probs; $OTHER_PORTS ("b=8003,c=8005": other servers, e.g. of other
flags) adds "b:completions-8" and so on, the scripts' requests to those; $SPLIT_PORTS ("8003,8005") adds "split": the
round's requests sent to those servers in turn by vllm_utils.server_generate (several EngineCore processes share its
per-token CPU work); "tokens": POST /inference/v1/generate, one prompt per request, detokenize=False (token ids and
log-probs only: what we train on); "tokens-nologprobs": the same without log-probs, the engine's floor; "inprocess":
the colocated engine of the training scripts (vllm_utils.colocate_engine at 0.3 of the GPU, colocate_generate), in
this process beside the idle server. Each variant runs ROUNDS rounds after one warm-up round, on prompts no round
repeats; $VARIANTS (comma-separated names) runs a subset. ALTERNATE=1 runs the chosen variants round by round
instead, the first one first in odd rounds and last in even ones (e.g. VARIANTS=completions-8,inprocess: the server's
round against the in-process one, each alone at work).
samples_returned counts what came back of the 256 asked for: vLLM 0.26's /inference/v1/generate mostly returned 244-254
of them (n=8 per request), so the scripts keep /v1/completions.
"""

import concurrent.futures
import json
import os
import statistics
import sys
import time
from functools import partial

import requests
from transformers import AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import vllm_utils  # noqa: E402

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()
FIELDS = dict(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0, max_tokens=256)


def tokens(url, model, prompts, logprobs=True):
    """A round through POST /inference/v1/generate: one request per prompt, all at once; (ids, log-probs) pairs."""

    def one(prompt):
        params = {**FIELDS, "n": 8, "detokenize": False, **({"logprobs": 0} if logprobs else {})}
        body = {"model": model, "token_ids": prompt, "sampling_params": params}
        choices = requests.post(f"{url}/inference/v1/generate", json=body, timeout=600).json()["choices"]
        return [
            (c["token_ids"], [t["logprob"] for t in c["logprobs"]["content"]] if logprobs else None) for c in choices
        ]

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return [sample for samples in pool.map(one, prompts) for sample in samples]


def completions_nologprobs(url, model, prompts, k=8):
    """The scripts' /v1/completions requests (k prompts each) without log-probs: what the log-prob work costs."""

    def complete(chunk):
        body = {**vllm_utils.completions_request(model, chunk, 8, FIELDS), "logprobs": None}
        choices = requests.post(f"{url}/v1/completions", json=body, timeout=600).json()["choices"]
        return [(c["token_ids"], None) for c in sorted(choices, key=lambda c: c["index"])]

    chunks = [prompts[i : i + k] for i in range(0, len(prompts), k)]
    with concurrent.futures.ThreadPoolExecutor(len(chunks)) as pool:
        return [sample for samples in pool.map(complete, chunks) for sample in samples]


def one_round(call, prompts):
    """(seconds, tokens, samples) of one round: call(prompts) -> (ids, log-probs) pairs."""
    start = time.perf_counter()
    samples = call(prompts)
    seconds = time.perf_counter() - start
    assert all(lp is None or len(lp) == len(ids) for ids, lp in samples), "a log-prob per sampled token"
    return seconds, sum(len(ids) for ids, _ in samples), len(samples)


def main(port, out, rounds=4):
    url = f"http://127.0.0.1:{port}"
    model = requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    tok = AutoTokenizer.from_pretrained("/tmp/bench-qwen05b")
    # the scripts' own requests: vllm_utils.server_generate, k prompts per /v1/completions request
    ours = lambda k, u=url: lambda prompts: list(zip(*vllm_utils.server_generate(u, model, prompts, 8, FIELDS, k)))  # noqa: E731
    variants = {f"completions-{k}": ours(k) for k in (8, 4, 2, 32, 1)}
    variants["completions-8-nologprobs"] = partial(completions_nologprobs, url, model)
    for label, other in (item.split("=") for item in filter(None, os.environ.get("OTHER_PORTS", "").split(","))):
        other_url = f"http://127.0.0.1:{other}"  # another server (other flags): LABEL:completions-8 asks it
        variants[f"{label}:completions-8"] = ours(8, other_url)
    if split := os.environ.get("SPLIT_PORTS"):  # the round shared by these servers, as --vllm-server-port P1 P2 does
        # (until 358bc54 this variant split the prompts in two halves itself, one thread per server: the same requests)
        variants["split"] = ours(8, [f"http://127.0.0.1:{port}" for port in split.split(",")])
    variants["tokens"] = partial(tokens, url, model)
    variants["tokens-nologprobs"] = partial(tokens, url, model, logprobs=False)
    keep = os.environ.get("VARIANTS", ",".join([*variants, "inprocess"])).split(",")
    if "inprocess" in keep:  # as grpo.py's colocate mode builds it (no sleep mode), for the bench-0.5b round
        llm = vllm_utils.colocate_engine("/tmp/bench-qwen05b", max_model_len=2048, max_num_seqs=256)
        variants["inprocess"] = lambda prompts: list(zip(*vllm_utils.colocate_generate(llm, prompts, 8, FIELDS)))
    variants = {name: variants[name] for name in keep}
    times, returned, n_tokens = ({name: [] for name in variants} for _ in range(3))
    offset = 0
    # ALTERNATE: round r of every variant before round r + 1 of any, the order reversed every other round
    order = [[name] * (rounds + 1) for name in variants]
    if os.environ.get("ALTERNATE") == "1":
        order = [list(variants)[:: 1 if r % 2 else -1] for r in range(rounds + 1)]
    for names in order:
        for name in names:
            r = len(returned[name])  # round 0 warms up
            text = [" ".join(WORDS[(7 * i + j) % 19] for j in range(60)) + f" {i}" for i in range(offset, offset + 32)]
            offset += 32
            seconds, tokens_, n_samples = one_round(variants[name], [tok(t)["input_ids"] for t in text])
            times[name].append(seconds) if r else None
            returned[name].append(n_samples)
            n_tokens[name].append(tokens_)
            print(name, r, round(seconds, 3), flush=True)
    results = {}
    for name in variants:
        median = round(statistics.median(times[name]), 3)
        results[name] = {"s_per_round": [round(t, 3) for t in times[name]], "median_s": median}
        results[name].update(tokens_per_s=round(n_tokens[name][-1] / median), samples_returned=returned[name])
        results[name]["tokens_per_round"] = n_tokens[name]  # a changed server's samples may stop before the limit
        print(name, json.dumps(results[name]), flush=True)
    results["alternate"] = os.environ.get("ALTERNATE") == "1"
    json.dump(results, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:]))
