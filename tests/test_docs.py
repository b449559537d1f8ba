"""README.md stays a front door: at most 15 KB, no dead relative links in it or in docs/*.md (files and `#heading`
anchors, by GitHub's slug rules), and its file table gives each script's current size and where to start reading
(the line of the ALGO LOGIC banner and of `def train(`)."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
PAGES = [README] + sorted(os.path.join(DOCS, name) for name in os.listdir(DOCS) if name.endswith(".md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)
# | [`grpo.py`](grpo.py) | 1873 | ... | ALGO LOGIC: line 269, `def train(`: line 377 |
TABLE_ROW = re.compile(r"^\| \[`([\w.]+\.py)`\]\([^)]*\) \| (\d+) \|(.*)\|$")
START = re.compile(r"ALGO LOGIC: line (\d+), `def train\(`: line (\d+)")


def prose_lines(path):
    """The file's lines outside fenced code blocks, inline code removed."""
    inside_fence = False
    for line in open(path, encoding="utf-8").read().splitlines():
        if line.lstrip().startswith("```"):
            inside_fence = not inside_fence
        elif not inside_fence:
            yield re.sub(r"`[^`]*`", "", line)


def heading_anchors(path):
    """GitHub's anchors of the file's headings: the text lowercased, punctuation dropped (letters, digits, spaces,
    `-` and `_` stay), spaces made `-`; a repeated anchor gets -1, -2, ..."""
    anchors, text = set(), open(path, encoding="utf-8").read()
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)  # no headings inside code blocks
    for heading in re.findall(r"^#{1,6} +(.+?) *#* *$", text, flags=re.M):
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


def test_readme_is_at_most_15_kb():
    assert os.path.getsize(README) <= 15_000, f"README.md is {os.path.getsize(README)} bytes: move details to docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_resolve(page):
    dead = []
    for line in prose_lines(page):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            file = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(file):
                dead.append(f"{target}: no file {os.path.relpath(file, ROOT)}")
            elif anchor and file.endswith(".md") and anchor not in heading_anchors(file):
                dead.append(f"{target}: no heading with anchor #{anchor} in {os.path.relpath(file, ROOT)}")
    assert not dead, "dead links in " + os.path.relpath(page, ROOT) + ":\n  " + "\n  ".join(dead)


def test_file_table_matches_the_files():
    rows = {}
    for line in open(README, encoding="utf-8").read().splitlines():
        if match := TABLE_ROW.match(line):
            rows[match[1]] = (int(match[2]), match[3])
    assert {"grpo.py", "rloo.py", "online_dpo.py"} <= set(rows), "README.md's file table lacks a script"
    # a fork adds its rewards to rewards.py: a size stated (and pinned here) would fail its CI for that alone
    assert "rewards.py" not in rows, "README.md's file table states rewards.py's size: leave it out (forks grow it)"
    stale = []
    for name, (size, rest) in rows.items():
        lines = open(os.path.join(ROOT, name), encoding="utf-8").read().splitlines()
        if size != len(lines):
            stale.append(f"{name}: {size} lines in the table, {len(lines)} in the file")
        if name in ("grpo.py", "rloo.py", "online_dpo.py"):
            # the first top-level comment naming ALGO LOGIC, and the loop
            algo = next(i for i, line in enumerate(lines, 1) if line.startswith("#") and "ALGO LOGIC" in line)
            train = next(i for i, line in enumerate(lines, 1) if line.startswith("def train("))
            start = START.search(rest)
            if start is None or (int(start[1]), int(start[2])) != (algo, train):
                stale.append(f"{name}: the table should say ALGO LOGIC: line {algo}, `def train(`: line {train}")
    assert not stale, "README.md's file table is stale:\n  " + "\n  ".join(stale)
