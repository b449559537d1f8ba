"""Server-mode faults (2 GPUs: a `vllm serve` of the tiny DeepSeek-V2-shaped model on GPU 1, trainers on GPU 0, each
a process of its own: tests/gpu/fault_trainer.py). The issue asks, and each test asserts:

1. a trainer whose model differs from the served one (the tiny Qwen3-MoE) gets a clear error before any NCCL
   (check_same_model: "the server serves ..., nothing sent"), the server stays healthy, and a fresh trainer of the
   right model then syncs against it (log-probs within 0.02 after the sync);
2. a trainer SIGKILLed between /start_weight_update and /update_weights: the server's engine still answers, and the
   next trainer finishes that update and syncs (within 0.02);
3. a trainer SIGKILLed mid-broadcast: the next trainer reports the wedged server within 30 s (from its first vllm_utils
   call) with the restart command, instead of a 300 s timeout.

The trainers send the MoE experts under per-expert checkpoint names (fault_trainer.py), so that these faults are
tested apart from the fused-expert naming that test_real_models.py reports.
What the server/trainer said and how long each took go to $GPU_RESULTS_DIR/fault_*.json. Run in this order (3 wedges
the server; the session's server fixture is stopped at the end):  pytest tests/gpu/test_faults.py -q
"""

import os
import subprocess
import sys
import time

import pytest
import requests
import torch
from tiny_models import BOUND, MODELS, parse_result

SCRIPT = os.path.join(os.path.dirname(__file__), "fault_trainer.py")
SERVED = MODELS["dsv2"]


def trainer(url, model, die=None, name="fault_trainer", timeout=180, gpus="0,1"):
    cmd = [sys.executable, SCRIPT, url, model, "--name", name, *(["--die", die] if die else [])]
    t0 = time.perf_counter()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as error:  # reported as an outcome: the trainer hung past `timeout`
        out = error.stdout.decode(errors="replace") if isinstance(error.stdout, bytes) else (error.stdout or "")
        done = subprocess.CompletedProcess(cmd, None, out, "")
        hung = {"ok": False, "stage": "hung", "error": f"TIMEOUT: no outcome within {timeout} s", "die": die}
        return {**hung, "seconds_to_outcome": float(timeout)}, done, time.perf_counter() - t0
    wall = time.perf_counter() - t0
    return parse_result(done.stdout), done, wall


def healthy(url):
    try:
        return requests.get(f"{url}/health", timeout=5).status_code == 200
    except requests.RequestException:
        return False


@pytest.fixture
def server(tiny_servers):
    for key in ("dsv2", "qwen3moe"):
        if not os.path.exists(os.path.join(MODELS[key], "config.json")):
            pytest.skip(f"needs {MODELS[key]} (tests/gpu/make_tiny_models.py)")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    return tiny_servers, tiny_servers.get(SERVED)


def test_1_wrong_model_is_refused_before_nccl_and_the_server_stays_usable(server):
    servers, url = server
    wrong, done, wall = trainer(url, MODELS["qwen3moe"], name="fault_wrong_model_trainer")
    assert wrong is not None, done.stdout[-3000:] + done.stderr[-5000:]
    still_healthy = healthy(url)
    fresh, done2, wall2 = trainer(url, SERVED, name="fault_wrong_model_then_fresh")
    from gpu_helpers import record

    record("fault_wrong_model", {"wrong": wrong, "wrong_wall_s": wall, "healthy_after": still_healthy, "fresh": fresh})
    assert not wrong["ok"] and wrong["stage"] == "check_same_model", wrong
    assert "the server serves" in wrong["error"] and "nothing sent" in wrong["error"], wrong["error"]
    assert still_healthy
    assert fresh is not None, done2.stdout[-3000:] + done2.stderr[-5000:]
    assert fresh["ok"] and fresh["after_sync"]["mean"] < BOUND, fresh


def test_2_trainer_killed_after_start_weight_update(server):
    servers, url = server
    killed, done, wall = trainer(url, SERVED, die="after-start", name="fault_after_start_killed")
    assert done.returncode == -9, f"the trainer was not killed: rc {done.returncode}\n{done.stdout[-3000:]}"
    still_healthy = healthy(url)
    nxt, done2, wall2 = trainer(url, SERVED, name="fault_after_start_next")
    from gpu_helpers import record

    record(
        "fault_after_start",
        {"killed_rc": done.returncode, "healthy_after_kill": still_healthy, "next": nxt, "next_wall_s": wall2},
    )
    assert nxt is not None, done2.stdout[-3000:] + done2.stderr[-5000:]
    if not nxt["ok"]:
        servers.restart(SERVED)  # so that test 3 starts from a working server
    assert nxt["ok"] and nxt["after_sync"]["mean"] < BOUND, nxt  # the dead trainer's update finished, then this one


def test_3_trainer_killed_mid_broadcast_is_reported_within_30s(server):
    servers, url = server
    killed, done, wall = trainer(url, SERVED, die="mid-broadcast", name="fault_mid_broadcast_killed")
    assert done.returncode == -9, f"the trainer was not killed: rc {done.returncode}\n{done.stdout[-3000:]}"
    health = healthy(url)
    nxt, done2, wall2 = trainer(url, SERVED, name="fault_mid_broadcast_next", timeout=150)
    from gpu_helpers import record

    record(
        "fault_mid_broadcast",
        {"killed_stdout": done.stdout[-500:], "healthy_after_kill": health, "next": nxt, "next_wall_s": wall2},
    )
    servers.stop(kill=True)  # wedged (or dead): the next test that needs one starts a fresh one
    assert nxt is not None, done2.stdout[-3000:] + done2.stderr[-5000:]
    assert not nxt["ok"] and "vllm serve" in nxt["error"], nxt  # the engine is blocked in the receive: restart it
    assert nxt["seconds_to_outcome"] < 30, f"reported after {nxt['seconds_to_outcome']:.0f} s: {nxt['error']}"
