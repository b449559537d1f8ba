"""Run the training scripts as commands on the CPU (shared by the CLI, dynamic-sampling and learning tests)."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASSETS = Path(__file__).parent / "assets"
STORIES = str(ASSETS / "stories260K")

# a short run on the bundled 260K-parameter model: 2 prompts x 4 completions of at most 8 tokens per step
SMALL = ["--model-name-or-path", STORIES, "--prompt-column", "prompt", "--answer-column", "", "--no-use-chat-template",
         "--no-bf16", "--reward-funcs", "keyword_reward", "--prompts-per-step", "2", "--num-generations", "4",
         "--max-completion-length", "8", "--learning-rate", "1e-3"]


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def run_script(script, *args, timeout=300):
    """Run one of the training scripts (grpo.py, rloo.py, online_dpo.py) on the CPU; returns the CompletedProcess."""
    env = dict(os.environ, WANDB_MODE="offline", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, str(ROOT / script), *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def run_grpo(*args, timeout=300):
    return run_script("grpo.py", *args, timeout=timeout)


def check(result):
    assert result.returncode == 0, f"{result.args[1]} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def read_metrics(output_dir):
    with open(Path(output_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]
