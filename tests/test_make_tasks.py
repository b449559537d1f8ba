"""benchmarks/make_tasks.py: the addition task's eval prompts are held out (their (a, b) pairs, in either order, never
occur in the training file), the training file keeps its format, and bench.jsonl is unchanged."""

import hashlib
import json
import re
import subprocess
import sys

from grpo_cli import ROOT

PROMPT = re.compile(r"What is (\d+) \+ (\d+)\? Reply with only the number\.")


def read_pairs(path):
    """The (a, b) of every row of an addition file, after checking the row's format and answer."""
    pairs = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        assert sorted(row) == ["answer", "prompt"]
        (message,) = row["prompt"]
        assert message["role"] == "user"
        a, b = map(int, PROMPT.fullmatch(message["content"]).groups())
        assert 1 <= a <= 30 and 1 <= b <= 30 and row["answer"] == str(a + b)
        pairs.append((a, b))
    return pairs


def test_eval_pairs_held_out(tmp_path):
    subprocess.run([sys.executable, ROOT / "benchmarks" / "make_tasks.py", tmp_path], check=True, capture_output=True)
    train, held = read_pairs(tmp_path / "addition.jsonl"), read_pairs(tmp_path / "addition_eval.jsonl")
    assert len(train) == 2000 and len(held) == 200 == len(set(held))
    assert not set(train) & set(held)
    assert not {(b, a) for a, b in train} & set(held)  # not even reversed
    assert len(set(train)) > 650  # 2000 draws cover nearly all of the 700 training pairs
    assert {(a, b) for a in range(1, 31) for b in range(1, 31)} - set(held) >= set(train)
    # bench.jsonl is the one the speed results were measured on
    digest = hashlib.sha256((tmp_path / "bench.jsonl").read_bytes()).hexdigest()
    assert digest == "049db10b515840f70b2e0a573b9acd29dc3f8cee4d0ee51a349592c5146ad9a9"
