"""grpo.py from the command line on the CPU: outputs, checkpoints and resuming, dynamic sampling, clear errors."""

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_cli import SMALL, STORIES, check, read_metrics, run_grpo, write_jsonl

PROMPTS = [
    "Once upon a time, there was a little girl named Lily.",
    "One day, a boy named Tim went to the park.",
    "The cat was sad.",
    "Sam and Mia wanted to play a game.",
]


@pytest.fixture
def stories_jsonl(tmp_path):
    return write_jsonl(tmp_path / "stories.jsonl", [{"prompt": p, "keyword": "the"} for p in PROMPTS])


def test_train_save_and_resume(tmp_path, stories_jsonl):
    out = tmp_path / "run"
    common = [
        *SMALL,
        "--dataset-name",
        stories_jsonl,
        "--output-dir",
        out,
        "--max-steps",
        4,
        "--seed",
        3,
        "--save-steps",
        1,
        "--save-total-limit",
        2,
    ]
    check(run_grpo(*common))

    # checkpoints every step but the last, only the newest 2 kept, each resumable
    assert sorted(d for d in os.listdir(out) if d.startswith("checkpoint")) == ["checkpoint-2", "checkpoint-3"]
    state = torch.load(out / "checkpoint-3" / "trainer_state.pt", weights_only=False)
    assert state["global_step"] == 3 and state["prompts_consumed"] == 3 * 2
    assert not [d for d in os.listdir(out) if ".tmp-" in d or ".old-" in d or d.startswith(".final-tmp")]

    # the final model and tokenizer load from output_dir itself, and training changed the weights
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert (
        tokenizer("Once upon a time")["input_ids"]
        == AutoTokenizer.from_pretrained(STORIES)("Once upon a time")["input_ids"]
    )
    start = AutoModelForCausalLM.from_pretrained(STORIES)
    changed = [n for n, p in model.state_dict().items() if not torch.equal(p, start.state_dict()[n])]
    assert changed, "the saved final model equals the initial model"
    assert AutoModelForCausalLM.from_pretrained(out / "checkpoint-3") is not None

    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for key in (
        "reward",
        "reward_std",
        "frac_reward_zero_std",
        "loss",
        "grad_norm",
        "learning_rate",
        "entropy",
        "completions/mean_length",
        "rewards/keyword_reward/mean",
    ):
        assert key in metrics[0], key
    assert all(m["completions/max_length"] <= 8 for m in metrics)

    final_weights = {n: p.clone() for n, p in model.state_dict().items()}

    # a crash after step 3's checkpoint: drop step 4's metrics line and resume from the newest checkpoint
    with open(out / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(m) + "\n" for m in metrics[:3])
    result = check(run_grpo(*common, "--resume-from-checkpoint", "latest"))
    assert "at step 3" in result.stdout
    resumed = read_metrics(out)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    # model, optimizer, schedule, RNG and prompt order are restored: step 4 repeats the uninterrupted run's step 4
    assert resumed[3]["learning_rate"] == pytest.approx(metrics[3]["learning_rate"])
    assert resumed[3]["reward"] == pytest.approx(metrics[3]["reward"])
    assert resumed[3]["num_tokens"] == metrics[3]["num_tokens"]
    for key in ("grad_norm", "entropy", "completions/mean_length"):
        assert resumed[3][key] == pytest.approx(metrics[3][key], rel=1e-4), key
    # ...and so does its update (AdamW's moments were restored too): the same final model
    resumed_model = AutoModelForCausalLM.from_pretrained(out)
    for name, param in resumed_model.state_dict().items():
        torch.testing.assert_close(param, final_weights[name], atol=1e-6, rtol=1e-5, msg=name)


def test_resume_latest_without_checkpoint_fails(tmp_path, stories_jsonl):
    result = run_grpo(
        *SMALL,
        "--dataset-name",
        stories_jsonl,
        "--output-dir",
        tmp_path / "empty",
        "--max-steps",
        1,
        "--resume-from-checkpoint",
        "latest",
    )
    assert result.returncode != 0 and "holds no complete checkpoint-N" in result.stderr
    assert not (tmp_path / "empty").exists()  # refused: the directory it would have made is gone


