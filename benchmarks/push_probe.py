"""Where a weight push's time goes: a model's weights pushed over CUDA IPC to running `vllm serve` IPC servers on this
GPU (vllm_utils.server_sync_weights_ipc, as grpo.py pushes them), to the first server alone and then to all at once,
with every HTTP call of the push timed, and the trainer's own share (gathering, bf16 cast and packing into the chunk
buffer; one IPC export) timed without any server.
Usage: python benchmarks/push_probe.py MODEL OUT.json PORT [PORT ...]   (one_gpu.sh push_probe; ~1 min)"""

import json
import statistics
import sys
import time
from collections import defaultdict

import torch
from transformers import AutoModelForCausalLM

import vllm_utils

PUSHES = 6  # the first of each series is a warm-up, left out of the medians


def main(model_path, out, ports):
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    calls = defaultdict(list)
    post, probe = vllm_utils._post, vllm_utils.probe_server

    def timed(fn, key):
        def call(base_url, path_or_model, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(base_url, path_or_model, *args, **kwargs)
            finally:
                calls[key or path_or_model].append(time.perf_counter() - t0)

        return call

    vllm_utils._post, vllm_utils.probe_server = timed(post, None), timed(probe, "/is_paused")  # every call of a push
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).cuda()
    version = vllm_utils.check_server(urls[0], model_path)["version"]
    median = lambda values: statistics.median(values[1:])  # noqa: E731
    results = {"model": model_path, "servers": urls, "vllm": version}

    packing = []  # the trainer's share alone: named_weights -> packed_chunks, and one export per chunk
    for _ in range(PUSHES):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for data, _chunk in vllm_utils.packed_chunks(vllm_utils.named_weights(model), 1 << 30):
            vllm_utils.ipc_handle(data)  # synchronizes the stream: the copies are done
        packing.append(time.perf_counter() - t0)
    torch.cuda.ipc_collect()
    results["packing_median_s"] = median(packing)

    for name, target in (("one_server", urls[0]), ("all_servers", urls)):
        calls.clear()
        totals = []
        for _ in range(PUSHES):
            t0 = time.perf_counter()
            vllm_utils.server_sync_weights_ipc(target, model, version, name=model_path)
            totals.append(time.perf_counter() - t0)
        each = {path: median(times) for path, times in calls.items() if len(times) > 1}  # per call, over servers
        results[name] = {"push_median_s": median(totals), "pushes_s": totals, "call_median_s": each}
        print(name, f"push {median(totals):.3f} s", {k: round(v, 4) for k, v in each.items()}, flush=True)
    print(f"packing alone {results['packing_median_s']:.3f} s", flush=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
