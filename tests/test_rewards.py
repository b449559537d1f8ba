import json
import threading
import time
from pathlib import Path

import pytest

import rewards

ASSETS = Path(__file__).parent / "assets"


def _rows(name):
    with open(ASSETS / name) as f:
        return [json.loads(line) for line in f]


GSM8K = _rows("gsm8k_sample.jsonl")
MATH500 = _rows("math500_sample.jsonl")
MALFORMED = ["", "I am not sure.", "asdf qwerty zxcv", "}{ \\boxed{ $$ <answer>", "The answer is"]


def _chat(text):
    return [{"role": "assistant", "content": text}]


def _boxed(answer):
    return f"Let me think step by step... so the answer is $\\boxed{{{answer}}}$."


# ---------------------------------------------------------------- math_accuracy

# MATH-500 row index -> a wrong final answer (different value, order, openness or name)
MATH_WRONG = {
    0: "\\left( 3, \\pi \\right)",  # gold \left( 3, \frac{\pi}{2} \right)
    1: "q - p",  # gold p - q
    2: "\\frac{3}{14}",  # gold \frac{14}{3}
    4: "\\text{Bob}",  # gold \text{Evelyn}
    7: "45^\\circ",  # gold 90^\circ
    8: "2\\sqrt{13}",  # gold 3\sqrt{13}
    11: "\\frac{3}{55}",  # gold \frac{3}{56}
    15: "6 + 5i",  # gold 6 - 5i
    23: "x=6",  # gold x=5
    25: "1, 2",  # gold 1,-2
    30: "42_8",  # gold 52_8
    31: "11\\sqrt3",  # gold 11\sqrt2
    36: "3, 5",  # gold 3, 5, 7
}


def test_math500_sample_has_the_answers_the_wrong_table_assumes():
    assert MATH500[0]["answer"] == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert MATH500[11]["answer"] == "\\frac{3}{56}" and MATH500[36]["answer"] == "3, 5, 7"


def test_math_accuracy_right_answers_all_rows():
    completions = [_boxed(r["answer"]) for r in MATH500]
    assert rewards.math_accuracy(completions, answer=[r["answer"] for r in MATH500]) == [1.0] * len(MATH500)


def test_math_accuracy_gold_solutions_score_one():
    completions = [r["solution"] for r in MATH500]
    assert rewards.math_accuracy(completions, answer=[r["answer"] for r in MATH500]) == [1.0] * len(MATH500)


@pytest.mark.parametrize("i", sorted(MATH_WRONG))
def test_math_accuracy_right_and_wrong(i):
    gold = MATH500[i]["answer"]
    completions = [_boxed(gold), _boxed(MATH_WRONG[i]), _chat(_boxed(gold)), _chat(_boxed(MATH_WRONG[i]))]
    assert rewards.math_accuracy(completions, answer=[gold] * 4) == [1.0, 0.0, 1.0, 0.0]


def test_math_accuracy_equivalent_forms():
    golds = ["\\frac{14}{3}", "\\frac{14}{3}", "p - q", "\\left( 3, \\frac{\\pi}{2} \\right)", "3, 5, 7", "90^\\circ"]
    preds = [
        "$\\boxed{\\dfrac{14}{3}}$",
        "The final answer is 14/3",
        "$\\boxed{-q + p}$",
        "$\\boxed{(3, \\pi/2)}$",
        "$\\boxed{7, 5, 3}$",
        "$\\boxed{90}$",
    ]
    assert rewards.math_accuracy(preds, answer=golds) == [1.0] * len(golds)


def test_math_accuracy_order_and_interval_type_matter():
    golds = ["\\left( 3, \\frac{\\pi}{2} \\right)", "(5,\\infty)", "(-\\infty, 0]"]
    preds = ["$\\boxed{(\\frac{\\pi}{2}, 3)}$", "$\\boxed{[5,\\infty)}$", "$\\boxed{(-\\infty, 0)}$"]
    assert rewards.math_accuracy(preds, answer=golds) == [0.0, 0.0, 0.0]


