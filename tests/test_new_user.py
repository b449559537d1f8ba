"""What a new user hit on the CPU (issue 26), each point through the scripts' own command lines: Ctrl-C stops at a
checkpoint that resumes bitwise; mistakes in the data arrive as one line before the weights load; CSV files; warnings
for settings that silently change training; the logged learning rate; the tokenizer's files kept byte for byte; a fork
named after its file; the small ones (the progress bar's KL, --save-total-limit 0, string --reward-kwargs, online_dpo's
`reward`)."""

import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from grpo_cli import (
    ASSETS,
    ROOT,
    SMALL,
    STORIES,
    STORIES_TASK,
    Process,
    check,
    read_metrics,
    run_script,
    script_env,
    wait_for_stderr,
    wait_for_steps,
    write_jsonl,
)

SCRIPTS = ["grpo.py", "rloo.py", "online_dpo.py"]
# the README's CPU quickstart, with 4 prompts x 2 completions a step (the BASE, less its --max-steps)
BASE = [*STORIES_TASK, "--learning-rate", "3e-3", "--max-completion-length", 24, "--prompts-per-step", 4]
BASE += ["--num-generations", 2]
SLOW = ["--prompts-per-step", 32, "--num-generations", 16, "--max-completion-length", 64]  # a step takes seconds
PLAIN = dict(capture_output=True, text=True, env=dict(script_env(), COLUMNS="200"), cwd=ROOT)  # subprocess.run's
PROMPTS = ["Once upon a time, there was a little girl named Lily.", "The cat was sad.", "Sam and Mia wanted to play."]


def run_before_weights(monkeypatch, capsys, script, *args):
    """Run `script` in this process with every AutoModel*.from_pretrained failing (the tokenizer and the config may
    load); returns (what it exited with, what it printed). An AssertionError in the first means the weights were asked
    for before the mistake was reported."""

    def no_weights(*_, **__):
        raise AssertionError(f"{script} loaded a model's weights before reporting the mistake")

    for name in ("AutoModelForCausalLM", "AutoModelForSequenceClassification"):
        monkeypatch.setattr(getattr(transformers, name), "from_pretrained", no_weights)
    monkeypatch.setattr(sys, "argv", [script, *map(str, args)])
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}  # the script installs its own
    try:
        runpy.run_path(str(ROOT / script), run_name="__main__")
        exited = "no error"
    except (SystemExit, AssertionError) as error:
        exited = str(error.code if isinstance(error, SystemExit) else error)
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
    return exited, capsys.readouterr().out


def weights(directory):
    return load_file(str(Path(directory) / "model.safetensors"))


