"""The issue's real-model check on two tiny random-init models (tests/gpu/make_tiny_models.py): DeepSeek-V2-shaped
(MLA + MoE) and Qwen3-MoE-shaped. In each mode the trainer's weights are changed until vLLM's log-probs of its own
samples differ from the trainer's by >= 0.2 mean absolute while vLLM still has the old weights (the control: it must
exceed the bound 0.02, so the test can fail), then synced through vllm_utils: after it they must be within 0.02.
Modes: colocate without sleep mode (after the checked sync, the trainer changes again and the same engine reports what
HEAD e895bb7's load path, a plain load_weights, gives: recorded, not asserted),
colocate with sleep mode (level 2), server (`vllm serve` on GPU 1, NCCL from GPU 0), and tensor parallel 2 colocated
under torchrun with sleep mode. When a sync raises, colocate (in the same engine) and server (in a fresh trainer) also
try it with the MoE experts sent under per-expert checkpoint names (transformers 5 keeps them fused as
mlp.experts.gate_up_proj; vLLM 0.26's DeepseekV2 load_weights knows only per-expert names), recorded as *unfused*,
not asserted: it separates that naming failure from the derived-tensor question. Each runs tests/gpu/real_model_run.py
in a process of its own (one sleep-mode engine per process; a fresh CUDA context per engine). Numbers: $GPU_RESULTS_DIR/real_<mode>_<model>.json.

    python tests/gpu/make_tiny_models.py /tmp/tiny-models       # once (VLLM_TEST_TINY_DIR, default /tmp/tiny-models)
    pytest tests/gpu/test_real_models.py -q                     # 2 GPUs for server and tp2; or tests/gpu/run_issue14.sh
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from tiny_models import BOUND, MODELS, RESULT, parse_result

HERE = os.path.dirname(__file__)
SCRIPT = os.path.join(HERE, "real_model_run.py")
TIMEOUT = int(os.environ.get("VLLM_TEST_RUN_TIMEOUT", "240"))


def run(cmd, env=None, timeout=TIMEOUT):
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired as error:
        out = (error.stdout or b"").decode(errors="replace") if isinstance(error.stdout, bytes) else error.stdout or ""
        pytest.fail(f"{' '.join(cmd[-3:])} ran past {timeout} s\n{out[-3000:]}")
    result = parse_result(done.stdout)
    assert result is not None, f"rc {done.returncode}, no RESULT\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return result, done


def check(result):
    """The issue's assertions, with every number in the message."""
    control, after = result["control"]["mean"], (result.get("after_sync") or {}).get("mean")
    assert control > BOUND, f"the control did not fail: stale weights gave {control:.4f} <= {BOUND}: {result}"
    assert "sync_error" not in result, f"the sync raised: {result['sync_error']}"
    assert after is not None and after < BOUND, f"after the sync {after} >= {BOUND} (control {control:.4f}): {result}"


def needs(model_key, gpus=1):
    if not os.path.exists(os.path.join(MODELS[model_key], "config.json")):
        pytest.skip(
            f"needs {MODELS[model_key]}: python tests/gpu/make_tiny_models.py {os.path.dirname(MODELS[model_key])}"
        )
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")


def overlap(servers, model_key):
    """With $VLLM_TEST_OVERLAP=1 (run_issue14.sh) and 2 GPUs, start this model's server on GPU 1 now, without waiting:
    it boots while the colocate engine runs on GPU 0 (CUDA_VISIBLE_DEVICES=0), ready for test_server."""
    if os.environ.get("VLLM_TEST_OVERLAP") == "1" and torch.cuda.device_count() >= 2:
        servers.start(MODELS[model_key])


@pytest.mark.parametrize("model_key", list(MODELS))
def test_colocate_without_sleep(model_key, tiny_servers):
    needs(model_key)
    overlap(tiny_servers, model_key)
    result, _ = run([sys.executable, SCRIPT, "colocate", MODELS[model_key]], env={"CUDA_VISIBLE_DEVICES": "0"})
    check(result)


@pytest.mark.parametrize("model_key", list(MODELS))
def test_colocate_with_sleep(model_key, tiny_servers):
    needs(model_key)
    overlap(tiny_servers, model_key)
    result, _ = run([sys.executable, SCRIPT, "colocate_sleep", MODELS[model_key]], env={"CUDA_VISIBLE_DEVICES": "0"})
    check(result)


@pytest.mark.parametrize("model_key", list(MODELS))
def test_server(model_key, tiny_servers):
    needs(model_key, gpus=2)
    url = tiny_servers.get(MODELS[model_key])
    cmd, env = [sys.executable, SCRIPT, "server", MODELS[model_key], url], {"CUDA_VISIBLE_DEVICES": "0,1"}
    result, _ = run(cmd, env=env)
    result["server_startup_s"] = tiny_servers.startup_s
    if "sync_error" in result:  # diagnostic, in a fresh trainer: the same sync with the experts under per-expert names
        unfused, _ = run(cmd, env={**env, "VLLM_TEST_UNFUSED": "1"})
        result["unfused_rerun"] = {key: unfused.get(key) for key in ("control", "sync_error", "after_sync", "ok")}
    check(result)


@pytest.mark.parametrize("model_key", list(MODELS))
def test_tensor_parallel_2(model_key, tiny_servers):
    needs(model_key, gpus=2)
    tiny_servers.stop()  # GPU 1 is the second rank's
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", SCRIPT, "tp2"]
    _, done = run([*cmd, MODELS[model_key]], env={"CUDA_VISIBLE_DEVICES": "0,1"})
    # both ranks print a RESULT line: check both
    results = [json.loads(line[len(RESULT) :]) for line in done.stdout.splitlines() if line.startswith(RESULT)]
    assert len(results) == 2, f"rc {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    for result in results:
        check(result)
