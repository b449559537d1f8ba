"""benchmarks/summarize.py: `runs` on run folders laid out as `benchmarks/one_gpu.sh eval` leaves them, `ratios` on
the committed runs of two leases (it must give the published numbers), and `ab` on one_gpu.sh ab's files."""

import importlib.util
import json
import shutil
import statistics

import pytest

from grpo_cli import ROOT

spec = importlib.util.spec_from_file_location("summarize", ROOT / "benchmarks" / "summarize.py")
summarize = importlib.util.module_from_spec(spec)
spec.loader.exec_module(summarize)
RESULTS = ROOT / "benchmarks" / "results"


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_runs(tmp_path, capsys):
    ours = [{"step": 0, "eval/pass@1": 0.05, "eval/completions/mean_length": 3.0}]
    ours += [{"step": s, "reward": s / 10, "step_time": 2.0 + s} for s in range(1, 7)]
    ours[-1].update({"eval/pass@1": 0.8, "eval/completions/mean_length": 2.0})
    trl = [{"step": s, "reward": 0.5, "time": s, "step_time": 1.0} for s in range(1, 4)]  # stopped by its timeout
    dpo = [{"step": s, "objective/scores": 0.25, "step_time": 1.0} for s in range(1, 3)]
    for name, rows, end in [
        ("ours_grpo", ours, "0 after 300 s"),
        ("trl_grpo", trl, "124 after 450 s"),
        ("ours_online_dpo", dpo, None),
        ("learn", dpo, "0"),  # one_gpu.sh's learning runs log no time
    ]:
        (tmp_path / name).mkdir()
        write(tmp_path / name / "metrics.jsonl", rows)
        log = f"== {name}: python x.py --flag 1\nsome output\n" + (f"== {name} exit {end}\n" if end else "")
        (tmp_path / f"{name}.log").write_text(log)

    out = tmp_path / "summary.json"
    summarize.main(
        ["runs"]
        + [str(tmp_path / n) for n in ("ours_grpo", "trl_grpo", "ours_online_dpo", "learn")]
        + ["--out", str(out), "--commit", "abc1234"]
    )

    summary = json.loads(out.read_text())
    assert summary["commit"] == "abc1234"
    grpo, trl, dpo, learn = summary["runs"]
    assert grpo["command"] == "python x.py --flag 1" and grpo["exit_status"] == 0 and grpo["elapsed_s"] == 300
    assert grpo["steps"] == 6 and grpo["reward_curve"] == [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    assert grpo["reward_first_5"] == 0.3 and grpo["reward_last_5"] == 0.4
    assert grpo["eval_pass_at_1"] == {"0": 0.05, "6": 0.8} and grpo["eval_mean_length"] == {"0": 3.0, "6": 2.0}
    assert grpo["train_s"] == 33.0 and grpo["s_per_step_median"] == 6.5  # steps 3-6: 5, 6, 7, 8 s
    assert trl["exit_status"] == 124 and trl["steps"] == 3 and trl["eval_pass_at_1"] == {}
    assert dpo["exit_status"] is None and dpo["reward_curve"] == [0.25, 0.25] and dpo["s_per_step_median"] is None
    assert learn["exit_status"] == 0 and learn["elapsed_s"] is None
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| run | steps | reward first 5 -> last 5 | eval pass@1, step 0 | eval pass@1, step 6 |")
    assert table[2] == "| ours_grpo | 6 | 0.300 -> 0.400 | 0.050 | 0.800 | 6.50 | 33 | 0 |"
    assert table[3] == "| trl_grpo | 3 | 0.500 -> 0.500 | - | - | 1.00 | 3 | 124 |"


@pytest.mark.parametrize("lease", ["6215430", "970e4b4"])
def test_ratios_give_the_published_numbers(tmp_path, lease):
    """The committed runs of two leases, laid out as one_gpu.sh bench leaves them: the step times and ratios that
    README.md's speed table and benchmarks/results/README.md quote (two decimals, as there)."""
    for path in (RESULTS / f"one_gpu_{lease}").glob("*"):
        if path.name.endswith(".metrics.jsonl"):
            (tmp_path / path.name.removesuffix(".metrics.jsonl")).mkdir()
            shutil.copy(path, tmp_path / path.name.removesuffix(".metrics.jsonl") / "metrics.jsonl")
        elif path.name.startswith("trl_colocate_"):
            (tmp_path / path.stem).mkdir()
            shutil.copy(path, tmp_path / path.stem / "trl_bench_colocate.json")

    summarize.main(["ratios", str(tmp_path), "--commit", lease])

    modes = json.loads((tmp_path / "vs_trl.json").read_text())["modes"]
    published = {  # (our s per step, x TRL) per pair
        "6215430": {"server_1gpu": [(3.35, 0.55), (3.05, 0.45)], "async_1gpu": [(2.54, 0.41), (2.45, 0.36)]},
        "970e4b4": {
            "colocate": [(4.55, 0.53), (4.27, 0.46)],
            "server_1gpu": [(4.12, 0.48), (4.08, 0.44)],
            "async_1gpu": [(3.55, 0.41), (3.29, 0.35)],
        },
    }[lease]
    assert sorted(modes) == sorted(published)
    for mode, pairs in published.items():
        got = [(round(p["ours"]["s_per_step"], 2), round(p["ratio"], 2)) for p in modes[mode]["pairs"]]
        assert got == pairs, mode


def bench_rows(times, key="step_time"):
    return [{"step": s, key: t, "timing/generation": t / 2} for s, t in enumerate(times, 1)]


def test_ab(tmp_path, capsys):
    """New / old per pair over steps 3-8 (steps 1-2 compile), both pairs pooled; a mode whose pair lacks a run, or
    a run cut before step 3, is left out; a run that logs timing/step instead of step_time is read too."""
    warm = [30.0, 20.0]
    write(tmp_path / "old_colocate_1.metrics.jsonl", bench_rows(warm + [3.0, 3.2, 3.1, 2.9, 3.0, 3.3]))
    write(tmp_path / "new_colocate_1.metrics.jsonl", bench_rows(warm + [2.0, 2.2, 2.1, 1.9, 2.0, 2.3]))
    write(tmp_path / "new_colocate_2.metrics.jsonl", bench_rows(warm + [2.5] * 6, key="timing/step"))
    write(tmp_path / "old_colocate_2.metrics.jsonl", bench_rows(warm + [2.5] * 5))  # cut after step 7
    write(tmp_path / "new_async_1.metrics.jsonl", bench_rows(warm + [1.0] * 6))  # no old async run
    write(tmp_path / "old_async_2.metrics.jsonl", bench_rows(warm[:1]))
    write(tmp_path / "new_async_2.metrics.jsonl", bench_rows(warm + [1.0] * 6))

    summarize.main(["ab", str(tmp_path), "--commit", "new1234", "--old-commit", "old5678"])

    result = json.loads((tmp_path / "ab.json").read_text())
    assert (result["commit"], result["old_commit"]) == ("new1234", "old5678")
    assert list(result["modes"]) == ["colocate"]
    pair1, pair2 = result["modes"]["colocate"]["pairs"]
    assert (pair1["order"], pair1["old_s_per_step"], pair1["new_s_per_step"]) == ("old first", 3.05, 2.05)
    assert pair1["new_over_old"] == pytest.approx(2.05 / 3.05)
    assert pair1["phases_median_s"]["new"] == {"timing/generation": pytest.approx(1.025)}
    assert (pair2["order"], pair2["new_over_old"], pair2["steps_timed"]) == ("new first", 1.0, {"old": 5, "new": 6})
    pooled = result["modes"]["colocate"]["pooled"]
    old = statistics.median([3.0, 3.2, 3.1, 2.9, 3.0, 3.3] + [2.5] * 5)
    new = statistics.median([2.0, 2.2, 2.1, 1.9, 2.0, 2.3] + [2.5] * 6)
    assert (pooled["old_s_per_step"], pooled["new_s_per_step"]) == (old, new)
    assert pooled["new_over_old"] == pytest.approx(new / old)
    assert "no step 3 in old" in capsys.readouterr().out
