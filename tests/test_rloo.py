"""rloo.py: leave-one-out baselines, the KL folded into the reward, the sequence-level loss (hand-computed from
arXiv 2402.14740), learning on the CPU, and clear errors."""

import json
import math
import runpy
import shutil
import sys
from pathlib import Path

import pytest
import torch

import rloo
from grpo_cli import STORIES, STORIES_TASK, run_script, write_jsonl

ROOT = Path(__file__).resolve().parents[1]


def run_rloo(*args, timeout=300):
    return run_script("rloo.py", *args, timeout=timeout)


def test_leave_one_out_baseline_k3():
    # rewards 1, 2, 4: baselines (2+4)/2 = 3, (1+4)/2 = 2.5, (1+2)/2 = 1.5
    advantages = rloo.rloo_advantages(torch.tensor([1.0, 2.0, 4.0]), 3)
    assert torch.allclose(advantages, torch.tensor([1 - 3, 2 - 2.5, 4 - 1.5]))
    # equals k / (k - 1) * (R - group mean) when every completion is scorable
    assert torch.allclose(advantages, 3 / 2 * (torch.tensor([1.0, 2.0, 4.0]) - 7 / 3))


def test_leave_one_out_baseline_k2_and_several_groups():
    # k = 2: each completion's baseline is the other one's reward
    advantages = rloo.rloo_advantages(torch.tensor([1.0, 0.0, 0.25, 0.75]), 2)
    assert torch.allclose(advantages, torch.tensor([1.0, -1.0, -0.5, 0.5]))


def test_leave_one_out_ties_give_zero():
    assert torch.equal(rloo.rloo_advantages(torch.tensor([3.0, 3.0, 3.0]), 3), torch.zeros(3))
    advantages = rloo.rloo_advantages(torch.tensor([2.0, 2.0, 5.0, 1.0]), 2)
    assert advantages.tolist() == [0.0, 0.0, 4.0, -4.0]


def test_leave_one_out_unscorable_completions():
    nan = float("nan")
    # [1, None, 3]: the None gets 0 and is left out of the others' baselines: 1 - 3 = -2, 3 - 1 = 2
    advantages = rloo.rloo_advantages(torch.tensor([1.0, nan, 3.0]), 3)
    assert advantages.tolist() == [-2.0, 0.0, 2.0]
    # a completion with no scorable sibling has no baseline: 0
    assert rloo.rloo_advantages(torch.tensor([1.0, nan]), 2).tolist() == [0.0, 0.0]


