"""benchmarks/engine_turns.py with a stand-in `vllm` package (an LLM whose start takes 0.3 s): three processes started
at once, in reverse order, start their engines one at a time in index order, none trains before all are up, and a run
that exits before its engine starts (its ready file written by the caller, as `one_gpu.sh eval` does) holds up nobody.
The script runs as __main__ with its own argv, and its exit status is the process's."""

import os
import subprocess
import sys
import textwrap

from grpo_cli import ROOT

FAKE_VLLM = """
import os, time

class LLM:
    def __init__(self, model, **kwargs):
        with open(os.environ["EVENTS"], "a") as f:
            f.write(f"start {os.environ['RUN']} {time.time()}\\n")
        time.sleep(0.3)
        with open(os.environ["EVENTS"], "a") as f:
            f.write(f"up {os.environ['RUN']} {time.time()}\\n")
"""
SCRIPT = """
import os, sys, time
assert __name__ == "__main__" and sys.argv[1:] == ["--flag", os.environ["RUN"]], sys.argv
if os.environ["RUN"] == "1":
    sys.exit(3)  # dies before its engine starts
from vllm import LLM
LLM(model="m")
with open(os.environ["EVENTS"], "a") as f:
    f.write(f"train {os.environ['RUN']} {time.time()}\\n")
"""


def test_engines_start_in_turn(tmp_path):
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(textwrap.dedent(FAKE_VLLM))
    (tmp_path / "script.py").write_text(textwrap.dedent(SCRIPT))
    turns, events = tmp_path / "turns", tmp_path / "events"
    turns.mkdir()
    env = dict(os.environ, PYTHONPATH=str(tmp_path), EVENTS=str(events), ENGINE_TURNS_PREIMPORT="")
    command = [sys.executable, ROOT / "benchmarks" / "engine_turns.py", turns]
    processes = {
        i: subprocess.Popen(
            [*command, str(i), "3", tmp_path / "script.py", "--flag", str(i)], env=dict(env, RUN=str(i))
        )
        for i in (2, 1, 0)
    }
    assert processes[1].wait(timeout=60) == 3
    (turns / "1.ready").touch()  # the caller's part: the run is over
    assert processes[0].wait(timeout=60) == 0 and processes[2].wait(timeout=60) == 0

    rows = [line.split() for line in events.read_text().splitlines()]
    order = [(kind, run) for kind, run, _ in rows]
    assert order[:4] == [("start", "0"), ("up", "0"), ("start", "2"), ("up", "2")]  # one at a time, in turn
    assert sorted(order[4:]) == [("train", "0"), ("train", "2")]  # after every engine is up
    times = {(kind, run): float(t) for kind, run, t in rows}
    assert times[("train", "0")] >= times[("up", "2")]
