"""Reward functions: `fn(completions, **columns) -> list[float | None]`.

`completions` holds strings or chat messages (the last message's content is scored). Dataset columns arrive as
keyword lists aligned with `completions`; the trainer also passes `prompts`, `completion_ids`,
`max_completion_length` and any `--reward-kwargs`, so every reward takes `**kwargs`. None means "cannot score this
sample" (e.g. unparseable gold) and the trainer skips it. A reward is a public function whose first parameter is
`completions` (--reward-funcs names it); the trainer's side (functions by name, calling them with the dataset's
columns, checking their signatures against those columns) is at the end of the file.
"""

import inspect
import re
import threading

import math_verify
import torch

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
    """1.0 if the row's `keyword` occurs in the completion as a whole word (case-insensitive), else 0.0. `keyword` is a
    dataset column or one word for every row (--reward-kwargs keyword play)."""
    keywords = [keyword] * len(completions) if isinstance(keyword, str) else _column(completions, "keyword", keyword)
    rewards = []
    for completion, word in zip(completions, keywords):
        pattern = rf"(?<!\w){re.escape(str(word).strip())}(?!\w)"
        rewards.append(float(re.search(pattern, _text(completion), re.IGNORECASE) is not None))
    return rewards


def first_word_reward(completions, answer, partial=0.5, **kwargs) -> list[float]:
    """1.0 if the completion's first word is the one-word `answer` (case and punctuation aside), else partial credit:
    `partial` times the share of the answer's letters that the word starts with, so that RL has a way towards an answer
    the model never says yet (the colour of an image in docs/vision.md's recipe)."""
    rewards = []
    for completion, gold in zip(completions, _column(completions, "answer", answer)):
        word, gold = (_text(completion).split() or [""])[0].strip(".,!?;:\"'").lower(), str(gold).strip().lower()
        prefix = next((i for i, (a, b) in enumerate(zip(word, gold)) if a != b), min(len(word), len(gold)))
        rewards.append(1.0 if word == gold else float(partial) * prefix / max(len(gold), 1))
    return rewards


# ------------------------------------------------------------------------------------------------------------------
# The trainer's side: the reward functions that --reward-funcs names, their arguments, their scores


def is_reward(fn) -> bool:
    """A reward is a public function of this module whose first parameter is `completions`."""
    if not inspect.isfunction(fn) or fn.__module__ != __name__ or fn.__name__.startswith("_"):
        return False
    return list(inspect.signature(fn).parameters)[:1] == ["completions"]


def functions(names) -> list:
    """The reward functions that --reward-funcs names, in order; exits with the valid names on an unknown one."""
    found = {name: fn for name, fn in globals().items() if is_reward(fn)}
    for name in names:
        if name not in found:
            raise SystemExit(
                f"error: unknown reward function '{name}'. --reward-funcs takes names from rewards.py: {sorted(found)}"
            )
    return [found[name] for name in names]


def missing_argument(reward_fns, given):
    """(function, parameter) of the first required parameter that no name in `given` (the keywords the trainer passes:
    the dataset's columns and its own) fills, or None if every reward function gets all it requires."""
    for fn in reward_fns:
        for p in inspect.signature(fn).parameters.values():
            required = p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            if required and p.name not in given:
                return fn, p.name
    return None


def check_arguments(reward_fns, columns, source, args):
    """Exit unless each reward function finds every argument it requires among the `columns` of dataset `source` (all
    but --prompt-column, --answer-column's as `answer`), what the trainer passes and --reward-kwargs, which replace
    none of those."""
    answer_column, reward_kwargs = args.answer_column, args.reward_kwargs
    given = set(columns) - {args.prompt_column, answer_column} | ({"answer"} if answer_column else set())
    given |= {"completions", "prompts", "completion_ids", "max_completion_length"}
    if clash := sorted(given & set(reward_kwargs)):
        raise SystemExit(
            f"error: --reward-kwargs {clash[0]} would replace the reward functions' argument of that name (a column of "
            f"{source}, or one the trainer passes: {sorted(given)}): use another keyword"
        )
    if missing := missing_argument(reward_fns, given | set(reward_kwargs)):
        fn, needed = missing[0].__name__, missing[1]
        what, fix = f"a column '{needed}', which {source} does not have", "pass other --reward-funcs or data"
        if needed == "answer":
            what, fix = f"the reference answer, and --answer-column '{answer_column}' gives none", "pass one"
        raise SystemExit(f"error: reward function '{fn}' (--reward-funcs) needs {what} (its columns: {columns}): {fix}")


def takes_images(fn) -> bool:
    """Whether a reward function names an `images` parameter: only such functions get the prompts' images."""
    return "images" in inspect.signature(fn).parameters


def score(reward_fns, completions, columns):
    """Call each reward function with the completions and, by name, the keyword `columns` (`images` only if it names
    them); returns the scores (num_completions, num_funcs) with NaN where a function gave None."""
    scores = torch.full((len(completions), len(reward_fns)), float("nan"))
    for k, fn in enumerate(reward_fns):
        try:
            given = columns if takes_images(fn) else {c: v for c, v in columns.items() if c != "images"}
            values = fn(completions=completions, **given)
        except Exception as error:
            raise RuntimeError(
                f"reward function '{fn.__name__}' raised {type(error).__name__}: {error}. It receives completions and "
                f"the keyword columns {sorted(columns)}; fix the function or the dataset columns it reads."
            ) from error
        if len(values) != len(completions):
            raise ValueError(
                f"reward function '{fn.__name__}' returned {len(values)} values for {len(completions)} completions"
            )
        scores[:, k] = torch.tensor([float("nan") if v is None else float(v) for v in values])
    return scores
