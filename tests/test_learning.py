"""End to end on the CPU: GRPO teaches the bundled stories260K model to use the word "play" (tests/assets/README.md).

Untrained, about a quarter of its completions contain the word. Observed with these settings (seeds 1-4, 30 steps):
mean reward of the first 5 steps 0.35-0.43, of the last 5 steps 0.90-0.96; with learning rate 0 it stays flat.
The command is grpo_cli.LEARNING; tests/test_plot.py plots these same runs."""

from grpo_cli import read_metrics


def rewards(learning_run, learning_rate):
    metrics = read_metrics(learning_run(learning_rate))  # the conftest fixture runs grpo_cli.LEARNING once per session
    assert [m["step"] for m in metrics] == list(range(1, 31))
    return [m["reward"] for m in metrics]


def test_reward_rises(learning_run):
    reward = rewards(learning_run, 2e-4)
    first, last = sum(reward[:5]) / 5, sum(reward[-5:]) / 5
    assert reward[0] < 0.5, reward  # the untrained model rarely says "play"
    assert last >= 0.8 and last - first >= 0.35, f"first 5 steps {first:.3f}, last 5 steps {last:.3f}: {reward}"


def test_reward_flat_without_updates(learning_run):
    # control: the same run with learning rate 0 samples from the untrained model throughout
    reward = rewards(learning_run, 0.0)
    first, last = sum(reward[:5]) / 5, sum(reward[-5:]) / 5
    assert last < 0.5 and abs(last - first) < 0.2, f"first 5 steps {first:.3f}, last 5 steps {last:.3f}: {reward}"
