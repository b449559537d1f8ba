"""Write the two GPU workloads as jsonl files (usage: python benchmarks/make_tasks.py OUT_DIR).

addition.jsonl  "What is {a} + {b}? Reply with only the number." as a chat message, a, b uniform in [1, 30]
                (seed 0), answer a + b: the learning task (reward: gsm8k_accuracy = last number equals the answer).
bench.jsonl     bench-0.5b prompts, plain text: prompt i = the 60 words words[(7*i + j) % 19], j = 0..59, then " i".
"""

import json
import os
import random
import sys

out = sys.argv[1] if len(sys.argv) > 1 else "benchmarks/data"
os.makedirs(out, exist_ok=True)
rng = random.Random(0)
with open(os.path.join(out, "addition.jsonl"), "w") as f:
    for _ in range(2000):
        a, b = rng.randint(1, 30), rng.randint(1, 30)
        prompt = [{"role": "user", "content": f"What is {a} + {b}? Reply with only the number."}]
        f.write(json.dumps({"prompt": prompt, "answer": str(a + b)}) + "\n")
words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()
with open(os.path.join(out, "bench.jsonl"), "w") as f:
    for i in range(512):
        prompt = " ".join(words[(7 * i + j) % 19] for j in range(60)) + f" {i}"
        f.write(json.dumps({"prompt": prompt, "keyword": "alpha"}) + "\n")
print("wrote", out)
