"""online_dpo.py from the command line on the CPU: outputs, checkpoints and resuming, the beta schedule, micro-batching,
all-tied steps, a reward model, clear errors, and learning on the bundled stories260K model."""

import json
import os
import runpy
import shutil
import sys
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

import rewards
from grpo_cli import ROOT, STORIES, STORIES_TASK, Process, check, read_metrics, run_script, write_jsonl

PROMPTS = [
    "Once upon a time, there was a little girl named Lily.",
    "One day, a boy named Tim went to the park.",
    "The cat was sad.",
    "Sam and Mia wanted to play a game.",
]
# a short run: 2 prompts x 4 completions of at most 8 tokens per step
SMALL = [
    "--model-name-or-path",
    STORIES,
    "--prompt-column",
    "prompt",
    "--answer-column",
    "",
    "--no-use-chat-template",
    "--no-bf16",
    "--prompts-per-step",
    "2",
    "--num-generations",
    "4",
    "--max-completion-length",
    "8",
    "--learning-rate",
    "1e-3",
]


def run_online_dpo(*args, timeout=300):
    return run_script("online_dpo.py", *args, timeout=timeout)


@pytest.fixture
def stories_jsonl(tmp_path):
    return write_jsonl(tmp_path / "stories.jsonl", [{"prompt": p, "keyword": "the"} for p in PROMPTS])


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    """A tiny random LlamaForSequenceClassification (num_labels 1) with the stories260K tokenizer: real-valued scores,
    so a prompt's completions (almost) never tie."""
    path = tmp_path_factory.mktemp("rm")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        num_labels=1,
    )
    LlamaForSequenceClassification(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(STORIES).save_pretrained(path)
    return path


def test_train_save_resume_and_beta_schedule(tmp_path, stories_jsonl):
    out = tmp_path / "run"
    # 4 prompts, 2 per step: steps 1-2 are epoch 0, steps 3-4 epoch 1, after which the last beta is reused
    common = [
        *SMALL,
        "--reward-funcs",
        "keyword_reward",
        "--dataset-name",
        stories_jsonl,
        "--output-dir",
        out,
        "--max-steps",
        6,
        "--seed",
        3,
        "--save-steps",
        1,
        "--save-total-limit",
        2,
        "--beta",
        0.5,
        0.2,
    ]
    check(run_online_dpo(*common))

    # checkpoints every step but the last, only the newest 2 kept, each resumable
    assert sorted(d for d in os.listdir(out) if d.startswith("checkpoint")) == ["checkpoint-4", "checkpoint-5"]
    state = torch.load(out / "checkpoint-5" / "trainer_state.pt", weights_only=False)
    assert state["global_step"] == 5 and state["prompts_consumed"] == 5 * 2
    assert not [d for d in os.listdir(out) if ".tmp-" in d or ".old-" in d or d.startswith(".final-tmp")]

    # the final model and tokenizer load from output_dir itself, and training changed the weights
    model = AutoModelForCausalLM.from_pretrained(out)
    assert (
        AutoTokenizer.from_pretrained(out)("Once upon a time")["input_ids"]
        == AutoTokenizer.from_pretrained(STORIES)("Once upon a time")["input_ids"]
    )
    start = AutoModelForCausalLM.from_pretrained(STORIES)
    assert [n for n, p in model.state_dict().items() if not torch.equal(p, start.state_dict()[n])], (
        "the final model equals the initial one"
    )

    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert [m["beta"] for m in metrics] == [0.5, 0.5, 0.2, 0.2, 0.2, 0.2]
    trained = [m for m in metrics if m["num_pairs"] > 0]
    assert trained, metrics
    for key in (
        "loss",
        "grad_norm",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "rewards/accuracies",
        "logps/chosen",
        "logps/rejected",
        "objective/scores_margin",
        "kl/k1_sequence_sum",
    ):
        assert key in trained[0], key
    for key in (
        "objective/scores",
        "frac_tied",
        "learning_rate",
        "completions/mean_length",
        "completions/clipped_ratio",
        "timing/generation",
        "timing/weight_sync",
        "step_time",
        "scores/keyword_reward/mean",
    ):
        assert key in metrics[0], key
    for m in trained:  # keyword_reward is 0 or 1: a pair is always a 1 against a 0
        assert m["objective/scores_margin"] == 1.0 and m["rewards/margins"] == pytest.approx(
            m["rewards/chosen"] - m["rewards/rejected"], abs=1e-5
        )
        assert 0 <= m["rewards/accuracies"] <= 1
    # step 1 (which has a pair with this seed) runs before any update: the policy is the reference, z = 0, loss log 2
    assert metrics[0]["num_pairs"] > 0 and metrics[0]["loss"] == pytest.approx(0.693147, abs=1e-6)
    assert (
        metrics[0]["kl/k1_sequence_sum"] == 0
        and metrics[0]["rewards/margins"] == 0
        and metrics[0]["rewards/accuracies"] == 0
    )

    # a crash after step 5's checkpoint: drop step 6's metrics line and resume from the newest checkpoint
    final_weights = {n: p.clone() for n, p in model.state_dict().items()}
    with open(out / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(m) + "\n" for m in metrics[:5])
    result = check(run_online_dpo(*common, "--resume-from-checkpoint", "latest"))
    assert "at step 5" in result.stdout
    resumed = read_metrics(out)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4, 5, 6]
    assert resumed[5].keys() == metrics[5].keys()
    for key in (
        "learning_rate",
        "beta",
        "objective/scores",
        "num_pairs",
        "skipped_steps",
        "completions/mean_length",
        "loss",
        "grad_norm",
        "kl/k1_sequence_sum",
    ):
        if key in metrics[5]:  # the pair metrics are absent when every prompt tied
            assert resumed[5][key] == pytest.approx(metrics[5][key], rel=1e-4), key
    resumed_model = AutoModelForCausalLM.from_pretrained(out)
    for name, param in resumed_model.state_dict().items():
        torch.testing.assert_close(param, final_weights[name], atol=1e-6, rtol=1e-5, msg=name)