def assert_bitwise_equal(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


# ----------------------------------------------------------------------------------------------------------------
# 1. Ctrl-C: a checkpoint at the end of the step, then exit; the run resumes to the uninterrupted run's weights


def test_ctrl_c_stops_at_a_checkpoint_that_resumes_to_the_uninterrupted_weights(tmp_path):
    k, max_steps = 2, 12  # Ctrl-C once step k is logged; the run stops at the end of the step it is in
    interrupted, uninterrupted = tmp_path / "interrupted", tmp_path / "uninterrupted"
    run = Process("grpo.py", *BASE, "--max-steps", max_steps, "--output-dir", interrupted)
    try:
        wait_for_steps(run, interrupted, k)
        run.send_signal(signal.SIGINT)
        stdout, stderr = run.communicate(timeout=240)
    finally:
        run.kill()
    assert run.returncode == 130, stderr[-3000:]  # 128 + SIGINT: stopped, not finished
    assert "KeyboardInterrupt" not in stderr
    stopped = read_metrics(interrupted)[-1]["step"]
    assert k <= stopped < max_steps and not (interrupted / "config.json").exists()
    said = next(line for line in stdout.splitlines() if line.startswith("SIGINT: "))
    assert (
        said.startswith(f"SIGINT: wrote checkpoint-{stopped} and stopped; resume with: python ") and "grpo.py " in said
    )
    assert said.endswith(f"--output-dir {interrupted} --resume-from-checkpoint latest"), said

    resumed = ["--max-steps", max_steps, "--output-dir", interrupted, "--resume-from-checkpoint", "latest"]
    assert f"at step {stopped}" in check(run_script("grpo.py", *BASE, *resumed)).stdout
    check(run_script("grpo.py", *BASE, "--max-steps", max_steps, "--output-dir", uninterrupted))
    assert_bitwise_equal(weights(interrupted), weights(uninterrupted))
    steps = lambda out: [m["step"] for m in read_metrics(out)]
    assert steps(interrupted) == steps(uninterrupted) == list(range(1, max_steps + 1))


def test_a_second_ctrl_c_stops_at_once(tmp_path):
    out = tmp_path / "run"
    run = Process("grpo.py", *BASE, *SLOW, "--max-steps", 4, "--output-dir", out)
    try:
        wait_for_steps(run, out, 1)
        run.send_signal(signal.SIGINT)
        # the second once the first was heard (a fixed delay raced the handler on a loaded machine), within step 2
        wait_for_stderr(run, "SIGINT: stopping", timeout=60)
        run.send_signal(signal.SIGINT)
        stdout, stderr = run.communicate(timeout=240)
    finally:
        run.kill()
    assert "SIGINT: stopping after this step's checkpoint (again: stop now)" in stderr, stderr[-3000:]
    assert "KeyboardInterrupt" in stderr and run.returncode not in (0, 130)
    assert "wrote checkpoint" not in stdout and not list(out.glob("checkpoint-*"))  # it did not wait for the step


def test_a_run_killed_before_its_first_step_leaves_a_directory_a_new_run_takes(tmp_path):
    out = tmp_path / "run"
    run = Process("grpo.py", *BASE, *SLOW, "--max-steps", 3, "--output-dir", out)
    try:
        wait_for_stderr(run, "0/3")  # the progress bar: set up
        run.kill()
        run.wait(60)
    finally:
        run.kill()
    assert sorted(os.listdir(out)) == [".lock"]  # no step logged, nothing that a new run would mix with
    refused = run_script("grpo.py", *BASE, "--max-steps", 1, "--output-dir", out, "--resume-from-checkpoint", "latest")
    assert "holds no complete checkpoint-N to continue. Start a new run: the same command without" in refused.stderr
    check(run_script("grpo.py", *BASE, "--max-steps", 1, "--output-dir", out))
    assert [m["step"] for m in read_metrics(out)] == [1]


# ----------------------------------------------------------------------------------------------------------------
# 2. mistakes in the prompts, before the weights load, as one line naming the column / row / flag (three scripts)


@pytest.mark.parametrize("script", SCRIPTS)
def test_bad_prompts_are_reported_before_the_weights_load(monkeypatch, capsys, tmp_path, script):
    def exits(rows, *extra):
        data = write_jsonl(tmp_path / "d.jsonl", rows)
        out = ["--output-dir", tmp_path / f"run{len(rows)}", "--max-steps", 1]  # (this process keeps a run's lock)
        return run_before_weights(monkeypatch, capsys, script, *SMALL, "--dataset-name", data, *out, *extra)[0]

    numbers = exits([{"prompt": 7, "keyword": "the"}, {"prompt": 8, "keyword": "the"}])
    assert numbers.startswith("error: --dataset-name") and "d.jsonl, row 0: --prompt-column 'prompt' holds 7" in numbers
    assert "\n" not in numbers
    long = [{"prompt": p, "keyword": "the"} for p in PROMPTS] + [{"prompt": "the cat sat " * 400, "keyword": "the"}]
    too_long = exits(long)
    assert "d.jsonl, row 3: the prompt has" in too_long and "context of 512 tokens" in too_long, too_long
    assert "--max-prompt-length" in too_long and "--max-completion-length" in too_long and "\n" not in too_long
    none_left = exits(long[:3], "--max-prompt-length", 2)
    assert "error: no prompt of --dataset-name" in none_left and "--max-prompt-length 2" in none_left, none_left


# ----------------------------------------------------------------------------------------------------------------
# 3. CSV is read like the other local formats; a failure to read is one line naming the file and what was expected


def test_a_csv_file_trains_and_an_empty_directory_is_one_line(monkeypatch, capsys, tmp_path):
    csv = tmp_path / "prompts.csv"
    csv.write_text("prompt,keyword\n" + "".join(f'"{p}",play\n' for p in PROMPTS + ["One day, a boy went to the"]))
    out = tmp_path / "run"
    check(run_script("grpo.py", *BASE, "--dataset-name", csv, "--max-steps", 1, "--output-dir", out))
    assert [m["step"] for m in read_metrics(out)] == [1]

    # a directory of such files, with the default --dataset-config (gsm8k's "main", which no local builder has)
    (tmp_path / "folder").mkdir()
    shutil.copy(csv, tmp_path / "folder" / "prompts.csv")
    check(
        run_script("grpo.py", *BASE, "--dataset-name", tmp_path / "folder", "--max-steps", 1, "--output-dir", out / "d")
    )

    (tmp_path / "empty").mkdir()
    (tmp_path / "prompts.txt").write_text("Once upon a time\n")
    for script in SCRIPTS:
        args = [*SMALL, "--dataset-name", tmp_path / "empty", "--output-dir", tmp_path / "run2"]
        message = run_before_weights(monkeypatch, capsys, script, *args)[0]
        assert message.startswith(f"error: --dataset-name {tmp_path / 'empty'}: a directory of .json / .jsonl / .csv")
        assert "\n" not in message and not (tmp_path / "run2").exists()
        txt = tmp_path / "prompts.txt"  # not a format that is read: said before anything (not a hub lookup)
        message = run_before_weights(monkeypatch, capsys, script, *SMALL, "--dataset-name", txt)[0]
        expected = "a .json / .jsonl / .csv / .parquet file (or a directory of them) expected"
        assert message == f"error: --dataset-name {txt}: {expected}", message


# ----------------------------------------------------------------------------------------------------------------
# 4. settings that silently change training are named at start


def test_warmup_past_the_last_step_and_more_prompts_per_step_than_prompts_are_warned_about(
    monkeypatch, capsys, tmp_path
):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": p, "keyword": "the"} for p in PROMPTS])
    args = [*SMALL, "--dataset-name", data, "--output-dir", tmp_path / "run", "--max-steps", 3, "--warmup-steps", 10]
    exited, printed = run_before_weights(monkeypatch, capsys, "grpo.py", *args, "--prompts-per-step", 1000)
    assert "loaded a model's weights" in exited  # warnings, not errors: the run goes on (to the weights, here)
    assert "warning: --warmup-steps 10 >= --max-steps 3: the learning rate never reaches --learning-rate" in printed
    assert "warning: --prompts-per-step 1000 > the 3 prompts kept: steps repeat prompts" in printed
    args[-1] = 2  # --warmup-steps 2 < --max-steps 3, --prompts-per-step 2 of 3 prompts: nothing to say
    assert "warning" not in run_before_weights(monkeypatch, capsys, "grpo.py", *args)[1]


# ----------------------------------------------------------------------------------------------------------------
# 5. the logged learning rate is the one the row's optimizer step used


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_logged_learning_rate_is_the_one_the_step_used(tmp_path, script):
    out = tmp_path / "run"
    schedule = ["--learning-rate", 1e-3, "--lr-scheduler-type", "linear", "--warmup-steps", 2, "--max-steps", 3]
    check(run_script(script, *BASE, *schedule, "--output-dir", out))
    # HF's linear schedule with 2 warmup steps of 3: step 1 uses 0, step 2 lr / 2, step 3 lr (then it would decay)
    assert [m["learning_rate"] for m in read_metrics(out)] == pytest.approx([0.0, 5e-4, 1e-3], abs=1e-12)


# ----------------------------------------------------------------------------------------------------------------
# 8. the progress bar shows a KL only when one is computed; online_dpo.py logs `reward` as the other two do


@pytest.mark.parametrize("script, beta, shown", [("grpo.py", 0, False), ("grpo.py", 0.1, True), ("rloo.py", 0, False)])
def test_the_progress_bar_shows_a_kl_only_when_one_is_computed(tmp_path, script, beta, shown):
    result = check(run_script(script, *BASE, "--beta", beta, "--max-steps", 1, "--output-dir", tmp_path / "run"))
    assert ("kl=" in result.stderr) == shown and "len=" in result.stderr, result.stderr[-2000:]


def test_online_dpo_logs_the_mean_reward_of_the_completions_as_reward(tmp_path):
    check(run_script("online_dpo.py", *BASE, "--max-steps", 2, "--output-dir", tmp_path / "run"))
    metrics = read_metrics(tmp_path / "run")
    assert all(m["reward"] == m["objective/scores"] for m in metrics)  # kept, and the other scripts' name beside it


# ----------------------------------------------------------------------------------------------------------------
# 6. checkpoints and the final model carry the tokenizer's files byte for byte: loaded again, it tokenizes alike


def test_checkpoints_and_the_final_model_tokenize_like_the_original(tmp_path):
    out, text = tmp_path / "run", "a</s>b <s> c"
    check(run_script("grpo.py", *BASE, "--max-steps", 2, "--save-steps", 1, "--output-dir", out))
    resumed = ["--max-steps", 3, "--output-dir", out, "--resume-from-checkpoint", out / "checkpoint-1"]
    check(run_script("grpo.py", *BASE, "--save-steps", 1, *resumed))  # a resumed run (its tokenizer: checkpoint-1's)
    original = transformers.AutoTokenizer.from_pretrained(STORIES)
    for directory in (out / "checkpoint-1", out / "checkpoint-2", out):
        for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
            assert (directory / name).read_bytes() == (Path(STORIES) / name).read_bytes(), (directory, name)
        loaded = transformers.AutoTokenizer.from_pretrained(directory)
        assert loaded(text)["input_ids"] == original(text)["input_ids"], directory


def test_a_tokenizer_json_that_its_class_does_not_list_is_kept_and_the_run_resumes(tmp_path):
    """A tokenizer as ../shared/gpu/smollm2_gguf_to_hf.py leaves the GPU tests' SmolLM2 (/tmp/smol): tokenizer.json
    alone, under a class whose own files are others (GPT2Tokenizer: vocab.json, merges.txt); transformers 5 loads it
    from tokenizer.json. Checkpoints lacked that file, so a resume's tokenizer knew only the special tokens and the run
    failed before "resumed from" (tests/gpu/test_faults_ipc.py test_4's resume: rc 1, nothing on stdout)."""
    model, out, text = tmp_path / "model", tmp_path / "run", "Once upon a time, there was a little girl named Lily."
    shutil.copytree(STORIES, model)
    (model / "tokenizer.model").unlink()
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))
    args = [model if arg == STORIES else arg for arg in BASE] + ["--save-steps", 1, "--output-dir", out]
    check(run_script("grpo.py", *args, "--max-steps", 2))
    resumed = check(run_script("grpo.py", *args, "--max-steps", 3, "--resume-from-checkpoint", "latest"))
    assert f"resumed from {out / 'checkpoint-1'} at step 1" in resumed.stdout
    original = transformers.AutoTokenizer.from_pretrained(model)
    for directory in (out / "checkpoint-1", out / "checkpoint-2", out):
        assert (directory / "tokenizer.json").read_bytes() == (model / "tokenizer.json").read_bytes(), directory
        loaded = transformers.AutoTokenizer.from_pretrained(directory)
        assert loaded(text)["input_ids"] == original(text)["input_ids"], directory


