"""A run never destroys another run, and every mistake is caught up front with a message that names the flag
(grpo.py, rloo.py, online_dpo.py).

Checks that come before any model loads run the script itself in this process (runpy), with every from_pretrained
replaced by a failure: a passing test proves the error came before a model or tokenizer was loaded. What needs real
processes (a lock held by a live run, SIGKILL, SIGTERM) runs the scripts as commands."""

import importlib
import json
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
import time

import pytest
import transformers

from grpo_cli import ASSETS, ROOT, SMALL, Process, check, launch, read_metrics, run_script, write_jsonl

SCRIPTS = ["grpo.py", "rloo.py", "online_dpo.py"]
PROMPTS = [
    "Once upon a time, there was a little girl named Lily.",
    "One day, a boy named Tim went to the park.",
    "The cat was sad.",
    "Sam and Mia wanted to play a game.",
]


@pytest.fixture
def stories_jsonl(tmp_path):
    return write_jsonl(tmp_path / "stories.jsonl", [{"prompt": p, "keyword": "the"} for p in PROMPTS])


def run_without_models(monkeypatch, script, *args):
    """Run `script` in this process with every from_pretrained failing; returns the message it exited with."""

    def no_model(*_, **__):
        raise AssertionError(f"{script} loaded a model or tokenizer before reporting the mistake")

    for name in ("AutoModelForCausalLM", "AutoTokenizer", "AutoModelForSequenceClassification"):
        monkeypatch.setattr(getattr(transformers, name), "from_pretrained", no_model)
    monkeypatch.setattr(sys, "argv", [script, *map(str, args)])
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(ROOT / script), run_name="__main__")
    return str(exited.value.code)


def start_script(script, *args):
    """Start a training script as a process (as grpo_cli.run_script does, without waiting for it): a handle with
    Popen's pid, poll, communicate, send_signal, kill and wait."""
    return Process(script, *args)


def wait_for_steps(process, output_dir, steps=1, timeout=180):
    """Wait until `process` has logged `steps` optimizer steps to output_dir/metrics.jsonl."""
    metrics = output_dir / "metrics.jsonl"
    deadline = time.time() + timeout
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
        assert process.poll() is None, f"the run ended early:\n{process.communicate()[1][-3000:]}"
        assert time.time() < deadline, "no metrics line in time"
        time.sleep(0.1)


# ----------------------------------------------------------------------------------------------------------------
# every bad input is rejected before any model loads, with the flag's name in the message


def malformed_jsonl(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "Once upon a time", "keyword": "the"}\n\n{"prompt": "The cat", "keyword": "the",}\n')
    return path