def test_dynamic_sampling_refills_the_batch(tmp_path):
    # "zzzqqq" never appears: those prompts' groups are all 0 and get dropped; "the" appears in about a third of the
    # completions, so those groups usually carry signal. Each round samples 2 prompts, so filling a step needs more.
    rows = [{"prompt": p, "keyword": "the"} for p in PROMPTS] + [{"prompt": p, "keyword": "zzzqqq"} for p in PROMPTS]
    data = write_jsonl(tmp_path / "mixed.jsonl", rows)
    out = tmp_path / "run"
    check(
        run_grpo(
            *SMALL,
            "--dataset-name",
            data,
            "--output-dir",
            out,
            "--max-steps",
            3,
            "--seed",
            1,
            "--max-completion-length",
            16,
            "--dynamic-sampling",
            "--dynamic-sampling-max-rounds",
            6,
        )
    )
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    rounds = [m["dynamic_sampling/generation_rounds"] for m in metrics]
    kept = [m["dynamic_sampling/kept_groups"] for m in metrics]
    assert max(rounds) > 1, rounds
    for r, k, m in zip(rounds, kept, metrics):
        assert 1 <= r <= 6
        assert k == 2 or r == 6, (rounds, kept)  # a full batch of groups, unless it gave up after max rounds
        if r > 1:
            assert m["frac_reward_zero_std"] > 0  # some groups of this step's rounds were dropped
    assert any(r > 1 and k == 2 for r, k in zip(rounds, kept)), (rounds, kept)  # a refill that succeeded


# ----------------------------------------------------------------------------------------------------------------
# clear errors


def failing(*args):
    result = run_grpo(*args, "--max-steps", 1)
    assert result.returncode != 0, result.stdout[-2000:]
    return result.stderr


def test_error_missing_prompt_column(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": p, "keyword": "the"} for p in PROMPTS])
    err = failing(*SMALL, "--dataset-name", data, "--output-dir", tmp_path / "run")
    assert "no column 'prompt'" in err and "--prompt-column" in err and "'text'" in err


def test_error_missing_answer_column(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": p, "keyword": "the"} for p in PROMPTS])
    err = failing(*SMALL, "--dataset-name", data, "--output-dir", tmp_path / "run", "--answer-column", "solution")
    assert "no column 'solution'" in err and "--answer-column" in err


def test_error_unknown_reward(tmp_path, stories_jsonl):
    err = failing(
        *SMALL, "--dataset-name", stories_jsonl, "--output-dir", tmp_path / "run", "--reward-funcs", "no_such_reward"
    )
    assert "unknown reward function 'no_such_reward'" in err and "--reward-funcs" in err
    names = err.split("takes names from rewards.py:")[-1].strip().splitlines()[0]
    assert "'keyword_reward'" in names and "'gsm8k_accuracy'" in names  # the list of valid names...
    assert "_column" not in names and "math_verify" not in names  # ...without helpers or imported modules


def test_error_prompt_longer_than_context(tmp_path):
    long_prompt = " ".join(["Once upon a time there was a big dog."] * 60)  # ~600 tokens; the model has 512
    data = write_jsonl(
        tmp_path / "d.jsonl", [{"prompt": long_prompt, "keyword": "the"}, {"prompt": "Hi", "keyword": "the"}]
    )
    err = failing(*SMALL, "--dataset-name", data, "--output-dir", tmp_path / "run")
    assert "exceeds the model's context of 512 tokens" in err and "--max-prompt-length" in err


def test_error_reward_function_raises(tmp_path, stories_jsonl):
    # soft_overlong_punishment raises on a buffer longer than --max-completion-length (8): named with its error
    err = failing(
        *SMALL,
        "--dataset-name",
        stories_jsonl,
        "--output-dir",
        tmp_path / "run",
        "--reward-funcs",
        "soft_overlong_punishment",
        "--reward-kwargs",
        "overlong_buffer_length",
        100,
    )
    assert "RuntimeError" in err and "reward function 'soft_overlong_punishment' raised ValueError" in err
    assert "overlong_buffer_length" in err


def test_error_missing_dataset_file(tmp_path):
    err = failing(*SMALL, "--dataset-name", tmp_path / "nope.jsonl", "--output-dir", tmp_path / "run")
    assert "nope.jsonl does not exist" in err


def test_error_dynamic_sampling_without_signal(tmp_path):
    # a keyword that never appears: every group ties at 0, so dynamic sampling can never fill a step
    data = write_jsonl(tmp_path / "never.jsonl", [{"prompt": p, "keyword": "zzzqqq"} for p in PROMPTS])
    result = run_grpo(
        *SMALL,
        "--dataset-name",
        data,
        "--output-dir",
        tmp_path / "run",
        "--max-steps",
        2,
        "--dynamic-sampling",
        "--dynamic-sampling-max-rounds",
        2,
    )
    assert result.returncode != 0
    assert "whose 4 completions got different rewards in 2 rounds" in result.stderr
    assert "--dynamic-sampling-max-rounds" in result.stderr
