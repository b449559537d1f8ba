"""Write the GPU workloads as jsonl files (usage: python benchmarks/make_tasks.py OUT_DIR).

addition.jsonl       "What is {a} + {b}? Reply with only the number." as a chat message, answer a + b: the learning
                     task (reward: gsm8k_accuracy = last number equals the answer). 2000 rows, (a, b) drawn uniformly
                     (seed 0) from the 700 training pairs below.
addition_eval.jsonl  the same prompt for each of the 200 held-out pairs (one row each, shuffled): the eval set.
                     a, b in [1, 30] give only 900 ordered pairs, so a random split of rows would not be held out;
                     the pairs are split instead. 100 unordered pairs {a, b} with a < b (seed 15) are held out in both
                     orders, so no eval prompt occurs in training, not even as b + a; the other 700 train.
bench.jsonl          bench-0.5b prompts, plain text: prompt i = the 60 words words[(7*i + j) % 19], j = 0..59, then " i".
"""

import json
import os
import random
import sys

NUMBERS = range(1, 31)
EVAL_UNORDERED_PAIRS = 100  # held out in both orders: 200 eval prompts


def split_pairs():
    """(training pairs, eval pairs): the 900 ordered pairs (a, b), a, b in [1, 30], split 700 / 200; a pair and its
    reverse are always on the same side."""
    unordered = [(a, b) for a in NUMBERS for b in NUMBERS if a < b]
    held = random.Random(15).sample(unordered, EVAL_UNORDERED_PAIRS)
    eval_pairs = [(a, b) for a, b in held] + [(b, a) for a, b in held]
    random.Random(16).shuffle(eval_pairs)  # both orders of a pair are not neighbours in the file
    held_out = set(eval_pairs)
    train_pairs = [(a, b) for a in NUMBERS for b in NUMBERS if (a, b) not in held_out]
    return train_pairs, eval_pairs


def addition_row(a, b):
    prompt = [{"role": "user", "content": f"What is {a} + {b}? Reply with only the number."}]
    return json.dumps({"prompt": prompt, "answer": str(a + b)}) + "\n"


def main(out):
    os.makedirs(out, exist_ok=True)
    train_pairs, eval_pairs = split_pairs()
    rng = random.Random(0)
    with open(os.path.join(out, "addition.jsonl"), "w") as f:
        for _ in range(2000):
            f.write(addition_row(*rng.choice(train_pairs)))
    with open(os.path.join(out, "addition_eval.jsonl"), "w") as f:
        for a, b in eval_pairs:
            f.write(addition_row(a, b))
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()
    with open(os.path.join(out, "bench.jsonl"), "w") as f:
        for i in range(512):
            prompt = " ".join(words[(7 * i + j) % 19] for j in range(60)) + f" {i}"
            f.write(json.dumps({"prompt": prompt, "keyword": "alpha"}) + "\n")
    print("wrote", out)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/data")
