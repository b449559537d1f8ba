"""Summaries of benchmark runs, from the run folders (each an --output-dir holding metrics.jsonl) that
benchmarks/one_gpu.sh and benchmarks/vs_trl.sh leave.

    python benchmarks/summarize.py runs RUN_DIR ... [--out FILE] [--commit C]
    python benchmarks/summarize.py ratios OUT_DIR [--commit C] [--model M]
    python benchmarks/summarize.py ab OUT_DIR [--commit C] [--old-commit C]

runs    Per run: the command and exit status (from RUN.log beside the folder: the command on its first line,
        "== NAME exit CODE [after S s]" at the end), steps trained, mean reward of the first and last 5 steps
        (online_dpo.py: objective/scores), greedy eval pass@1 and mean completion length at every evaluated step,
        training seconds (the sum of the step times), the median step time from step 3 on, and the reward curve (one
        value per step from step 1). Prints a Markdown table; --out writes the JSON (benchmarks/results/
        addition_eval.json, which README.md's plot draws). Learning runs and trl_addition.py's runs alike.
ratios  Step time ours / TRL 1.16: run i of each of our modes against TRL's run i of the same vLLM mode (same host,
        same sitting, alternating order); both sides the median of steps 3-8. Writes OUT_DIR/vs_trl.json.
ab      Step time of an older commit's grpo.py against this one's (one_gpu.sh ab): OUT_DIR/{old,new}_MODE_PAIR
        .metrics.jsonl; per mode and pair the median of steps 3-8 of each and new / old, then both pairs' steps 3-8
        pooled. Writes OUT_DIR/ab.json.

A step's time is its `step_time` (the scripts' metric: the whole step, generation to weight push), or `timing/step`
where a run logs that instead; the first two steps compile and warm up, hence steps 3-8."""

import argparse
import json
import os
import re
import statistics
import subprocess

STEP_TIME_KEYS = ("step_time", "timing/step")


def load(path):
    """The rows of a metrics.jsonl (path: the file, or the run folder holding it)."""
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def step_time(row):
    """The row's step time, or None (an evaluation row of its own, before training)."""
    return next((row[key] for key in STEP_TIME_KEYS if row.get(key) is not None), None)


def timed(rows, first=3, last=8):
    """The rows of steps first..last (last=None: to the end) that have a step time."""
    return [r for r in rows if step_time(r) is not None and first <= r["step"] and (last is None or r["step"] <= last)]


def median_step_time(rows, first=3, last=8):
    window = timed(rows, first, last)
    return statistics.median(step_time(r) for r in window) if window else None


def phases(rows):
    """The median of each timing/... phase over steps 3-8."""
    window = timed(rows)
    keys = sorted({k for r in window for k in r if k.startswith("timing/") and k not in STEP_TIME_KEYS})
    return {k: statistics.median(r.get(k, 0.0) for r in window) for k in keys}


# ---- runs: learning runs (and the evaluation runs of one_gpu.sh eval) ----


def reward(row):
    return row.get("reward", row.get("objective/scores"))


def summarize_run(path):
    name = os.path.basename(os.path.normpath(path))
    rows = load(path)
    log_path = os.path.join(os.path.dirname(os.path.normpath(path)), f"{name}.log")
    lines = open(log_path).read().splitlines() if os.path.exists(log_path) else []
    command = lines[0].removeprefix(f"== {name}: ") if lines else None
    ends = [re.match(rf"== {re.escape(name)} exit (\d+)(?: after (\d+) s)?$", line) for line in lines]
    end = next((m for m in reversed(ends) if m), None)
    trained = [row for row in rows if reward(row) is not None]
    rewards = [reward(row) for row in trained]
    evals = [row for row in rows if "eval/pass@1" in row]
    return {
        "run": name,
        "command": command,
        "exit_status": int(end.group(1)) if end else None,
        "elapsed_s": int(end.group(2)) if end and end.group(2) else None,
        "steps": max((row["step"] for row in trained), default=0),
        "reward_first_5": statistics.mean(rewards[:5]) if rewards else None,
        "reward_last_5": statistics.mean(rewards[-5:]) if rewards else None,
        "eval_pass_at_1": {str(row["step"]): row["eval/pass@1"] for row in evals},
        "eval_mean_length": {str(row["step"]): row.get("eval/completions/mean_length") for row in evals},
        "train_s": sum(step_time(row) or 0.0 for row in rows),
        "s_per_step_median": median_step_time(rows, 3, None),
        "reward_curve": rewards,
    }


