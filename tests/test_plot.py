"""benchmarks/plot.py on the metrics.jsonl of real CPU runs of grpo.py (the learning test's runs, shared through the
learning_run fixture): the plotted lines are the metrics' values, the bars the median step times, the PNGs are real."""

import importlib.util
import json
import statistics
from itertools import accumulate

import pytest

from grpo_cli import ROOT, read_metrics

spec = importlib.util.spec_from_file_location("plot", ROOT / "benchmarks" / "plot.py")
plot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot)


def check_png(path):
    import matplotlib.image

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, (path, len(data))
    height, width, _ = matplotlib.image.imread(path).shape  # it decodes, at the figure's size
    assert height >= 400 and width >= 400


def test_plot_runs_and_trl(tmp_path, learning_run):
    runs = [learning_run(2e-4), learning_run(0.0)]
    # a third run: the first one's metrics with an eval/ metric every 10 steps (the scripts log eval/... keys there)
    with_eval = tmp_path / "with_eval"
    with_eval.mkdir()
    rows = read_metrics(runs[0])
    for row in rows:
        if row["step"] % 10 == 0:
            row["eval/accuracy"] = row["step"] / 100
    (with_eval / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    trl = tmp_path / "trl_bench_colocate.json"  # the format /work/shared/gpu/trl_bench.py writes
    trl.write_text(
        json.dumps(
            {
                "trainer": "trl 1.16 GRPOTrainer",
                "mode": "colocate",
                "s_per_step": [0.9, 0.8, 0.7, 0.75, 0.8, 0.85, 0.9],
                "s_per_step_median_steps_3_8": 0.8,
                "peak_memory_gib": 10.0,
                "train_s": 7.0,
            }
        )
    )
    out = tmp_path / "plots"

    plots = plot.plot_all([str(p) for p in runs] + [str(with_eval)], [str(trl)], str(out))

    assert sorted(plots) == sorted(str(out / name) for name in ("reward.png", "eval_accuracy.png", "step_time.png"))
    for path in plots:
        check_png(out / path.split("/")[-1])

    # reward against steps and against wall-clock time (the running sum of step_time): one line per run, its values
    _, (by_step, by_time) = plots[str(out / "reward.png")]
    assert [line.get_label() for line in by_step.get_lines()] == ["lr0.0002", "lr0.0", "with_eval"]
    for run, step_line, time_line in zip(runs + [with_eval], by_step.get_lines(), by_time.get_lines()):
        metrics = read_metrics(run)
        assert len(metrics) == 30
        assert list(step_line.get_xdata()) == [m["step"] for m in metrics]
        assert list(step_line.get_ydata()) == [m["reward"] for m in metrics]
        assert list(time_line.get_xdata()) == pytest.approx(list(accumulate(m["step_time"] for m in metrics)))
        assert list(time_line.get_ydata()) == [m["reward"] for m in metrics]
    assert by_time.get_lines()[0].get_xdata()[-1] > 0

    # eval/ metrics: only the run that has them, only at the steps where they were logged
    _, (by_step, by_time) = plots[str(out / "eval_accuracy.png")]
    (line,) = by_step.get_lines()
    assert list(line.get_xdata()) == [10, 20, 30] and list(line.get_ydata()) == [0.1, 0.2, 0.3]
    elapsed = list(accumulate(row["step_time"] for row in rows))
    assert list(by_time.get_lines()[0].get_xdata()) == pytest.approx([elapsed[9], elapsed[19], elapsed[29]])

    # step-time bars: each run's median over steps 3-8, then TRL's own median beside them
    _, ax = plots[str(out / "step_time.png")]
    heights = [bar.get_height() for bar in ax.patches]
    expected = [statistics.median(m["step_time"] for m in read_metrics(run)[2:8]) for run in runs + [with_eval]]
    assert heights == pytest.approx(expected + [0.8])
    assert [t.get_text() for t in ax.get_xticklabels()] == ["lr0.0002", "lr0.0", "with_eval", "trl_bench_colocate"]


def test_plot_command_line(tmp_path, learning_run, capsys):
    out = tmp_path / "cli"
    plot.main([str(learning_run(2e-4)), "--out", str(out)])
    assert sorted(p.name for p in out.iterdir()) == ["reward.png", "step_time.png"]
    for name in ("reward.png", "step_time.png"):
        check_png(out / name)
    assert capsys.readouterr().out.split() == [str(out / "reward.png"), str(out / "step_time.png")]
    with pytest.raises(SystemExit):
        plot.main(["--out", str(out)])  # nothing to plot


def write_run(folder, rows):
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(folder)


def test_plot_eval_runs_and_trl_runs(tmp_path):
    """The runs of `benchmarks/one_gpu.sh eval`: ours with an evaluation before training (a step-0 row of its own, no
    step_time), online_dpo.py's reward under objective/scores, and benchmarks/trl_addition.py's TRL runs (reward,
    time, step_time): one reward plot with all of them, TRL's dashed in the colour of ours, eval/pass@1 under a plain
    file name, no eval/num_prompts plot, and step-time bars over the rows that have a step_time."""
    evals = {0: 0.1, 2: 0.5, 4: 0.9}
    ours = [{"step": 0, "eval/pass@1": 0.1, "eval/num_prompts": 200, "timing/eval": 9.0}]
    ours += [{"step": s, "reward": s / 10, "step_time": 1.0 + s} for s in range(1, 5)]
    for row in ours[2::2]:
        row.update({"eval/pass@1": evals[row["step"]], "eval/num_prompts": 200})
    dpo = [{"step": s, "objective/scores": s / 20, "step_time": 2.0} for s in range(1, 5)]
    trl = [{"step": s, "reward": s / 40, "time": 3.0 * s, "step_time": 3.0, "trl/loss": 0.5} for s in range(1, 5)]
    paths = [
        write_run(tmp_path / "ours_grpo", ours),
        write_run(tmp_path / "ours_online_dpo", dpo),
        write_run(tmp_path / "trl_grpo", trl),
    ]

    plots = plot.plot_all(paths, (), str(tmp_path / "plots"))

    names = sorted(p.split("/")[-1] for p in plots)
    assert names == ["eval_pass_at_1.png", "reward.png", "step_time.png"]
    for path in plots:
        check_png(tmp_path / "plots" / path.split("/")[-1])
    _, (by_step, by_time) = plots[str(tmp_path / "plots" / "reward.png")]
    lines = {line.get_label(): line for line in by_step.get_lines()}
    assert list(lines) == ["ours_grpo", "ours_online_dpo", "trl_grpo"]
    assert list(lines["ours_grpo"].get_ydata()) == [0.1, 0.2, 0.3, 0.4]
    assert list(lines["ours_online_dpo"].get_ydata()) == [0.05, 0.1, 0.15, 0.2]
    assert list(lines["trl_grpo"].get_ydata()) == [0.025, 0.05, 0.075, 0.1]
    assert lines["trl_grpo"].get_linestyle() == "--" and lines["ours_grpo"].get_linestyle() == "-"
    assert lines["trl_grpo"].get_color() == lines["ours_grpo"].get_color() != lines["ours_online_dpo"].get_color()
    assert list(by_time.get_lines()[2].get_xdata()) == [3.0, 6.0, 9.0, 12.0]

    _, (by_step, _) = plots[str(tmp_path / "plots" / "eval_pass_at_1.png")]
    (line,) = by_step.get_lines()
    assert list(line.get_xdata()) == list(evals) and list(line.get_ydata()) == list(evals.values())

    _, ax = plots[str(tmp_path / "plots" / "step_time.png")]
    assert [bar.get_height() for bar in ax.patches] == [4.5, 2.0, 3.0]  # ours: steps 3 and 4 (window 3-8)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["ours_grpo", "ours_online_dpo", "trl_grpo"]


def test_plot_keeps_both_trl_runs_of_a_pair(tmp_path):
    """benchmarks/vs_trl.sh and one_gpu.sh write TRL's pairs as trl_colocate_1/trl_bench_colocate.json and
    trl_colocate_2/...: two files of one name, both bars drawn (labelled by their folders), not the second one in place
    of the first."""
    paths = []
    for i, median in ((1, 5.6), (2, 5.3)):
        (tmp_path / f"trl_colocate_{i}").mkdir()
        path = tmp_path / f"trl_colocate_{i}" / "trl_bench_colocate.json"
        path.write_text(json.dumps({"s_per_step": [median] * 7, "s_per_step_median_steps_3_8": median}))
        paths.append(str(path))
    _, ax = plot.plot_all([], paths, str(tmp_path / "plots"))[str(tmp_path / "plots" / "step_time.png")]
    assert [bar.get_height() for bar in ax.patches] == [5.6, 5.3]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["trl_colocate_1", "trl_colocate_2"]


def test_reward_vs_trl_from_the_committed_summary(tmp_path, capsys):
    """README.md's plot: plot.py --summary on the committed benchmarks/results/addition_eval.json draws each of our
    runs' reward curve beside TRL's run of the same algorithm, step 1 first, into one PNG small enough to commit."""
    summary = ROOT / "benchmarks" / "results" / "addition_eval.json"
    curves = {run["run"]: run["reward_curve"] for run in json.loads(summary.read_text())["runs"]}

    plot.main(["--summary", str(summary), "--out", str(tmp_path)])

    png = tmp_path / "reward_vs_trl.png"
    assert capsys.readouterr().out.split() == [str(png)]
    import matplotlib.image

    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and 20_000 < png.stat().st_size < 100_000
    height, width, _ = matplotlib.image.imread(png).shape  # three panels side by side, a README's width
    assert height >= 250 and width >= 900
    fig, axes = plot.plot_reward_vs_trl(json.loads(summary.read_text()))
    assert [ax.get_title() for ax in axes] == ["grpo", "rloo", "online_dpo"]
    for ax in axes:
        ours, trl = ax.get_lines()
        algo = ax.get_title()
        assert (ours.get_label(), ours.get_linestyle()) == (f"{algo}.py", "-")
        assert (trl.get_label(), trl.get_linestyle()) == ("TRL 1.16", "--")
        assert list(ours.get_ydata()) == curves[f"ours_{algo}"] and list(trl.get_ydata()) == curves[f"trl_{algo}"]
        assert list(ours.get_xdata()) == list(range(1, len(curves[f"ours_{algo}"]) + 1))
    plot.plt.close(fig)
    with pytest.raises(SystemExit):
        plot.main(["--summary", str(summary), "some_run"])  # the summary brings its own runs