def test_micro_batches_give_the_same_step(tmp_path, stories_jsonl, reward_model_dir):
    # one micro-batch for all pairs vs one pair per micro-batch: the same loss and gradient (each pair weighs 1/num_pairs)
    runs = {
        budget: Process(
            "online_dpo.py",
            *SMALL,
            "--reward-model-path",
            reward_model_dir,
            "--dataset-name",
            stories_jsonl,
            "--output-dir",
            tmp_path / f"mb{budget}",
            "--max-steps",
            2,
            "--seed",
            5,
            "--prompts-per-step",
            4,
            "--micro-batch-tokens",
            budget,
        )
        for budget in (16384, 1)
    }  # side by side
    results = []
    for budget, process in runs.items():
        check(process.result())
        results.append(read_metrics(tmp_path / f"mb{budget}"))
    (a1, a2), (b1, b2) = results
    assert a1["num_pairs"] == b1["num_pairs"] == 4, (a1, b1)
    for key in ("loss", "grad_norm", "rewards/chosen", "logps/rejected"):
        assert a1[key] == pytest.approx(b1[key], rel=1e-5, abs=1e-6), key
    # step 2 is scored on a model updated with that gradient: still the same (up to float summation order)
    assert a2["num_pairs"] == b2["num_pairs"] and a2["objective/scores"] == b2["objective/scores"]
    for key in ("loss", "grad_norm", "kl/k1_sequence_sum"):
        assert a2[key] == pytest.approx(b2[key], rel=1e-3, abs=1e-5), key


def test_all_tied_steps_are_skipped_and_counted(tmp_path):
    # a keyword that never appears: every completion scores 0, every prompt ties, no step has a pair
    data = write_jsonl(tmp_path / "never.jsonl", [{"prompt": p, "keyword": "zzzqqq"} for p in PROMPTS])
    out = tmp_path / "run"
    check(
        run_online_dpo(
            *SMALL, "--reward-funcs", "keyword_reward", "--dataset-name", data, "--output-dir", out, "--max-steps", 3
        )
    )
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert [m["skipped_steps"] for m in metrics] == [1, 2, 3]
    assert all(m["frac_tied"] == 1.0 and m["num_pairs"] == 0 and "loss" not in m for m in metrics)
    model, start = AutoModelForCausalLM.from_pretrained(out), AutoModelForCausalLM.from_pretrained(STORIES)
    for name, param in model.state_dict().items():
        assert torch.equal(param, start.state_dict()[name]), name


