"""Evaluation (--eval-steps, --eval-dataset, --eval-num-generations, --max-steps 0) and --log-completions, through the
scripts themselves on the CPU: the numbers against the same metrics computed by hand, when it runs, which weights and
which generator it uses (the stand-in server of test_async.py), and 2 ranks against 1."""

import json
import re

import pytest
import torch
from test_async import StandInServer, run_in_process
from test_distributed import torchrun
from test_safe_runs import run_without_models
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

import grpo
from grpo_cli import ASSETS, SMALL, STORIES, check, read_metrics, run_script, write_jsonl

SCRIPTS = ["grpo.py", "rloo.py", "online_dpo.py"]
# 5 prompts (an odd number: 2 ranks get 3 and 2), keywords that the untrained model writes for some prompts only
EVAL_ROWS = [
    {"prompt": "Once upon a time, there was a little girl named", "keyword": "Lily"},
    {"prompt": "One day, a boy went to the", "keyword": "park"},
    {"prompt": "The cat sat on the mat and", "keyword": "dog"},
    {"prompt": "Sue had a red ball. She", "keyword": "play"},
    {"prompt": "Tom and his mom went to the store to buy", "keyword": "ball"},
]


@pytest.fixture
def eval_data(tmp_path):
    return write_jsonl(tmp_path / "eval.jsonl", EVAL_ROWS)


def keyword_solved(text, keyword):  # rewards.keyword_reward, written again: a whole word, any case
    return float(re.search(rf"(?<!\w){re.escape(keyword)}(?!\w)", text, re.IGNORECASE) is not None)


