"""Turn the run folders written by benchmarks/gpu_phase.sh into benchmarks/results/*.json.
Usage: python benchmarks/summarize.py RESULTS_DIR [RESULTS_DIR ...]   (each holds <run>/metrics.jsonl + <run>.log)"""

import json
import os
import statistics
import sys

TRL_1_16 = {  # seconds per step (or reward) that TRL 1.16 reached on the same task, sizes and hosts (issue text)
    "addition_server": {"reward_first": 0.08, "reward_last": 0.84, "s_per_step": 0.97, "note": "TRL ran colocate"},
    "addition_colocate": {"reward_first": 0.08, "reward_last": 0.84, "s_per_step": 0.97},
    "rloo_colocate": {"reward_first": 0.08, "reward_last": 0.60, "s_per_step": 0.95, "note": "RLOOTrainer, 60 steps"},
    "rloo_server": {"reward_first": 0.08, "reward_last": 0.60, "s_per_step": 0.95, "note": "RLOOTrainer ran colocate"},
    "online_dpo_colocate": {
        "reward_first": 0.13,
        "reward_last": 0.13,
        "note": "OnlineDPOTrainer, 2 samples, lr 1e-5, step 1 and step 60",
    },
    "online_dpo_colocate_g2": {
        "reward_first": 0.13,
        "reward_last": 0.13,
        "note": "OnlineDPOTrainer, 2 samples, lr 1e-5, step 1 and step 60",
    },
    "bench_server": {"s_per_step": 7.32},
    "bench_colocate": {"s_per_step": 7.72},
    "bench_no_vllm": {"s_per_step": 12.41},
}


def flag(command, name):
    """The integer value of a --flag in a logged command line."""
    words = command.split()
    return int(words[words.index(name) + 1])


out_dir = os.path.join(os.path.dirname(__file__), "results")
os.makedirs(out_dir, exist_ok=True)
for results in sys.argv[1:]:
    for name in sorted(os.listdir(results)):
        path = os.path.join(results, name, "metrics.jsonl")
        if not os.path.exists(path):
            continue
        rows = [json.loads(line) for line in open(path)]
        log = open(os.path.join(results, f"{name}.log")).read()
        command = log.splitlines()[0].removeprefix(f"== {name}: ")
        rewards = [
            r["reward"] if "reward" in r else r["objective/scores"] for r in rows
        ]  # online_dpo: mean sample reward
        window = rows[2:8] if name.startswith("bench") else rows  # bench: median of steps 3-8
        summary = {
            "run": name,
            "command": command,
            "steps": len(rows),
            "reward_first_5": statistics.mean(rewards[:5]),
            "reward_last_5": statistics.mean(rewards[-5:]),
            "s_per_step_median": statistics.median(r["step_time"] for r in window),
            "generation_s_median": statistics.median(r["timing/generation"] for r in window),
            "weight_sync_s_median": statistics.median(r["timing/weight_sync"] for r in window),
            # generated tokens per second of generation time: completions per step x mean length / generation time
            "generation_tokens_per_s_median": statistics.median(
                flag(command, "--prompts-per-step")
                * flag(command, "--num-generations")
                * r["completions/mean_length"]
                / r["timing/generation"]
                for r in window
            ),
            "sampling_logp_difference_mean_last_5": statistics.mean(
                r.get("sampling/sampling_logp_difference/mean", float("nan")) for r in rows[-5:]
            ),
            "reward_curve": rewards,
            "s_per_step_curve": [r["step_time"] for r in rows],
            "trl_1_16": TRL_1_16.get(name),
        }
        if summary["trl_1_16"] and "s_per_step" in summary["trl_1_16"]:
            summary["s_per_step_ratio_vs_trl"] = summary["s_per_step_median"] / summary["trl_1_16"]["s_per_step"]
        with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
            json.dump(summary, f, indent=1)
        print(
            f"{name}: reward {summary['reward_first_5']:.3f} -> {summary['reward_last_5']:.3f}, "
            f"{summary['s_per_step_median']:.2f} s/step, ratio vs TRL {summary.get('s_per_step_ratio_vs_trl', float('nan')):.2f}"
        )
