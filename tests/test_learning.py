"""End to end on the CPU: GRPO teaches the bundled stories260K model to use the word "play" (tests/assets/README.md).

Untrained, about a quarter of its completions contain the word. Observed with these settings (seeds 1-4, 30 steps):
mean reward of the first 5 steps 0.35-0.43, of the last 5 steps 0.90-0.96; with learning rate 0 it stays flat."""
from grpo_cli import ASSETS, STORIES, check, read_metrics, run_grpo

COMMAND = ["--model-name-or-path", STORIES, "--dataset-name", ASSETS / "stories_prompts.jsonl", "--prompt-column", "prompt",
           "--answer-column", "", "--reward-funcs", "keyword_reward", "--no-use-chat-template", "--no-bf16",
           "--max-completion-length", 24, "--prompts-per-step", 4, "--num-generations", 8, "--max-steps", 30, "--seed", 1]


def rewards(tmp_path, learning_rate):
    out = tmp_path / f"lr{learning_rate}"
    check(run_grpo(*COMMAND, "--learning-rate", learning_rate, "--output-dir", out))
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == list(range(1, 31))
    return [m["reward"] for m in metrics]


def test_reward_rises(tmp_path):
    reward = rewards(tmp_path, 2e-4)
    first, last = sum(reward[:5]) / 5, sum(reward[-5:]) / 5
    assert reward[0] < 0.5, reward  # the untrained model rarely says "play"
    assert last >= 0.8 and last - first >= 0.35, f"first 5 steps {first:.3f}, last 5 steps {last:.3f}: {reward}"


def test_reward_flat_without_updates(tmp_path):
    # control: the same run with learning rate 0 samples from the untrained model throughout
    reward = rewards(tmp_path, 0.0)
    first, last = sum(reward[:5]) / 5, sum(reward[-5:]) / 5
    assert last < 0.5 and abs(last - first) < 0.2, f"first 5 steps {first:.3f}, last 5 steps {last:.3f}: {reward}"
