"""Run under `torchrun --nproc_per_node 2` on 2 GPUs (tests/gpu/test_colocate.py starts it): one colocated engine with
tensor parallelism 2 over both ranks, with sleep mode, as grpo.py builds it. Both ranks change their weights the same
way, sync them through vLLM's reload path (each rank's engine takes its own shard of the full tensors) and generate:
the engine's log-probs match the trainer's within 0.02 mean absolute, on both ranks. Model: $VLLM_TEST_TP_MODEL (default
/tmp/bench-qwen05b, the Qwen2.5-0.5B shape: its 14 heads split over 2 GPUs; SmolLM2-135M's 9 do not)."""

import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from gpu_helpers import QUESTIONS, change_weights, mean_abs_diff, record, trainer_logprobs  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import vllm_utils  # noqa: E402

MODEL = os.environ.get("VLLM_TEST_TP_MODEL", "/tmp/bench-qwen05b")
rank = int(os.environ["RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl")
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).cuda()
args = SimpleNamespace(
    vllm_mode="colocate",
    trust_remote_code=False,
    vllm_tensor_parallel_size=2,
    vllm_gpu_memory_utilization=0.3,
    vllm_max_model_len=512,
    vllm_enable_sleep_mode=True,
    seed=0,
    bf16=True,
    prompts_per_step=4,
    num_generations=4,
    max_completion_length=32,
    temperature=1.0,
    top_p=1.0,
    top_k=0,
    min_p=0.0,
    repetition_penalty=1.0,
)
engine = vllm_utils.start(args, MODEL, max_prompt_length=128)
vllm_utils.sleep(engine)
change_weights(model, tokenizer)  # the same steps on both ranks: the same weights
vllm_utils.sync_weights(engine, model)
prompts = [
    tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
    for q in QUESTIONS[rank::2]
]  # each rank its own prompts (rank 0 two, rank 1 one)
prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
completion_ids, vllm_lp = vllm_utils.generate(engine, prompts)
trainer_lp, mask = trainer_logprobs(model, [p for p in prompts for _ in range(4)], completion_ids, 1.0)
mean_diff, max_diff = mean_abs_diff(trainer_lp, vllm_lp, mask)
record(
    f"colocate_tp2_rank{rank}", {"model": MODEL, "logprob_mean_abs_diff": mean_diff, "logprob_max_abs_diff": max_diff}
)
assert len(completion_ids) == 4 * len(prompts) and mean_diff < 0.02, (rank, mean_diff)
dist.barrier()
if rank == 0:
    print("COLOCATE TP OK")
dist.destroy_process_group()
