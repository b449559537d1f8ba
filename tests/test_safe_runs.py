"""A run never overwrites, deletes or resumes another run's files, and every mistake is caught up front with a message
that names the flag (grpo.py, rloo.py, online_dpo.py). Run directories follow CleanRL's convention: a new run writes to
--output-dir, or else to a new runs/{exp_name}__{seed}__{unix time}, and refuses a directory that holds files.

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
from types import SimpleNamespace

import pytest
import transformers

from grpo_cli import ASSETS, ROOT, SMALL, Process, check, launch, read_metrics, run_script, wait_for_steps, write_jsonl

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
    # two-sided clipping's cap at or below the upper clip would stop positive-advantage tokens before their clip does
    ("grpo.py", lambda t: ["--delta", 1.2], ["--delta 1.2 must be > 1 + --epsilon-high = 1.2 (--epsilon-high: "]),
    ("grpo.py", lambda t: ["--delta", 1.25, "--epsilon-high", 0.28], ["--delta 1.25 must be > 1 + --epsilon-high"]),
    (
        "grpo.py",
        lambda t: ["--vllm-importance-sampling-clip-min", 4],
        ["--vllm-importance-sampling-clip-max must be >"],
    ),
    ("grpo.py", lambda t: ["--save-total-limit", -1, "--max-steps", 0], ["--save-total-limit", "--max-steps"]),
    ("grpo.py", lambda t: ["--reward-weights", 1, 2], ["--reward-weights has 2 values for 1 --reward-funcs"]),
    ("grpo.py", lambda t: ["--use-vllm"], ["--use-vllm needs a CUDA GPU"]),
    ("rloo.py", lambda t: ["--vllm-server-port", 8000, 8000], ["--vllm-server-port must be TCP ports", "each once"]),
    ("online_dpo.py", lambda t: ["--vllm-server-port", 8000, 0], ["--vllm-server-port must be TCP ports"]),
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
    (
        "grpo.py",
        lambda t: ["--dataset-name", write_jsonl(t / "d.jsonl", [])],
        ["--dataset-name", "d.jsonl", "holds no records"],
    ),
    (
        "grpo.py",
        lambda t: ["--dataset-name", write_jsonl(t / "d.jsonl", [{"prompt": "a", "keyword": "the"}, {"prompt": "b"}])],
        ["--dataset-name", "d.jsonl, line 2", "a JSON object with the keys ['keyword', 'prompt']"],
    ),
    (
        "rloo.py",
        lambda t: ["--reward-funcs", "gsm8k_accuracy"],
        ["gsm8k_accuracy", "reference answer", "--answer-column"],
    ),
    ("grpo.py", lambda t: ["--save-merged-model"], ["--save-merged-model is ignored without --use-peft"]),
    ("grpo.py", lambda t: ["--use-peft", "--lora-r", 0, "--lora-dropout", 1], ["--lora-r must be", "--lora-dropout"]),
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


@pytest.mark.parametrize(
    "script, targets, expected",
    [
        ("grpo.py", ["q_proj", "qkv_proj", "lm_head"], ["qkv_proj lm_head: no linear layer", "k_proj, o_proj, q_proj"]),
        ("rloo.py", ["c_attn"], ["--lora-target-modules c_attn: no linear layer"]),
        ("online_dpo.py", ["wq"], ["--lora-target-modules wq: no linear layer"]),
    ],
)
def test_a_lora_target_that_no_linear_layer_has_is_one_line(tmp_path, stories_jsonl, script, targets, expected):
    """peft adapts the names it finds and ignores the others (and an LM head's adapter, which the log-probs would never
    see): the run stops before its first step, naming them and the linear layers there are, and leaves no directory."""
    out = tmp_path / "run"
    flags = ["--dataset-name", stories_jsonl, "--output-dir", out, "--max-steps", 1, "--use-peft"]
    result = run_script(script, *SMALL, *flags, "--lora-target-modules", *targets)
    assert result.returncode == 1 and all(text in result.stderr for text in expected), result.stderr[-2000:]
    assert len(result.stderr.strip().splitlines()[-1]) > 40 and "Traceback" not in result.stderr
    assert not out.exists() and not (out.parent / "runs").exists()


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
# --help: tyro's plain box of the flat Args, every flag with its docstring, the description and the CPU example


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_is_the_plain_box_with_every_docstring(monkeypatch, capsys, script):
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(ROOT / script), run_name="__main__")
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # tyro wraps the help: compare with whitespace collapsed
    assert "Example" in text and f"python {script} --model-name-or-path tests/assets/stories260K" in text
    module = importlib.import_module(script[:-3])
    docs = {name: " ".join(doc.split()) for name, doc in attribute_docstrings(module.Args).items()}
    assert set(docs) == set(module.Args.__dataclass_fields__)
    for name, doc in docs.items():  # every flag, with its name unchanged, and the start of its docstring
        flag = "--" + name.replace("_", "-")
        assert re.search(rf"{flag}[ ,{{]", text), flag
        assert doc[:30] in text, (flag, doc[:30])
    assert "--overwrite-output-dir" not in text


def attribute_docstrings(cls):
    """{field: its docstring} of a dataclass whose fields are each followed by a string literal (the Args style)."""
    import ast
    import inspect
    import itertools
    import textwrap

    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    pairs = itertools.pairwise(body)
    return {a.target.id: b.value.value for a, b in pairs if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr)}


@pytest.mark.parametrize("script", SCRIPTS)
def test_parsing_gives_the_flat_args(script):
    module = importlib.import_module(script[:-3])
    args = module.parse_args(["--learning-rate", "0.5", "--no-bf16", "--reward-funcs", "a", "b", "--output-dir", "x"])
    assert type(args) is module.Args
    assert (
        args.learning_rate == 0.5 and args.bf16 is False and args.reward_funcs == ["a", "b"] and args.output_dir == "x"
    )
    assert module.parse_args([]) == module.Args() and module.Args().exp_name == script[:-3]


# ----------------------------------------------------------------------------------------------------------------
# run directories: a new one per run, another run's files refused, one live process per directory, resumes


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


def test_default_run_directories_are_new_for_every_run(monkeypatch, tmp_path):
    # CleanRL's runs/{exp_name}__{seed}__{unix time}: two runs started in the same second get different directories
    import grpo

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(time, "time", lambda: 1700000000.5)
    claims = [grpo.claim_run_dir(grpo.Args()) for _ in range(2)]
    try:
        dirs = [claim[0] for claim in claims]
        assert dirs == [os.path.join("runs", "grpo__1__1700000000"), os.path.join("runs", "grpo__1__1700000000__2")]
        assert all(claim[1] is None for claim in claims)  # new runs: nothing resumed
        assert claims[0][2]["run_id"] != claims[1][2]["run_id"]  # two wandb runs
        assert sorted(os.listdir(tmp_path / "runs" / "grpo__1__1700000000")) == [".lock"]
        # `latest` resumes a run: it needs the run's directory
        with pytest.raises(SystemExit, match="--resume-from-checkpoint latest needs --output-dir DIR"):
            grpo.claim_run_dir(grpo.Args(resume_from_checkpoint="latest"))
    finally:
        for claim in claims:
            os.close(claim[3])


@pytest.mark.parametrize("script", SCRIPTS)
def test_reused_output_dir_is_refused(monkeypatch, earlier_run, stories_jsonl, script):
    before = snapshot(earlier_run)
    message = run_without_models(
        monkeypatch, script, *SMALL, "--dataset-name", stories_jsonl, "--output-dir", earlier_run, "--max-steps", 2
    )
    assert f"--output-dir {earlier_run} holds files (" in message and "checkpoint-5" in message, message
    assert "another --output-dir" in message and "--resume-from-checkpoint latest" in message
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
    assert "holds files (notes.txt)" in message and "another --output-dir" in message, message
    assert "--resume-from-checkpoint" not in message  # only remedies that work: it holds no checkpoint
    assert os.listdir(out) == ["notes.txt"]  # not even a .lock left behind


def test_resume_latest_and_save_total_limit_stay_in_the_run(monkeypatch, tmp_path, earlier_run, stories_jsonl):
    out = tmp_path / "run"
    shutil.copytree(earlier_run, out)
    common = [*SMALL, "--dataset-name", stories_jsonl, "--save-steps", 1]
    # `latest` is the newest complete checkpoint; the run continues in its directory, its older checkpoints go
    result = check(
        run_script("grpo.py", *common, "--output-dir", out, "--max-steps", 8, "--resume-from-checkpoint", "latest")
    )
    assert f"resumed from {out / 'checkpoint-5'} at step 5" in result.stdout
    assert sorted(d for d in os.listdir(out) if d.startswith("checkpoint")) == ["checkpoint-6", "checkpoint-7"]
    assert [m["step"] for m in read_metrics(out)] == list(range(1, 9))
    # a checkpoint's path: the run continues in that checkpoint's directory (no --output-dir needed)
    result = check(run_script("grpo.py", *common, "--max-steps", 9, "--resume-from-checkpoint", out / "checkpoint-7"))
    assert "at step 7" in result.stdout and [m["step"] for m in read_metrics(out)] == list(range(1, 10))
    # another --output-dir than the checkpoint's run directory, and a checkpoint at --max-steps: refused up front
    message = run_without_models(
        monkeypatch,
        "grpo.py",
        *common,
        "--output-dir",
        tmp_path / "x",
        "--resume-from-checkpoint",
        out / "checkpoint-8",
    )
    assert f"continues its run in {out}" in message and not (tmp_path / "x").exists(), message
    message = run_without_models(
        monkeypatch, "grpo.py", *common, "--output-dir", out, "--max-steps", 8, "--resume-from-checkpoint", "latest"
    )
    assert "checkpoint-8 is at step 8 and --max-steps is 8: there is nothing left to train" in message, message
    # a checkpoint without run.json (its script and wandb run unknown) is refused with a remedy that works
    shutil.copytree(out / "checkpoint-8", tmp_path / "bare" / "checkpoint-8")
    os.remove(tmp_path / "bare" / "checkpoint-8" / "run.json")
    message = run_without_models(
        monkeypatch,
        "grpo.py",
        *common,
        "--max-steps",
        9,
        "--resume-from-checkpoint",
        tmp_path / "bare" / "checkpoint-8",
    )
    assert "has no run.json" in message and "--model-name-or-path" in message, message


def test_two_runs_cannot_share_a_directory(monkeypatch, tmp_path, stories_jsonl):
    out = tmp_path / "run"
    common = [*SMALL, "--dataset-name", stories_jsonl, "--output-dir", out, "--save-steps", 1]
    first = start_script("grpo.py", *common, "--max-steps", 100000)
    try:
        wait_for_steps(first, out, 2)
        for extra in ([], ["--resume-from-checkpoint", "latest"]):
            message = run_without_models(monkeypatch, "grpo.py", *common, "--max-steps", 200000, *extra)
            assert f"--output-dir {out} is in use by a run that is still going" in message, message
            assert f"pid {first.pid}" in message
        assert first.poll() is None  # the first run goes on
    finally:
        first.kill()  # SIGKILL: no clean-up of its own; the kernel releases its lock
        first.wait()
    steps = max(int(d.split("-")[1]) for d in os.listdir(out) if re.fullmatch(r"checkpoint-\d+", d))
    check(run_script("grpo.py", *common, "--max-steps", steps + 1, "--resume-from-checkpoint", "latest"))
    assert [m["step"] for m in read_metrics(out)][-1] == steps + 1


def test_a_save_cut_short_is_never_taken_for_a_checkpoint(tmp_path, earlier_run, stories_jsonl):
    out = tmp_path / "run"
    shutil.copytree(earlier_run, out)
    # a save that a crash interrupted: written as checkpoint-N.tmp, renamed only when complete
    shutil.copytree(out / "checkpoint-5", out / "checkpoint-6.tmp")
    os.remove(out / "checkpoint-6.tmp" / "model.safetensors")
    (out / ".final.tmp").mkdir()
    common = [*SMALL, "--dataset-name", stories_jsonl, "--output-dir", out, "--save-steps", 1]
    result = check(run_script("grpo.py", *common, "--max-steps", 6, "--resume-from-checkpoint", "latest"))
    assert "at step 5" in result.stdout and "removed checkpoint-6.tmp" in result.stdout
    assert not (out / "checkpoint-6.tmp").exists() and not (out / ".final.tmp").exists()
    assert (out / "config.json").exists()


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
    said = next(line for line in stdout.splitlines() if line.startswith("SIGTERM: "))
    assert (
        said.startswith(f"SIGTERM: wrote checkpoint-{steps[-1]} and stopped; resume with: python ") and script in said
    )
    assert said.endswith(f"--output-dir {out} --resume-from-checkpoint latest"), said
    assert os.path.isdir(out / f"checkpoint-{steps[-1]}") and not (out / "config.json").exists()  # no final model
    assert steps == list(range(1, steps[-1] + 1))

    result = check(run_script(script, *common, "--max-steps", steps[-1] + 2, "--resume-from-checkpoint", "latest"))
    assert f"at step {steps[-1]}" in result.stdout
    assert [m["step"] for m in read_metrics(out)] == list(range(1, steps[-1] + 3))
    assert (out / "config.json").exists()
    if track:  # both processes logged to the one wandb run that the checkpoint's run.json names
        run_id = json.loads((out / f"checkpoint-{steps[-1]}" / "run.json").read_text())["run_id"]
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


# ----------------------------------------------------------------------------------------------------------------
# found in review: a lost lock race, a reward model that fails after the directory is made, a directory of two runs


def test_a_file_system_without_flock_is_warned_about_once(monkeypatch, tmp_path, capsys):
    """Where flock fails (some network mounts) the run goes on, saying once that nothing keeps a second run out."""
    import grpo

    def no_flock(*_):
        raise OSError("flock not supported")

    out = tmp_path / "run"
    out.mkdir()
    (out / ".lock").write_text("")  # the earlier run's lock file: the shared look and the exclusive lock both fail
    monkeypatch.setattr(grpo.fcntl, "flock", no_flock)
    lock = grpo.claim_run_dir(grpo.Args(output_dir=str(out)))[3]
    os.close(lock)
    assert capsys.readouterr().out.count("warning: cannot lock") == 1


def test_a_run_that_loses_the_lock_race_leaves_the_winners_directory_alone(monkeypatch, tmp_path):
    """Run B checks for DIR/.lock before run A creates and locks it; B then fails to lock. B must not remove A's lock
    file or A's (still empty) directory on its way out."""
    import fcntl

    import grpo

    out, real_open, winner = tmp_path / "run", os.open, {}

    def racing_open(path, flags, mode=0o777):
        if str(path).endswith(".lock") and flags & os.O_CREAT and not winner:  # run A gets there first, right here
            winner["fd"] = real_open(path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(winner["fd"], fcntl.LOCK_EX | fcntl.LOCK_NB)
        return real_open(path, flags, mode)

    monkeypatch.setattr(grpo.os, "open", racing_open)
    with pytest.raises(SystemExit, match="is in use by a run that is still going"):
        grpo.claim_run_dir(grpo.Args(output_dir=str(out)))
    assert (out / ".lock").exists()  # A's lock file and directory are still there
    os.close(winner["fd"])


def test_online_dpo_with_a_reward_model_that_fails_to_load_leaves_no_directory(tmp_path, stories_jsonl):
    """The reward model loads after the run directory is made (and metrics.jsonl opened): a failure there must not
    leave a directory that refuses the corrected command."""
    broken = tmp_path / "broken-reward-model"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    out, at = tmp_path / "run", SMALL.index("--reward-funcs")
    small = SMALL[:at] + SMALL[at + 2 :]  # the reward model instead of SMALL's reward function
    args = [*small, "--dataset-name", stories_jsonl, "--output-dir", out, "--max-steps", 1]
    result = run_script("online_dpo.py", *args, "--reward-model-path", broken)
    assert result.returncode != 0 and not out.exists(), (sorted(os.listdir(out)), result.stderr[-2000:])


def test_a_directory_holding_another_runs_checkpoints_is_not_resumed(monkeypatch, tmp_path, earlier_run, stories_jsonl):
    """A directory that holds two runs' checkpoints (26cd7f5's --overwrite-output-dir made them; so does a checkpoint
    copied in): `latest` would take the other run's and --save-total-limit delete it. Refused, nothing touched."""
    out = tmp_path / "run"
    shutil.copytree(earlier_run, out)
    shutil.copytree(out / "checkpoint-4", out / "checkpoint-2")
    identity = json.loads((out / "checkpoint-2" / "run.json").read_text())
    (out / "checkpoint-2" / "run.json").write_text(json.dumps({**identity, "run_id": "another-run"}))
    before = snapshot(out)
    common = [*SMALL, "--dataset-name", stories_jsonl, "--save-steps", 1, "--max-steps", 8]
    message = run_without_models(
        monkeypatch, "grpo.py", *common, "--output-dir", out, "--resume-from-checkpoint", "latest"
    )
    assert "also holds checkpoints of another run (checkpoint-2)" in message, message
    assert snapshot(out) == before


# ----------------------------------------------------------------------------------------------------------------
# untrusted files: the run's own files are never written through a symbolic link; a checkpoint never runs code


def test_untrusted_lock_symlink(tmp_path):
    """out/.lock -> a file elsewhere: claim_run_dir opened it, truncated it and wrote its pid line into that file. The
    run is refused in one line naming the link, and the file keeps its contents."""
    import grpo

    out, target = tmp_path / "run", tmp_path / "elsewhere.txt"
    out.mkdir()
    target.write_text("not the run's")
    (out / ".lock").symlink_to(target)
    with pytest.raises(SystemExit) as exited:
        grpo.claim_run_dir(grpo.Args(output_dir=str(out)))
    assert str(exited.value.code) == f"error: {out / '.lock'} is a symbolic link: {LINK_REFUSED}"
    assert target.read_text() == "not the run's"


LINK_REFUSED = "a run writes its own files, not through links. Remove it"


@pytest.mark.parametrize("name", ["metrics.jsonl", "checkpoint-2/run.json", "checkpoint-3", "checkpoint-3.tmp"])
def test_untrusted_run_file_symlinks(tmp_path, name):
    """The run's other files and folders as links to elsewhere: a resume would rewrite metrics.jsonl through its link,
    take a linked checkpoint-N (and delete it, --save-total-limit) or fail on a linked .tmp with a traceback. Each is
    refused in one line naming the link, before any model loads, and what it points to is left as it was."""
    import grpo

    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    identity = {"run_id": "r", "run_name": "n", "script": "grpo.py"}
    for step, directory in ((2, out / "checkpoint-2"), (3, elsewhere)):
        directory.mkdir(parents=True)
        (directory / "run.json").write_text(json.dumps({**identity, "global_step": step}))
    (elsewhere / "metrics.jsonl").write_text('{"step": 9}\n')
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    link = out / name
    link.unlink(missing_ok=True)
    link.symlink_to(elsewhere / os.path.basename(name) if name.endswith((".json", ".jsonl")) else elsewhere)
    before = snapshot(elsewhere)
    with pytest.raises(SystemExit) as exited:
        grpo.claim_run_dir(grpo.Args(output_dir=str(out), resume_from_checkpoint="latest", max_steps=8))
    assert str(exited.value.code) == f"error: {link} is a symbolic link: {LINK_REFUSED}"
    assert snapshot(elsewhere) == before and elsewhere.exists()


def test_untrusted_final_model_links(tmp_path, earlier_run, stories_jsonl):
    """The final model's files are moved into the run directory by rename, config.json last: links there (to files of
    elsewhere) are replaced, never written through, and a config.json means a complete model."""
    out, victim = tmp_path / "run", tmp_path / "victim.json"
    shutil.copytree(earlier_run, out)
    victim.write_text("{}")
    for name in ("config.json", "tokenizer_config.json"):
        (out / name).unlink()
        (out / name).symlink_to(victim)
    common = [*SMALL, "--dataset-name", stories_jsonl, "--output-dir", out, "--save-steps", 1]
    check(run_script("grpo.py", *common, "--max-steps", 6, "--resume-from-checkpoint", "latest"))
    assert victim.read_text() == "{}"
    assert not (out / "config.json").is_symlink() and json.loads((out / "config.json").read_text())["model_type"]


def test_untrusted_checkpoint_pickle(tmp_path):
    """trainer_state.pt is loaded with weights_only (tensors, numbers, strings and containers of them): one holding a
    pickled object, here one whose unpickling writes a file, is refused in one line and nothing of it runs."""
    import torch

    import grpo

    written = tmp_path / "written-while-loading"

    class WritesAFile:
        def __reduce__(self):
            return open, (str(written), "w")

    torch.save({"optimizer": WritesAFile(), "global_step": 2}, tmp_path / "trainer_state.pt")
    with pytest.raises(SystemExit) as exited:
        grpo.load_checkpoint(SimpleNamespace(world_size=1), str(tmp_path))
    assert str(exited.value.code) == f"error: {tmp_path}/trainer_state.pt holds objects beyond tensors: not loaded"
    assert not written.exists()


# ----------------------------------------------------------------------------------------------------------------
# a flag typed where nothing reads it (check_args' IGNORED table) is refused, in one line naming it and what it needs

STARTS = ["--model-name-or-path", str(ASSETS / "stories260K"), "--dataset-name", str(ASSETS / "stories_prompts.jsonl")]
IGNORED_FLAGS = [  # (flags typed, the line that refuses them): every row of IGNORED
    (["--vllm-server-port", "9000"], "--vllm-server-port is ignored without --use-vllm: add --use-vllm or drop"),
    (["--vllm-mode=server"], "--vllm-mode is ignored without --use-vllm"),
    (["--use-vllm", "--vllm-server-timeout", "5"], "--vllm-server-timeout is ignored without --vllm-mode server"),
    (["--use-vllm", "--vllm-mode", "server", "--no-vllm-enable-sleep-mode"], "--vllm-enable-sleep-mode is ignored"),
    (["--use-vllm", "--vllm-mode", "server", "--vllm-max-model-len", "64"], "without --vllm-mode colocate"),
    (["--lora_r", "8"], "--lora-r is ignored without --use-peft: add --use-peft or drop --lora-r"),
    (["--save-merged-model"], "--save-merged-model is ignored without --use-peft"),
    (["--dataset-split", "test"], "--dataset-split is ignored without a hub --dataset-name"),
    (["--dataset-config", "main"], "--dataset-config is ignored without a hub --dataset-name"),
    (["--eval-max-samples", "3"], "--eval-max-samples is ignored without --eval-steps N (or --max-steps 0)"),
]


def check_args_message(module, argv):
    """What module's check_args exits with ('' if it passes) after its parse_args (a flag it cannot parse fails)."""
    args = module.parse_args(argv)
    try:
        module.check_args(args, world_size=1)
    except SystemExit as exited:
        return str(exited.code)
    return ""


@pytest.mark.parametrize("flags, expected", IGNORED_FLAGS, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
@pytest.mark.parametrize("script", SCRIPTS)
def test_ignored_flag_is_refused(script, flags, expected):
    lines = check_args_message(importlib.import_module(script[:-3]), [*STARTS, *flags]).splitlines()
    assert all(line.startswith("error: ") for line in lines), lines
    assert len([line for line in lines if expected in line]) == 1, lines


def documented_commands(script):
    """The argv of each `python script ...` / `torchrun ... script ...` in README.md's and docs/*.md's code blocks and
    in the script's docstring (lines joined at a trailing backslash; commands with placeholders such as $ADD left out)."""
    import shlex

    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    text = "\n".join(p.read_text() for p in pages) + importlib.import_module(script[:-3]).__doc__.replace("\\\\", "\\")
    command = re.compile(rf"\s*(\w+=\S* )*(python|torchrun) .*\b{script}( |$)")  # after any VAR=value
    commands = []
    for line in re.sub(r"\\\n\s*", " ", text).splitlines():
        words = shlex.split(line, comments=True) if command.match(line) and "$" not in line else []
        if words and "..." not in words and words[-1] != "--help":
            commands.append(words[words.index(script) + 1 :])
    return commands


@pytest.mark.parametrize("script", SCRIPTS)
def test_ignored_flag_never_trips_on_flags_that_are_read(monkeypatch, script):
    module = importlib.import_module(script[:-3])
    monkeypatch.setattr(
        module, "path_problem", lambda *args, **kwargs: None
    )  # no hub look-ups for the commands' models
    read = [
        [*STARTS],  # nothing typed: the defaults
        ["--use-vllm", "--vllm-mode", "server", "--vllm-server-port", "9000", "--vllm-weight-sync-timeout=5"],
        ["--use-vllm", "--vllm-enable-sleep-mode", "--vllm-gpu-memory-utilization", "0.5", "--vllm-max-model-len", "9"],
        ["--use-peft", "--lora-r", "8", "--lora-target-modules", "q_proj", "--save-merged-model"],
        ["--dataset-name", "openai/gsm8k", "--dataset-config", "main", "--dataset-split", "train"],
        [*STARTS, "--eval-dataset", STARTS[-1], "--eval-steps", "2", "--eval-max-samples", "3"],
        [*STARTS, "--eval-dataset", STARTS[-1], "--max-steps", "0", "--eval-num-generations", "2"],
    ]
    documented = documented_commands(script)
    assert len(documented) >= 3, documented  # the docstring's three examples at least
    for argv in read + documented:
        assert "is ignored" not in check_args_message(module, argv), argv
    # and every row of the table is exercised by test_ignored_flag_is_refused
    typed = {re.sub("^--no-", "--", f.split("=")[0].replace("_", "-")) for flags, _ in IGNORED_FLAGS for f in flags}
    assert all(any(re.match(regex, flag) for flag in typed) for regex, _, _ in module.IGNORED)


# ----------------------------------------------------------------------------------------------------------------
# a model that cannot load is one line before anything loads, not a traceback after a minute of retries


@pytest.mark.parametrize("case", ["a file", "offline", "the hub out of reach"])
def test_a_model_that_cannot_load_is_one_line(tmp_path, stories_jsonl, case):
    (tmp_path / "model.safetensors").write_bytes(b"not a model directory")
    name = "model.safetensors" if case == "a file" else "someone/not-in-the-cache"
    hub = {"offline": dict(HF_HUB_OFFLINE="1"), "the hub out of reach": dict(HF_ENDPOINT="http://127.0.0.1:9")}
    env = dict(os.environ, WANDB_MODE="offline", CUDA_VISIBLE_DEVICES="", HF_HUB_CACHE=str(tmp_path / "hub-cache"))
    env |= hub.get(case, {})  # (an empty cache: the name is in none)
    args = [*SMALL, "--dataset-name", stories_jsonl, "--output-dir", tmp_path / "run", "--model-name-or-path", name]
    command = [sys.executable, str(ROOT / "grpo.py"), *map(str, args)]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    expected = {
        "a file": "error: --model-name-or-path model.safetensors is a file, not a model directory",
        "offline": "error: --model-name-or-path someone/not-in-the-cache is not in the local Hugging Face cache and",
    }
    assert lines[0].startswith(expected.get(case, expected["offline"])), lines
    assert not (tmp_path / "run").exists()
