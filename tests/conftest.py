import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `import grpo` / `import rewards` from the repo root
os.environ.setdefault("WANDB_MODE", "offline")
# The models in these tests are tiny: one thread is much faster than several fighting over 2 cores (a 260K-parameter
# model generates ~50x slower with 2 threads when another process holds one of the cores).
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_sessionstart(session):
    # the fork server that runs the training scripts' commands imports torch and transformers while pytest collects
    from grpo_cli import _prefork

    _prefork()


@pytest.fixture(scope="session")
def learning_run(tmp_path_factory):
    """learning_run(lr): the output folder of `python grpo.py LEARNING --learning-rate lr` (grpo_cli.LEARNING), run
    once per session (tests/test_learning.py checks its rewards, tests/test_plot.py plots them). The first call starts
    the learning rates of test_learning.py (2e-4 and 0) side by side, a core each."""
    from grpo_cli import LEARNING, Process, check

    root, runs = tmp_path_factory.mktemp("learning"), {}

    def start(learning_rate):
        runs[learning_rate] = Process(
            "grpo.py", *LEARNING, "--learning-rate", learning_rate, "--output-dir", root / f"lr{learning_rate}"
        )

    def run(learning_rate):
        if not runs:
            start(2e-4)
            start(0.0)
        if learning_rate not in runs:
            start(learning_rate)
        check(runs[learning_rate].result())
        return root / f"lr{learning_rate}"

    yield run
    for process in runs.values():
        process.kill()