def test_kl_folded_into_reward_k1():
    rewards = torch.tensor([1.0, 0.5])
    old = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    ref = torch.tensor([[-1.5, -1.0], [-0.5, -1.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])  # the second completion has one token
    penalised, token_kl = rloo.kl_penalised_rewards(rewards, old, ref, mask, beta=0.1)
    # k1 sums: row 0: (-1 + 1.5) + (-2 + 1) = -0.5; row 1: (-0.5 + 0.5) = 0 (the padded position does not count)
    assert torch.allclose(penalised, torch.tensor([1.0 - 0.1 * -0.5, 0.5 - 0.1 * 0.0]))
    assert torch.allclose(token_kl, torch.tensor([[0.5, -1.0], [0.0, 0.0]]))


def test_sequence_policy_loss_hand_computed():
    # sequence log-ratios: row 0: (0.1 + 0.2) = 0.3 -> rho = e^0.3 = 1.3499 (clipped at 1.2 for A > 0);
    # row 1: (-0.5) + padding -> rho = e^-0.5 = 0.6065 (clipped at 0.8 for A < 0: max(rho, 0.8) * |A| counts)
    logprobs = torch.tensor([[-1.0, -2.0], [-1.5, -9.0]])
    old = torch.tensor([[-1.1, -2.2], [-1.0, -3.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    advantages = torch.tensor([2.0, -1.0])
    loss, ratio = rloo.sequence_policy_loss(logprobs, old, advantages, mask, 0.2, 0.2)
    rho0, rho1 = math.exp(0.3), math.exp(-0.5)
    assert ratio.tolist() == pytest.approx([rho0, rho1], rel=1e-5)
    expected0 = -min(rho0 * 2.0, 1.2 * 2.0)
    expected1 = -min(rho1 * -1.0, 0.8 * -1.0)
    assert loss.tolist() == pytest.approx([expected0, expected1], rel=1e-5)


def test_sequence_policy_loss_gradient_is_reinforce_on_policy():
    # with old = sg(current): d loss / d logprob_t = -A for every real token (REINFORCE), 0 on padding
    logprobs = torch.tensor([[-1.0, -2.0], [-1.5, -9.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, _ = rloo.sequence_policy_loss(logprobs, logprobs.detach(), torch.tensor([2.0, -1.0]), mask)
    loss.sum().backward()
    assert logprobs.grad.tolist() == [[-2.0, -2.0], [1.0, 0.0]]


# learning: RLOO teaches stories260K to use the word "play"; the run (rloo_learning_run, conftest.py) starts in the
# background with the session, with --learning-rate 5e-4
LEARN = [
    *STORIES_TASK,
    "--num-generations",
    4,
    "--prompts-per-step",
    4,
    "--max-completion-length",
    24,
    "--max-steps",
    30,
    "--seed",
    1,
]


def test_rloo_learns_on_cpu(rloo_learning_run):
    out = rloo_learning_run(5e-4)  # the run exited 0
    metrics = [json.loads(line) for line in open(out / "metrics.jsonl")]
    rewards = [m["reward"] for m in metrics]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print("rloo rewards", [round(r, 2) for r in rewards])
    assert last >= first + 0.35 and last >= 0.8, (first, last)
    assert "kl/k1_token_mean" in metrics[-1]  # beta 0.05 by default: the KL to the reference is logged
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)  # the final model loads


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--prompt-column", "text"], "--prompt-column"),
        (["--reward-funcs", "no_such_reward"], "--reward-funcs takes names from rewards.py"),
        (["--num-generations", "1"], "leave-one-out baseline needs another completion"),
    ],
)
def test_rloo_errors(tmp_path, extra, message):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Once upon a time", "keyword": "play"}])
    args = [
        "--model-name-or-path",
        STORIES,
        "--dataset-name",
        data,
        "--prompt-column",
        "prompt",
        "--answer-column",
        "",
        "--reward-funcs",
        "keyword_reward",
        "--no-use-chat-template",
        "--max-steps",
        1,
        "--max-completion-length",
        4,
        "--output-dir",
        tmp_path / "run",
        *extra,
    ]
    result = run_rloo(*args)
    assert result.returncode != 0 and message in result.stderr, result.stderr[-2000:]


@pytest.mark.parametrize("messages", [False, True], ids=["plain-text prompts", "chat-message prompts"])
def test_reward_functions_get_messages_only_when_the_prompts_are_messages(tmp_path, monkeypatch, messages):
    # TRL's rule: completions are chat messages only when the dataset's prompts are; plain-text prompts that the chat
    # template wraps (--use-chat-template, a tokenizer with a template) give reward functions plain strings
    import rewards

    model = tmp_path / "model"
    shutil.copytree(STORIES, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    received = []

    def record_type(completions, **kwargs):
        received.extend(type(c) for c in completions)
        return [0.0] * len(completions)

    record_type.__module__ = "rewards"  # --reward-funcs takes the functions of rewards.py
    monkeypatch.setattr(rewards, "record_type", record_type, raising=False)
    prompt = [{"role": "user", "content": "Once upon a time"}] if messages else "Once upon a time"
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": prompt}] * 2)
    argv = ["--model-name-or-path", model, "--dataset-name", data, "--prompt-column", "prompt", "--answer-column", ""]
    argv += ["--reward-funcs", "record_type", "--use-chat-template", "--num-generations", 2, "--prompts-per-step", 2]
    argv += ["--max-completion-length", 4, "--max-steps", 1, "--beta", 0, "--no-bf16", "--output-dir", tmp_path / "run"]
    monkeypatch.setattr(sys, "argv", ["rloo.py", *map(str, argv)])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    runpy.run_path(str(ROOT / "rloo.py"), run_name="__main__")
    assert received and set(received) == {list if messages else str}, received
