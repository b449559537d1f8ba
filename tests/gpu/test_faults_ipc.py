"""Server-mode faults on ONE GPU: an IPC `vllm serve` (--weight-transfer-config '{"backend": "ipc"}') on the trainer's
GPU 0, trainers on the same GPU, each a process of its own. Each test asserts, and records what the trainer said and
after how many seconds in $GPU_RESULTS_DIR/fault_ipc_*.json:

1. a trainer of another model (the tiny Qwen3-MoE against the served tiny DeepSeek-V2) is refused before any
   /start_weight_update ("nothing sent"); the server then trains a correct trainer (within the bound after its push);
2. a trainer SIGKILLed between /start_weight_update and its first /update_weights: the next trainer recovers the
   server (a push within the bound) or fails with the command that restarts it;
3. a trainer SIGKILLed inside /update_weights (the memory its IPC handle points at vanishes under the server): the
   next trainer pushes within the bound, or reports within 30 s with the restart command, and a fresh trainer then
   trains against a restarted server;
4. the server killed while grpo.py trains against it, inside a weight push (tests/gpu/grpo_marked.py marks it):
   SIGKILL of the EngineCore process, and separately of the `vllm serve` parent. The trainer reports it within 30 s
   of the kill with the restart command (or, if the server kept serving, finishes its run), and the same command
   with --resume-from-checkpoint latest continues from the last checkpoint against a restarted server, to the end.

    python tests/gpu/make_tiny_models.py /tmp/tiny-models && pytest tests/gpu/test_faults_ipc.py -q   # 1 GPU
"""

import os
import signal
import subprocess
import sys
import time

import pytest
import requests
from gpu_helpers import MODEL, record
from test_faults import trainer
from tiny_models import BOUND, MODELS, Servers

SERVED = MODELS["dsv2"]
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
MARKED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "grpo_marked.py")


@pytest.fixture(scope="module")
def ipc_servers():
    servers = Servers(port=int(os.environ.get("VLLM_TEST_IPC_FAULT_PORT", "8041")), backend="ipc")
    yield servers
    servers.stop()


def needs_tiny():
    for key in ("dsv2", "qwen3moe"):
        if not os.path.exists(os.path.join(MODELS[key], "config.json")):
            pytest.skip(f"needs {MODELS[key]} (tests/gpu/make_tiny_models.py)")


def on_gpu0(url, model, **kwargs):
    return trainer(url, model, gpus="0", **kwargs)


def test_1_wrong_model_is_refused_before_anything_is_sent_and_the_server_then_trains(ipc_servers):
    needs_tiny()
    url = ipc_servers.get(SERVED)
    wrong, done, wall = on_gpu0(url, MODELS["qwen3moe"], name="fault_ipc_wrong_model_trainer")
    assert wrong is not None, done.stdout[-3000:] + done.stderr[-5000:]
    fresh, done2, _ = on_gpu0(url, SERVED, name="fault_ipc_wrong_model_then_fresh")
    record("fault_ipc_wrong_model", {"wrong": wrong, "wrong_wall_s": wall, "fresh": fresh})
    assert not wrong["ok"] and wrong["stage"] == "check_same_model" and "nothing sent" in wrong["error"], wrong
    assert fresh is not None and fresh["ok"] and fresh["after_sync"]["mean"] < BOUND, (fresh, done2.stderr[-3000:])


def test_2_trainer_killed_after_start_weight_update(ipc_servers):
    needs_tiny()
    url = ipc_servers.get(SERVED)
    _, done, _ = on_gpu0(url, SERVED, die="after-start", name="fault_ipc_after_start_killed")
    assert done.returncode == -9, f"the trainer was not killed: rc {done.returncode}\n{done.stdout[-3000:]}"
    nxt, done2, wall2 = on_gpu0(url, SERVED, name="fault_ipc_after_start_next")
    record("fault_ipc_after_start", {"next": nxt, "next_wall_s": wall2})
    assert nxt is not None, done2.stdout[-3000:] + done2.stderr[-5000:]
    if nxt["ok"]:
        assert nxt["after_sync"]["mean"] < BOUND, nxt
    else:
        assert "vllm serve" in nxt["error"], f"neither recovered nor said how to restart: {nxt['error']}"
        ipc_servers.restart(SERVED)


