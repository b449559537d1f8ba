"""A fork server for the tests that run the training scripts as commands (tests/grpo_cli.py talks to it).

Starting `python grpo.py` costs 5-10 s of imports (torch, transformers, datasets, math_verify) before the script does
anything, more than most CPU test runs themselves take. This process imports all of that once, then serves requests
read from stdin, one JSON object per line: {"id": n, "argv": [script, *args], "cwd": ..., "env": {...}, "nproc": N,
"timeout": s, "out": folder, "preimport": [modules], "nice": n}. For each it forks N children (N = 0: one plain
process). Each child is a fresh process that runs the script exactly as `python script args` would (runpy, `__name__ ==
"__main__"`, sys.argv, sys.path[0] = the script's folder, the request's environment and working directory), its stdout
and stderr written to out/rankI.stdout and out/rankI.stderr, its exit status that of the interpreter: 0, SystemExit's
code, or 1 after an uncaught exception's traceback; with "nice" > 0 (the tests' background runs, grpo_cli.Background)
it starts a session of its own, lowered by that much in CPU priority (os.nice, and the session's autogroup nice).
N >= 1 launches the children as `torchrun --standalone --nproc_per_node N` launches its workers: the same rendezvous
variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...), and when one worker fails the others are
stopped. Commands run side by side; each gets two answers, one JSON line each: {"id": n, "pids": [...]} once started,
{"id": n, "returncode": rc, "timed_out": bool} once ended.
Nothing here computes with torch before forking: the children start from imported modules only."""

import json
import os
import runpy
import select
import signal
import socket
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # sys.path: ROOT, this file's folder, then what any `python script.py` has after its folder
for name in (
    "numpy",
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint.state_dict",
    "torch.utils.checkpoint",
    "tqdm",
    "tyro",
    "datasets",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "safetensors.torch",
    "tokenizers",
    "rewards",
    "grpo",
    "rloo",
    "online_dpo",
):
    try:  # a module that fails to import here fails in the child too, with the child's own traceback
        __import__(name)
    except Exception:  # noqa: BLE001
        pass
try:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, get_scheduler  # noqa: F401
except Exception:  # noqa: BLE001
    pass


def run_child(argv, cwd, env, out, rank, nice=0):
    """In the forked child: become `python argv...` and exit with its status. Never returns."""
    if nice:  # a background command (grpo_cli.Background): a session of its own, low priority within it and among them
        os.setsid()
        os.nice(nice)
        lower_session(nice)
    else:
        os.setpgid(0, 0)  # its own process group, so that a timeout can stop whatever it started
    die_with_parent()
    for fd, path, flags in (
        (0, os.devnull, os.O_RDONLY),
        (1, f"{out}/rank{rank}.stdout", os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        (2, f"{out}/rank{rank}.stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
    ):
        os.dup2(os.open(path, flags, 0o644), fd)
    code = 1
    try:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = list(argv)
        sys.path[:] = [os.path.dirname(os.path.abspath(argv[0])), *sys.path[2:]]
        runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except (
        SystemExit
    ) as exit_:  # as the interpreter treats it: None is 0, an int is the status, anything else is printed
        code = exit_.code
        if code is None:
            code = 0
        elif not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    finally:
        try:
            import atexit

            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code & 0xFF if isinstance(code, int) else 1)


def lower_session(nice):
    """Linux's autogroup scheduling shares the CPU between sessions first (a process's nice counts only within its
    session): the session's own nice, where the kernel has one."""
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:
        pass


def die_with_parent():
    """Linux: killed when the parent process ends (pytest interrupted, the server killed) instead of running on."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """One command: its N forked processes (or, with preimport, the intermediate child that forks them)."""

    def __init__(self, request):
        self.id, self.returncode, self.timed_out, self.pipe = request.get("id"), 0, False, None
        self.deadline = time.monotonic() + request.get("timeout", 300)
        if request.get("preimport"):  # modules that only this command needs (vllm: seconds per rank) are imported by
            read_end, write_end = os.pipe()  # an intermediate child that runs the command; this process stays as it was
            pid = os.fork()
            if pid == 0:
                die_with_parent()
                if request.get("nice"):
                    os.setsid()
                    os.nice(request["nice"])
                    lower_session(request["nice"])
                os.close(read_end)
                for name in request["preimport"]:
                    __import__(name)
                job = Job(dict(request, preimport=[], nice=0))  # this process is niced already
                while (reply := job.poll()) is None:
                    time.sleep(0.02)
                os.write(write_end, json.dumps(reply).encode())
                os._exit(0)
            os.close(write_end)
            self.pipe, self.children = read_end, {pid: 0}
            return
        argv, nproc = request["argv"], request.get("nproc", 0)
        env = dict(request["env"])
        if nproc:  # what torchrun --standalone sets for its workers
            env.update(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(free_port()),
                LOCAL_WORLD_SIZE=str(nproc),
                WORLD_SIZE=str(nproc),
                GROUP_WORLD_SIZE="1",
                ROLE_WORLD_SIZE=str(nproc),
                GROUP_RANK="0",
                ROLE_NAME="default",
                TORCHELASTIC_RESTART_COUNT="0",
                TORCHELASTIC_MAX_RESTARTS="0",
                TORCHELASTIC_RUN_ID="prefork",
                TORCHELASTIC_USE_AGENT_STORE="False",
                TORCH_NCCL_ASYNC_ERROR_HANDLING="1",
            )
        self.children = {}
        for rank in range(max(nproc, 1)):
            child_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank)) if nproc else env
            pid = os.fork()
            if pid == 0:
                run_child(argv, request["cwd"], child_env, request["out"], rank, request.get("nice", 0))
            self.children[pid] = rank
        self.pids = list(self.children)  # in rank order

    def poll(self):
        """None while running; then {"id", "returncode", "timed_out"}."""
        for pid in list(self.children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done == 0:
                continue
            del self.children[pid]
            code = os.waitstatus_to_exitcode(status)
            if code != 0 and self.returncode == 0:
                self.returncode = code
                self.stop()  # torchrun stops the other workers when one fails; they would wait in a collective
        if self.children and time.monotonic() > self.deadline:
            self.timed_out, self.returncode = True, self.returncode or -signal.SIGKILL
            self.stop()
        if self.children:
            return None
        if self.pipe is not None:  # the intermediate child's report on the command it ran
            with os.fdopen(self.pipe) as f:
                reply = f.read()
            return dict(
                json.loads(reply) if reply else {"returncode": self.returncode or 1, "timed_out": self.timed_out},
                id=self.id,
            )
        return {"id": self.id, "returncode": self.returncode, "timed_out": self.timed_out}

    def stop(self):
        for pid in self.children:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def answer(reply):
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    die_with_parent()
    jobs, pending, stdin_open = [], b"", True
    while stdin_open:  # requests and finished jobs, as they come: several commands may run at once
        if select.select([sys.stdin], [], [], 0.02)[0]:
            data = os.read(sys.stdin.fileno(), 1 << 16)
            stdin_open, pending = bool(data), pending + data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                job = Job(json.loads(line))
                jobs.append(job)
                answer({"id": job.id, "pids": job.pids if job.pipe is None else list(job.children)})
        for job in list(jobs):
            if (reply := job.poll()) is not None:
                jobs.remove(job)
                answer(reply)
    for job in jobs:  # the client is gone: so are its commands
        job.stop()
