"""A fork server for the tests that run the training scripts as commands (tests/grpo_cli.py talks to it).

Starting `python grpo.py` costs 5-10 s of imports (torch, transformers, datasets, math_verify) before the script does
anything, more than most CPU test runs themselves take. This process imports all of that once, then serves requests
read from stdin, one JSON object per line: {"argv": [script, *args], "cwd": ..., "env": {...}, "nproc": N,
"timeout": s, "out": folder, "preimport": [modules]}. For each it forks N children (N = 0: one plain process). Each
child is a fresh process that runs the script exactly as `python script args` would (runpy, `__name__ == "__main__"`,
sys.argv, sys.path[0] = the script's folder, the request's environment and working directory), its stdout and stderr
written to out/rankI.stdout and out/rankI.stderr, its exit status that of the interpreter: 0, SystemExit's code, or 1
after an uncaught exception's traceback. N >= 1 launches the children as `torchrun --standalone --nproc_per_node N` launches
its workers: the same rendezvous variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...), and when
one worker fails the others are stopped. Answers one JSON line per request: {"returncode": rc, "timed_out": bool}.
Nothing here computes with torch before forking: the children start from imported modules only."""
import json
import os
import runpy
import signal
import socket
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # sys.path: ROOT, this file's folder, then what any `python script.py` has after its folder
for name in ("numpy", "torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.checkpoint.state_dict",
             "torch.utils.checkpoint", "tqdm", "tyro", "datasets", "transformers", "transformers.models.llama.modeling_llama",
             "safetensors.torch", "tokenizers", "rewards", "grpo", "rloo", "online_dpo"):
    try:  # a module that fails to import here fails in the child too, with the child's own traceback
        __import__(name)
    except Exception:  # noqa: BLE001
        pass
try:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, get_scheduler  # noqa: F401
except Exception:  # noqa: BLE001
    pass


def run_child(argv, cwd, env, out, rank):
    """In the forked child: become `python argv...` and exit with its status. Never returns."""
    os.setpgid(0, 0)  # its own process group, so that a timeout can stop whatever it started
    die_with_parent()
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, f"{out}/rank{rank}.stdout", os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, f"{out}/rank{rank}.stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
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
    except SystemExit as exit_:  # as the interpreter treats it: None is 0, an int is the status, anything else is printed
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


def serve(request):
    if request.get("preimport"):  # modules that only this command needs (vllm: seconds per rank) are imported by an
        read_end, write_end = os.pipe()  # intermediate child that forks the command, this process stays as it was
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            for name in request["preimport"]:
                __import__(name)
            os.write(write_end, json.dumps(serve(dict(request, preimport=[]))).encode())
            os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end) as f:
            reply = f.read()
        os.waitpid(pid, 0)
        return json.loads(reply) if reply else {"returncode": 1, "timed_out": False}
    argv, nproc = request["argv"], request.get("nproc", 0)
    env = dict(request["env"])
    if nproc:  # what torchrun --standalone sets for its workers
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), LOCAL_WORLD_SIZE=str(nproc), WORLD_SIZE=str(nproc),
                   GROUP_WORLD_SIZE="1", ROLE_WORLD_SIZE=str(nproc), GROUP_RANK="0", ROLE_NAME="default",
                   TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID="prefork",
                   TORCHELASTIC_USE_AGENT_STORE="False", TORCH_NCCL_ASYNC_ERROR_HANDLING="1")
    children = {}
    for rank in range(max(nproc, 1)):
        child_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank)) if nproc else env
        pid = os.fork()
        if pid == 0:
            run_child(argv, request["cwd"], child_env, request["out"], rank)
        children[pid] = rank
    deadline = time.monotonic() + request.get("timeout", 300)
    returncode, timed_out = 0, False
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if time.monotonic() > deadline:
                timed_out = True
                returncode = returncode or -signal.SIGKILL
                stop(children)
            time.sleep(0.02)
            continue
        if pid not in children:
            continue
        del children[pid]
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and returncode == 0:
            returncode = code
            stop(children)  # torchrun stops the other workers when one fails; they would wait in a collective
    return {"returncode": returncode, "timed_out": timed_out}


def stop(children):
    for pid in children:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


if __name__ == "__main__":
    die_with_parent()
    for line in sys.stdin:
        reply = serve(json.loads(line))
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