BAD_INPUTS = [  # (script, extra arguments (a function of tmp_path), what the message must say)
    (
        "grpo.py",
        lambda t: ["--model-name-or-path", "tests/assets/no_such_model"],
        ["--model-name-or-path", "no such directory"],
    ),
    ("grpo.py", lambda t: ["--model-name-or-path", ASSETS], ["--model-name-or-path", "no config.json"]),
    (
        "grpo.py",
        lambda t: ["--resume-from-checkpoint", t / "runs" / "checkpoint-3"],
        ["--resume-from-checkpoint", "no such directory"],
    ),
    ("grpo.py", lambda t: ["--max-completion-length", 0], ["--max-completion-length must be at least 1"]),
    ("grpo.py", lambda t: ["--learning-rate", -1], ["--learning-rate must be >= 0"]),
    ("grpo.py", lambda t: ["--steps-per-generation", 0], ["--steps-per-generation must be at least 1"]),
    ("rloo.py", lambda t: ["--steps-per-generation", 0], ["--steps-per-generation must be at least 1"]),
    ("grpo.py", lambda t: ["--num-generations", 1], ["--num-generations must be at least 2"]),
    ("grpo.py", lambda t: ["--temperature", 0], ["--temperature must be > 0"]),
    ("grpo.py", lambda t: ["--epsilon", -0.2, "--delta", 0.5], ["--epsilon must be >= 0", "--delta must be > 1"]),
    (
        "grpo.py",
        lambda t: ["--vllm-importance-sampling-clip-min", 4],
        ["--vllm-importance-sampling-clip-max must be >"],
    ),
    ("grpo.py", lambda t: ["--save-total-limit", -1, "--max-steps", 0], ["--save-total-limit", "--max-steps"]),
    ("grpo.py", lambda t: ["--reward-weights", 1, 2], ["--reward-weights has 2 values for 1 --reward-funcs"]),
    ("grpo.py", lambda t: ["--use-vllm"], ["--use-vllm needs a CUDA GPU"]),
    ("grpo.py", lambda t: ["--reward-funcs", "gsm8k_accuracy"], ["gsm8k_accuracy", "--answer-column"]),
    (
        "grpo.py",
        lambda t: ["--reward-funcs", "no_such_reward"],
        ["unknown reward function 'no_such_reward'", "--reward-funcs"],
    ),
    (
        "grpo.py",
        lambda t: ["--dataset-name", write_jsonl(t / "d.jsonl", [{"prompt": p} for p in PROMPTS])],
        ["keyword_reward", "--reward-funcs", "column 'keyword'"],
    ),
    (
        "grpo.py",
        lambda t: ["--dataset-name", write_jsonl(t / "d.jsonl", [{"text": p, "keyword": "the"} for p in PROMPTS])],
        ["no column 'prompt'", "--prompt-column"],
    ),
    (
        "grpo.py",
        lambda t: ["--dataset-name", malformed_jsonl(t)],
        ["--dataset-name", "broken.jsonl, line 3", "not valid JSON"],
    ),
    ("grpo.py", lambda t: ["--dataset-name", t / "nope.jsonl"], ["--dataset-name", "nope.jsonl does not exist"]),
    (
        "rloo.py",
        lambda t: ["--model-name-or-path", "tests/assets/no_such_model"],
        ["--model-name-or-path", "no such directory"],
    ),
    (
        "rloo.py",
        lambda t: ["--max-completion-length", 0, "--reward-clip-range", 1, 0],
        ["--max-completion-length", "--reward-clip-range"],
    ),
    ("rloo.py", lambda t: ["--use-vllm"], ["--use-vllm"]),
    ("rloo.py", lambda t: ["--dataset-name", malformed_jsonl(t)], ["--dataset-name", "broken.jsonl, line 3"]),
    (
        "online_dpo.py",
        lambda t: ["--model-name-or-path", "tests/assets/no_such_model"],
        ["--model-name-or-path", "no such directory"],
    ),
    ("online_dpo.py", lambda t: ["--reward-model-path", t / "rm"], ["--reward-model-path", "no such directory"]),
    ("online_dpo.py", lambda t: ["--learning-rate", -1, "--beta", 0], ["--learning-rate", "--beta"]),
    ("online_dpo.py", lambda t: ["--reward-funcs", "gsm8k_accuracy"], ["--answer-column"]),
    ("online_dpo.py", lambda t: ["--dataset-name", malformed_jsonl(t)], ["--dataset-name", "broken.jsonl, line 3"]),
]


@pytest.mark.parametrize("script, extra, expected", BAD_INPUTS, ids=lambda v: v if isinstance(v, str) else None)
def test_bad_input_is_rejected_before_any_model_loads(monkeypatch, tmp_path, stories_jsonl, script, extra, expected):
    out = tmp_path / "run"
    message = run_without_models(
        monkeypatch,
        script,
        *SMALL,
        "--dataset-name",
        stories_jsonl,
        "--output-dir",
        out,
        "--max-steps",
        1,
        *extra(tmp_path),
    )
    for text in expected:
        assert text in message, message
    assert not out.exists()  # nothing written, not even an empty output directory


def test_a_run_that_fails_while_starting_leaves_no_directory(tmp_path, stories_jsonl):
    broken = tmp_path / "broken-model"  # passes the start-up checks (it has a config.json), fails to load
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    result = run_script(
        "grpo.py",
        *SMALL,
        "--dataset-name",
        stories_jsonl,
        "--output-dir",
        tmp_path / "run",
        "--max-steps",
        1,
        "--model-name-or-path",
        broken,
    )
    assert result.returncode != 0 and not (tmp_path / "run").exists(), result.stderr[-2000:]