def test_chat_prompts_reward_model_and_missing_eos_penalty(tmp_path, reward_model_dir):
    # chat-message prompts: the policy (stories260K given a chat template) sees them through its template, the reward
    # model through its own template with the completion as the assistant's reply
    template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    policy, rm = tmp_path / "policy", tmp_path / "rm"
    shutil.copytree(STORIES, policy)
    shutil.copytree(reward_model_dir, rm)
    for path in (policy, rm):
        tokenizer = AutoTokenizer.from_pretrained(path)
        tokenizer.chat_template = template
        tokenizer.save_pretrained(path)
    data = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": [{"role": "user", "content": p}]} for p in PROMPTS])
    out = tmp_path / "run"
    check(
        run_online_dpo(
            *SMALL,
            "--model-name-or-path",
            policy,
            "--reward-model-path",
            rm,
            "--dataset-name",
            data,
            "--output-dir",
            out,
            "--max-steps",
            2,
            "--missing-eos-penalty",
            100,
        )
    )
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["num_pairs"] == 2 and m["frac_tied"] == 0  # real-valued scores do not tie
        # 8-token completions rarely end with EOS: the mean score is about -100 x the share cut at the length limit
        assert m["completions/clipped_ratio"] > 0.5
        assert m["objective/scores"] == pytest.approx(-100 * m["completions/clipped_ratio"], abs=5)
        assert "loss" in m and not any(k.startswith("scores/") for k in m)


@pytest.mark.parametrize("messages", [False, True])
def test_reward_functions_get_chat_messages_only_for_chat_prompts(tmp_path, monkeypatch, messages):
    """TRL's rule: completions reach the reward functions as chat messages only when the dataset's prompts are chat
    messages. Plain-text prompts that --use-chat-template wraps in the policy's template give plain strings."""
    policy = tmp_path / "policy"
    shutil.copytree(STORIES, policy)
    tokenizer = AutoTokenizer.from_pretrained(policy)
    tokenizer.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    tokenizer.save_pretrained(policy)
    rows = [{"prompt": [{"role": "user", "content": p}] if messages else p} for p in PROMPTS]
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    received = []

    def record_types(completions, **kwargs):
        received.extend(type(c).__name__ for c in completions)
        return [0.0] * len(completions)

    record_types.__module__ = "rewards"  # --reward-funcs takes the functions of rewards.py
    monkeypatch.setattr(rewards, "record_types", record_types, raising=False)
    args = [*SMALL, "--model-name-or-path", policy, "--use-chat-template", "--reward-funcs", "record_types"]
    args += ["--dataset-name", data, "--output-dir", tmp_path / "run", "--max-steps", 1]
    monkeypatch.setattr(sys, "argv", ["online_dpo.py", *map(str, args)])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runpy.run_path(str(ROOT / "online_dpo.py"), run_name="__main__")
    assert received and set(received) == {"list" if messages else "str"}
    # every reward 0: no pair, no update, and the step's schedule move is not reported as a misuse of PyTorch's
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]


# ----------------------------------------------------------------------------------------------------------------
# clear errors


def failing(*args):
    result = run_online_dpo(*args, "--max-steps", 1)
    assert result.returncode != 0, result.stdout[-2000:]
    return result.stderr


