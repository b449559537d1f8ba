"""Helpers of the real-model GPU tests (test_real_models.py, test_faults.py and the scripts they start): where the tiny
models are (tests/gpu/make_tiny_models.py builds them), a `vllm serve` of one of them on GPU 1, the weight change, and
the log-prob comparison of vLLM's own samples with the trainer's."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import torch

TINY_DIR = os.environ.get("VLLM_TEST_TINY_DIR", "/tmp/tiny-models")
MODELS = {"dsv2": os.path.join(TINY_DIR, "tiny-dsv2"), "qwen3moe": os.path.join(TINY_DIR, "tiny-qwen3moe")}
PORT = int(os.environ.get("VLLM_TEST_TINY_PORT", "8021"))
EAGER = os.environ.get("VLLM_TEST_EAGER", "1") == "1"  # --enforce-eager: startup in seconds, not minutes
BOUND = 0.02  # the bound on the mean absolute log-prob difference
CONTROL_TARGET = 0.2  # the weight change grows until stale weights give at least this (10x the bound)
FIELDS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "max_tokens": 32}
TEXTS = [
    "What is 28 + 13? Reply with only the number.",
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return",
]
RESULT = "RESULT "  # the line the scripts print their JSON result on


def prompts(tokenizer):
    return [list(tokenizer(text)["input_ids"]) for text in TEXTS]


def perturb(model, alpha, seed):
    """Add alpha x (each matrix's std) Gaussian noise to every matrix (norm weights stay): a random-init model gives
    near-uniform outputs, so the change must be large for stale weights to show. Drawn on the CPU: the same on every
    rank and GPU."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim >= 2:
                noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
                param.add_((noise * alpha * param.float().std().cpu()).to(param.device, param.dtype))


def compare(sample, model, prompt_ids, n=4):
    """Mean and max |vLLM - trainer| log-prob of vLLM's own samples; `sample(prompt_ids, n)` -> (ids, log-probs)."""
    from gpu_helpers import mean_abs_diff, trainer_logprobs

    ids, lps = sample(prompt_ids, n)
    trainer_lp, mask = trainer_logprobs(model, [p for p in prompt_ids for _ in range(n)], ids, 1.0)
    mean, worst = mean_abs_diff(trainer_lp, lps, mask)
    return {"mean": mean, "max": worst, "tokens": int(mask.sum().item())}


def change_until_control_fails(model, sample, prompt_ids, seed=0, agree=lambda value: value):
    """Perturb the trainer's weights (not vLLM's) in growing steps until vLLM's stale log-probs differ from the
    trainer's by CONTROL_TARGET; returns the steps [(total alpha, control)], the last one the control. `agree` maps a
    rank's control to the one all ranks decide on (under torchrun every rank must take the same number of steps)."""
    steps, total = [], 0.0
    for alpha in (0.5, 0.5, 1.0, 2.0, 4.0):
        perturb(model, alpha, seed + len(steps))
        total += alpha
        steps.append((total, compare(sample, model, prompt_ids)))
        if agree(steps[-1][1]["mean"]) >= CONTROL_TARGET:
            break
    return steps


def emit(name, values):
    """Record (gpu_helpers.record: $GPU_RESULTS_DIR/<name>.json) and print the RESULT line the tests parse."""
    from gpu_helpers import record

    record(name, values)
    print(RESULT + json.dumps(values), flush=True)


def parse_result(stdout):
    lines = [line[len(RESULT) :] for line in stdout.splitlines() if line.startswith(RESULT)]
    return json.loads(lines[-1]) if lines else None


def serve_args(model, port, memory="0.3", eager=EAGER, backend="nccl", kv_bytes=None):
    """`vllm serve` as the scripts' serve command starts it (vllm_utils.serve_command), on a short context. `kv_bytes`:
    a fixed KV cache instead of one sized from the GPU's free memory, for a server that starts beside other processes
    on its GPU (their allocations would skew vLLM's memory profile)."""
    args = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, "--port", str(port)]
    args += ["--weight-transfer-config", f'{{"backend": "{backend}"}}', "--logprobs-mode", "processed_logprobs"]
    args += "--max-logprobs -1 --api-server-count 4 --max-model-len 1024 --gpu-memory-utilization".split() + [memory]
    args += ["--kv-cache-memory-bytes", str(kv_bytes)] if kv_bytes else []
    return args + ["--host", "127.0.0.1"] + (["--enforce-eager"] if eager else [])  # the trainers run on this host