def test_math_accuracy_boxed_wins_over_later_answers():
    completions = [
        "$\\boxed{27}$. Check: 3 * 9 = 28 - 1, step 4",
        "$\\boxed{27}$. The final answer is 28",
        "$\\boxed{28}$. The final answer is 27",
    ]
    assert rewards.math_accuracy(completions, answer=["27"] * 3) == [1.0, 1.0, 0.0]


def test_math_accuracy_scores_the_last_chat_message():
    chat = [{"role": "assistant", "content": "$\\boxed{28}$"}, {"role": "assistant", "content": "$\\boxed{27}$"}]
    assert rewards.math_accuracy([chat, chat[:1]], answer=["27", "27"]) == [1.0, 0.0]


@pytest.mark.parametrize("text", MALFORMED)
def test_math_accuracy_malformed_completion_is_zero(text):
    assert rewards.math_accuracy([text, _chat(text)], answer=["\\frac{14}{3}", "\\frac{14}{3}"]) == [0.0, 0.0]


def test_math_accuracy_unparseable_gold_is_none():
    golds = ["}{", "", "?", MATH500[2]["answer"]]
    assert rewards.math_accuracy([_boxed("\\frac{14}{3}")] * 4, answer=golds) == [None, None, None, 1.0]


def test_math_accuracy_missing_gold_is_none():
    # None / NaN (pandas) must not become the text "None" / "nan", which parses as a product of symbols
    preds = [_boxed("None"), "the answer is none", _boxed("nan"), _boxed("3")]
    assert rewards.math_accuracy(preds, answer=[None, None, float("nan"), "3"]) == [None, None, None, 1.0]


def test_math_accuracy_gold_already_in_math_mode():
    golds = ["$\\frac{14}{3}$", "The answer is $\\boxed{7}$.", "\\$18.90"]
    preds = [_boxed("\\frac{14}{3}"), _boxed("7"), _boxed("18.90")]
    assert rewards.math_accuracy(preds, answer=golds) == [1.0, 1.0, 1.0]


def test_math_accuracy_times_out_instead_of_hanging(monkeypatch):
    # sympy would compare 9^(9^(9^9)) with 2 for ever; the signal timeout makes it a plain 0.0
    monkeypatch.setattr(rewards, "_TIMEOUT_S", 1)
    start = time.time()
    assert rewards.math_accuracy(["$\\boxed{9^{9^{9^{9}}}}$"], answer=["2"]) == [0.0]
    assert time.time() - start < 10


def test_math_accuracy_works_off_the_main_thread():
    # math_verify's signal-based timeout raises ValueError outside the main thread unless the timeout is None
    results, errors = [], []

    def work():
        try:
            results.append(
                rewards.math_accuracy([_boxed("\\frac{14}{3}"), _boxed("3"), "no idea"], answer=["\\frac{14}{3}"] * 3)
            )
        except BaseException as e:  # noqa: BLE001 - reported by the assert below
            errors.append(e)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=60)
    assert not errors, errors
    assert results == [[1.0, 0.0, 0.0]]


# ---------------------------------------------------------------- gsm8k_accuracy


def _gsm8k_gold(row):
    return int(row["answer"].split("####")[-1].replace(",", ""))


def test_gsm8k_gold_solutions_score_one():
    answers = [r["answer"] for r in GSM8K]
    assert rewards.gsm8k_accuracy(answers, answer=answers) == [1.0] * len(GSM8K)


def test_gsm8k_right_wrong_and_chat():
    for row in GSM8K[:10]:
        n = _gsm8k_gold(row)
        completions = [
            f"So she makes ${n:,}.",  # last number, thousands separator, trailing dot
            f"The answer is {n + 1}.",
            f"I first thought {n + 1}, but it is {n}",  # the last number counts
            f"It is {n}.\n#### {n + 3}",  # the number after #### counts
            f"Total {n + 2}\n#### {n}\nThat took 5 steps.",
            _chat(f"#### {n}"),
            _chat(f"{n - 1}"),
        ]
        got = rewards.gsm8k_accuracy(completions, answer=[row["answer"]] * len(completions))
        assert got == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0], (n, got)


