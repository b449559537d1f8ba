import os
import sys
from pathlib import Path

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
