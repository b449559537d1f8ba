"""Summarise the runs of benchmarks/eval_phase.sh: one JSON for benchmarks/results/ and a Markdown table for README.md.

    python benchmarks/eval_summary.py OUT/ours_grpo OUT/trl_grpo ... --out OUT/addition_eval.json

Each RUN is a run folder (metrics.jsonl of grpo.py, rloo.py, online_dpo.py or benchmarks/trl_addition.py) with its
log beside it (RUN.log: the command on its first line, "== NAME exit CODE after S s" on its last). Per run: the
command, exit status, steps trained, mean reward of the first and last 5 steps (online_dpo.py: objective/scores),
greedy eval pass@1 and mean greedy completion length at every evaluated step, training seconds (sum of step_time),
and the reward curve.
"""

import argparse
import json
import os
import re
import statistics
import subprocess


def reward(row):
    return row.get("reward", row.get("objective/scores"))


def summarize(path):
    name = os.path.basename(os.path.normpath(path))
    with open(os.path.join(path, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    log_path = os.path.join(os.path.dirname(os.path.normpath(path)), f"{name}.log")
    lines = open(log_path).read().splitlines() if os.path.exists(log_path) else []
    command = lines[0].removeprefix(f"== {name}: ") if lines else None
    ends = [re.match(rf"== {re.escape(name)} exit (\d+) after (\d+) s", line) for line in lines]
    end = next((m for m in reversed(ends) if m), None)
    trained = [row for row in rows if reward(row) is not None]
    rewards = [reward(row) for row in trained]
    evals = [row for row in rows if "eval/pass@1" in row]
    return {
        "run": name,
        "command": command,
        "exit_status": int(end.group(1)) if end else None,
        "elapsed_s": int(end.group(2)) if end else None,
        "steps": max((row["step"] for row in trained), default=0),
        "reward_first_5": statistics.mean(rewards[:5]) if rewards else None,
        "reward_last_5": statistics.mean(rewards[-5:]) if rewards else None,
        "eval_pass_at_1": {str(row["step"]): row["eval/pass@1"] for row in evals},
        "eval_mean_length": {str(row["step"]): row.get("eval/completions/mean_length") for row in evals},
        "train_s": sum(row.get("step_time", 0.0) for row in rows),
        "reward_curve": rewards,
    }


def table(summaries):
    """Markdown: one row per run."""
    steps = sorted({int(s) for r in summaries for s in r["eval_pass_at_1"]})
    head = ["run", "steps", "reward first 5 -> last 5"] + [f"eval pass@1, step {s}" for s in steps]
    lines = ["| " + " | ".join(head + ["train s", "exit"]) + " |", "|" + "---|" * (len(head) + 2)]
    for r in summaries:
        fmt = lambda v: "-" if v is None else f"{v:.3f}"
        cells = [r["run"], str(r["steps"]), f"{fmt(r['reward_first_5'])} -> {fmt(r['reward_last_5'])}"]
        cells += [fmt(r["eval_pass_at_1"].get(str(s))) for s in steps]
        cells += [f"{r['train_s']:.0f}", str(r["exit_status"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run folders, each with metrics.jsonl and its NAME.log beside it")
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("--commit", default=None, help="the commit the runs used (default: git rev-parse HEAD)")
    args = parser.parse_args(argv)
    commit = args.commit
    if commit is None:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        commit = git.stdout.strip() if git.returncode == 0 else "unknown"
    summaries = [summarize(path) for path in args.runs]
    with open(args.out, "w") as f:
        json.dump({"commit": commit, "runs": summaries}, f, indent=1)
    print(table(summaries))


if __name__ == "__main__":
    main()