def test_gsm8k_number_formats():
    golds = ["#### 70,000", "#### 70000", "-3", "2.5", "7", "$1,000", "12"]
    preds = ["it earns 70000 dollars", "it earns $70,000.", "x = -3.", "2.50", "3 + 4 = 7.", "1000", "12,34"]
    assert rewards.gsm8k_accuracy(preds, answer=golds) == [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    assert rewards.gsm8k_accuracy(["5-3"], answer=["-3"]) == [0.0]  # a minus after a digit is an operator
    assert rewards.gsm8k_accuracy(["is 3.5 not 3"], answer=["3.5"]) == [0.0]
    # the Unicode minus sign (U+2212), in the completion or the gold
    assert rewards.gsm8k_accuracy(["x = \u22125", "#### \u22125", "x = -5"], answer=["-5", "-5", "#### \u22125"]) == [
        1.0,
        1.0,
        1.0,
    ]
    assert rewards.gsm8k_accuracy(["x = \u22125"], answer=["5"]) == [0.0]


@pytest.mark.parametrize("text", MALFORMED + ["#### ", "#### none"])
def test_gsm8k_malformed_completion_is_zero(text):
    assert rewards.gsm8k_accuracy([text, _chat(text)], answer=["#### 42", "42"]) == [0.0, 0.0]


def test_gsm8k_addition_task_and_unparseable_gold():
    golds = ["7", " 7 ", "seven", "", "The answer is 7", "#### x"]
    assert rewards.gsm8k_accuracy(["7"] * 6, answer=golds) == [1.0, 1.0, None, None, None, None]


# ---------------------------------------------------------------- think_format


def test_think_format():
    good = [
        "<think>a</think><answer>b</answer>",
        "  <think>\nstep 1\nstep 2\n</think>\n\n<answer>\n42\n</answer>\n",
        "<think></think> <answer></answer>",
    ]
    bad = [
        "",
        "<answer>42</answer>",
        "<think>x</think>",
        "<answer>b</answer><think>a</think>",
        "hi <think>a</think><answer>b</answer>",
        "<think>a</think><answer>b</answer> bye",
        "<think>a</think> so <answer>b</answer>",
        "<think>a</think><answer>b</answer><answer>c</answer>",
        "<think><think>a</think></think><answer>b</answer>",
        "<think>a<answer>b</answer></think>",
        "<think>a</think><answer>b",
    ]
    assert rewards.think_format(good + [_chat(good[1])]) == [1.0] * 4
    assert rewards.think_format(bad + [_chat(bad[1])]) == [0.0] * (len(bad) + 1)


# ---------------------------------------------------------------- soft_overlong_punishment


def test_soft_overlong_punishment_hand_computed():
    lengths = [0, 16, 17, 18, 20, 21, 100]
    ids = [[1] * n for n in lengths]
    got = rewards.soft_overlong_punishment(
        completions=["x"] * len(ids),
        completion_ids=ids,
        max_completion_length=20,
        overlong_buffer_length=4,
        prompts=["p"] * 7,
    )
    assert got == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0]


def test_soft_overlong_punishment_default_buffer_is_a_quarter():
    ids = [[7] * n for n in (15, 16, 18, 20)]  # Lmax 20 -> Lcache 5, penalty starts after 15 tokens
    got = rewards.soft_overlong_punishment(["x"] * 4, completion_ids=ids, max_completion_length=20)
    assert got == pytest.approx([0.0, -0.2, -0.6, -1.0])


