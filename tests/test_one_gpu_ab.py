"""benchmarks/one_gpu.sh ab on the CPU, with a stand-in `python3` first on the PATH: the trainers (grpo.py, this
tree's and OLD_DIR's) write a metrics.jsonl of known step times, `vllm serve` is a small HTTP server answering
/health, `import vllm` succeeds; everything else (summarize.py, the wait for the servers) is the real Python. Checked:
the order of each PAIR, which grpo.py runs, the bench phase's flags for each MODE, the files the phase leaves, and
its ab.json."""

import json
import os
import socket
import stat
import subprocess
import sys
import textwrap

import pytest

from grpo_cli import ROOT

STAND_IN = """#!/usr/bin/env bash
# the host's python3, but for the GPU parts of one_gpu.sh
[ "$1" = -c ] && [ "$2" = "import vllm" ] && exit 0
[ "$1" = -m ] && [ "$2" = vllm.entrypoints.cli.main ] && exec {python} {here}/server.py "$@"
case "$1" in
  *grpo.py) exec {python} {here}/trainer.py "$@" ;;
  benchmarks/make_tasks.py) exit 0 ;;
esac
exec {python} "$@"
"""
TRAINER = """
import json, os, sys
script, args = sys.argv[1], sys.argv[2:]
old = open(script).readline().startswith("# stand-in of an older grpo.py")
with open(os.environ["AB_CALLS"], "a") as f:
    f.write(json.dumps({"old": old, "script": script, "args": args}) + "\\n")
out = args[args.index("--output-dir") + 1]
os.makedirs(out)
open(os.path.join(out, "model.safetensors"), "w").close()  # the phase keeps metrics.jsonl only
with open(os.path.join(out, "metrics.jsonl"), "w") as f:
    for step in range(1, 9):  # steps 1-2 compile; the old script's steps 3-8 take 3.0 s, the new one's 2.0 s
        seconds = 30.0 if step < 3 else (3.0 if old else 2.0) + step / 100
        f.write(json.dumps({"step": step, "step_time": seconds, "timing/generation": 1.0}) + "\\n")
"""
SERVER = """
import http.server, os, sys, threading
port = int(sys.argv[sys.argv.index("--port") + 1])
open(os.path.join(os.environ["AB_PIDS"], str(os.getpid())), "w").close()
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", port), Health)
threading.Timer(120, os._exit, (0,)).start()  # never outlives the test by long
server.serve_forever()
"""


def port_free(port):
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the stand-in server binds (TIME_WAIT is no user)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture
def stand_in(tmp_path):
    here = tmp_path / "bin"
    here.mkdir()
    (here / "trainer.py").write_text(textwrap.dedent(TRAINER))
    (here / "server.py").write_text(textwrap.dedent(SERVER))
    (here / "python3").write_text(STAND_IN.format(python=sys.executable, here=here))
    (here / "python3").chmod((here / "python3").stat().st_mode | stat.S_IEXEC)
    old = tmp_path / "bench_old"
    old.mkdir()
    (old / "grpo.py").write_text("# stand-in of an older grpo.py\n")
    (old / "COMMIT").write_text("0ld0ld0\n")
    pids = tmp_path / "pids"
    pids.mkdir()
    env = dict(os.environ, PATH=f"{here}:{os.environ['PATH']}", AB_CALLS=str(tmp_path / "calls"), AB_PIDS=str(pids))
    env.update(OLD_DIR=str(old), COMMIT="new1234")
    for name in ("SERVERS", "MPS", "BENCH_MODEL", "SERVE_FLAGS", "ASYNC_FLAGS", "OLD_COMMIT"):
        env.pop(name, None)
    yield env, tmp_path
    for pid in os.listdir(pids):  # the stand-in servers, started in sessions of their own
        try:
            os.kill(int(pid), 9)
        except ProcessLookupError:
            pass


def ab(env, out, **settings):
    result = subprocess.run(
        ["bash", "benchmarks/one_gpu.sh", "ab", str(out)],
        cwd=ROOT,
        env=dict(env, **settings),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def calls(tmp_path):
    rows = [json.loads(line) for line in (tmp_path / "calls").read_text().splitlines()]
    (tmp_path / "calls").unlink()
    return rows


def test_colocate_pairs(stand_in):
    env, tmp_path = stand_in
    out = tmp_path / "ab"
    ab(env, out, PAIR="1")  # MODE=colocate by default
    first, second = calls(tmp_path)
    assert (first["old"], second["old"]) == (True, False)  # PAIR=1: old first
    assert first["script"] == str(tmp_path / "bench_old" / "grpo.py") and second["script"] == "grpo.py"
    for run in (first, second):
        args = " ".join(run["args"])
        assert "--vllm-mode colocate" in args and "--vllm-mode server" not in args
        assert "--model-name-or-path /tmp/bench-qwen05b" in args and "--max-steps 8" in args
        assert "--prompts-per-step 32 --num-generations 8 --max-completion-length 256" in args
    stdout = ab(env, out, PAIR="2", MODE="colocate")
    first, second = calls(tmp_path)
    assert (first["old"], second["old"]) == (False, True)  # PAIR=2: new first

    names = sorted(p.name for p in out.iterdir())
    runs = [f"{side}_colocate_{pair}" for pair in (1, 2) for side in ("new", "old")]
    assert names == sorted(["ab.json"] + [f"{r}.log" for r in runs] + [f"{r}.metrics.jsonl" for r in runs])
    result = json.loads((out / "ab.json").read_text())
    assert (result["commit"], result["old_commit"]) == ("new1234", "0ld0ld0")
    pairs = result["modes"]["colocate"]["pairs"]
    assert [(p["pair"], p["order"]) for p in pairs] == [(1, "old first"), (2, "new first")]
    assert [p["old_s_per_step"] for p in pairs] == pytest.approx([3.055, 3.055])  # steps 3-8: 3.03 ... 3.08
    assert [p["new_s_per_step"] for p in pairs] == pytest.approx([2.055, 2.055])
    assert result["modes"]["colocate"]["pooled"]["new_over_old"] == pytest.approx(2.055 / 3.055)
    assert "ab colocate, 2 pair(s) pooled: old 3.055 s, new 2.055 s, new/old 0.673" in stdout


@pytest.mark.skipif(not (port_free(8001) and port_free(8011)), reason="ports 8001 and 8011 are taken on this host")
def test_async_pair_against_two_servers(stand_in):
    env, tmp_path = stand_in
    out = tmp_path / "ab"
    ab(env, out, PAIR="2", MODE="async")
    first, second = calls(tmp_path)
    assert (first["old"], second["old"]) == (False, True)
    for run in (first, second):
        args = " ".join(run["args"])
        assert "--vllm-mode server --vllm-server-port 8001 8011 --async-generation" in args
    assert sorted(os.listdir(tmp_path / "pids")) and (out / "server_8001.log").exists()
    assert (out / "server_8011.log").exists()
    result = json.loads((out / "ab.json").read_text())
    assert list(result["modes"]) == ["async"] and result["modes"]["async"]["pairs"][0]["order"] == "new first"
    assert (out / "new_async_2.metrics.jsonl").exists() and (out / "old_async_2.metrics.jsonl").exists()