def table(summaries):
    """Markdown: one row per run."""
    steps = sorted({int(s) for r in summaries for s in r["eval_pass_at_1"]})
    head = ["run", "steps", "reward first 5 -> last 5"] + [f"eval pass@1, step {s}" for s in steps]
    lines = ["| " + " | ".join(head + ["s/step", "train s", "exit"]) + " |", "|" + "---|" * (len(head) + 3)]
    for r in summaries:
        fmt = lambda v, digits=3: "-" if v is None else f"{v:.{digits}f}"
        cells = [r["run"], str(r["steps"]), f"{fmt(r['reward_first_5'])} -> {fmt(r['reward_last_5'])}"]
        cells += [fmt(r["eval_pass_at_1"].get(str(s))) for s in steps]
        cells += [fmt(r["s_per_step_median"], 2), f"{r['train_s']:.0f}", str(r["exit_status"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def runs(args):
    commit = args.commit
    if commit is None:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        commit = git.stdout.strip() if git.returncode == 0 else "unknown"
    summaries = [summarize_run(path) for path in args.run_dirs]
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"commit": commit, "runs": summaries}, f, indent=1)
    print(table(summaries))


# ---- ratios: ours against TRL 1.16 (one_gpu.sh bench and lora7b, vs_trl.sh server and colocate) ----

# mode: (our runs' folder prefix, TRL's folder prefix, TRL's vLLM mode); folders PREFIX_1 and PREFIX_2, one per pair
MODES = {
    "server": ("ours_server", "trl_server", "server"),
    "async": ("ours_async", "trl_server", "server"),
    "async_gradient_checkpointing": ("ours_lean", "trl_server", "server"),
    "colocate": ("ours_colocate", "trl_colocate", "colocate"),
    "vlm_colocate": ("ours_vlm", "trl_vlm", "colocate"),  # one_gpu.sh vision, VISION=vs_trl: Qwen2.5-VL-3B's shape
    # one GPU (one_gpu.sh bench): the servers on the trainer's GPU, against TRL's only one-GPU mode
    "server_1gpu": ("ours_server1gpu", "trl_colocate", "colocate"),
    "async_1gpu": ("ours_async1gpu", "trl_colocate", "colocate"),
    "async_1gpu_one_server": ("ours_async1srv", "trl_colocate", "colocate"),  # one_gpu.sh bench's side async_one
    "lora7b": ("ours_lora7b", "trl_lora7b", "colocate"),  # LoRA on the 7B shape, colocate with sleep mode
}
# ours against ours in the same pair: (numerator's prefix, denominator's prefix)
OURS_PAIRS = {
    "async_1gpu_vs_colocate": ("ours_async1gpu", "ours_colocate"),
    "async_one_server_vs_two": ("ours_async1srv", "ours_async1gpu"),  # SERVERS=2, side async_one beside async
}


def ours(path):
    rows = load(path)
    window = timed(rows)
    return {
        "s_per_step": median_step_time(rows),
        "steps": len(rows),
        "phases_median_s": phases(rows),
        "peak_memory_gib": max((r.get("memory/peak_gib", 0.0) for r in rows), default=None),
        "sampling_logp_difference_mean": statistics.mean(
            r.get("sampling/sampling_logp_difference/mean", float("nan")) for r in window
        ),
    }


def ratios(args):
    result = {"commit": args.commit, "model": args.model, "modes": {}, "ours_vs_ours": {}}
    has_run = lambda folder: os.path.exists(os.path.join(folder, "metrics.jsonl"))
    for mode, (our_prefix, trl_prefix, trl_mode) in MODES.items():
        pairs = []
        for i in (1, 2):
            our_dir = os.path.join(args.out_dir, f"{our_prefix}_{i}")
            trl_file = os.path.join(args.out_dir, f"{trl_prefix}_{i}", f"trl_bench_{trl_mode}.json")
            if not (has_run(our_dir) and os.path.exists(trl_file)):
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
    for mode, (num, den) in OURS_PAIRS.items():
        pairs = []
        for i in (1, 2):
            a, b = (os.path.join(args.out_dir, f"{prefix}_{i}") for prefix in (num, den))
            if has_run(a) and has_run(b):
                x, y = median_step_time(load(a)), median_step_time(load(b))
                pairs.append({"pair": i, f"{num}_s_per_step": x, f"{den}_s_per_step": y, "ratio": x / y})
        if pairs:
            median = statistics.median(p["ratio"] for p in pairs)
            result["ours_vs_ours"][mode] = {"ratio_median": median, "pairs": pairs}
            print(f"{mode}: ratio {median:.3f} over {len(pairs)} pair(s)")
    with open(os.path.join(args.out_dir, "vs_trl.json"), "w") as f:
        json.dump(result, f, indent=1)


# ---- ab: an older commit's grpo.py against this one's (one_gpu.sh ab) ----


def ab(args):
    result = {"commit": args.commit, "old_commit": args.old_commit, "window": "steps 3-8", "modes": {}}
    for mode in ("colocate", "async"):
        pairs, pooled = [], {"old": [], "new": []}
        for pair in (1, 2, 3, 4):
            paths = {side: os.path.join(args.out_dir, f"{side}_{mode}_{pair}.metrics.jsonl") for side in pooled}
            if not all(os.path.exists(p) for p in paths.values()):
                continue
            rows = {side: load(p) for side, p in paths.items()}
            times = {side: [step_time(r) for r in timed(rows[side])] for side in rows}
            if not all(times.values()):  # a run that ended before step 3 (its log says why)
                print(f"ab {mode} pair {pair}: no step 3 in " + " and ".join(s for s in times if not times[s]))
                continue
            old, new = statistics.median(times["old"]), statistics.median(times["new"])
            order = "old first" if pair % 2 else "new first"
            pairs.append(
                {
                    "pair": pair,
                    "order": order,
                    "old_s_per_step": old,
                    "new_s_per_step": new,
                    "new_over_old": new / old,
                    "steps_timed": {side: len(t) for side, t in times.items()},
                    "phases_median_s": {side: phases(r) for side, r in rows.items()},
                }
            )
            for side in pooled:
                pooled[side] += times[side]
            print(f"ab {mode} pair {pair} ({order}): old {old:.3f} s, new {new:.3f} s, new/old {new / old:.3f}")
        if pairs:
            old, new = statistics.median(pooled["old"]), statistics.median(pooled["new"])
            result["modes"][mode] = {
                "pairs": pairs,
                "pooled": {"old_s_per_step": old, "new_s_per_step": new, "new_over_old": new / old},
                "mean_of_pair_ratios": statistics.mean(p["new_over_old"] for p in pairs),
            }
            print(f"ab {mode}, {len(pairs)} pair(s) pooled: old {old:.3f} s, new {new:.3f} s, new/old {new / old:.3f}")
    with open(os.path.join(args.out_dir, "ab.json"), "w") as f:
        json.dump(result, f, indent=1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("runs", help="learning and evaluation runs: a table, and JSON with --out")
    p.add_argument("run_dirs", nargs="+", help="run folders, each with metrics.jsonl and its NAME.log beside it")
    p.add_argument("--out", default=None, help="the JSON file to write")
    p.add_argument("--commit", default=None, help="the commit the runs used (default: git rev-parse HEAD)")
    p = commands.add_parser("ratios", help="ours / TRL 1.16 step times: OUT_DIR/vs_trl.json")
    p.add_argument("out_dir")
    p.add_argument("--commit", default=None)
    p.add_argument("--model", default=None, help="the bench model's path (bench-0.5b or bench-1.5b)")
    p = commands.add_parser("ab", help="new / old step times of one_gpu.sh ab: OUT_DIR/ab.json")
    p.add_argument("out_dir")
    p.add_argument("--commit", default=None, help="this tree's commit")
    p.add_argument("--old-commit", default=None, help="the commit of the scripts in OLD_DIR")
    args = parser.parse_args(argv)
    {"runs": runs, "ratios": ratios, "ab": ab}[args.command](args)


if __name__ == "__main__":
    main()
