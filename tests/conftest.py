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
def background():
    """The session's grpo_cli.Background: the runs below start with the first test, in the order listed in
    BACKGROUND_FIXTURES, on the core that the tests leave idle; their processes are killed at the end."""
    from grpo_cli import Background

    work = Background()
    yield work
    work.close()


# the fixtures whose runs start in the background when the session's first test starts, each only if a selected test
# uses it, in this order: that of their tests (pytest_collection_modifyitems below)
BACKGROUND_FIXTURES = [
    "same_steps_runs",
    "learning_run",
    "online_dpo_learning_run",
    "rloo_learning_run",
    "sigterm_under_torchrun_run",
    "lora_learning_run",
    "lora_same_steps_run",
    "vision_learning_runs",
]


def uses_background(item):
    return any(name in BACKGROUND_FIXTURES for name in getattr(item, "fixturenames", ()))


def pytest_collection_modifyitems(session, config, items):
    # the tests that read background runs come last (each file's in their order), so that the runs have the rest of
    # the session to finish in
    items[:] = [item for item in items if not uses_background(item)] + [item for item in items if uses_background(item)]


@pytest.fixture(scope="session", autouse=True)
def _start_background_runs(request):
    used = {name for item in request.session.items for name in item.fixturenames}
    for name in BACKGROUND_FIXTURES:
        if name in used:
            request.getfixturevalue(name)


def learning_runs(background, root, script, args, learning_rates):
    """run(lr): the output folder of `python SCRIPT ARGS --learning-rate lr --output-dir root/lr<lr>` (it must exit 0);
    the runs of `learning_rates` start now, in the background, another learning rate when first asked for."""
    from grpo_cli import background_run

    jobs = {}

    def start(learning_rate):
        out = root / f"lr{learning_rate}"
        jobs[learning_rate] = background.submit(
            background_run, script, *args, "--learning-rate", learning_rate, "--output-dir", out
        )

    def run(learning_rate):
        if learning_rate not in jobs:
            start(learning_rate)
        jobs[learning_rate].result()
        return root / f"lr{learning_rate}"

    for learning_rate in learning_rates:
        start(learning_rate)
    return run


@pytest.fixture(scope="session")
def learning_run(background, tmp_path_factory):
    """learning_run(lr): the output folder of `python grpo.py LEARNING --learning-rate lr` (grpo_cli.LEARNING), run
    once per session (tests/test_learning.py checks its rewards, tests/test_plot.py plots them); test_learning.py's
    learning rates (2e-4 and 0) run in the background from the session's start."""
    from grpo_cli import LEARNING

    return learning_runs(background, tmp_path_factory.mktemp("learning"), "grpo.py", LEARNING, [2e-4, 0.0])


@pytest.fixture(scope="session")
def online_dpo_learning_run(background, tmp_path_factory):
    """online_dpo_learning_run(lr): the output folder of `python online_dpo.py LEARN --learning-rate lr`
    (tests/test_online_dpo_cli.py's learning test; 3e-4 and 0 run in the background from the session's start)."""
    from test_online_dpo_cli import LEARN

    return learning_runs(background, tmp_path_factory.mktemp("learn_dpo"), "online_dpo.py", LEARN, [3e-4, 0.0])


@pytest.fixture(scope="session")
def rloo_learning_run(background, tmp_path_factory):
    """rloo_learning_run(lr): the output folder of `python rloo.py LEARN --learning-rate lr` (tests/test_rloo.py's
    learning test; 5e-4 runs in the background from the session's start)."""
    from test_rloo import LEARN

    return learning_runs(background, tmp_path_factory.mktemp("learn_rloo"), "rloo.py", LEARN, [5e-4])


@pytest.fixture(scope="session")
def same_steps_runs(background, tmp_path_factory):
    """{script: job}: each script's runs on 1 and on 2 ranks for test_distributed.py's
    test_the_scripts_take_the_same_steps_on_two_ranks_as_on_one (test_distributed.run_on_one_and_two_ranks), in the
    background."""
    from test_distributed import SAME_STEPS_SCRIPTS, run_on_one_and_two_ranks

    return {
        script: background.submit(
            run_on_one_and_two_ranks, tmp_path_factory.mktemp(f"same_steps_{script[:-3]}"), script, real
        )
        for script, real in SAME_STEPS_SCRIPTS
    }


@pytest.fixture(scope="session")
def sigterm_under_torchrun_run(background, tmp_path_factory):
    """test_safe_runs.py's run under torchrun itself that gets SIGTERM after 2 steps
    (test_safe_runs.sigterm_under_torchrun), in the background."""
    from test_safe_runs import sigterm_under_torchrun

    return background.submit(sigterm_under_torchrun, tmp_path_factory.mktemp("sigterm_torchrun"))


@pytest.fixture(scope="session")
def lora_learning_run(background, tmp_path_factory):
    """lora_learning_run(lr): the output folder of `python grpo.py LEARNING --use-peft --learning-rate lr`
    (tests/test_lora.py's learning test; its learning rate runs in the background from the session's start)."""
    from test_lora import LORA_LEARNING_RATE

    from grpo_cli import LEARNING

    root = tmp_path_factory.mktemp("learn_lora")
    return learning_runs(background, root, "grpo.py", [*LEARNING, "--use-peft"], [LORA_LEARNING_RATE])


@pytest.fixture(scope="session")
def lora_same_steps_run(background, tmp_path_factory):
    """test_distributed.run_on_one_and_two_ranks for grpo.py with --use-peft (tests/test_lora.py), in the background."""
    from test_distributed import run_on_one_and_two_ranks

    path = tmp_path_factory.mktemp("same_steps_lora")
    return background.submit(run_on_one_and_two_ranks, path, "grpo.py", False, ["--use-peft"])


@pytest.fixture(scope="session")
def vision_learning_runs(background, tmp_path_factory):
    """{script: job}: test_vision.py's colour-task run of each script (test_vision.learn), in the background. The
    warm-started tiny VLM and its data are built first, here: in the jobs' threads, torch's one global generator would
    be shared."""
    from test_vision import LEARN, colour_task, learn

    task = colour_task(tmp_path_factory.mktemp("vision_task"), warm=True)
    root = tmp_path_factory.mktemp("vision_runs")
    return {script: background.submit(learn, task, root / script[:-3], script) for script in LEARN}