def test_a_tokenizer_without_its_vocabulary_is_refused_before_the_weights_load(tmp_path):
    """A tokenizer folder without tokenizer.json (what checkpoints of such a class were before) loads under transformers
    as the special tokens alone: the run stops with the folder named, not with the log-prob check's "forward transforms
    the logits" after the weights loaded."""
    model = tmp_path / "model"
    shutil.copytree(STORIES, model)
    (model / "tokenizer.model").unlink()
    (model / "tokenizer.json").unlink()
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))
    args = [model if arg == STORIES else arg for arg in BASE] + ["--output-dir", tmp_path / "run", "--max-steps", 1]
    failed = run_script("grpo.py", *args)
    assert failed.returncode == 1 and f"the tokenizer files in {model} are incomplete" in failed.stderr, failed.stderr
    assert "Loading weights" not in failed.stderr and not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------------------------------------------
# 7. a fork (a copy of grpo.py under another name, with a reward of its own) is named after its file


def test_a_fork_is_named_after_its_file_and_its_checkpoints_are_its_own(tmp_path):
    fork = tmp_path / "fork"
    fork.mkdir()
    shutil.copy(ROOT / "grpo.py", fork / "my_algo.py")
    shutil.copy(ROOT / "vllm_utils.py", fork)
    reward = (
        "\n\ndef length_reward(completions, **kwargs) -> list[float]:\n    return [len(c) / 100 for c in completions]\n"
    )
    (fork / "rewards.py").write_text((ROOT / "rewards.py").read_text() + reward)
    out = tmp_path / "run"
    args = [*BASE, "--reward-funcs", "length_reward", "--max-steps", 2, "--save-steps", 1, "--output-dir", out]
    # a process of its own: tests/prefork.py's forks have imported the repository's rewards.py already
    fork_run = lambda *a: subprocess.run([sys.executable, fork / "my_algo.py", *map(str, a)], **PLAIN)
    check(fork_run(*args))
    assert json.loads((out / "checkpoint-1" / "run.json").read_text())["script"] == "my_algo.py"
    help_text = fork_run("--help").stdout
    assert "my_algo" in help_text.split("--exp-name", 1)[1].split("--", 1)[0]  # exp_name's default: runs/my_algo__...
    args = ["--max-steps", 3, "--output-dir", out, "--resume-from-checkpoint", out / "checkpoint-1"]
    refused = run_script("grpo.py", *BASE, *args)
    assert refused.returncode != 0 and "is a checkpoint of my_algo.py: continue that run with my_algo.py" in (
        refused.stderr
    )


