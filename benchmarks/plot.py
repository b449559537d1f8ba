"""Plot training runs and speed benchmarks as PNG files.

    python benchmarks/plot.py runs/a runs/b --trl trl_bench_colocate.json --out plots/
    python benchmarks/plot.py --summary benchmarks/results/addition_eval.json --out benchmarks/results/


Each RUN is an --output-dir of grpo.py, rloo.py or online_dpo.py (or its metrics.jsonl), or of
benchmarks/trl_addition.py (TRL's trainers, same row format); each --trl file is a JSON written by trl_bench.py
({"s_per_step": [...], "s_per_step_median_steps_3_8": x, ...}). Writes to --out:
  <metric>.png     the metric against optimizer steps (left) and against wall-clock seconds, the running sum of
                   step_time (right), one line per run; for reward (online_dpo.py's runs: their objective/scores, the
                   mean sample reward) and every eval/... metric but eval/num_prompts; file names keep letters, digits, "_", "-" and "."
                   (eval/pass@1 -> eval_pass_at_1.png). Runs named trl_X are dashed, in the colour of ours_X or X.
  step_time.png    per-run median seconds per step over steps 3-8 (the TRL benchmark's window), TRL beside ours
With --summary (a JSON of benchmarks/summarize.py runs --out: each run's reward curve, step 1 first), instead:
  reward_vs_trl.png  reward per step, one panel per algorithm X: our run ours_X solid beside TRL's trl_X dashed
                     (README.md's plot: benchmarks/results/addition_eval.json, the evaluation runs of 387eaf4)
"""

import argparse
import json
import os
import re
import statistics
from itertools import accumulate

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# plotted metric: the keys it is read from, the first a row has (online_dpo.py logs its mean sample reward as
# objective/scores, so that its curve is drawn beside the other scripts' reward)
CURVES = {"reward": ("reward", "objective/scores")}


def value(row, key):
    """The row's value of the plotted metric `key`, or None."""
    for name in CURVES.get(key, (key,)):
        if row.get(name) is not None:
            return row[name]
    return None


def file_name(key):
    """A PNG name for a metric: eval/pass@1 -> eval_pass_at_1.png."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", key.replace("@", "_at_")) + ".png"


def line_style(name, names):
    """TRL's run trl_X dashed, in the colour of ours_X (or X); other runs solid, a colour each."""
    bases = list(dict.fromkeys(n.removeprefix("trl_").removeprefix("ours_") for n in names))
    base = name.removeprefix("trl_").removeprefix("ours_")
    return {"color": f"C{bases.index(base) % 10}", "linestyle": "--" if name.startswith("trl_") else "-"}


def load_run(path):
    """The rows of a run's metrics.jsonl (path: the run's folder or the file)."""
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_names(paths):
    """Short, distinct names: the folder's name, or the path as given when two folders share a name."""
    names = [os.path.basename(os.path.normpath(p if os.path.isdir(p) else os.path.dirname(p) or ".")) for p in paths]
    return [n if names.count(n) == 1 else p for n, p in zip(names, paths)]