# ----------------------------------------------------------------------------------------------------------------
# --help: grouped as README.md's option table, a description and an example, each default once


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_is_grouped_like_the_readme(monkeypatch, capsys, script):
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(ROOT / script), run_name="__main__")
    assert exited.value.code == 0
    text = capsys.readouterr().out
    groups = re.findall(r"^\W*(\S+) options\b", text, re.MULTILINE)
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("### Options") : readme.index("## rloo.py")]
    readme_groups = [g.lower().replace(" ", "-") for g in re.findall(r"^\| \*\*(.+?)\*\* \|", table, re.MULTILINE)]
    assert [g for g in readme_groups if g in groups] == groups  # the same order
    assert len(groups) >= 8 and set(groups) <= set(readme_groups), groups
    assert "Example" in text and f"python {script} --model-name-or-path tests/assets/stories260K" in text
    for name in importlib.import_module(
        script[:-3]
    ).Args.__dataclass_fields__:  # every flag, with its name unchanged, and one default each
        flag = "--" + name.replace("_", "-")
        assert re.search(rf"{flag}[ ,]", text), flag
    assert not re.search(r"\(default: [^)]*\)\W*\(default:", text)  # each default printed once
    assert "(default: all 1)" not in text and "(default: epsilon)" not in text


@pytest.mark.parametrize("script", SCRIPTS)
def test_parsing_gives_the_flat_args(script):
    module = importlib.import_module(script[:-3])
    args = module.parse_args(["--learning-rate", "0.5", "--no-bf16", "--reward-funcs", "a", "b", "--output-dir", "x"])
    assert type(args) is module.Args
    assert (
        args.learning_rate == 0.5 and args.bf16 is False and args.reward_funcs == ["a", "b"] and args.output_dir == "x"
    )
    assert module.parse_args([]) == module.Args()


# ----------------------------------------------------------------------------------------------------------------
# the output directory: another run's files, a live run, dead runs' temporaries, checkpoints of other runs


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory):
    """A finished grpo.py run with checkpoint-4 and checkpoint-5 (6 steps, --save-steps 1, --save-total-limit 2)."""
    base = tmp_path_factory.mktemp("earlier")
    data = write_jsonl(base / "stories.jsonl", [{"prompt": p, "keyword": "the"} for p in PROMPTS])
    out = base / "run"
    check(
        run_script("grpo.py", *SMALL, "--dataset-name", data, "--output-dir", out, "--max-steps", 6, "--save-steps", 1)
    )
    assert sorted(d for d in os.listdir(out) if d.startswith("checkpoint")) == ["checkpoint-4", "checkpoint-5"]
    return out


def snapshot(directory):
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


@pytest.mark.parametrize("script", SCRIPTS)
def test_reused_output_dir_is_refused(monkeypatch, earlier_run, stories_jsonl, script):
    before = snapshot(earlier_run)
    message = run_without_models(
        monkeypatch, script, *SMALL, "--dataset-name", stories_jsonl, "--output-dir", earlier_run, "--max-steps", 2
    )
    assert "holds another run's files" in message and "grpo.py run started" in message, message
    assert "--resume-from-checkpoint" in message and "--overwrite-output-dir" in message
    if script != "grpo.py":  # and resuming it with another script is refused too
        message = run_without_models(
            monkeypatch,
            script,
            *SMALL,
            "--dataset-name",
            stories_jsonl,
            "--output-dir",
            earlier_run,
            "--max-steps",
            8,
            "--resume-from-checkpoint",
            "latest",
        )
        assert "checkpoint-5 is a checkpoint of grpo.py: continue that run with grpo.py" in message, message
    assert snapshot(earlier_run) == before  # the earlier run is untouched


def test_a_directory_of_other_files_is_refused_and_left_as_it_was(monkeypatch, tmp_path, stories_jsonl):
    out = tmp_path / "notes"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    message = run_without_models(
        monkeypatch, "grpo.py", *SMALL, "--dataset-name", stories_jsonl, "--output-dir", out, "--max-steps", 1
    )
    assert "holds files that are not this run's (notes.txt)" in message and "--overwrite-output-dir" in message
    assert os.listdir(out) == ["notes.txt"]  # not even a .lock left behind