# ----------------------------------------------------------------------------------------------------------------
# 8. --save-total-limit 0 keeps every checkpoint (and says so); string --reward-kwargs, and a clear error when one
# would replace a dataset column


def test_save_total_limit_0_keeps_every_checkpoint(tmp_path):
    out = tmp_path / "run"
    check(
        run_script("grpo.py", *BASE, "--max-steps", 4, "--save-steps", 1, "--save-total-limit", 0, "--output-dir", out)
    )
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    help_text = subprocess.run([sys.executable, ROOT / "grpo.py", "--help"], **PLAIN).stdout
    assert "0 or None = keep every checkpoint" in " ".join(help_text.split()), help_text


def test_a_string_reward_kwarg_points_keyword_reward_at_another_word(monkeypatch, capsys, tmp_path):
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": p} for p in PROMPTS + ["One day, a boy went to the"]])
    out = tmp_path / "run"
    args = ["--dataset-name", plain, "--reward-kwargs", "keyword", "the", "--max-steps", 1, "--output-dir", out]
    check(run_script("grpo.py", *BASE, *args))
    assert "rewards/keyword_reward/mean" in read_metrics(out)[0]
    # a keyword that is also a column of the dataset: one line before the weights load, not a TypeError later
    args = [*SMALL, "--dataset-name", ASSETS / "stories_prompts.jsonl", "--reward-kwargs", "keyword", "the"]
    message = run_before_weights(monkeypatch, capsys, "grpo.py", *args, "--output-dir", tmp_path / "run2")[0]
    assert message.startswith("error: --reward-kwargs keyword would replace") and "stories_prompts.jsonl" in message
    assert "\n" not in message
