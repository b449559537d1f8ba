"""Step-time ratios ours / TRL from one sitting of benchmarks/vs_trl.sh: python benchmarks/ratios.py OUT_DIR [--commit C]

Pairs run i of each of our modes with TRL's run i of the same vLLM mode (same host, same sitting, alternating order).
Both sides: the median step time of steps 3-8. Writes OUT_DIR/vs_trl.json and prints one line per mode."""

import argparse
import json
import os
import statistics

MODES = {
    "server": ("ours_server", "trl_server", "server"),
    "async": ("ours_async", "trl_server", "server"),
    "async_gradient_checkpointing": ("ours_lean", "trl_server", "server"),
    "colocate": ("ours_colocate", "trl_colocate", "colocate"),
    # one GPU (benchmarks/one_gpu.sh): the server on the trainer's GPU, against TRL's only one-GPU mode
    "server_1gpu": ("ours_server1gpu", "trl_colocate", "colocate"),
    "async_1gpu": ("ours_async1gpu", "trl_colocate", "colocate"),
    "async_1gpu_one_server": ("ours_async1srv", "trl_colocate", "colocate"),  # one_gpu.sh bench's side async_one
    # LoRA on the 7B shape, colocate with sleep mode (one_gpu.sh lora7b)
    "lora7b": ("ours_lora7b", "trl_lora7b", "colocate"),
}


def ours(path):
    rows = [json.loads(line) for line in open(os.path.join(path, "metrics.jsonl"))]
    steps = rows[2:8]  # steps 3-8
    phases = sorted({k for r in steps for k in r if k.startswith("timing/")})
    return {
        "s_per_step": statistics.median(r["step_time"] for r in steps),
        "steps": len(rows),
        "phases_median_s": {k: statistics.median(r.get(k, 0.0) for r in steps) for k in phases},
        "peak_memory_gib": max((r.get("memory/peak_gib", 0.0) for r in rows), default=None),
        "sampling_logp_difference_mean": statistics.mean(
            r.get("sampling/sampling_logp_difference/mean", float("nan")) for r in steps
        ),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--commit", default=None)
    parser.add_argument("--model", default=None, help="the bench model's path (bench-0.5b or bench-1.5b)")
    args = parser.parse_args()
    result = {"commit": args.commit, "model": args.model, "modes": {}, "ours_vs_ours": {}}
    for mode, (our_prefix, trl_prefix, trl_mode) in MODES.items():
        pairs = []
        for i in (1, 2):
            our_dir, trl_file = (
                os.path.join(args.out_dir, f"{our_prefix}_{i}"),
                os.path.join(args.out_dir, f"{trl_prefix}_{i}", f"trl_bench_{trl_mode}.json"),
            )
            if not (os.path.exists(os.path.join(our_dir, "metrics.jsonl")) and os.path.exists(trl_file)):
                continue
            trl = json.load(open(trl_file))
            mine = ours(our_dir)
            pairs.append(
                {
                    "pair": i,
                    "ours": mine,
                    "trl_s_per_step": trl["s_per_step_median_steps_3_8"],
                    "trl_peak_memory_gib": trl["peak_memory_gib"],
                    "ratio": mine["s_per_step"] / trl["s_per_step_median_steps_3_8"],
                }
            )
        if pairs:
            result["modes"][mode] = {"ratio_median": statistics.median(p["ratio"] for p in pairs), "pairs": pairs}
            print(
                f"{mode}: ratio {result['modes'][mode]['ratio_median']:.3f} over {len(pairs)} pair(s): "
                + ", ".join(f"{p['ours']['s_per_step']:.2f} s vs TRL {p['trl_s_per_step']:.2f} s" for p in pairs)
            )
    # one GPU: the async server step against our own colocate step of the same pair
    ours_pairs = {
        "async_1gpu_vs_colocate": ("ours_async1gpu", "ours_colocate"),
        "async_one_server_vs_two": ("ours_async1srv", "ours_async1gpu"),  # SERVERS=2, side async_one beside async
    }
    for mode, (num, den) in ours_pairs.items():
        pairs = []
        for i in (1, 2):
            a, b = (os.path.join(args.out_dir, f"{prefix}_{i}") for prefix in (num, den))
            if os.path.exists(os.path.join(a, "metrics.jsonl")) and os.path.exists(os.path.join(b, "metrics.jsonl")):
                x, y = ours(a)["s_per_step"], ours(b)["s_per_step"]
                pairs.append({"pair": i, f"{num}_s_per_step": x, f"{den}_s_per_step": y, "ratio": x / y})
        if pairs:
            result["ours_vs_ours"][mode] = {
                "ratio_median": statistics.median(p["ratio"] for p in pairs),
                "pairs": pairs,
            }
            print(f"{mode}: ratio {result['ours_vs_ours'][mode]['ratio_median']:.3f} over {len(pairs)} pair(s)")
    with open(os.path.join(args.out_dir, "vs_trl.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
