"""TRL 1.16 on the addition task, for learning curves beside ours on the same host (`benchmarks/one_gpu.sh eval`).

Run on the GPU host after `source .gpu/setup.sh` (TRL 1.16 comes with .gpu/extra; /tmp/tasks from make_tasks.py):
    CUDA_VISIBLE_DEVICES=1 python3 benchmarks/trl_addition.py grpo|rloo|online_dpo OUT_DIR
Writes OUT_DIR/metrics.jsonl, one row per optimizer step, in the format benchmarks/plot.py reads:
    {"step", "reward", "time" (s since train() began), "step_time" (s since the previous row), "trl/<key>": ...}
(reward: the step's mean reward, TRL's "reward", or for online_dpo its "objective/scores"; trl/...: all TRL logged.)

Workload, as in our runs: /tmp/smol (SmolLM2-135M-Instruct), /tmp/tasks/addition.jsonl (conversational prompts,
answer column), our rewards.gsm8k_accuracy (TRL passes conversational completions as [{"role": "assistant", ...}],
which it reads), 32 new tokens, lr 1e-5, 100 optimizer steps, vLLM colocated without sleep mode, float32 weights
under bf16 autocast as ours (--param-dtype float32; TRL's OnlineDPOTrainer would otherwise load the bf16 checkpoint
as bf16). Per step:
  grpo, rloo:  16 prompts x 8 completions (per-device batch 32 x 4 accumulation steps = one generation of 128);
               everything else TRL's defaults (GRPO: loss dapo, beta 0; RLOO: beta 0.05, KL in the reward, as ours).
  online_dpo:  64 prompts x 2 completions: TRL 1.16's OnlineDPOTrainer samples exactly 2 per prompt (hard-coded,
               experimental/online_dpo); ours uses 4 (best vs worst). beta 0.1, temperature 1.0 as our recipe.
Env: VLLM_MEM (vLLM's share of the GPU, default 0.07), MAX_STEPS (default 100).
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # rewards.py

ALGOS = ("grpo", "rloo", "online_dpo")
MODEL, DATA = "/tmp/smol", "/tmp/tasks/addition.jsonl"


def configs(algo, out):
    """The TRL config's keyword arguments for `algo` (tests/test_trl_addition.py checks each key against TRL 1.16)."""
    common = dict(
        output_dir=out,
        learning_rate=1e-5,
        max_steps=int(os.environ.get("MAX_STEPS", "100")),
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        bf16=True,
        seed=0,
        model_init_kwargs={"dtype": "float32"},
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=float(os.environ.get("VLLM_MEM", "0.07")),
    )
    if algo == "online_dpo":
        return dict(
            common,
            per_device_train_batch_size=64,  # prompts; 2 completions each
            gradient_accumulation_steps=1,
            max_new_tokens=32,
            temperature=1.0,
            beta=[0.1],
        )
    return dict(
        common,
        per_device_train_batch_size=32,  # completions per micro-batch
        gradient_accumulation_steps=4,  # 4 x 32 = 128 = 16 prompts x 8: one generation per optimizer step
        num_generations=8,
        max_completion_length=32,
        vllm_max_model_length=512,
    )


def main(algo, out):
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback

    from rewards import gsm8k_accuracy

    class Metrics(TrainerCallback):
        """One metrics.jsonl row per logged step (logging_steps=1: every optimizer step)."""

        def __init__(self, path):
            self.file, self.start, self.last = open(path, "w"), None, None

        def on_train_begin(self, args, state, control, **kwargs):
            self.start = self.last = time.time()

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = logs or {}
            reward = logs.get("reward", logs.get("objective/scores"))
            if reward is None:  # the end-of-training summary (train_runtime, ...)
                return
            torch.cuda.synchronize()
            now = time.time()
            row = {"step": state.global_step, "reward": reward, "time": now - self.start, "step_time": now - self.last}
            row.update({f"trl/{k}": v for k, v in logs.items() if isinstance(v, int | float)})
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
            self.last = now

    os.makedirs(out, exist_ok=True)
    with open(DATA) as f:  # no datasets cache: three of these start at once
        dataset = Dataset.from_list([json.loads(line) for line in f])
    kwargs = dict(
        model=MODEL, reward_funcs=gsm8k_accuracy, train_dataset=dataset, callbacks=[Metrics(f"{out}/metrics.jsonl")]
    )
    if algo == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        trainer = GRPOTrainer(args=GRPOConfig(**configs(algo, out)), **kwargs)
    elif algo == "rloo":
        from trl import RLOOConfig, RLOOTrainer

        trainer = RLOOTrainer(args=RLOOConfig(**configs(algo, out)), **kwargs)
    else:
        from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

        tokenizer = AutoTokenizer.from_pretrained(MODEL)  # OnlineDPOTrainer requires a processing_class
        trainer = OnlineDPOTrainer(args=OnlineDPOConfig(**configs(algo, out)), processing_class=tokenizer, **kwargs)
    print(f"trl_addition {algo}: trainer ready", flush=True)
    start = time.time()
    trainer.train()
    print(f"trl_addition {algo}: trained {trainer.state.global_step} steps in {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ALGOS:
        sys.exit(f"usage: python3 benchmarks/trl_addition.py {'|'.join(ALGOS)} OUT_DIR")
    main(sys.argv[1], sys.argv[2])
