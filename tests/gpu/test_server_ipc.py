"""Server mode on ONE GPU: a stock `vllm serve --weight-transfer-config '{"backend": "ipc"}'` on the trainer's own GPU,
weights pushed as CUDA IPC handles (vllm_utils.server_sync_weights_ipc). For bench-0.5b and the two tiny MoE models of
tests/gpu/make_tiny_models.py, tests/gpu/real_model_run.py changes the trainer's weights until vLLM's stale log-probs
of its own samples differ from the trainer's by >= 0.2 mean absolute (the control, which must fail the bound 0.02),
pushes them, and compares again: after the push they must be within the bound that the colocate tests use.

    python tests/gpu/make_tiny_models.py /tmp/tiny-models   # once
    pytest tests/gpu/test_server_ipc.py -q                  # 1 GPU; VLLM_TEST_BENCH_URL: a running bench-0.5b IPC server

The last test does the same with two servers of one model on the GPU (--vllm-server-port 8000 8001): each samples
some of every comparison, and one push reaches both.
"""

import os
import sys

import pytest
from test_real_models import SCRIPT, check, needs, run
from tiny_models import MODELS, Servers

BENCH = os.environ.get("VLLM_TEST_BENCH_MODEL", "/tmp/bench-qwen05b")


@pytest.fixture(scope="module")
def ipc_servers():
    servers = Servers(port=int(os.environ.get("VLLM_TEST_IPC_PORT", "8031")), backend="ipc")
    yield servers
    servers.stop()


@pytest.mark.parametrize("model_key", [*MODELS, "bench05b"])
def test_ipc_server_push_matches_the_trainer(model_key, ipc_servers):
    if model_key == "bench05b":
        if not os.path.exists(os.path.join(BENCH, "config.json")):
            pytest.skip(f"needs {BENCH} (../shared/gpu/make_bench_model.py)")
        url = os.environ.get("VLLM_TEST_BENCH_URL") or ipc_servers.get(BENCH)
        model = BENCH
        if os.environ.get("VLLM_TEST_BENCH_URL"):
            from vllm_utils import wait_for_server

            wait_for_server(url, 400, BENCH)  # a compiled server may still be starting
    else:
        needs(model_key)
        model, url = MODELS[model_key], ipc_servers.get(MODELS[model_key])
    result, _ = run([sys.executable, SCRIPT, "server", model, url], env={"CUDA_VISIBLE_DEVICES": "0"})
    assert result["backend"] == "ipc", result
    check(result)


def test_two_ipc_servers_share_the_rounds_and_both_take_the_push(ipc_servers):
    """Two servers of the tiny DeepSeek-V2-shaped model on the trainer's GPU: samples from both, before and after one
    push to both, compared with the trainer's log-probs (the bound and the control as above)."""
    needs("dsv2")
    twin = Servers(port=ipc_servers.port + 1, backend="ipc")
    try:
        urls = [ipc_servers.get(MODELS["dsv2"]), twin.get(MODELS["dsv2"])]
        result, _ = run(
            [sys.executable, SCRIPT, "server", MODELS["dsv2"], ",".join(urls)], env={"CUDA_VISIBLE_DEVICES": "0"}
        )
        assert result["servers"] == urls, result
        check(result)
    finally:
        twin.stop()