def test_soft_overlong_punishment_bad_buffer_raises():
    for bad in (0, -1, 21):
        with pytest.raises(ValueError):
            rewards.soft_overlong_punishment(
                ["x"], completion_ids=[[1]], max_completion_length=20, overlong_buffer_length=bad
            )


# ---------------------------------------------------------------- keyword_reward


def test_keyword_reward():
    completions = [
        "The ball was red.",
        "She had a balloon.",
        "BALL!",
        "Tim and Sue went to the park",
        "the dog ran",
        "",
        _chat("Lily saw a Ball"),
        "a football game",
    ]
    keywords = ["ball", "ball", "ball", "park", "cat", "ball", "ball", "ball"]
    assert rewards.keyword_reward(completions, keyword=keywords) == [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0]


# ---------------------------------------------------------------- interface shared by all rewards

REWARDS = [n for n, f in vars(rewards).items() if rewards.is_reward(f)]  # the rule, not a list of names


def test_the_rewards_are_the_public_functions_whose_first_parameter_is_completions():
    # the module's own rewards, each documented; its helpers (the trainer's side, `_`-prefixed ones) are not rewards
    assert set(REWARDS) >= {"math_accuracy", "gsm8k_accuracy", "think_format", "soft_overlong_punishment"}
    assert not {"functions", "missing_argument", "score", "is_reward", "_text"} & set(REWARDS)
    for name in REWARDS:
        assert getattr(rewards, name).__doc__.strip(), name
    assert [fn.__name__ for fn in rewards.functions(["keyword_reward", "think_format"])] == [
        "keyword_reward",
        "think_format",
    ]
    with pytest.raises(SystemExit, match="unknown reward function 'score'.*--reward-funcs"):
        rewards.functions(["score"])  # public, but its first parameter is reward_fns


def test_a_fork_adds_a_reward_by_defining_it(monkeypatch):
    def length_reward(completions, **kwargs):
        return [float(len(c)) for c in completions]

    length_reward.__module__ = "rewards"
    monkeypatch.setattr(rewards, "length_reward", length_reward, raising=False)
    (fn,) = rewards.functions(["length_reward"])
    assert rewards.score([fn], ["ab", "c"], {}).tolist() == [[2.0], [1.0]]


def test_missing_argument_and_score():
    fns = rewards.functions(["keyword_reward", "gsm8k_accuracy"])
    assert rewards.missing_argument(fns, {"completions", "keyword", "answer"}) is None
    assert rewards.missing_argument(fns, {"completions", "answer"}) == (rewards.keyword_reward, "keyword")
    scores = rewards.score(fns, ["the cat", "1"], {"keyword": ["cat", "dog"], "answer": ["x", "1"]})
    assert scores[0, 0] == 1 and scores[1, 0] == 0 and scores[0, 1].isnan() and scores[1, 1] == 1  # None -> NaN
    with pytest.raises(RuntimeError, match="reward function 'keyword_reward' raised"):
        rewards.score(fns, ["a"], {"answer": ["1"]})


@pytest.mark.parametrize("name", REWARDS)
def test_rewards_accept_the_trainer_keywords(name):
    completions = ["<think>7</think><answer>7</answer>", _chat("the ball is 8")]
    out = getattr(rewards, name)(
        completions=completions,
        prompts=["a", "b"],
        completion_ids=[[1, 2], [3] * 9],
        max_completion_length=8,
        overlong_buffer_length=2,
        answer=["7", "7"],
        keyword=["ball", "ball"],
        question=["q", "q"],
        unused_extra=3,
    )
    assert len(out) == 2 and all(isinstance(x, float) for x in out)


@pytest.mark.parametrize("name", ["math_accuracy", "gsm8k_accuracy"])
def test_answer_length_mismatch_raises(name):
    with pytest.raises(ValueError, match="answer"):
        getattr(rewards, name)(["1", "2"], answer=["1"])
    with pytest.raises(ValueError, match="answer"):
        getattr(rewards, name)(["1"], answer="1")
