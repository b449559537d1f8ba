"""One optimizer step of GRPO (each loss type), RLOO and Online DPO on a fixed global batch, run with `torchrun --nproc_per_node N tests/dist_step.py OUT`.
Each rank takes its contiguous share of the rows, the model is FSDP2-sharded when N > 1, the loss normalisers count
all ranks' rows and the loss is scaled by N (FSDP averages gradients), exactly as grpo.py's loop does. Rank 0 saves
the full gradients and updated weights for each loss type to OUT (tests/test_distributed.py compares N = 1 and 2)."""

import os
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import grpo  # noqa: E402

STORIES = os.path.join(os.path.dirname(__file__), "assets", "stories260K")
world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
if world_size > 1:
    dist.init_process_group("gloo")
torch.manual_seed(0)
# the global batch: 4 prompts x 2 completions of different lengths, fixed advantages and old log-probs
prompts = [torch.randint(3, 512, (n,)).tolist() for n in (5, 9, 3, 7)]
batch_prompts = [p for p in prompts for _ in range(2)]
batch_completions = [torch.randint(3, 512, (n,)).tolist() for n in (6, 2, 8, 4, 5, 7, 3, 6)]
advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.5, -1.5, 0.7, -0.7])
N = len(batch_prompts) // world_size
rows = list(range(rank * N, (rank + 1) * N))  # this rank's share of the rows
results = {}


def sharded_model(script, scale=1.0):
    """stories260K in fp32 (weights times `scale`), FSDP2-sharded as the script shards it when N > 1."""
    model = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    return script.shard_model(model, mixed_precision=False) if world_size > 1 else model


def micro_batch_logprobs(script, model):
    """This rank's micro-batches as the scripts form them (padding passes included, to keep FSDP's collectives in
    step), each with the policy's per-token log-probs and a fixed wave per (row, position) to offset old log-probs
    by, so that ratios leave the clip range: (micro_batch, padding_pass, logprobs, completion_mask, wave)."""
    micro_batches = script.token_budget_batches(
        rows, [len(p) for p in batch_prompts], [len(c) for c in batch_completions], 30
    )
    for micro_batch in script.same_count_on_all_ranks(micro_batches, world_size, "cpu"):
        padding_pass = micro_batch is None
        micro_batch = [rows[0]] if padding_pass else micro_batch
        ids, attn, pos, cmask, P = script.collate(
            [batch_prompts[i] for i in micro_batch], [batch_completions[i] for i in micro_batch], "cpu", 0
        )
        logprobs = script.per_token_logprobs(model, ids, attn, pos, cmask, P, temperature=0.8, chunk_tokens=5)
        wave = torch.sin(torch.tensor(micro_batch)[:, None] * 10.0 + torch.arange(cmask.shape[1])[None])
        yield micro_batch, padding_pass, logprobs, cmask, wave


def step_and_record(name, script, model, optimizer):
    """Keep the full gradients, take the optimizer step, keep the full updated weights (gathered from the shards)."""
    grads = {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
        for n, p in model.named_parameters()
    }
    optimizer.step()
    state, _ = script.full_state(model, None)
    results[name] = {"grads": grads, "weights": {k: v.clone() for k, v in state.items()}}


for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
    model = sharded_model(grpo)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    lengths = torch.tensor([len(batch_completions[i]) for i in rows])
    mask = (torch.arange(8)[None] < lengths[:, None]).float()  # (N, C) of this rank
    weights = grpo.policy_loss_weights(
        mask,
        loss_type,
        8,
        total_tokens=grpo.global_sum(mask.sum(), world_size, "cpu"),
        num_sequences=N * world_size,
        step_tokens=grpo.global_sum(mask.sum(), world_size, "cpu"),
    )
    for micro_batch, padding_pass, logprobs, cmask, wave in micro_batch_logprobs(grpo, model):
        loss, _ = grpo.policy_loss(logprobs, logprobs.detach() + 0.3 * wave, advantages[micro_batch], cmask, 0.2, 0.28)
        local = [i - rows[0] for i in micro_batch]
        ((loss * weights[local, : cmask.shape[1]]).sum() * (0 if padding_pass else world_size)).backward()
    step_and_record(loss_type, grpo, model, optimizer)

# RLOO (rloo.py): per-sequence loss, each sequence weighs 1 / (all ranks' sequences)
import rloo  # noqa: E402

model = sharded_model(rloo)
optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
for micro_batch, padding_pass, logprobs, cmask, wave in micro_batch_logprobs(rloo, model):
    loss, _ = rloo.sequence_policy_loss(
        logprobs, logprobs.detach() + 0.05 * wave, advantages[micro_batch], cmask, 0.2, 0.2
    )
    ((loss / (N * world_size)).sum() * (0 if padding_pass else world_size)).backward()
step_and_record("rloo", rloo, model, optimizer)

# Online DPO (online_dpo.py): rows (2i, 2i + 1) of the batch form pair i; every pair weighs 1 / (all ranks' pairs)
import online_dpo  # noqa: E402

model = sharded_model(online_dpo)
reference = sharded_model(online_dpo, scale=1.05)  # a reference that differs from the policy, so that z != 0
optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
pairs = [(r, r + 1) for r in rows[::2]]  # this rank's pairs
micro_batches = online_dpo.same_count_on_all_ranks([[j] for j in range(len(pairs))], world_size, "cpu")  # a pair each
for micro_batch in micro_batches:
    padding_pass = micro_batch is None
    mb_rows = (
        [rows[0], rows[0]] if padding_pass else [pairs[j][0] for j in micro_batch] + [pairs[j][1] for j in micro_batch]
    )
    prompts_, completions_ = [batch_prompts[i] for i in mb_rows], [batch_completions[i] for i in mb_rows]
    with torch.no_grad(), online_dpo.unsharded(reference, world_size):
        ref = online_dpo.sequence_logprobs(reference, prompts_, completions_, 0.8, "cpu", 0).view(2, -1)
    policy = online_dpo.sequence_logprobs(model, prompts_, completions_, 0.8, "cpu", 0).view(2, -1)
    losses = online_dpo.dpo_loss(policy[0], policy[1], ref[0], ref[1], 0.1, "sigmoid")
    (losses.sum() / (len(pairs) * world_size) * (0 if padding_pass else world_size)).backward()
step_and_record("online_dpo", online_dpo, model, optimizer)

if rank == 0:
    torch.save(results, sys.argv[1])
if world_size > 1:
    dist.destroy_process_group()
