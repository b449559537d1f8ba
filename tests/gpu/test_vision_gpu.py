"""Images through real vLLM on one GPU (issue 45), with the tiny VLM of tests/make_tiny_vlm.py (warm-started: it says
a colour word, whatever the image):

    pytest tests/gpu/test_vision_gpu.py -q -k colocate_holds     # vLLM holds the trainer's weights (and a control)
    pytest tests/gpu/test_vision_gpu.py -q -k learns             # grpo.py learns the colour task: colocate, IPC server
                                                             # (sync and --async-generation)

The weight check changes the trainer's weights until the unsynced engine's log-probs differ from the trainer's by at
least 0.2 (the control), then pushes them: after the push they differ by at most 0.02. The learning runs are the CPU
recipe of docs/vision.md with --use-vllm; each writes its metrics to $GPU_RESULTS_DIR (a 1 x H100's at 7e25ed0:
benchmarks/results/vision_gpu_7e25ed0/)."""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from gpu_helpers import mean_abs_diff, record

import grpo
import vllm_utils

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from make_tiny_vlm import make_colour_dataset, make_tiny_vlm  # noqa: E402

FIELDS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "max_tokens": 8}


@pytest.fixture(scope="module")
def colours():
    """(the warm-started tiny VLM, the training set, the held-out set), built once."""
    root = Path(tempfile.mkdtemp())
    make_tiny_vlm(root / "vlm", warm=True)
    return root / "vlm", make_colour_dataset(root / "train", 64, seed=0), make_colour_dataset(root / "held", 40, 1)


def trainer_logprobs(model, run, prompt_set, rows, completion_ids):
    """The trainer's log-probs of each row's completions (grpo.per_token_logprobs with the rows' images)."""
    prompt_ids = [prompt_set.prompt_ids[r] for r in rows]
    batch = grpo.collate(prompt_ids, completion_ids, model.device, pad_id=0)
    images = grpo.image_inputs(run, prompt_set, rows)
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        return grpo.per_token_logprobs(model, *batch, 1.0, images=images), batch.completion_mask


def difference(model, run, prompt_set, rows, completion_ids, vllm_lp):
    """(mean, max) |trainer - vLLM| log-prob of the sampled tokens."""
    trainer_lp, mask = trainer_logprobs(model, run, prompt_set, rows, completion_ids)
    return mean_abs_diff(trainer_lp, vllm_lp, mask)


def test_vision_colocate_holds_the_trainers_weights(colours):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path, train, _ = colours
    args = grpo.parse_args(
        ["--dataset-name", str(train), "--prompt-column", "prompt", "--reward-funcs", "format_reward"]
    )
    processor = AutoProcessor.from_pretrained(path)
    prompt_set = grpo.load_prompts(args, grpo.read_dataset(args, []), processor.tokenizer, 10**6, processor=processor)
    run = type("Run", (), {"processor": processor, "device": torch.device("cuda")})()
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).cuda()
    for param in model.get_encoder("image").parameters():  # frozen (--freeze-vision-tower): the push leaves vLLM's
        param.requires_grad_(False)
    llm = vllm_utils.colocate_engine(
        str(path), gpu_memory_utilization=0.1, max_model_len=256, limit_mm_per_prompt={"image": 1}, enforce_eager=True
    )
    rows = list(range(8))
    prompt_ids = [prompt_set.prompt_ids[r] for r in rows]
    sample = lambda: vllm_utils.colocate_generate(llm, prompt_ids, 1, FIELDS, grpo.vllm_images(run, prompt_set, rows))
    differences = []
    for scale in (0.0, 0.05, 0.1, 0.2, 0.4, 0.8):  # change until the unsynced engine fails the check (the control)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "text_model" in name and param.dim() == 2:
                    param.add_(torch.randn_like(param) * scale * param.std())
        differences.append(difference(model, run, prompt_set, rows, *sample())[0])
        if differences[-1] >= 0.2:
            break
    control = differences[-1]
    vllm_utils.sync_weights({"mode": "colocate", "llm": llm, "images": 1}, model)  # as the trainer: features reset
    synced, synced_max = difference(model, run, prompt_set, rows, *sample())
    record("vision_colocate_sync", {"control_diffs": differences, "synced_mean": synced, "synced_max": synced_max})
    assert control >= 0.2 and synced <= 0.02


DIST = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")  # this process's engine set (and holds) them
LEARN = ["--prompt-column", "prompt", "--reward-funcs", "first_word_reward", "--reward-kwargs", "partial", "0"]
LEARN += ["--no-bf16", "--max-completion-length", "8", "--prompts-per-step", "4", "--lr-scheduler-type", "constant"]
LEARN += ["--seed", "0", "--num-generations", "16", "--temperature", "1.0", "--max-steps", "80"]
LEARN += ["--learning-rate", "5e-4", "--beta", "0.1", "--use-vllm"]
MODES = {
    "colocate": ["--vllm-mode", "colocate", "--vllm-gpu-memory-utilization", "0.1"],
    "server": ["--vllm-mode", "server", "--vllm-server-port", "8301", "--vllm-server-timeout", "300"],
    "server_async": [
        "--vllm-mode",
        "server",
        "--vllm-server-port",
        "8301",
        "--vllm-server-timeout",
        "300",
        "--async-generation",
    ],
}


@pytest.mark.parametrize("mode", list(MODES))
def test_vision_grpo_learns_with_vllm(colours, mode, tmp_path):
    path, train, _ = colours
    server = None
    if mode.startswith("server"):  # an IPC server of the tiny VLM on this GPU, eager, a fixed KV cache
        command = vllm_utils.serve_command(str(path), port=8301, backend="ipc", kv_bytes=1 << 30)
        command = command.replace("vllm serve", f"{sys.executable} -m vllm.entrypoints.cli.main serve")
        server = subprocess.Popen(
            command + " --enforce-eager --max-model-len 256 --gpu-memory-utilization 0.05",
            shell=True,
            start_new_session=True,
            stdout=open(tmp_path / "server.log", "w"),
            stderr=subprocess.STDOUT,
        )
    try:
        t0 = time.perf_counter()
        out = tmp_path / mode
        flags = [*LEARN, *MODES[mode], "--model-name-or-path", str(path), "--dataset-name", str(train)]
        result = subprocess.run(
            [sys.executable, str(ROOT / "grpo.py"), *flags, "--output-dir", str(out)],
            cwd=ROOT,
            env={**{k: v for k, v in os.environ.items() if k not in DIST}, "WANDB_MODE": "offline"},
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        metrics = [json.loads(line) for line in open(out / "metrics.jsonl")]
        rewards = [m["reward"] for m in metrics]
        means = [sum(rewards[i - 5 : i]) / 5 for i in range(5, len(rewards) + 1)]
        difference = [m.get("sampling/sampling_logp_difference/mean") for m in metrics]
        record(
            f"vision_learn_{mode}", {"seconds": time.perf_counter() - t0, "last5": means[-1], "logp_diff": difference}
        )
        # the median step: one of 80 small steps may stray (colocated: 0.032 once, bf16 vLLM against the fp32 trainer),
        # and with --async-generation each round was sampled one optimizer step before (lr 5e-4: up to 0.17 while the
        # policy moves); an engine left unsynced differs by >= 0.2 on most steps once the policy has learned
        assert max(means) >= 0.8 and statistics.median(d for d in difference if d is not None) <= 0.02
    finally:
        if server is not None:
            os.killpg(server.pid, 15)
