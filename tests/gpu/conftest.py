"""GPU tests: real vLLM on real GPUs. Skipped unless CUDA and vLLM are present and the test model exists.
Model: $VLLM_TEST_MODEL (default /tmp/smol, SmolLM2-135M-Instruct on the H200 hosts). Numbers measured here are
written as JSON into $GPU_RESULTS_DIR when it is set."""

import contextlib
import os

import pytest
import torch

MODEL = os.environ.get("VLLM_TEST_MODEL", "/tmp/smol")

try:
    import vllm  # noqa: F401

    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False


def pytest_collection_modifyitems(config, items):
    reason = None
    if not torch.cuda.is_available():
        reason = "needs a CUDA GPU"
    elif not HAVE_VLLM:
        reason = "needs vLLM"
    elif not os.path.exists(os.path.join(MODEL, "config.json")):
        reason = f"needs the test model at {MODEL} (set VLLM_TEST_MODEL)"
    for item in items:
        if reason and "tests/gpu" in str(item.fspath):
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def tiny_servers():
    """One `vllm serve` of a tiny model at a time on GPU 1 (tests/gpu/tiny_models.py), shared by test_real_models.py
    and test_faults.py. $VLLM_TEST_PRESTART (dsv2 or qwen3moe) starts that one at once, so that it boots while the
    colocate tests run on GPU 0."""
    from tiny_models import MODELS, Servers

    servers = Servers()
    if os.environ.get("VLLM_TEST_PRESTART") in MODELS and torch.cuda.device_count() >= 2:
        servers.start(MODELS[os.environ["VLLM_TEST_PRESTART"]])
    yield servers
    servers.stop()


def pytest_sessionstart(session):
    if os.environ.get("GPU_RESULTS_DIR"):  # this session's failures only
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(os.environ["GPU_RESULTS_DIR"], "failures.txt"))


def pytest_runtest_logreport(report):
    """Each failure's report into $GPU_RESULTS_DIR/failures.txt as soon as it happens: a lease's time limit that cuts
    the session also cuts pytest's summary, which is where the failures would otherwise be printed (lost once)."""
    if report.failed and os.environ.get("GPU_RESULTS_DIR"):
        with open(os.path.join(os.environ["GPU_RESULTS_DIR"], "failures.txt"), "a") as f:
            f.write(f"== {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{report.longreprtext}\n\n")
