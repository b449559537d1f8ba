"""Run the training scripts as commands on the CPU (shared by the CLI, dynamic-sampling and learning tests)."""

import atexit
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASSETS = Path(__file__).parent / "assets"
STORIES = str(ASSETS / "stories260K")

# a short run on the bundled 260K-parameter model: 2 prompts x 4 completions of at most 8 tokens per step
SMALL = [
    "--model-name-or-path",
    STORIES,
    "--prompt-column",
    "prompt",
    "--answer-column",
    "",
    "--no-use-chat-template",
    "--no-bf16",
    "--reward-funcs",
    "keyword_reward",
    "--prompts-per-step",
    "2",
    "--num-generations",
    "4",
    "--max-completion-length",
    "8",
    "--learning-rate",
    "1e-3",
]

# the learning test's run (tests/test_learning.py): 4 prompts x 8 completions of at most 24 tokens, 30 steps; add
# --learning-rate and --output-dir
# the bundled model rewarded for "play" on the bundled prompts (README's quickstarts), on the CPU
STORIES_TASK = [
    "--model-name-or-path",
    STORIES,
    "--dataset-name",
    ASSETS / "stories_prompts.jsonl",
    "--prompt-column",
    "prompt",
    "--answer-column",
    "",
    "--reward-funcs",
    "keyword_reward",
    "--no-use-chat-template",
    "--no-bf16",
]

LEARNING = [
    *STORIES_TASK,
    "--max-completion-length",
    24,
    "--prompts-per-step",
    4,
    "--num-generations",
    8,
    "--max-steps",
    30,
    "--seed",
    1,
]


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def script_env():
    return dict(
        os.environ,
        WANDB_MODE="offline",
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
        CUDA_VISIBLE_DEVICES="",
        TOKENIZERS_PARALLELISM="false",
    )


class _Prefork:
    """The fork server (tests/prefork.py) of this pytest process: started once, stopped at exit."""

    def __init__(self):
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).parent / "prefork.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=script_env(),
            cwd=ROOT,
            text=True,
        )
        atexit.register(self.proc.kill)
        self.replies, self.changed, self.ids = {}, threading.Condition(), itertools.count()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            reply = json.loads(line)
            with self.changed:
                self.replies.setdefault(reply["id"], []).append(reply)
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def send(self, request):
        request_id = next(self.ids)
        with self.changed:
            self.proc.stdin.write(json.dumps(dict(request, id=request_id)) + "\n")
            self.proc.stdin.flush()
        return request_id

    def reply(self, request_id, index, timeout=None):
        """The request's index-th answer (0: started, 1: ended), or None after timeout seconds."""
        with self.changed:
            ok = self.changed.wait_for(
                lambda: len(self.replies.get(request_id, [])) > index or self.proc.poll() is not None, timeout
            )
            if len(self.replies.get(request_id, [])) > index:
                return self.replies[request_id][index]
            if ok:
                raise RuntimeError(f"tests/prefork.py exited ({self.proc.poll()})")
            return None


_server = None


def _prefork():
    global _server
    if _server is None or _server.proc.poll() is not None:
        _server = _Prefork()
    return _server


class Process:
    """A command started by tests/prefork.py, with the parts of subprocess.Popen's interface that the tests use
    (pid, poll, wait, communicate, send_signal, terminate, kill, returncode; text stdout and stderr)."""

    def __init__(self, script, *args, nproc=0, timeout=600, preimport=()):
        self.args = [
            sys.executable,
            *(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] if nproc else []),
            str(ROOT / script),
            *map(str, args),
        ]
        self.nproc, self.timeout, self.returncode, self.timed_out = nproc, timeout, None, False
        self._out = tempfile.TemporaryDirectory()
        self._server = _prefork()
        self._id = self._server.send(
            {
                "argv": [str(ROOT / script), *map(str, args)],
                "cwd": str(ROOT),
                "env": script_env(),
                "nproc": nproc,
                "timeout": timeout,
                "out": self._out.name,
                "preimport": list(preimport),
            }
        )
        self.pids = self._server.reply(self._id, 0)["pids"]
        self.pid = self.pids[0]

    def poll(self):
        return self.wait(timeout=0) if self.returncode is None else self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            reply = self._server.reply(self._id, 1, timeout)
            if reply is None:
                if timeout == 0:
                    return None
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode, self.timed_out = reply["returncode"], reply["timed_out"]
        return self.returncode

    def communicate(self, timeout=None):
        self.wait(timeout)
        return tuple(
            "".join(
                Path(self._out.name, f"rank{r}.{stream}").read_text(errors="replace") for r in range(max(self.nproc, 1))
            )
            for stream in ("stdout", "stderr")
        )

    def result(self):
        """Wait for the end: a CompletedProcess, as subprocess.run returns."""
        stdout, stderr = self.communicate()
        if self.timed_out:
            raise subprocess.TimeoutExpired(self.args, self.timeout, stdout, stderr)
        return subprocess.CompletedProcess(self.args, self.returncode, stdout, stderr)

    def send_signal(self, sig):
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        for pid in self.pids:
            if self.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def launch(script, *args, nproc=0, timeout=300, preimport=()):
    """`python SCRIPT ARGS` (nproc 0) or `torchrun --standalone --nproc_per_node NPROC SCRIPT ARGS`, on the CPU, each
    process forked from tests/prefork.py (which has imported torch and transformers already: seconds saved per run).
    preimport: modules to import once for all NPROC processes of this command only (vllm). Returns a CompletedProcess:
    the exit status, and stdout / stderr (the ranks' one after the other)."""
    return Process(script, *args, nproc=nproc, timeout=timeout, preimport=preimport).result()


def run_script(script, *args, timeout=300):
    """Run one of the training scripts (grpo.py, rloo.py, online_dpo.py) on the CPU; returns the CompletedProcess."""
    return launch(script, *args, timeout=timeout)


def run_grpo(*args, timeout=300):
    return run_script("grpo.py", *args, timeout=timeout)


def check(result):
    assert result.returncode == 0, (
        f"{result.args[1]} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    )
    return result


def read_metrics(output_dir):
    with open(Path(output_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]
