"""Summarize py-spy raw profiles (`py-spy record --subprocesses --threads -f raw`) of a `vllm serve` during rounds:
per process and thread, the active samples, then the functions with the most samples of their own (self) and in all
(inclusive). Usage: python benchmarks/spy_summary.py SPY.txt [SPY.txt ...] [--top N]"""

import collections
import re
import sys


def parse(path):
    """{(process, thread): Counter of stacks (tuples of frames, outermost first)}."""
    by_thread = collections.defaultdict(collections.Counter)
    for line in open(path):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        processes = re.findall(r'process (\d+):"([^"]*)";?', stack)  # a command line may hold ";"
        pid, command = processes[-1] if processes else ("?", "")
        frames = re.sub(r'process \d+:"[^"]*";?', "", stack).split(";")
        title = next((word for word in command.split() if "VLLM" in word or "EngineCore" in word), None)
        name = f"{pid} {title or ' '.join(command.split()[1:4])[:70]}"
        threads = [f for f in frames if f.startswith("thread ")]
        code = [f for f in frames if not f.startswith(("process ", "thread "))]
        by_thread[(name, threads[-1] if threads else "")][tuple(code)] += int(count)
    return by_thread


def short(frame):
    """`func (path/to/file.py:123)` -> `func (file.py)`: lines differ between calls of one function."""
    return re.sub(r"\(([^()]*/)?([^/():]+):\d+\)$", r"(\2)", frame)


def main(paths, top=12):
    for path in paths:
        print(f"# {path}")
        for (process, thread), stacks in sorted(parse(path).items(), key=lambda item: -sum(item[1].values())):
            total = sum(stacks.values())
            if total < 20:
                continue
            own, inclusive = collections.Counter(), collections.Counter()
            for stack, n in stacks.items():
                if stack:
                    own[short(stack[-1])] += n
                for frame in {short(f) for f in stack}:
                    inclusive[frame] += n
            print(f"\n## {process} {thread}: {total} active samples")
            print("self:      " + "; ".join(f"{f} {100 * n / total:.0f}%" for f, n in own.most_common(top)))
            print("inclusive: " + "; ".join(f"{f} {100 * n / total:.0f}%" for f, n in inclusive.most_common(top + 8)))
        print()


if __name__ == "__main__":
    args = sys.argv[1:]
    top = int(args[args.index("--top") + 1]) if "--top" in args else 12
    main([a for i, a in enumerate(args) if a != "--top" and (i == 0 or args[i - 1] != "--top")], top)