class Servers:
    """One `vllm serve` at a time on GPU 1 (CUDA_VISIBLE_DEVICES=1), started on demand, shared by the tests; with
    backend "ipc", on the trainer's GPU 0 (one GPU), with the pickled IPC handles allowed and a fixed KV cache."""

    def __init__(self, port=PORT, log_dir=None, backend="nccl"):
        self.port, self.proc, self.model, self.backend = port, None, None, backend
        self.log_dir = log_dir or os.environ.get("GPU_RESULTS_DIR", "/tmp")
        self.url = f"http://127.0.0.1:{port}"
        self.started = None

    def start(self, model):
        """Start (not wait for) a server of `model`, stopping one of another model first."""
        if self.model == model and self.proc and self.proc.poll() is None:
            return
        self.stop()
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "1", "VLLM_SERVER_DEV_MODE": "1"}
        args = serve_args(model, self.port)
        if self.backend == "ipc":
            env.update(CUDA_VISIBLE_DEVICES="0", VLLM_ALLOW_INSECURE_SERIALIZATION="1")
            args = serve_args(model, self.port, memory="0.1", backend="ipc", kv_bytes=2 << 30)
        name = os.path.basename(model)
        self.log_path = os.path.join(self.log_dir, f"serve_{name}_{int(time.time())}.log")
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(  # its own process group: stop() ends the engine-core children with it
            args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.model, self.started = model, time.perf_counter()
        with open(os.path.join(self.log_dir, "server.pid"), "a") as f:  # run_issue14.sh kills each if pytest was
            f.write(f"{self.proc.pid}\n")

    def get(self, model, timeout=300):
        """The URL of a healthy server of `model` and its startup seconds (from start to healthy)."""
        import requests

        self.start(model)
        deadline = time.monotonic() + timeout
        while True:  # as vllm_utils.wait_for_server, but a server that exited is reported at once, with its log
            if self.proc.poll() is not None:
                with open(self.log_path) as f:
                    tail = f.read()[-4000:]
                raise RuntimeError(f"vllm serve {model} exited with {self.proc.returncode}:\n{tail}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{self.url}/health", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm serve {model} not healthy within {timeout} s (log: {self.log_path})")
            time.sleep(1)
        self.startup_s = getattr(self, "startup_s", None) or time.perf_counter() - self.started
        return self.url

    def restart(self, model, timeout=300):
        self.stop()
        self.startup_s = None
        return self.get(model, timeout)

    def stop(self, kill=False):
        """SIGTERM (SIGKILL with `kill`: a server wedged in a NCCL receive) to its process group, then SIGKILL."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:  # a server wedged in an NCCL receive may not stop on SIGTERM
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        if self.proc:  # engine-core children left behind would hold GPU 1's memory
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc = self.model = None
        self.startup_s = None


def unfused_weights(weights):
    """(name, tensor) pairs with transformers 5's fused MoE experts (mlp.experts.gate_up_proj [E, 2I, H] and
    mlp.experts.down_proj [E, H, I]) split into the checkpoint's per-expert names (mlp.experts.{e}.gate_proj.weight
    [I, H], .up_proj.weight, .down_proj.weight), as save_pretrained writes them: a diagnostic for a vLLM loader that
    knows only those (DeepseekV2's load_weights in vLLM 0.26)."""
    for name, tensor in weights:
        if name.endswith("mlp.experts.gate_up_proj") and tensor.ndim == 3:
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                yield f"{name[: -len('gate_up_proj')]}{e}.gate_proj.weight", gate[e]
                yield f"{name[: -len('gate_up_proj')]}{e}.up_proj.weight", up[e]
        elif name.endswith("mlp.experts.down_proj") and tensor.ndim == 3:
            for e in range(tensor.shape[0]):
                yield f"{name[: -len('down_proj')]}{e}.down_proj.weight", tensor[e]
        else:
            yield name, tensor
