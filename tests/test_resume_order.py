"""A resumed run trains the same prompts, in the same order, as the run that was never interrupted.

The bug this guards against: with --async-generation --dynamic-sampling, the round generating in the background drew
its prompts before the current step's refill rounds drew theirs, and the checkpoint subtracted that in-flight round
from the prompts drawn as if it had been the last one drawn; a resume then trained one refill round twice and skipped
the in-flight round. So the checkpoint must record exactly which prompts were trained: here every combination of
script, --async-generation and (grpo.py only) --dynamic-sampling runs 6 steps uninterrupted, then again resumed from
its checkpoint of step 2, and the prompts each scoring call received must match from that point on.

The prompts are recorded by a reward function, which every scored round calls once. Its reward depends only on the
prompt and the completion's position in its group, never on the completion's text: a prompt of SIGNAL gets alternating
0 / 1 over its group's completions (signal: dynamic sampling keeps the group), every other prompt a constant (no
signal: the group is dropped and a refill round drawn). So which groups are kept, and how many refill rounds each
step draws, are the same whatever the completions (which the stand-in server samples with seeds counted per process,
so they differ between the uninterrupted and the resumed run) and differ between the two runs only if the prompts do.
"""

import pytest
from test_async import ARGS, StandInServer, run_in_process

import rewards
from grpo_cli import read_metrics, write_jsonl

PROMPTS = [  # none is the end of another: a decoded prompt ("<s> ...") is matched by its ending
    "Lily had a red ball.",
    "The dog ran to the park.",
    "Tom saw a big fish in the pond.",
    "Sue liked to sing songs.",
    "A little bird sat on a tree.",
    "Ben found a shiny stone.",
    "The sun was hot that day.",
    "Mia and her mom baked a cake.",
    "An old man lived by the sea.",
    "The cat was very sleepy.",
]
# with --seed 3's prompt order and 2 prompts per round, steps 1 and 2 of grpo.py --dynamic-sampling need refill rounds
SIGNAL = set(PROMPTS[:4])
CHECKPOINT_STEP, MAX_STEPS = 2, 6
G = int(ARGS[ARGS.index("--num-generations") + 1])  # completions per prompt (SMALL's 4)

CASES = [  # (script, --async-generation, --dynamic-sampling): dynamic sampling is grpo.py's alone
    (script, async_generation, dynamic)
    for script in ("grpo.py", "rloo.py", "online_dpo.py")
    for async_generation in (False, True)
    for dynamic in ((False, True) if script == "grpo.py" else (False,))
]


@pytest.fixture
def recorded(monkeypatch):
    """The prompts of each scoring call, in order: one tuple of prompt texts (one per group) per scored round."""
    calls = []

    def recording_reward(completions, prompts, **kwargs):
        texts = [next(p for p in PROMPTS if decoded.endswith(p)) for decoded in prompts]  # prompt-major, G each
        calls.append(tuple(texts[::G]))
        return [float(k % G % 2) if text in SIGNAL else 0.0 for k, text in enumerate(texts)]

    recording_reward.__module__ = rewards.__name__  # rewards.is_reward: a function of that module
    monkeypatch.setattr(rewards, "recording_reward", recording_reward, raising=False)
    return calls


@pytest.mark.parametrize(
    "script, async_generation, dynamic",
    CASES,
    ids=[f"{s[:-3]}-{'async' if a else 'sync'}{'-dynamic' if d else ''}" for s, a, d in CASES],
)
def test_resume_order_trains_the_prompts_of_the_uninterrupted_run(
    tmp_path, monkeypatch, recorded, script, async_generation, dynamic
):
    StandInServer(monkeypatch, delay=0.0)
    args = list(ARGS)
    args[args.index("--reward-funcs") + 1] = "recording_reward"
    data = write_jsonl(tmp_path / "stories.jsonl", [{"prompt": p} for p in PROMPTS])
    run = tmp_path / "run"
    common = [*args, "--dataset-name", data, "--output-dir", run, "--max-steps", MAX_STEPS]
    common += ["--save-steps", CHECKPOINT_STEP]
    common += ["--async-generation" if async_generation else "--no-async-generation"]
    common += ["--dynamic-sampling", "--dynamic-sampling-max-rounds", 3] if dynamic else []

    run_in_process(script, monkeypatch, *common)
    uninterrupted, metrics = list(recorded), read_metrics(run)
    assert [m["step"] for m in metrics] == list(range(1, MAX_STEPS + 1))
    rounds = [m["dynamic_sampling/generation_rounds"] if dynamic else 1 for m in metrics]
    assert len(uninterrupted) == sum(rounds)  # one scoring call per round, none for a round never trained
    if dynamic:  # refill rounds came up to the checkpoint, while a round was in flight (with --async-generation)
        assert rounds[CHECKPOINT_STEP - 1] > 1, rounds
    trained = {text for texts in uninterrupted for text in texts}
    assert trained & SIGNAL and trained - SIGNAL  # groups with and without signal

    recorded.clear()
    run_in_process(script, monkeypatch, *common, "--resume-from-checkpoint", run / f"checkpoint-{CHECKPOINT_STEP}")
    trained_before = sum(rounds[:CHECKPOINT_STEP])  # the scoring calls of the steps up to the checkpoint
    assert recorded == uninterrupted[trained_before:]
    assert [m["step"] for m in read_metrics(run)] == list(range(1, MAX_STEPS + 1))
