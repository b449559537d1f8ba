"""Run the training scripts as commands on the CPU (shared by the CLI, dynamic-sampling and learning tests)."""
import atexit
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASSETS = Path(__file__).parent / "assets"
STORIES = str(ASSETS / "stories260K")

# a short run on the bundled 260K-parameter model: 2 prompts x 4 completions of at most 8 tokens per step
SMALL = ["--model-name-or-path", STORIES, "--prompt-column", "prompt", "--answer-column", "", "--no-use-chat-template",
         "--no-bf16", "--reward-funcs", "keyword_reward", "--prompts-per-step", "2", "--num-generations", "4",
         "--max-completion-length", "8", "--learning-rate", "1e-3"]

# the learning test's run (tests/test_learning.py): 4 prompts x 8 completions of at most 24 tokens, 30 steps; add
# --learning-rate and --output-dir
LEARNING = ["--model-name-or-path", STORIES, "--dataset-name", ASSETS / "stories_prompts.jsonl", "--prompt-column", "prompt",
              "--answer-column", "", "--reward-funcs", "keyword_reward", "--no-use-chat-template", "--no-bf16",
              "--max-completion-length", 24, "--prompts-per-step", 4, "--num-generations", 8, "--max-steps", 30, "--seed", 1]


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def script_env():
    return dict(os.environ, WANDB_MODE="offline", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false")


_server = None


def _prefork():
    """The fork server (tests/prefork.py) of this pytest process, started on first use and stopped at exit."""
    global _server
    if _server is None or _server.poll() is not None:
        _server = subprocess.Popen([sys.executable, str(Path(__file__).parent / "prefork.py")], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, env=script_env(), cwd=ROOT, text=True)
        atexit.register(_server.kill)
    return _server


def launch(script, *args, nproc=0, timeout=300, preimport=()):
    """`python SCRIPT ARGS` (nproc 0) or `torchrun --standalone --nproc_per_node NPROC SCRIPT ARGS`, on the CPU, each
    process forked from tests/prefork.py (which has imported torch and transformers already: seconds saved per run).
    preimport: modules to import once for all NPROC processes of this command only (vllm). Returns a CompletedProcess:
    the exit status, and stdout / stderr (the ranks' one after the other)."""
    argv = [str(ROOT / script), *map(str, args)]
    server = _prefork()
    with tempfile.TemporaryDirectory() as out:
        server.stdin.write(json.dumps({"argv": argv, "cwd": str(ROOT), "env": script_env(), "nproc": nproc,
                                       "timeout": timeout, "out": out, "preimport": list(preimport)}) + "\n")
        server.stdin.flush()
        reply = server.stdout.readline()
        if not reply:
            raise RuntimeError(f"tests/prefork.py exited ({server.wait()})")
        reply = json.loads(reply)
        stdout, stderr = ("".join(Path(out, f"rank{r}.{stream}").read_text(errors="replace") for r in range(max(nproc, 1)))
                          for stream in ("stdout", "stderr"))
    command = [sys.executable, *(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] if nproc else []), *argv]
    if reply["timed_out"]:
        raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
    return subprocess.CompletedProcess(command, reply["returncode"], stdout, stderr)


def run_script(script, *args, timeout=300):
    """Run one of the training scripts (grpo.py, rloo.py, online_dpo.py) on the CPU; returns the CompletedProcess."""
    return launch(script, *args, timeout=timeout)


def run_grpo(*args, timeout=300):
    return run_script("grpo.py", *args, timeout=timeout)


def check(result):
    assert result.returncode == 0, f"{result.args[1]} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def read_metrics(output_dir):
    with open(Path(output_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]