def plot_curves(runs, key):
    """`key` of every run against steps and against cumulative step_time (seconds): (figure, (by_step, by_time))."""
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, rows in runs.items():
        elapsed = list(accumulate(row.get("step_time", 0.0) for row in rows))  # wall clock at the end of each row
        points = [(row["step"], t, value(row, key)) for row, t in zip(rows, elapsed) if value(row, key) is not None]
        if points:
            steps, times, values = zip(*points)
            style = line_style(name, list(runs))
            by_step.plot(steps, values, marker=".", label=name, **style)
            by_time.plot(times, values, marker=".", label=name, **style)
    for ax, xlabel in ((by_step, "optimizer step"), (by_time, "wall-clock seconds (sum of step_time)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(key)
    fig.tight_layout()
    return fig, (by_step, by_time)


def median_step_time(rows):
    """Median step_time over steps 3-8 (warm-up left out, as trl_bench.py does), or over every row of a shorter run;
    rows without a step_time (the evaluation before training, at step 0) are left out."""
    rows = [row for row in rows if "step_time" in row]
    window = [row["step_time"] for row in rows if 3 <= row["step"] <= 8] or [row["step_time"] for row in rows]
    return statistics.median(window)


def plot_step_times(runs, trl):
    """Bars of median seconds per step: our runs, then the TRL results beside them. Returns (figure, ax)."""
    names = list(runs) + list(trl)
    values = [median_step_time(rows) for rows in runs.values()]
    values += [r.get("s_per_step_median_steps_3_8") or statistics.median(r["s_per_step"]) for r in trl.values()]
    colors = ["tab:orange" if n.startswith("trl_") else "tab:blue" for n in runs] + ["tab:orange"] * len(trl)
    fig, ax = plt.subplots(figsize=(max(4, 1.3 * len(names) + 2), 4.5))
    bars = ax.bar(range(len(names)), values, color=colors)
    ax.bar_label(bars, fmt="%.2f")
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right")
    ax.set_ylabel("median seconds per step (steps 3-8)")
    ax.set_title("step time: ours (blue), TRL (orange)")
    fig.tight_layout()
    return fig, ax


def plot_reward_vs_trl(summary):
    """Reward per step of each ours_X beside trl_X of a summarize.py runs JSON, one panel per X: (figure, axes)."""
    curves = {run["run"]: run["reward_curve"] for run in summary["runs"]}
    algos = [name.removeprefix("ours_") for name in curves if name.startswith("ours_")]
    fig, axes = plt.subplots(1, len(algos), figsize=(3.4 * len(algos) + 0.6, 3), sharey=True, squeeze=False)
    for ax, algo in zip(axes[0], algos):
        for name, label, style in ((f"ours_{algo}", f"{algo}.py", "-"), (f"trl_{algo}", "TRL 1.16", "--")):
            if curves.get(name):
                steps = range(1, len(curves[name]) + 1)
                ax.plot(steps, curves[name], style, color="C1" if style == "--" else "C0", linewidth=1, label=label)
        ax.set_title(algo, fontsize="medium")
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", loc="lower right")
    axes[0][0].set_ylabel("mean reward")
    fig.suptitle(f"reward per step, commit {summary.get('commit')}", fontsize="medium")
    fig.tight_layout()
    return fig, axes[0]


def plot_all(run_paths, trl_paths=(), out_dir="plots"):
    """Write every plot to out_dir; returns {png path: (figure, axes)} for the caller to inspect or close."""
    runs = {name: load_run(path) for name, path in zip(run_names(run_paths), run_paths)}
    names = [os.path.splitext(os.path.basename(p))[0] for p in trl_paths]  # trl_bench_<mode> ...
    if len(set(names)) < len(names):  # ... or, when two share that name (pairs of one sitting), their folders' names
        names = [os.path.basename(os.path.dirname(os.path.abspath(p))) for p in trl_paths]
    trl = {}
    for name, path in zip(names, trl_paths):
        with open(path) as f:
            trl[name] = json.load(f)
    keys = [k for k in CURVES if any(value(row, k) is not None for rows in runs.values() for row in rows)]
    keys += sorted(
        {k for rows in runs.values() for row in rows for k in row if k.startswith("eval/")} - {"eval/num_prompts"}
    )
    os.makedirs(out_dir, exist_ok=True)
    plots = {}
    for key in keys:
        plots[os.path.join(out_dir, file_name(key))] = plot_curves(runs, key)
    timed = {n: rows for n, rows in runs.items() if any("step_time" in row for row in rows)}
    if timed or trl:
        plots[os.path.join(out_dir, "step_time.png")] = plot_step_times(timed, trl)
    for path, (fig, _) in plots.items():
        fig.savefig(path, dpi=120)
    return plots


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", help="run folders (--output-dir) or metrics.jsonl files")
    parser.add_argument(
        "--trl", nargs="+", action="extend", default=[], help="TRL benchmark JSONs written by trl_bench.py"
    )
    parser.add_argument("--summary", default=None, help="a JSON of summarize.py runs: reward_vs_trl.png only")
    parser.add_argument("--out", default="plots", help="folder for the PNG files")
    args = parser.parse_args(argv)
    if args.summary:
        if args.runs or args.trl:
            parser.error("--summary draws its own runs: give no run folder or --trl file with it")
        with open(args.summary) as f:
            fig, _ = plot_reward_vs_trl(json.load(f))
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "reward_vs_trl.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        print(path)
        return
    if not args.runs and not args.trl:
        parser.error("give at least one run folder or --trl file")
    for path, (fig, _) in plot_all(args.runs, args.trl, args.out).items():
        plt.close(fig)
        print(path)


if __name__ == "__main__":
    main()