def test_3_trainer_killed_inside_update_weights(ipc_servers):
    needs_tiny()
    url = ipc_servers.get(SERVED)
    killed, done, _ = on_gpu0(url, SERVED, die="mid-update", name="fault_ipc_mid_update_killed")
    assert done.returncode == -9, f"the trainer was not killed: rc {done.returncode}\n{done.stdout[-3000:]}"
    nxt, done2, wall2 = on_gpu0(url, SERVED, name="fault_ipc_mid_update_next", timeout=150)
    server_alive = ipc_servers.proc.poll() is None
    fresh = None
    if not (nxt and nxt["ok"]):  # as the message says: restart the server, then a fresh trainer trains against it
        ipc_servers.restart(SERVED)
        fresh, _, _ = on_gpu0(ipc_servers.url, SERVED, name="fault_ipc_mid_update_fresh")
    record("fault_ipc_mid_update", {"next": nxt, "next_wall_s": wall2, "server_alive": server_alive, "fresh": fresh})
    assert nxt is not None, done2.stdout[-3000:] + done2.stderr[-5000:]
    if nxt["ok"]:
        assert nxt["after_sync"]["mean"] < BOUND, nxt
        return
    assert "vllm serve" in nxt["error"] and nxt["seconds_to_outcome"] < 30, nxt
    assert fresh is not None and fresh["ok"] and fresh["after_sync"]["mean"] < BOUND, fresh


def _engine_core(session):
    """The pid of the EngineCore process in the server's session (it renamed itself VLLM::EngineCore)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if int(fields[3]) == session and cmdline.startswith(b"VLLM::EngineCore"):
            return int(pid)
    raise RuntimeError(f"no VLLM::EngineCore in session {session}")


@pytest.mark.parametrize("victim", ["engine_core", "serve_parent"])
def test_4_server_killed_inside_a_push_is_reported_and_the_run_resumes(ipc_servers, victim, tmp_path):
    if not os.path.exists(os.path.join(MODEL, "config.json")):
        pytest.skip(f"needs {MODEL}")
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "make_tasks.py"), str(tmp_path)], check=True)
    url = ipc_servers.restart(MODEL)
    out, marker = tmp_path / "run", tmp_path / "pushing"
    flags = [
        *f"--model-name-or-path {MODEL} --dataset-name {tmp_path / 'addition.jsonl'} --prompt-column prompt".split(),
        *"--answer-column answer --reward-funcs gsm8k_accuracy --max-completion-length 32 --learning-rate 1e-5".split(),
        *"--prompts-per-step 8 --num-generations 4 --use-vllm --vllm-mode server --save-steps 1".split(),
        *f"--vllm-server-port {ipc_servers.port} --output-dir {out} --max-steps 20 --vllm-weight-sync-buffer-mb 1".split(),
    ]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0", "FAULT_MARKER": str(marker), "WANDB_MODE": "offline"}
    log = open(tmp_path / "trainer.log", "w")
    run = [sys.executable, MARKED, *flags]  # 1 MiB chunks: a push takes a few seconds
    proc = subprocess.Popen(run, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.monotonic() + 300
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "trainer.log").read_text()[-3000:]
        time.sleep(0.05)
    pid = _engine_core(ipc_servers.proc.pid) if victim == "engine_core" else ipc_servers.proc.pid
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    try:
        rc = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = None
    seconds = time.monotonic() - killed_at
    said = (tmp_path / "trainer.log").read_text()
    try:
        health = requests.get(f"{url}/health", timeout=5).status_code
    except requests.RequestException as error:
        health = f"{type(error).__name__}"
    ipc_servers.restart(MODEL)  # what the message tells the user to do
    resume = subprocess.run(
        [sys.executable, "grpo.py", *flags, "--resume-from-checkpoint", "latest"],  # the same command, resumed
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    steps = [line for line in open(out / "metrics.jsonl")] if (out / "metrics.jsonl").exists() else []
    values = {"victim": victim, "trainer_rc": rc, "seconds_to_report": seconds, "health_after_kill": health}
    values.update(trainer_said=said[-1500:], resume_rc=resume.returncode, resume_tail=resume.stdout[-800:])
    values["resume_stderr"] = resume.stderr[-3000:]  # the first GPU run failed here with nothing on stdout
    values["metrics_rows_after_resume"] = len(steps)
    record(f"fault_ipc_server_killed_{victim}", values)
    if rc == 0:  # the server kept serving (a parent whose children live on): nothing to report, nothing lost
        assert health == 200, values
    else:
        assert rc is not None and seconds < 30, f"reported after {seconds:.0f} s (rc {rc}): {said[-2000:]}"
        assert "vllm serve" in said[-4000:], f"the trainer did not say how to restart the server: {said[-2000:]}"
    assert resume.returncode == 0 and "resumed from" in resume.stdout, resume.stdout[-3000:] + resume.stderr[-3000:]
    assert len(steps) == 20, steps[-2:]  # the rows after the checkpoint were redone, none lost or doubled