def test_old_checkpoints_are_neither_deleted_nor_resumed(monkeypatch, tmp_path, earlier_run, stories_jsonl):
    out = tmp_path / "run"
    shutil.copytree(earlier_run, out)
    old = {name: (out / name / "model.safetensors").read_bytes() for name in ("checkpoint-4", "checkpoint-5")}
    # a new run there, explicitly: its own checkpoints 1-2 are kept (--save-total-limit 2 ignores checkpoint-4/-5)
    common = [
        *SMALL,
        "--dataset-name",
        stories_jsonl,
        "--output-dir",
        out,
        "--max-steps",
        3,
        "--save-steps",
        1,
        "--seed",
        7,
    ]
    check(run_script("grpo.py", *common, "--overwrite-output-dir"))
    assert sorted(d for d in os.listdir(out) if d.startswith("checkpoint")) == [
        "checkpoint-1",
        "checkpoint-2",
        "checkpoint-4",
        "checkpoint-5",
    ]
    assert {name: (out / name / "model.safetensors").read_bytes() for name in old} == old
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3]  # a new metrics.jsonl, not appended to the old one
    # `latest` is this run's checkpoint-2, not the earlier run's checkpoint-5
    result = check(run_script("grpo.py", *common, "--resume-from-checkpoint", "latest"))
    assert f"resumed from {out / 'checkpoint-2'} at step 2" in result.stdout
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3]
    # a checkpoint at --max-steps: nothing to train, said before any model loads
    message = run_without_models(
        monkeypatch, "grpo.py", *common[:-4], "--max-steps", 2, "--resume-from-checkpoint", "latest"
    )
    assert "checkpoint-2 is at step 2 and --max-steps is 2: there is nothing left to train" in message, message


def test_two_runs_cannot_share_a_directory(monkeypatch, tmp_path, stories_jsonl):
    out = tmp_path / "run"
    common = [*SMALL, "--dataset-name", stories_jsonl, "--output-dir", out]
    first = start_script("grpo.py", *common, "--max-steps", 100000)
    try:
        wait_for_steps(first, out)
        for extra in ([], ["--overwrite-output-dir"], ["--resume-from-checkpoint", "latest"]):
            message = run_without_models(monkeypatch, "grpo.py", *common, "--max-steps", 2, *extra)
            assert f"--output-dir {out} is in use by a run that is still going" in message, message
            assert f"pid {first.pid}" in message
        assert first.poll() is None  # the first run goes on
    finally:
        first.kill()  # SIGKILL: no clean-up of its own; the kernel releases its lock
        first.wait()
    check(run_script("grpo.py", *common, "--max-steps", 1, "--overwrite-output-dir"))
    assert [m["step"] for m in read_metrics(out)] == [1]


def test_temporaries_of_dead_runs_are_removed_at_start(tmp_path, earlier_run, stories_jsonl):
    out = tmp_path / "run"
    shutil.copytree(earlier_run, out)
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid names no process now
    shutil.copytree(out / "checkpoint-5", out / f"checkpoint-6.tmp-{dead.pid}")  # a save interrupted by SIGINT
    (out / f".final-tmp-{dead.pid}").mkdir()
    live = out / f"checkpoint-9.tmp-{os.getpid()}"  # this test's own process is alive: never touched
    live.mkdir()
    result = check(
        run_script(
            "grpo.py",
            *SMALL,
            "--dataset-name",
            stories_jsonl,
            "--output-dir",
            out,
            "--max-steps",
            6,
            "--save-steps",
            1,
            "--resume-from-checkpoint",
            "latest",
        )
    )
    assert "at step 5" in result.stdout and f"removed checkpoint-6.tmp-{dead.pid}" in result.stdout
    assert not (out / f"checkpoint-6.tmp-{dead.pid}").exists() and not (out / f".final-tmp-{dead.pid}").exists()
    assert live.is_dir()