def test_error_missing_prompt_column(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": p, "keyword": "the"} for p in PROMPTS])
    err = failing(*SMALL, "--reward-funcs", "keyword_reward", "--dataset-name", data, "--output-dir", tmp_path / "run")
    assert "no column 'prompt'" in err and "--prompt-column" in err and "'text'" in err


def test_error_unknown_reward(tmp_path, stories_jsonl):
    err = failing(
        *SMALL, "--dataset-name", stories_jsonl, "--output-dir", tmp_path / "run", "--reward-funcs", "no_such_reward"
    )
    assert "unknown reward function 'no_such_reward'" in err and "'keyword_reward'" in err


def test_error_reward_function_raises(tmp_path, stories_jsonl):
    # soft_overlong_punishment raises on a buffer longer than --max-completion-length (8): named with its error
    err = failing(
        *SMALL,
        "--reward-funcs",
        "soft_overlong_punishment",
        "--reward-kwargs",
        "overlong_buffer_length",
        100,
        "--dataset-name",
        stories_jsonl,
        "--output-dir",
        tmp_path / "run",
    )
    assert "reward function 'soft_overlong_punishment' raised ValueError" in err and "overlong_buffer_length" in err


def test_error_no_reward_or_both(tmp_path, stories_jsonl):
    err = failing(*SMALL, "--dataset-name", stories_jsonl, "--output-dir", tmp_path / "run")
    assert "no reward given" in err and "--reward-funcs" in err and "--reward-model-path" in err
    err = failing(
        *SMALL,
        "--dataset-name",
        stories_jsonl,
        "--output-dir",
        tmp_path / "run",
        "--reward-funcs",
        "keyword_reward",
        "--reward-model-path",
        STORIES,
    )
    assert "both --reward-funcs and --reward-model-path" in err


def test_error_bad_penalty_and_prompt_too_long(tmp_path, stories_jsonl):
    err = failing(
        *SMALL,
        "--reward-funcs",
        "keyword_reward",
        "--dataset-name",
        stories_jsonl,
        "--output-dir",
        tmp_path / "run",
        "--missing-eos-penalty",
        0,
    )
    assert "--missing-eos-penalty must be > 0" in err
    long_prompt = " ".join(["Once upon a time there was a big dog."] * 60)  # ~600 tokens; the model has 512
    data = write_jsonl(
        tmp_path / "d.jsonl", [{"prompt": long_prompt, "keyword": "the"}, {"prompt": "Hi", "keyword": "the"}]
    )
    err = failing(*SMALL, "--reward-funcs", "keyword_reward", "--dataset-name", data, "--output-dir", tmp_path / "run")
    assert "exceeds the model's context of 512 tokens" in err and "--max-prompt-length" in err


# ----------------------------------------------------------------------------------------------------------------
# learning: online DPO teaches stories260K to use the word "play" (about a quarter of its completions, untrained)
#
# Measured with these settings (best vs worst of G = 4, 8 prompts per step, 24 tokens, lr 3e-4, 30 steps), seeds 1-8:
# mean score of the first 5 steps 0.39-0.52, of the last 5 steps 0.91-0.99 (rise 0.44-0.59); the 5-step mean first
# reaches 0.8 at step 9-15. With learning rate 0 (seeds 1-3): 0.24-0.32 -> 0.22-0.29.

LEARN = [
    *STORIES_TASK,
    "--num-generations",
    4,
    "--prompts-per-step",
    8,
    "--max-completion-length",
    24,
    "--max-steps",
    30,
    "--seed",
    1,
]


@pytest.fixture(scope="module")
def scores(online_dpo_learning_run):
    """scores(lr): objective/scores of each step of `online_dpo.py LEARN --learning-rate lr` (the conftest fixture runs
    both learning rates of the tests below in the background from the session's start)."""

    def run(learning_rate):
        metrics = read_metrics(online_dpo_learning_run(learning_rate))
        assert [m["step"] for m in metrics] == list(range(1, 31))
        return [m["objective/scores"] for m in metrics]

    return run


def test_score_rises(scores):
    score = scores(3e-4)
    first, last = sum(score[:5]) / 5, sum(score[-5:]) / 5
    assert score[0] < 0.5, score  # the untrained model rarely says "play"
    assert last >= 0.8 and last - first >= 0.3, f"first 5 steps {first:.3f}, last 5 steps {last:.3f}: {score}"


def test_score_flat_without_updates(scores):
    score = scores(0.0)
    first, last = sum(score[:5]) / 5, sum(score[-5:]) / 5
    assert last < 0.5 and abs(last - first) < 0.2, f"first 5 steps {first:.3f}, last 5 steps {last:.3f}: {score}"
