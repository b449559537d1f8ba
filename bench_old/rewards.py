"""Reward functions: `fn(completions, **columns) -> list[float | None]`.

`completions` holds strings or chat messages (the last message's content is scored). Dataset columns arrive as
keyword lists aligned with `completions`; the trainer also passes `prompts`, `completion_ids`,
`max_completion_length` and any `--reward-kwargs`, so every reward takes `**kwargs`. None means "cannot score this
sample" (e.g. unparseable gold) and the trainer skips it. Public names are rewards; helpers start with `_`.
"""

import re
import threading

import math_verify

# Seconds per math_verify parse / comparison. math_verify enforces it with signal.alarm, which only works in the
# main thread (elsewhere it raises ValueError): off the main thread we pass None, i.e. no timeout, as math_verify
# recommends. So call math_accuracy from the main thread to be safe from inputs that hang sympy (e.g. 9^{9^{9^9}}).
_TIMEOUT_S = 3
# Default LaTeX normalization (basic_latex, units, malformed_operators, nits, boxed="all"); a \boxed{} answer wins over
# "final answer is" / plain LaTeX, and plain numbers/expressions are the fallback. (TRL's accuracy_reward turns off
# malformed_operators, which fails \frac43 or 11\sqrt2 on MATH-500.)
_MATH_CONFIG = (math_verify.LatexExtractionConfig(boxed_match_priority=0), math_verify.ExprExtractionConfig())
_NUMBER = re.compile(r"(?<![\d.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_THINK_FORMAT = re.compile(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", re.DOTALL)


def _text(completion) -> str:
    """Completion text: the string itself, or the content of the last chat message."""
    if isinstance(completion, str):
        return completion
    return completion[-1]["content"] or ""


def _column(completions, name, values) -> list:
    """The column `values` as a list, checked to hold one value per completion."""
    if values is None or isinstance(values, str) or len(values) != len(completions):
        got = "None" if values is None else "a str" if isinstance(values, str) else f"{len(values)} values"
        raise ValueError(f"reward column {name!r} needs one value per completion ({len(completions)}), got {got}")
    return list(values)


def _timeout() -> int | None:
    """math_verify timeout in seconds, or None (no timeout) off the main thread where signal.alarm fails."""
    return _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def math_accuracy(completions, answer, **kwargs) -> list[float | None]:
    """1.0 if the completion's final answer (\\boxed{} first) equals the LaTeX `answer` by math_verify, else 0.0.

    The gold is a bare answer such as `\\frac{14}{3}` or `\\left( 3, \\frac{\\pi}{2} \\right)` (wrapped in $...$ to
    parse) or a text holding $...$ / \\boxed{}; None if it does not parse to a math expression.
    """
    timeout = _timeout()
    rewards = []
    for completion, gold in zip(completions, _column(completions, "answer", answer)):
        if gold is None or gold != gold:  # a missing answer (None, or NaN from pandas): str() would parse as symbols
            rewards.append(None)
            continue
        gold = str(gold).strip()
        if not re.search(r"(?<!\\)\$|\\boxed|\\\(|\\\[", gold):
            gold = f"${gold}$"
        gold = math_verify.parse(gold, _MATH_CONFIG, fallback_mode="no_fallback", parsing_timeout=timeout)
        if not gold:
            rewards.append(None)
            continue
        pred = math_verify.parse(_text(completion), _MATH_CONFIG, parsing_timeout=timeout)
        rewards.append(float(math_verify.verify(gold, pred, timeout_seconds=timeout)))
    return rewards


def gsm8k_accuracy(completions, answer, **kwargs) -> list[float | None]:
    """1.0 if the completion's final number equals the gold number, else 0.0.

    Gold: the number after `####` (GSM8K solutions) or a bare number like "42"; None otherwise. Prediction: the first
    number after the last `####` if there is one, else the last number in the text ("1,000", "-3", "2.5", "$7." ok).
    """
    rewards = []
    for completion, gold in zip(completions, _column(completions, "answer", answer)):
        gold = str(gold).rsplit("####", 1)[-1].replace(",", "").replace("$", "").replace("\u2212", "-").strip()
        if not re.fullmatch(r"-?\d+(?:\.\d+)?", gold):
            rewards.append(None)
            continue
        text = _text(completion).replace("\u2212", "-")  # the Unicode minus sign some models write
        if "####" in text:
            numbers = _NUMBER.findall(text.rsplit("####", 1)[-1])[:1]
        else:
            numbers = _NUMBER.findall(text)[-1:]
        rewards.append(float(bool(numbers) and abs(float(numbers[0].replace(",", "")) - float(gold)) < 1e-6))
    return rewards


def think_format(completions, **kwargs) -> list[float]:
    """1.0 if the completion is exactly `<think>...</think>` then `<answer>...</answer>` (plus whitespace), else 0.0."""
    rewards = []
    for completion in completions:
        text = _text(completion)
        once = all(text.count(tag) == 1 for tag in ("<think>", "</think>", "<answer>", "</answer>"))
        rewards.append(float(once and _THINK_FORMAT.fullmatch(text) is not None))
    return rewards


def soft_overlong_punishment(
    completions, completion_ids, max_completion_length, overlong_buffer_length=None, **kwargs
) -> list[float]:
    """DAPO soft overlong punishment (arXiv 2503.14476, eq. 13) on the completion's token count.

    With L = len(ids), Lmax = max_completion_length, Lcache = overlong_buffer_length (default Lmax // 4):
    0 if L <= Lmax - Lcache, (Lmax - Lcache - L) / Lcache if L <= Lmax, else -1.
    """
    l_max = int(max_completion_length)
    l_cache = l_max // 4 if overlong_buffer_length is None else int(overlong_buffer_length)
    if not 0 < l_cache <= l_max:
        raise ValueError(f"need 0 < overlong_buffer_length <= max_completion_length, got {l_cache} and {l_max}")
    rewards = []
    for ids in _column(completions, "completion_ids", completion_ids):
        length = len(ids)
        if length <= l_max - l_cache:
            rewards.append(0.0)
        elif length <= l_max:
            rewards.append((l_max - l_cache - length) / l_cache)
        else:
            rewards.append(-1.0)
    return rewards


def keyword_reward(completions, keyword, **kwargs) -> list[float]:
    """1.0 if the row's `keyword` occurs in the completion as a whole word (case-insensitive), else 0.0."""
    rewards = []
    for completion, word in zip(completions, _column(completions, "keyword", keyword)):
        pattern = rf"(?<!\w){re.escape(str(word).strip())}(?!\w)"
        rewards.append(float(re.search(pattern, _text(completion), re.IGNORECASE) is not None))
    return rewards
