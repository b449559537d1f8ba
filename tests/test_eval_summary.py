"""benchmarks/eval_summary.py on run folders laid out as benchmarks/eval_phase.sh leaves them."""

import importlib.util
import json

from grpo_cli import ROOT

spec = importlib.util.spec_from_file_location("eval_summary", ROOT / "benchmarks" / "eval_summary.py")
eval_summary = importlib.util.module_from_spec(spec)
spec.loader.exec_module(eval_summary)


def test_summary(tmp_path, capsys):
    ours = [{"step": 0, "eval/pass@1": 0.05, "eval/completions/mean_length": 3.0}]
    ours += [{"step": s, "reward": s / 10, "step_time": 2.0} for s in range(1, 7)]
    ours[-1].update({"eval/pass@1": 0.8, "eval/completions/mean_length": 2.0})
    trl = [{"step": s, "reward": 0.5, "time": s, "step_time": 1.0} for s in range(1, 4)]  # stopped by its timeout
    dpo = [{"step": s, "objective/scores": 0.25, "step_time": 1.0} for s in range(1, 3)]
    for name, rows, end in [
        ("ours_grpo", ours, "0 after 300"),
        ("trl_grpo", trl, "124 after 450"),
        ("ours_online_dpo", dpo, None),
    ]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        log = f"== {name}: python x.py --flag 1\nsome output\n" + (f"== {name} exit {end} s\n" if end else "")
        (tmp_path / f"{name}.log").write_text(log)

    out = tmp_path / "summary.json"
    eval_summary.main(
        [str(tmp_path / n) for n in ("ours_grpo", "trl_grpo", "ours_online_dpo")]
        + ["--out", str(out), "--commit", "abc1234"]
    )

    summary = json.loads(out.read_text())
    assert summary["commit"] == "abc1234"
    grpo, trl, dpo = summary["runs"]
    assert grpo["command"] == "python x.py --flag 1" and grpo["exit_status"] == 0 and grpo["elapsed_s"] == 300
    assert grpo["steps"] == 6 and grpo["reward_curve"] == [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    assert grpo["reward_first_5"] == 0.3 and grpo["reward_last_5"] == 0.4
    assert grpo["eval_pass_at_1"] == {"0": 0.05, "6": 0.8} and grpo["eval_mean_length"] == {"0": 3.0, "6": 2.0}
    assert grpo["train_s"] == 12.0
    assert trl["exit_status"] == 124 and trl["steps"] == 3 and trl["eval_pass_at_1"] == {}
    assert dpo["exit_status"] is None and dpo["reward_curve"] == [0.25, 0.25]
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| run | steps | reward first 5 -> last 5 | eval pass@1, step 0 | eval pass@1, step 6 |")
    assert table[2] == "| ours_grpo | 6 | 0.300 -> 0.400 | 0.050 | 0.800 | 12 | 0 |"
    assert table[3] == "| trl_grpo | 3 | 0.500 -> 0.500 | - | - | 3 | 124 |"
