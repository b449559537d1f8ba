"""Behaviours where we follow TRL (each found by reading our code against TRL 1.16's)."""

import math

import pytest
import torch

import grpo
import rloo
from grpo_cli import SMALL, check, read_metrics, run_script, write_jsonl


def test_dynamic_sampling_drops_a_group_whose_scored_rewards_all_match():
    nan = float("nan")
    assert not grpo.has_signal(torch.tensor([1.0, 1.0, nan, 1.0]))  # the NaN gets advantage 0: no signal
    assert not grpo.has_signal(torch.tensor([nan, nan, nan, nan]))
    assert not grpo.has_signal(torch.tensor([0.5, 0.5, 0.5, 0.5]))
    assert grpo.has_signal(torch.tensor([1.0, 0.0, nan, 1.0]))


def test_normalized_rloo_advantages_leave_unscored_completions_out():
    advantages, scored = torch.tensor([1.0, -1.0, 0.0, 3.0]), torch.tensor([True, True, False, True])
    # mean and std over the scored rows only: mean 1, std 2 (n - 1); the unscored row stays 0
    expected = torch.tensor([0.0, -2.0, 0.0, 2.0]) / (2.0 + 1e-4)
    torch.testing.assert_close(rloo.normalize_advantages(advantages, scored), expected)


@pytest.mark.parametrize("script", ["grpo.py", "rloo.py"])
def test_reference_model_matches_the_policy_at_step_1(tmp_path, script):
    # the reference is loaded in the policy's dtype: with bf16 weights (and on CUDA, bf16 autocast) the KL before the
    # first update is exactly 0, not the rounding difference between a bf16 and an fp32 copy of the same weights
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Once upon a time", "keyword": "the"}] * 4)
    check(
        run_script(
            script,
            *SMALL,
            "--dataset-name",
            data,
            "--output-dir",
            tmp_path / "run",
            "--max-steps",
            1,
            "--beta",
            0.1,
            "--param-dtype",
            "bfloat16",
        )
    )
    kl = {"grpo.py": "kl/k3_token_mean", "rloo.py": "kl/k1_token_mean"}[script]  # each script's KL estimator
    assert read_metrics(tmp_path / "run")[0][kl] == 0.0


def test_gspo_with_a_token_level_loss_type_warns(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Once upon a time", "keyword": "the"}] * 4)
    result = check(
        run_script(
            "grpo.py",
            *SMALL,
            "--dataset-name",
            data,
            "--output-dir",
            tmp_path / "run",
            "--max-steps",
            1,
            "--importance-sampling-level",
            "sequence",
            "--loss-type",
            "dapo",
        )
    )
    assert "--importance-sampling-level sequence (GSPO) with --loss-type dapo" in result.stdout
    assert not math.isnan(read_metrics(tmp_path / "run")[0]["loss"])


@pytest.mark.parametrize("prompts_are_messages", [False, True])
def test_reward_functions_get_messages_only_when_the_dataset_prompts_are(tmp_path, monkeypatch, prompts_are_messages):
    # TRL's rule: completions are chat messages only when the dataset's prompts are; plain-text prompts that the chat
    # template wraps (--use-chat-template) give reward functions plain strings
    import shutil

    from transformers import AutoTokenizer

    import rewards
    from grpo_cli import STORIES

    model = shutil.copytree(STORIES, tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    tokenizer.save_pretrained(model)
    received = []

    def record_types(completions, **kwargs):
        received.extend(type(c) for c in completions)
        return [0.0] * len(completions)

    record_types.__module__ = "rewards"  # --reward-funcs takes functions of rewards.py
    monkeypatch.setattr(rewards, "record_types", record_types, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    prompt = "Once upon a time"
    prompt = [{"role": "user", "content": prompt}] if prompts_are_messages else prompt
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": prompt}] * 2)
    replace = {STORIES: str(model), "keyword_reward": "record_types", "--no-use-chat-template": "--use-chat-template"}
    argv = [replace.get(a, a) for a in SMALL] + ["--dataset-name", data]
    grpo.train(grpo.parse_args([*map(str, argv), "--output-dir", str(tmp_path / "run"), "--max-steps", "1"]))
    assert received and set(received) == ({list} if prompts_are_messages else {str})
