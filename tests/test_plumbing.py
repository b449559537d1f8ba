"""The PLUMBING block (everything below the banner line) is byte-identical in grpo.py, rloo.py and online_dpo.py.

A change to the block is made in grpo.py, then copied into the other two by

    python tests/test_plumbing.py --write

and this test fails, with a diff, whenever one copy differs from grpo.py's."""

import difflib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BANNER = "# ==== PLUMBING: identical in grpo.py, rloo.py and online_dpo.py (tests/test_plumbing.py) ===="
MASTER, COPIES = "grpo.py", ["rloo.py", "online_dpo.py"]


def split(text, name="script"):
    """(what is above the banner, the block from the banner line to the end of the file)."""
    if text.count(BANNER + "\n") != 1:
        raise ValueError(f"{name} must hold the banner line exactly once:\n{BANNER}")
    above, below = text.split(BANNER + "\n")
    return above, BANNER + "\n" + below


def block_diff(master_text, copy_text, copy_name):
    """The unified diff of copy_name's block against grpo.py's ('' when they are equal), with the files' line numbers."""
    (master_above, master), (copy_above, copy) = split(master_text, MASTER), split(copy_text, copy_name)
    lines = difflib.unified_diff(master.splitlines(True), copy.splitlines(True), MASTER, copy_name, n=2)
    offsets = master_above.count("\n"), copy_above.count("\n")
    renumber = lambda m: f"@@ -{int(m[1]) + offsets[0]}{m[2]} +{int(m[3]) + offsets[1]}{m[4]} @@"
    return "".join(re.sub(r"^@@ -(\d+)(,\d+)? \+(\d+)(,\d+)? @@", renumber, line) for line in lines)


def test_the_block_is_identical_in_the_three_scripts():
    master = (ROOT / MASTER).read_text()
    diffs = [block_diff(master, (ROOT / name).read_text(), name) for name in COPIES]
    assert not any(diffs), (
        "the PLUMBING blocks differ (python tests/test_plumbing.py --write copies grpo.py's):\n" + "".join(diffs)
    )


def test_an_edited_copy_fails_with_a_diff():
    master = (ROOT / MASTER).read_text()
    edited = master.replace("def clock(device):", "def clock(device):  # edited", 1)
    assert edited != master
    diff = block_diff(master, edited, "rloo.py")
    assert "-def clock(device):\n" in diff and "+def clock(device):  # edited\n" in diff
    line = master.splitlines().index("def clock(device):") + 1  # the hunk names the files' own line numbers
    assert re.search(rf"^@@ -{line - 2},\d+ \+{line - 2},\d+ @@", diff, re.MULTILINE), diff
    assert block_diff(master, master, "rloo.py") == ""
    # a script without its banner is an error, not an empty block that matches nothing
    try:
        split(master.replace(BANNER, "# plumbing"), "rloo.py")
    except ValueError as error:
        assert "rloo.py must hold the banner line exactly once" in str(error)
    else:
        raise AssertionError("a missing banner was not reported")


def write():
    """Copy grpo.py's block into rloo.py and online_dpo.py, keeping what is above their banners."""
    block = split((ROOT / MASTER).read_text(), MASTER)[1]
    for name in COPIES:
        path = ROOT / name
        above = split(path.read_text(), name)[0]
        if above + block != path.read_text():
            path.write_text(above + block)
            print(f"copied grpo.py's PLUMBING block into {name}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit(f"usage: python {sys.argv[0]} --write   (copies grpo.py's PLUMBING block into {COPIES})")
    write()
