"""Run the training scripts as commands on the CPU (shared by the CLI, dynamic-sampling and learning tests)."""

import atexit
import contextlib
import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
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
    (pid, poll, wait, communicate, send_signal, terminate, kill, returncode; text stdout and stderr). nice > 0: each
    process in a session of its own at that lower CPU priority (Background)."""

    def __init__(self, script, *args, nproc=0, timeout=600, preimport=(), nice=0):
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
                "nice": nice,
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


class Background:
    """Work whose outcome only some tests read (a learning run's metrics, a run under torchrun itself), started before
    those tests come: conftest.py submits it when the session's first test starts, if a selected test needs it, and
    puts those tests last. Most tests keep one of the two cores busy (one process, or ranks that wait on each other);
    this work runs on what they leave idle, two jobs at a time in the order submitted, at the lowest CPU priority:
    nice 19, in sessions of their own whose autogroup nice is 19 too (Linux's autogroup scheduling shares the CPU
    between sessions first, and a process's nice counts only within its session), so that the running test keeps
    both cores when it wants them. A test that asks for a job's result waits for it (starting it now if it was still
    queued), and from then on the background runs at normal priority (hurry: root may raise priorities, others keep
    them low), so that other programs on the machine do not starve it while nothing else of ours runs. A job is
    `fn(background, *args)` in a thread of this process; its commands come from `process` or `popen`, so that close()
    (end of session) kills those still running."""

    def __init__(self, slots=2):
        self.nice, self.jobs, self.processes, self._queue = 19, [], [], queue.Queue()
        self._slots = threading.Semaphore(slots)
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while True:
            job = self._queue.get()
            self._slots.acquire()
            if not job.start(release=self._slots.release):  # a test started it already
                self._slots.release()

    def submit(self, fn, *args):
        job = _BackgroundJob(self, fn, args)
        self.jobs.append(job)
        self._queue.put(job)
        return job

    def process(self, script, *args, **kwargs):
        """Process(script, *args, **kwargs) at the background's CPU priority."""
        self.processes.append(Process(script, *args, nice=self.nice, **kwargs))
        return self.processes[-1]

    def popen(self, argv, **kwargs):
        """subprocess.Popen(argv, **kwargs) at the background's CPU priority, in a session of its own (`nice` execs
        argv: the pid is argv's)."""
        process = subprocess.Popen(["nice", "-n", str(self.nice), *map(str, argv)], start_new_session=True, **kwargs)
        self.processes.append(process)
        if self.nice:
            threading.Thread(target=self._lower_sessions, args=(process,), daemon=True).start()
        return process

    def _lower_sessions(self, process):
        """The autogroup nice of the command's session and of those its children start (torchrun's workers do), set
        as they appear, until the command ends or hurry() (tests/prefork.py sets its own children's)."""
        lowered = set()
        while process.poll() is None and self.nice:
            for pid in process_tree(process.pid):
                with contextlib.suppress(OSError):  # gone, or no autogroup in this kernel
                    if pid not in lowered and os.getsid(pid) != os.getsid(0):
                        with open(f"/proc/{pid}/autogroup", "w") as f:
                            f.write(str(self.nice))
                        lowered.add(pid)
            time.sleep(0.2)

    def _running(self):
        """The processes of the commands still running, with their children (not the pids of ended ones: reused)."""
        return [
            pid
            for process in self.processes
            if process.poll() is None
            for top in getattr(process, "pids", [process.pid])
            for pid in process_tree(top)
        ]

    def hurry(self):
        """Normal priority for the running commands, their children (torchrun's workers) and those still to come."""
        if self.nice == 0:
            return
        self.nice = 0
        for pid in self._running():
            with contextlib.suppress(OSError):  # gone, or not ours to raise (not root): it keeps its nice
                os.setpriority(os.PRIO_PROCESS, pid, 0)
                if os.getsid(pid) != os.getsid(0):
                    with open(f"/proc/{pid}/autogroup", "w") as f:
                        f.write("0")

    def close(self):
        for pid in self._running():  # torchrun's workers too: they do not die with it
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def process_tree(pid):
    """pid and the processes below it (Linux: read from /proc)."""
    children = {}
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{entry}/stat") as f:
                children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


class _BackgroundJob:
    def __init__(self, background, fn, args):
        self._background, self._fn, self._args, self._lock = background, fn, args, threading.Lock()
        self._started, self._done, self._value, self._error = False, threading.Event(), None, None

    def start(self, release=None):
        """Start the job in a thread, unless it started already (False); `release` is called once it ends."""
        with self._lock:
            if self._started:
                return False
            self._started = True
        threading.Thread(target=self._work, args=(release,), daemon=True).start()
        return True

    def _work(self, release):
        try:
            self._value = self._fn(self._background, *self._args)
        except BaseException as error:  # noqa: BLE001 -- raised again in the test that reads the result
            self._error = error
        finally:
            self._done.set()
            if release is not None:
                release()

    def result(self, timeout=900):
        """The job's return value (or its exception, raised here), waiting for it; started now if still queued."""
        self.start()
        if not self._done.is_set():
            self._background.hurry()
        if not self._done.wait(timeout):
            raise TimeoutError(f"background job {self._fn.__name__} still running after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._value


def background_run(background, script, *args, nproc=0):
    """A Background job: `python SCRIPT ARGS` (or on NPROC ranks); its CompletedProcess, an assertion error with its
    output unless it exited 0. The timeout is long: while the tests keep both cores busy, a niced command gets almost no
    CPU."""
    return check(background.process(script, *args, nproc=nproc, timeout=1800).result())


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


def wait_for_stderr(process, text, timeout=240):
    """Wait until `process` (a Process) has written `text` to its (rank 0's) stderr."""
    stderr, deadline = Path(process._out.name, "rank0.stderr"), time.time() + timeout
    while not (stderr.exists() and text in stderr.read_text(errors="replace")):
        assert process.poll() is None and time.time() < deadline, process.communicate()[1][-3000:]
        time.sleep(0.02)


def wait_for_steps(process, output_dir, steps=1, timeout=240):
    """Wait until `process` (a Process) has logged `steps` optimizer steps to output_dir/metrics.jsonl."""
    metrics = Path(output_dir) / "metrics.jsonl"
    deadline = time.time() + timeout
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
        assert process.poll() is None, f"the run ended early:\n{process.communicate()[1][-3000:]}"
        assert time.time() < deadline, "no metrics line in time"
        time.sleep(0.05)