# ----------------------------------------------------------------------------------------------------------------
# preemption: SIGTERM writes a checkpoint at the end of the step and exits; the run resumes from it


def sigterm_after_two_steps(run, out, timeout=180):
    """Send SIGTERM (what a cluster scheduler sends) once the run logged 2 steps; returns its (stdout, stderr)."""
    try:
        wait_for_steps(run, out, 2, timeout)
        run.send_signal(signal.SIGTERM)
        return run.communicate(timeout=max(120, timeout))
    finally:
        run.kill()


@pytest.mark.parametrize("script", SCRIPTS)
def test_sigterm_leaves_a_resumable_checkpoint(monkeypatch, tmp_path, stories_jsonl, script):
    out = tmp_path / "run"
    track = ["--track"] if script == "grpo.py" else []  # and a resumed run continues its wandb run
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    common = [*SMALL, "--dataset-name", stories_jsonl, "--output-dir", out, "--lr-scheduler-type", "constant", *track]
    run = start_script(script, *common, "--max-steps", 100000)
    stdout, stderr = sigterm_after_two_steps(run, out)
    assert run.returncode == 143, stderr[-3000:]
    steps = [m["step"] for m in read_metrics(out)]
    assert f"SIGTERM: wrote checkpoint-{steps[-1]} and stopped" in stdout
    assert os.path.isdir(out / f"checkpoint-{steps[-1]}") and not (out / "config.json").exists()  # no final model
    assert steps == list(range(1, steps[-1] + 1))

    result = check(run_script(script, *common, "--max-steps", steps[-1] + 2, "--resume-from-checkpoint", "latest"))
    assert f"at step {steps[-1]}" in result.stdout
    assert [m["step"] for m in read_metrics(out)] == list(range(1, steps[-1] + 3))
    assert (out / "config.json").exists()
    if track:  # both processes logged to the one wandb run named in run.json
        run_id = json.loads((out / "run.json").read_text())["run_id"]
        runs = sorted(p.name for p in (tmp_path / "wandb").glob("offline-run-*"))
        assert len(runs) == 2 and all(name.endswith(f"-{run_id}") for name in runs), (runs, run_id)


def sigterm_under_torchrun(background, tmp_path):
    """The run of test_sigterm_under_torchrun_stops_both_ranks_at_one_checkpoint, a background job (conftest.py's
    sigterm_under_torchrun_run): grpo.py under torchrun itself, sent SIGTERM through torchrun once it logged 2 steps.
    Returns the output directory, the arguments and (stdout, stderr)."""
    out = tmp_path / "run"
    data = write_jsonl(tmp_path / "stories.jsonl", [{"prompt": p, "keyword": "the"} for p in PROMPTS])
    common = [*SMALL, "--dataset-name", data, "--output-dir", out, "--prompts-per-step", 4]
    env = dict(os.environ, WANDB_MODE="offline", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "grpo.py"]
    run = background.popen(
        [*torchrun, *common, "--max-steps", 100000],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return out, common, sigterm_after_two_steps(run, out, timeout=1800)  # niced: slow while the tests use both cores


def test_sigterm_under_torchrun_stops_both_ranks_at_one_checkpoint(sigterm_under_torchrun_run):
    # torchrun forwards SIGTERM to every worker; the ranks agree on the step (a collective), write one checkpoint, stop.
    # The run (sigterm_under_torchrun above) starts in the background with the session
    out, common, (stdout, stderr) = sigterm_under_torchrun_run.result()
    steps = [m["step"] for m in read_metrics(out)]
    assert f"SIGTERM: wrote checkpoint-{steps[-1]} and stopped" in stdout, stderr[-3000:]
    assert sorted(d for d in os.listdir(out) if d.startswith("checkpoint")) == [f"checkpoint-{steps[-1]}"]
    # the resume on 2 ranks (workers forked with torchrun's environment; the SIGTERM above went through torchrun itself)
    resumed = launch("grpo.py", *common, "--max-steps", steps[-1] + 1, "--resume-from-checkpoint", "latest", nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at step {steps[-1]}" in resumed.stdout and [m["step"] for m in read_metrics(out)] == list(
        range(1, steps[-1] + 2)
    )