def greedy_by_hand(model_path, max_new_tokens):
    """Each eval prompt's greedy completion from Hugging Face generate, one prompt at a time (no padding)."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=2, pad_token_id=0)
    texts = []
    for row in EVAL_ROWS:
        ids = torch.tensor([tokenizer(row["prompt"])["input_ids"]])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
        texts.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return texts


@pytest.mark.parametrize("script", SCRIPTS)
def test_max_steps_0_evaluates_like_greedy_generate_by_hand_and_exits(tmp_path, eval_data, script):
    out = tmp_path / "run"
    result = check(
        run_script(
            script,
            *SMALL,
            "--dataset-name",
            ASSETS / "stories_prompts.jsonl",
            "--eval-dataset",
            eval_data,
            "--max-completion-length",
            12,
            "--max-steps",
            0,
            "--output-dir",
            out,
        )
    )
    (line,) = read_metrics(out)  # one evaluation, of the given model, and nothing trained or saved
    assert line["step"] == 0 and not (out / "config.json").exists() and "saved the final model" not in result.stdout
    texts = greedy_by_hand(STORIES, 12)
    solved = [keyword_solved(text, row["keyword"]) for text, row in zip(texts, EVAL_ROWS)]
    assert 0 < sum(solved) < len(solved), texts  # the check can tell a wrong completion from a right one
    assert line["eval/num_prompts"] == len(EVAL_ROWS)
    assert line["eval/pass@1"] == pytest.approx(sum(solved) / len(solved))
    assert line["eval/reward"] == pytest.approx(sum(solved) / len(solved))  # 0/1 reward: the same here
    assert line["eval/rewards/keyword_reward/mean"] == pytest.approx(sum(solved) / len(solved))
    assert "eval/pass@2" not in line  # k = 1: greedy only


@pytest.mark.parametrize("script", SCRIPTS)
def test_eval_runs_at_step_0_every_n_steps_and_at_the_end_and_completions_are_logged(
    monkeypatch, tmp_path, eval_data, script
):
    out = tmp_path / "run"
    track = ["--track"] if script == "grpo.py" else []  # wandb offline: the completions table too
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    result = check(
        run_script(
            script,
            *SMALL,
            "--dataset-name",
            ASSETS / "stories_prompts.jsonl",
            "--eval-dataset",
            eval_data,
            "--eval-max-samples",
            3,
            "--eval-num-generations",
            2,
            "--eval-steps",
            2,
            "--max-steps",
            5,
            "--log-completions",
            3,
            "--output-dir",
            out,
            *track,
        )
    )
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4, 5]
    assert [m["step"] for m in metrics if "eval/pass@1" in m] == [0, 2, 4, 5]
    for m in metrics:
        if "eval/pass@1" in m:
            assert m["eval/num_prompts"] == 3 and 0 <= m["eval/mean@2"] <= m["eval/pass@2"] <= 1  # 0/1 rewards
    # --log-completions 3: three (prompt, completion, reward) lines per logging step (every step)
    rows = re.findall(r"^  reward (\S+) \| (.+) => (.*)$", result.stdout, re.MULTILINE)
    assert len(rows) == 3 * 5, result.stdout[-3000:]
    assert all(float(reward) in (0.0, 1.0) for reward, _, _ in rows)
    assert (out / "config.json").exists()  # trained: the final model is saved as usual
    if track:  # one "completions" table per logging step, 3 rows of (step, prompt, completion, reward)
        tables = sorted((tmp_path / "wandb").glob("offline-run-*/files/media/table/completions_*.table.json"))
        assert len(tables) == 5
        table = json.loads(tables[0].read_text())
        assert table["columns"] == ["step", "prompt", "completion", "reward"] and len(table["data"]) == 3


@pytest.mark.parametrize("script", SCRIPTS)
def test_eval_goes_through_the_server_after_the_weight_push_with_async_generation(
    tmp_path, monkeypatch, eval_data, script
):
    server = StandInServer(monkeypatch, delay=0.05)
    train = write_jsonl(tmp_path / "train.jsonl", EVAL_ROWS)
    out = tmp_path / "run"
    run_in_process(
        script,
        monkeypatch,
        *SMALL,
        "--use-vllm",
        "--vllm-mode",
        "server",
        "--async-generation",
        "--dataset-name",
        train,
        "--eval-dataset",
        eval_data,
        "--eval-steps",
        2,
        "--max-steps",
        4,
        "--eval-num-generations",
        3,
        "--output-dir",
        out,
    )
    metrics = read_metrics(out)
    assert server.in_flight == 0 and server.updates_while_serving == 0
    train_metrics = [m for m in metrics if m["step"] > 0]
    pushed = [m.get("num_pairs", 1) > 0 for m in train_metrics]  # online DPO pushes only after a step with a pair
    tokenizer = AutoTokenizer.from_pretrained(STORIES)
    evals = []  # the requests of each evaluation: greedy ones (temperature 0) first, then the sampled ones
    for request in server.requests:
        if request["temperature"] is None:  # a training round
            continue
        if request["temperature"] == 0.0 and (not evals or evals[-1][-1]["temperature"] != 0.0):
            evals.append([])
        evals[-1].append(request)
    assert len(evals) == 3
    for step, requests in zip([0, 2, 4], evals):
        # the weights of that step: version 1 is the initial push, then one per step that changed the weights
        assert all(r["version"] == 1 + sum(pushed[:step]) == r["end_version"] for r in requests), (step, requests)
        greedy = [c for r in requests if r["temperature"] == 0.0 for c in r["completions"]]
        sampled = [c for r in requests if r["temperature"] > 0 for c in r["completions"]]
        assert all(r["n"] == 3 for r in requests if r["temperature"] > 0) and len(greedy) == 5 and len(sampled) == 15
        assert {r["temperature"] for r in requests} == {0.0, server.args.temperature}  # greedy, and the training one
        texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in greedy + sampled]
        greedy_solved = [keyword_solved(text, row["keyword"]) for text, row in zip(texts[:5], EVAL_ROWS)]
        sampled_solved = [
            [keyword_solved(text, row["keyword"]) for text in texts[5 + 3 * i : 8 + 3 * i]]
            for i, row in enumerate(EVAL_ROWS)
        ]
        (line,) = [m for m in metrics if m["step"] == step and "eval/pass@1" in m]
        assert line["eval/pass@1"] == pytest.approx(sum(greedy_solved) / 5)
        assert line["eval/mean@3"] == pytest.approx(sum(map(sum, sampled_solved)) / 15)
        assert line["eval/pass@3"] == pytest.approx(sum(max(s) for s in sampled_solved) / 5)


def test_two_ranks_give_the_same_eval_as_one(tmp_path, eval_data):
    lines = []
    for n in (1, 2):
        out = tmp_path / f"run{n}"
        result = torchrun(
            n,
            "grpo.py",
            *SMALL,
            "--dataset-name",
            ASSETS / "stories_prompts.jsonl",
            "--eval-dataset",
            eval_data,
            "--max-completion-length",
            12,
            "--max-steps",
            0,
            "--output-dir",
            out,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        (line,) = read_metrics(out)
        lines.append(line)
    one, two = lines
    assert one["eval/num_prompts"] == two["eval/num_prompts"] == len(EVAL_ROWS)
    for key in ("eval/reward", "eval/pass@1", "eval/rewards/keyword_reward/mean", "eval/completions/mean_length"):
        assert one[key] == pytest.approx(two[key], abs=1e-6), key


def test_rank_share_covers_every_prompt_once_in_order():
    for num_prompts in (1, 4, 5, 7):
        for world_size in (1, 2, 3):
            shares = [grpo.rank_share(num_prompts, rank, world_size) for rank in range(world_size)]
            assert len({len(rows) for rows, _ in shares}) == 1  # the same number of generate calls on every rank
            assert [i for rows, real in shares for i in rows[:real]] == list(range(num_prompts))


def test_eval_metrics_by_hand():
    # 2 prompts, 2 reward functions weighted 1 and 0.5; NaN (unscorable) counts 0 in the total
    greedy = torch.tensor([[1.0, -1.0], [float("nan"), 1.0]])  # totals 0.5, 0.5
    sampled = torch.tensor([[[0.0, -1.0], [1.0, 0.0]], [[0.0, 0.0], [0.0, float("nan")]]])  # totals -0.5, 1 | 0, 0
    metrics = grpo.eval_metrics(greedy, sampled, torch.tensor([1.0, 0.5]), ["a", "b"])
    assert metrics["eval/reward"] == 0.5 and metrics["eval/pass@1"] == 1.0
    assert metrics["eval/rewards/a/mean"] == 1.0 and metrics["eval/rewards/b/mean"] == 0.0
    assert metrics["eval/mean@2"] == pytest.approx(0.125) and metrics["eval/pass@2"] == 0.5
    assert metrics["eval/rewards/a/mean@2"] == 0.25 and metrics["eval/rewards/b/mean@2"] == pytest.approx(-1 / 3)


@pytest.mark.parametrize(
    "script, extra, expected",
    [
        ("grpo.py", ["--eval-steps", 2], ["--eval-steps needs an eval dataset", "--eval-dataset"]),
        ("grpo.py", ["--max-steps", 0], ["--max-steps 0", "--eval-dataset"]),
        (
            "grpo.py",
            ["--eval-dataset", "tests/assets/nope.jsonl", "--eval-steps", 1],
            ["--eval-dataset tests/assets/nope.jsonl does not exist"],
        ),
        ("grpo.py", ["--eval-dataset", "EVAL"], ["--eval-dataset is ignored without --eval-steps N"]),
        (
            "grpo.py",
            ["--eval-dataset", "EVAL", "--eval-steps", 3, "--steps-per-generation", 2],
            ["--eval-steps 3 must be a multiple"],
        ),
        (
            "rloo.py",
            ["--eval-dataset", "EVAL", "--eval-steps", 1, "--eval-num-generations", 0, "--log-completions", -1],
            ["--eval-num-generations must be at least 1", "--log-completions must be >= 0"],
        ),
        (
            "online_dpo.py",
            ["--eval-dataset", "EVAL", "--eval-steps", 1, "--eval-max-samples", 0],
            ["--eval-max-samples must be at least 1"],
        ),
        ("online_dpo.py", ["--eval-dataset", "NO_KEYWORD", "--eval-steps", 1], ["--eval-dataset", "column 'keyword'"]),
    ],
)
def test_bad_eval_flags_are_rejected_before_any_model_loads(monkeypatch, tmp_path, eval_data, script, extra, expected):
    no_keyword = write_jsonl(tmp_path / "no_keyword.jsonl", [{"prompt": row["prompt"]} for row in EVAL_ROWS])
    extra = [{"EVAL": eval_data, "NO_KEYWORD": no_keyword}.get(str(a), a) for a in extra]
    message = run_without_models(
        monkeypatch,
        script,
        *SMALL,
        "--dataset-name",
        eval_data,
        "--output-dir",
        tmp_path / "run",
        "--max-steps",
        1,
        *extra,
    )
    for text in expected:
        assert text in message, message
    assert not (tmp_path / "run").exists()


def test_a_test_split_of_a_hub_dataset_is_the_default_eval_set():
    args = grpo.Args(dataset_name="openai/gsm8k", dataset_config="main", eval_steps=10)
    assert grpo.eval_source(args) == ("openai/gsm8k", "main", "test")
    assert grpo.eval_source(grpo.Args(dataset_name="data/addition.jsonl", eval_steps=10)) is None
    local = grpo.Args(eval_dataset="data/eval.jsonl")
    assert grpo.eval_source(local) == ("data/eval.jsonl", None, "test")
    other = grpo.Args(eval_dataset="a/b", eval_dataset_config="x", eval_dataset_split="validation")
    assert grpo.eval_source(other) == ("a/b", "x", "validation")
    named = grpo.Args(dataset_name="openai/gsm8k", dataset_config="main", eval_dataset="openai/gsm8k")
    assert grpo.eval_source(named) == ("openai/gsm8k", "main", "test")  # the training dataset's config


def test_evaluation_leaves_training_as_it_was(tmp_path, eval_data):
    # evaluation samples from a forked RNG and changes no weights: the same run with and without it trains alike
    common = [*SMALL, "--dataset-name", ASSETS / "stories_prompts.jsonl", "--max-steps", 3]
    check(run_script("grpo.py", *common, "--output-dir", tmp_path / "plain"))
    check(
        run_script(
            "grpo.py",
            *common,
            "--output-dir",
            tmp_path / "evaluated",
            "--eval-dataset",
            eval_data,
            "--eval-steps",
            1,
            "--eval-num-generations",
            2,
        )
    )
    plain, evaluated = read_metrics(tmp_path / "plain"), read_metrics(tmp_path / "evaluated")[1:]
    assert [m["step"] for m in evaluated] == [1, 2, 3] and all("eval/pass@2" in m for m in evaluated)
    for a, b in zip(plain, evaluated):
        assert (a["reward"], a["loss"], a["grad_norm"]) == (b["reward"], b["loss"], b["grad_norm"])
    assert any(m["grad_norm"] > 0 for m in plain)  # it trained


def test_a_reward_that_draws_from_torch_s_rng_changes_neither_training_nor_the_eval_samples(
    tmp_path, eval_data, monkeypatch
):
    """Evaluation scores its completions inside its forked RNG, after both generations: a reward function that draws
    from torch's global RNG (a random tie-break, a sampled judge) changes neither what training samples (the same run
    without evaluation) nor evaluation's sampled completions (step 0's eval, before any update, as with a reward that
    draws nothing). The scripts run in this process, so that the function added to rewards.py is theirs."""
    import rewards

    def text_length(completions, **kwargs):  # a reward that tells samples apart: their length in characters
        return [len(text) / 100 for text in completions]

    def noisy_length(completions, **kwargs):  # the same, plus a draw from torch's RNG
        torch.rand(1)
        return text_length(completions)

    for fn in (text_length, noisy_length):
        fn.__module__ = "rewards"  # as if a fork had added them to rewards.py
        monkeypatch.setattr(rewards, fn.__name__, fn, raising=False)
    evaluating = ["--eval-dataset", eval_data, "--eval-steps", 1, "--eval-num-generations", 4]
    runs = {}
    for name, reward, extra in (("plain", "text_length", evaluating), ("noisy", "noisy_length", evaluating)):
        flags = [*SMALL, "--dataset-name", ASSETS / "stories_prompts.jsonl", "--max-steps", 2, "--reward-funcs", reward]
        run_in_process("grpo.py", monkeypatch, *flags, *extra, "--output-dir", tmp_path / name)
        runs[name] = read_metrics(tmp_path / name)
    flags = [*SMALL, "--dataset-name", ASSETS / "stories_prompts.jsonl", "--max-steps", 2, "--reward-funcs"]
    run_in_process("grpo.py", monkeypatch, *flags, "noisy_length", "--output-dir", tmp_path / "noisy_no_eval")
    without = read_metrics(tmp_path / "noisy_no_eval")
    assert [m["step"] for m in runs["noisy"]] == [0, 1, 2]
    for a, b in zip(without, runs["noisy"][1:]):
        assert (a["reward"], a["loss"], a["grad_norm"]) == (b["reward"], b["loss"], b["grad_norm"])
    keys = ["eval/reward", "eval/mean@4", "eval/pass@4", "eval/completions/mean_length"]
    assert [runs["plain"][0][k] for k in keys] == [runs["noisy"][0][k] for k in keys]
