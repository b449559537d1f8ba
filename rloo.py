# REINFORCE Leave-One-Out (RLOO) in one file. Docs: README.md, section "rloo.py".
"""REINFORCE Leave-One-Out for language models, with vLLM or Hugging Face `generate` for sampling.

Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human Feedback in
LLMs" (arXiv 2402.14740): sample k completions per prompt and use, as each completion's baseline, the mean reward of
the other k - 1. The whole completion is one action: sequence-level log-probabilities, the KL penalty to the frozen
reference model folded into the reward (k1, as in the paper; --no-kl-in-reward puts a k3 KL in the loss instead), and a
PPO-style clipped sequence ratio when a batch is reused (--num-iterations > 1). The options are grouped as in
README.md's table (grpo.py); a run writes its model, checkpoints and metrics.jsonl to --output-dir, which it keeps
to itself.

Example, on the CPU (about 25 seconds on 2 CPU cores, no download): the bundled 260K-parameter TinyStories model is
rewarded for the word "play" and, within a few steps, writes little else ("play play play ..."):
  OMP_NUM_THREADS=1 python rloo.py --model-name-or-path tests/assets/stories260K \\
      --dataset-name tests/assets/stories_prompts.jsonl --prompt-column prompt --answer-column "" \\
      --reward-funcs keyword_reward --no-use-chat-template --num-generations 4 --beta 0 --learning-rate 3e-3 \\
      --max-completion-length 24 --max-steps 30 --no-bf16 --output-dir runs/quickstart-rloo

More examples:
  # one GPU, vLLM inside the training process
  python rloo.py --use-vllm --vllm-mode colocate --vllm-enable-sleep-mode
  # trainer on GPU 0, a stock vLLM server on GPU 1 (README.md, "Using vLLM")
  python rloo.py --use-vllm --vllm-mode server
"""

import ast
import atexit
import dataclasses
import fcntl
import functools
import inspect
import itertools
import json
import os
import random
import re
import shutil
import signal
import socket
import sys
import textwrap
import threading
import time
import uuid
from collections import defaultdict, namedtuple
from concurrent.futures import Future
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from functools import partial
from typing import Annotated, Literal

import numpy as np
import torch
import torch.distributed as dist
import tyro
from tqdm import tqdm

import rewards
import vllm_utils


@dataclass
class Args:
    # Experiment
    exp_name: str = "rloo"
    """name of this experiment (used in the run name)"""
    seed: int = 1
    """seed of the experiment: prompt order, sampling and initialisation"""
    track: bool = False
    """log metrics to Weights & Biases"""
    wandb_project_name: str = "vllm-rl"
    """the wandb project name"""
    wandb_entity: str | None = None
    """the wandb entity (team)"""
    output_dir: str = "runs/rloo"
    """where checkpoints, metrics.jsonl and the final model + tokenizer are written"""

    # Model
    model_name_or_path: str = "Qwen/Qwen2.5-0.5B-Instruct"
    """Hugging Face causal LM: a hub name or a local path"""
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of the trained weights (float32 keeps small AdamW updates from rounding away; see --bf16)"""
    bf16: bool = True
    """run forward/backward under bfloat16 autocast on CUDA (ignored on the CPU)"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory"""
    torch_compile: bool = True
    """torch.compile each decoder layer's forward (CUDA, with --use-vllm, one process): forward + backward of a
    bench-0.5b step 1.15 -> 0.87 s on an H200; step 1 compiles (~30 s)"""
    use_chat_template: bool = True
    """wrap plain-text prompts as a user message and apply the tokenizer's chat template (if it has one)"""
    system_prompt: str | None = None
    """optional system message put before every prompt"""

    # Data
    dataset_name: str = "openai/gsm8k"
    """hub dataset name, or a local .json / .jsonl / .parquet file"""
    dataset_config: str | None = "main"
    """dataset configuration name (hub datasets only)"""
    dataset_split: str = "train"
    """split to train on"""
    prompt_column: str = "question"
    """column holding the prompt: a string, or a list of chat messages"""
    answer_column: str = "answer"
    """column holding the reference answer, passed to rewards as `answer` ("" if there is none)"""
    max_prompt_length: int | None = None
    """drop prompts with more tokens than this (None = keep all, and an over-long prompt is an error)"""

    # Generation
    num_generations: int = 2
    """k: completions sampled per prompt (each one's baseline is the mean reward of the other k - 1)"""
    prompts_per_step: int = 16
    """unique prompts per generation round (the round is num_prompts x G completions)"""
    max_completion_length: int = 512
    """maximum new tokens per completion"""
    temperature: float = 1.0
    """sampling temperature (training log-probs are computed at the same temperature)"""
    top_p: float = 1.0
    """nucleus sampling"""
    top_k: int = 0
    """top-k sampling (0 = off)"""
    min_p: float = 0.0
    """min-p sampling (0 = off)"""
    repetition_penalty: float = 1.0
    """repetition penalty (1 = off)"""

    # vLLM (README.md, "Using vLLM")
    use_vllm: bool = False
    """generate with vLLM instead of Hugging Face `generate`"""
    vllm_mode: Literal["colocate", "server"] = "colocate"
    """colocate: a vllm.LLM inside this process; server: a separate `vllm serve` reached over HTTP + NCCL"""
    vllm_gpu_memory_utilization: float = 0.3
    """colocate: share of the GPU's memory vLLM may take (weights + KV cache)"""
    vllm_tensor_parallel_size: int = 1
    """colocate: tensor-parallel size of the in-process engine"""
    vllm_max_model_len: int | None = None
    """colocate: context length of the engine (None = longest prompt + max_completion_length)"""
    vllm_enable_sleep_mode: bool = False
    """colocate: free vLLM's memory (sleep level 2) while training"""
    vllm_server_host: str = "127.0.0.1"
    """server: host of `vllm serve`"""
    vllm_server_port: int = 8000
    """server: port of `vllm serve`"""
    vllm_server_timeout: float = 240.0
    """server: seconds to wait for the server to answer /health"""
    vllm_group_port: int | None = None
    """server: TCP port the trainer opens for the NCCL weight-sync rendezvous (None: a free port, chosen per run)"""
    vllm_generation_chunk_size: int = 8
    """server: prompts per /v1/completions request; a round's requests are sent at once and vLLM batches them"""
    vllm_generation_timeout: float = 1800.0
    """server: seconds one /v1/completions request may take"""
    vllm_weight_sync_timeout: float = 300.0
    """server: seconds the NCCL group setup, and each weight update, may take"""
    vllm_weight_sync_buffer_mb: int = 1024
    """server: size of each packed NCCL broadcast chunk (two in flight on each side: lower it if memory is short)"""
    async_generation: bool = False
    """server: generate the next round while training on this one (a step costs about max(generation, training)
    instead of their sum). Each round is sampled by weights one optimizer round behind the ones it trains; the
    importance-sampling correction below covers that staleness too"""
    vllm_importance_sampling_correction: bool = True
    """correct the vLLM/trainer log-prob mismatch with a truncated or masked importance ratio"""
    vllm_importance_sampling_mode: Literal["sequence_truncate", "sequence_mask"] = "sequence_mask"
    """kind of the per-sequence correction (RLOO's loss is per sequence): clamp, or zero outside the bounds"""
    vllm_importance_sampling_clip_min: float | None = None
    """lower bound of the importance ratio (None = unbounded)"""
    vllm_importance_sampling_clip_max: float | None = 3.0
    """upper bound of the importance ratio"""

    # Rewards (and how they become advantages)
    reward_funcs: list[str] = field(default_factory=lambda: ["gsm8k_accuracy"])
    """names of functions in rewards.py; their weighted sum is the reward"""
    reward_weights: list[float] | None = None
    """one weight per reward function (None = all 1)"""
    reward_kwargs: dict[str, float] = field(default_factory=dict)
    """extra keyword arguments for every reward function, e.g. overlong_buffer_length 128"""
    reward_clip_range: tuple[float, float] | None = None
    """clamp the summed reward to [low, high] before the KL penalty and the baseline"""
    normalize_advantages: bool = False
    """whiten the advantages over the whole batch (subtract the mean, divide by std + 1e-4)"""

    # Loss
    beta: float = 0.05
    """weight of the KL penalty to the frozen reference model (0 = no reference model)"""
    kl_in_reward: bool = True
    """subtract beta * KL (k1, summed over the completion) from the reward, as in the paper; else add beta * k3 KL
    summed over the completion to the loss"""
    epsilon: float = 0.2
    """lower clipping range of the sequence ratio (matters when --num-iterations > 1)"""
    epsilon_high: float | None = None
    """upper clipping range (None = epsilon)"""
    num_iterations: int = 1
    """optimisation passes over each generated batch (old log-probs are stored for the clipped ratio)"""
    steps_per_generation: int = 1
    """optimizer steps per generated batch (the batch is split into this many mini-batches of whole groups)"""
    mask_truncated_completions: bool = False
    """exclude completions that hit max_completion_length from the loss (they still count in the baselines)"""

    # Optimization
    learning_rate: float = 1e-6
    """AdamW learning rate"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    adam_beta1: float = 0.9
    """AdamW beta1"""
    adam_beta2: float = 0.999
    """AdamW beta2"""
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = "linear"
    """learning-rate schedule after warmup"""
    warmup_steps: int = 0
    """linear warmup optimizer steps"""
    max_grad_norm: float = 1.0
    """gradient clipping norm (0 or less = no clipping; the norm is still logged)"""
    max_steps: int = 200
    """total optimizer steps (0: only evaluate the model, see --eval-steps, and exit)"""
    micro_batch_tokens: int = 16384
    """token budget (rows x padded length) of one forward/backward micro-batch; gradients accumulate over them"""

    # Logging and checkpoints
    logging_steps: int = 1
    """print a metrics line every this many optimizer steps"""
    log_completions: int = 0
    """every logging step, print this many of the step's (prompt, completion, reward) rows and, with --track, log them
    to wandb as a table (0 = off)"""
    save_steps: int = 0
    """write a resumable checkpoint every this many optimizer steps (0 = only the final model)"""
    save_total_limit: int | None = 2
    """keep only the newest this many checkpoints"""
    resume_from_checkpoint: str | None = None
    """a checkpoint directory, or "latest" for this run's newest one in output_dir"""
    overwrite_output_dir: bool = False
    """start a new run in an output_dir that holds another run's files (its metrics.jsonl and final model are replaced;
    its checkpoints are kept, and never resumed or deleted by this run)"""

    # Evaluation (README.md, "Evaluation")
    eval_steps: int = 0
    """evaluate at step 0, every this many optimizer steps and after the last step (0 = no evaluation in training)"""
    eval_dataset: str | None = None
    """hub dataset name, or a local .json / .jsonl / .parquet file, read with the training column flags (None = the
    training dataset's --eval-dataset-split, when it is a hub dataset)"""
    eval_dataset_config: str | None = None
    """configuration of --eval-dataset (None = --dataset-config when evaluating on the training dataset)"""
    eval_dataset_split: str = "test"
    """split to evaluate on (hub datasets only)"""
    eval_max_samples: int | None = None
    """evaluate on the first this many prompts (None = all)"""
    eval_num_generations: int = 1
    """k: besides the greedy completion of each prompt (pass@1), sample k at --temperature for mean@k and pass@k (1 =
    greedy only). A completion solves its prompt when its weighted total reward is > 0"""


# ======================================================================================================================
# ALGO LOGIC: the leave-one-out advantages, the KL in the reward, the clipped per-sequence loss, the vLLM IS ratio
# ======================================================================================================================


def rloo_advantages(rewards, num_generations):
    """A_i = R_i - mean_{j != i} R_j: each completion's baseline is the mean reward of the other k - 1 completions of
    its prompt (arXiv 2402.14740, sec. 3.3; k = num_generations). rewards: (N,) with N = num_prompts * k, groups
    contiguous. NaN marks an unscorable completion: it is left out of the others' baselines and gets advantage 0, as
    does a completion with no scorable sibling."""
    grouped = rewards.view(-1, num_generations)  # (num_prompts, k)
    valid = ~grouped.isnan()
    total = torch.where(valid, grouped, 0).sum(1, keepdim=True)
    others = valid.sum(1, keepdim=True) - 1  # scorable siblings of a scorable completion
    baseline = (total - grouped) / others.clamp(min=1)
    advantages = torch.where(valid & (others > 0), grouped - baseline, torch.zeros_like(grouped))
    return advantages.view(-1)


def normalize_advantages(advantages, scored, world_size=1, device="cpu"):
    """--normalize-advantages: (A - mean) / (std + 1e-4) over the scored completions of every rank. An unscorable one
    (NaN reward) keeps advantage 0 and stays out of the statistics (as in TRL). advantages, scored: (N,)."""
    everyone = gather_rows(torch.where(scored, advantages, torch.nan).to(device), world_size).cpu()
    everyone = everyone[~everyone.isnan()]
    std = everyone.std() if everyone.numel() > 1 else torch.tensor(0.0)
    return torch.where(scored, (advantages - everyone.mean()) / (std + 1e-4), torch.zeros_like(advantages))


def kl_penalised_rewards(rewards, old_logprobs, ref_logprobs, completion_mask, beta):
    """R - beta * KL with the sequence KL estimated by k1 = sum_t (log pi_old - log pi_ref) over the sampled tokens
    (arXiv 2402.14740, eq. 1): the penalty is part of the reward, so the baseline also subtracts it. Returns the
    penalised rewards (N,) and the per-token k1 (N, C)."""
    token_kl = (old_logprobs - ref_logprobs) * completion_mask
    return rewards - beta * token_kl.sum(-1), token_kl


def sequence_policy_loss(logprobs, old_logprobs, advantages, completion_mask, epsilon_low=0.2, epsilon_high=0.2):
    """Per-sequence REINFORCE loss with a PPO-style clipped ratio; returns the loss (B,) and rho (for clip metrics):
    rho = exp(sum_t log pi(o_t) - sum_t log pi_old(o_t)),  loss = -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A).
    With old = sg(current) (one pass per batch) rho = 1 and the gradient is the plain REINFORCE -A * grad log pi(o)."""
    log_ratio = ((logprobs - old_logprobs) * completion_mask).sum(-1)  # (B,)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    return -torch.min(ratio * advantages, clipped * advantages), ratio


def k3_kl(logprobs, ref_logprobs):
    """Per-token KL(pi || pi_ref), k3 = exp(ref - logp) - (ref - logp) - 1 >= 0 (Schulman 2020; DeepSeekMath eq. 4)."""
    diff = ref_logprobs - logprobs
    return torch.exp(diff) - diff - 1


def vllm_importance_ratio(old_logprobs, sampling_logprobs, completion_mask, mode, clip_min, clip_max):
    """Importance weight pi_trainer / pi_vllm that corrects for vLLM sampling from slightly different numerics
    (truncated IS, "Your efficient RL framework secretly brings you off-policy RL training", Yao et al. 2025).

    One per completion, exp(sum_t log ratio_t) (the product of token ratios): sequence_truncate clamps it to
    [clip_min, clip_max]; sequence_mask sets it to 0 outside the bounds. NaN log-probs (vLLM gave none) count as
    ratio 1. Returns (B,) weights (no gradient) and |log ratio| per token (B, C)."""
    diff = torch.nan_to_num((old_logprobs - sampling_logprobs) * completion_mask, nan=0.0)
    ratio = torch.exp(diff.sum(-1))
    low = clip_min if clip_min is not None else 0.0
    high = clip_max if clip_max is not None else float("inf")
    if mode.endswith("truncate"):
        ratio = ratio.clamp(min=low, max=high)
    else:
        ratio = torch.where((ratio >= low) & (ratio <= high), ratio, torch.zeros_like(ratio))
    return ratio.detach(), diff.abs()


def rloo_loss(args, logprobs, old_logprobs, ref_logprobs, sampling_logprobs, advantages, completion_mask):
    """The loss of each sequence of a micro-batch, (B,):
      loss_i = w_i * -min(rho_i A_i, clip(rho_i, 1 - eps_low, 1 + eps_high) A_i)  [+ beta * sum_t k3_it]
    the clipped REINFORCE loss (sequence_policy_loss) times w_i, the per-sequence importance ratio pi_old / pi_vllm
    when sampling_logprobs are given (vLLM's numerics and, with --async-generation, the older weights that sampled the
    round; else w_i = 1), plus the k3 KL with --no-kl-in-reward (the KL in the loss instead of the reward). Returns the
    loss, rho (B,) for the clip metrics, w (B,) and |log pi_old - log pi_vllm| per token (B, C) (None without IS)."""
    epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    loss, ratio = sequence_policy_loss(logprobs, old_logprobs, advantages, completion_mask, args.epsilon, epsilon_high)
    is_ratio = logp_difference = None
    if sampling_logprobs is not None:
        options = {k: getattr(args, f"vllm_importance_sampling_{k}") for k in ("mode", "clip_min", "clip_max")}
        is_ratio, logp_difference = vllm_importance_ratio(old_logprobs, sampling_logprobs, completion_mask, **options)
        loss = loss * is_ratio
    if ref_logprobs is not None and not args.kl_in_reward:
        loss = loss + args.beta * (k3_kl(logprobs, ref_logprobs) * completion_mask).sum(-1)
    return loss, ratio, is_ratio, logp_difference


def train(args):
    """One run: the start-up (every check before any model loads), then one generation round per pass of the loop:
    generate -> score -> (old / reference log-probs) -> advantages -> loss and optimizer steps -> sync the weights
    to vLLM -> evaluate, log, save. On several processes (torchrun) each rank takes an equal share of every round's
    prompts, whole groups, and FSDP2 shards the weights."""
    # TRY NOT TO MODIFY: start-up. Every mistake in the flags or the data stops the run here, before any model loads
    world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    is_main = rank == 0
    check_args(args, world_size)
    reward_fns = reward_functions(args.reward_funcs)
    dataset = read_dataset(args, reward_fns)  # each dataset checked against the column flags and the reward functions
    eval_dataset = read_dataset(args, reward_fns, evaluation=True) if args.eval_steps or args.max_steps == 0 else None
    device = start_processes(world_size)
    warn_truncated_sampling(args)
    # the output directory is this run's alone (a lock); another run's files are refused; only this run's checkpoints
    run, checkpoint_dir, output_lock = claim_output_dir(args, "rloo.py") if is_main else (None, None, None)
    checkpoint_dir = from_rank_0(checkpoint_dir, world_size)  # rank 0 decided which checkpoint to resume
    preemption = on_sigterm()  # SIGTERM: a checkpoint at the end of the step, then exit
    # seeding: the same on every rank until sampling, so that all ranks hold the same weights
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    # no weight cache: each weight is cast once per forward anyway, and the cache would outlive gradient checkpointing
    autocast = dict(device_type=device.type, dtype=torch.bfloat16, enabled=args.bf16 and device.type == "cuda")
    autocast["cache_enabled"] = False
    model_path = checkpoint_dir or args.model_name_or_path
    model, ref_model, tokenizer, pad_id, eos_ids = load_models(args, model_path, device, world_size)
    max_context = getattr(model.config, "max_position_embeddings", None) or 10**9
    train_set = load_prompts(args, dataset, tokenizer, max_context)
    eval_set = load_prompts(args, eval_dataset, tokenizer, max_context) if eval_dataset is not None else None
    reward_weights = torch.tensor(args.reward_weights or [1.0] * len(reward_fns))
    optimizer, scheduler = make_optimizer(args, model, device)
    global_step, prompts_consumed = 0, 0
    torch.manual_seed(args.seed + rank)  # from here on each rank samples its own completions
    if checkpoint_dir:
        global_step, prompts_consumed = load_checkpoint(
            checkpoint_dir, model, optimizer, scheduler, device, rank, world_size
        )
    prompts = prompt_stream(len(train_set.prompt_ids), args.seed, start=prompts_consumed)
    engine, generate = make_generator(args, model, model_path, train_set, eval_set, pad_id, eos_ids, world_size)
    metrics_file, wandb = open_metrics(args, run, checkpoint_dir, global_step) if is_main else (None, None)  # rank 0's
    progress = tqdm(total=args.max_steps, initial=global_step, desc="rloo", dynamic_ncols=True, disable=not is_main)
    epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    steps_per_round = args.steps_per_generation * args.num_iterations  # optimizer steps per generation round
    weights_version = global_step  # the optimizer step whose weights the generator holds
    next_round = None  # --async-generation: the round generating in the background while this one trains
    evaluation = (eval_set, generate, tokenizer, reward_fns, reward_weights, device, rank, world_size)
    run_eval = partial(evaluate, args, *evaluation)  # the eval/... metrics of the generator's current weights
    if eval_set is not None and (global_step == 0 or args.max_steps == 0):  # the model before training
        log_metrics(metrics_file, wandb, {"step": global_step, **run_eval()}, show=True)

    while global_step < args.max_steps:
        round_start = time.perf_counter()
        metrics, timing = {}, defaultdict(float, {"timing/weight_sync": 0.0})
        # ALGO LOGIC: 1. generate: sample prompts and num_generations completions each. --async-generation: this
        # step's round was generated during the last step, by the weights before it; the next round starts now, from
        # the current weights, and generates while we train
        if next_round is None:
            next_round = start_round(args, prompts, train_set, generate, weights_version, rank, world_size)
            prompts_consumed += args.prompts_per_step
        (rows, version, generation), next_round = next_round, None
        if args.async_generation and global_step + steps_per_round < args.max_steps:
            next_round = start_round(args, prompts, train_set, generate, weights_version, rank, world_size)
            prompts_consumed += args.prompts_per_step
        t0 = time.perf_counter()
        (completion_ids, sampling_logprobs), timing["timing/generation"] = generation.result()
        timing["timing/generation_wait"] = time.perf_counter() - t0  # what generation costs the trainer
        staleness = global_step - version  # optimizer steps between the sampling and the trained weights
        if args.use_vllm:
            vllm_utils.sleep(engine)  # sleep mode: vLLM's memory goes to training until the next generation
        prompt_ids = [train_set.prompt_ids[i] for i in rows for _ in range(args.num_generations)]
        N = len(prompt_ids)

        # 2. score: reward functions see the decoded completions and this row's dataset columns by name
        t0 = time.perf_counter()
        scores = score(args, tokenizer, reward_fns, train_set, rows, completion_ids, args.num_generations)  # (N, funcs)
        rewards = (scores * reward_weights).nansum(-1).masked_fill(scores.isnan().all(-1), float("nan"))  # (N,)
        if args.reward_clip_range is not None:
            rewards = rewards.clamp(*args.reward_clip_range)
        timing["timing/scoring"] = time.perf_counter() - t0

        # 3. old and reference log-probs, before any update (no gradient). The old ones need their own pass only if the
        # weights change before the batch's last use, or for the KL; else the training pass's (detached) are the same
        t0 = clock(device)
        prompt_lengths, completion_lengths = [len(p) for p in prompt_ids], [len(c) for c in completion_ids]
        truncated = torch.tensor([not (c and c[-1] in eos_ids) for c in completion_ids])  # no EOS: hit the limit
        C = max(max(completion_lengths), 1)
        completion_mask = (torch.arange(C)[None] < torch.tensor(completion_lengths)[:, None]).float()  # (N, C)
        need_old = args.num_iterations > 1 or args.steps_per_generation > 1 or ref_model is not None
        old_logprobs = ref_logprobs = None  # (N, C) on the CPU
        if need_old:
            old_logprobs, ref_logprobs = no_grad_logprobs(
                args, model, ref_model, prompt_ids, completion_ids, C, device, pad_id, autocast, world_size
            )

        # 4. the KL in the reward (k1 per token, once: for the penalty and the metric), then leave-one-out advantages
        if ref_model is not None:
            penalised, token_kl = kl_penalised_rewards(rewards, old_logprobs, ref_logprobs, completion_mask, args.beta)
            tokens = global_sum(completion_mask.sum(), world_size, device)
            metrics["kl/k1_token_mean"] = global_sum(token_kl.sum(), world_size, device) / tokens
            rewards = penalised if args.kl_in_reward else rewards
        advantages = rloo_advantages(rewards, args.num_generations)  # groups are whole on each rank
        if args.normalize_advantages:  # over every rank's scorable completions
            advantages = normalize_advantages(advantages, ~rewards.isnan(), world_size, device)
        use_vllm_is = args.use_vllm and args.vllm_importance_sampling_correction and sampling_logprobs is not None
        if use_vllm_is:  # vLLM's log-probs of the sampled tokens, (N, C), NaN where it gave none
            sampling_logprobs = torch.tensor(
                [[float("nan") if v is None else v for v in lp] + [0.0] * (C - len(lp)) for lp in sampling_logprobs]
            )
        timing["timing/old_ref_logprobs"] = clock(device) - t0

        # 5. loss and optimizer steps: num_iterations passes; each pass is steps_per_generation optimizer steps over
        # whole groups. The loss is the mean over the step's sequences of all ranks: each weighs 1 / (rows_per_step x
        # world_size) (0 if masked), and FSDP averages gradients over ranks, hence the x world_size in the loss.
        model.train()
        train_stats, is_stats = defaultdict(list), defaultdict(list)  # per micro-batch; IS: valid tokens, sequences
        rows_per_step = N // args.steps_per_generation
        sequence_weights = torch.ones(N) / (rows_per_step * world_size)
        if args.mask_truncated_completions:
            sequence_weights = sequence_weights * (~truncated).float()
        for _iteration, s in itertools.product(range(args.num_iterations), range(args.steps_per_generation)):
            if global_step >= args.max_steps:
                break
            step_rows = range(s * rows_per_step, (s + 1) * rows_per_step)
            t0 = clock(device)
            step_loss = 0.0
            micro_batches = token_budget_batches(step_rows, prompt_lengths, completion_lengths, args.micro_batch_tokens)
            for mb in same_count_on_all_ranks(micro_batches, world_size, device):
                padding_pass = mb is None  # only to keep FSDP's collectives in step with the other ranks
                mb = [step_rows[0]] if padding_pass else mb
                ids, attn, pos, cmask, P = collate(
                    [prompt_ids[i] for i in mb], [completion_ids[i] for i in mb], device, pad_id
                )
                Cm = cmask.shape[1]
                with torch.autocast(**autocast):
                    logprobs, entropy = per_token_logprobs(
                        model, ids, attn, pos, cmask, P, args.temperature, with_entropy=True, into_grad=True
                    )
                A = advantages[mb].to(device)
                old = old_logprobs[mb, :Cm].to(device) if need_old else logprobs.detach()
                ref = ref_logprobs[mb, :Cm].to(device) if ref_model is not None else None
                sampled = sampling_logprobs[mb, :Cm].to(device) if use_vllm_is else None
                sequence_loss, ratio, is_ratio, logp_difference = rloo_loss(args, logprobs, old, ref, sampled, A, cmask)
                loss = (sequence_loss * sequence_weights[mb].to(device)).sum() * (0 if padding_pass else world_size)
                loss.backward()
                step_loss += loss.detach()  # summed on the device: no host sync per micro-batch
                if padding_pass:
                    continue
                if use_vllm_is:
                    is_stats["logp_difference"].append(logp_difference[cmask.bool()])
                    is_stats["ratio"].append(is_ratio)
                # metrics: clipped ratios per sequence (low with A < 0, high with A > 0), token-mean entropy
                low = ((ratio < 1 - args.epsilon) & (A < 0)).float()
                high = ((ratio > 1 + epsilon_high) & (A > 0)).float()
                train_stats["entropy"].append(((entropy * cmask).sum() / cmask.sum().clamp(min=1)).detach())
                train_stats["clip_ratio/low_mean"].append(low.mean())
                train_stats["clip_ratio/high_mean"].append(high.mean())
                train_stats["clip_ratio/region_mean"].append((low + high).clamp(max=1).mean())
            t1 = clock(device)
            grad_norm = clip_gradients(model, args.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)  # now: the weight sync and generation get the memory
            scheduler.step()
            global_step += 1
            progress.update(1)
            timing["timing/forward_backward"] += t1 - t0
            timing["timing/optimizer"] += clock(device) - t1

        # 6. sync: push the new weights to vLLM before the next generation round. --async-generation: once the round
        # in flight is complete (on every rank), so that vLLM never switches weights in the middle of a round
        if args.use_vllm:
            t0 = time.perf_counter()
            if next_round is not None:
                next_round[2].result()
                if world_size > 1:
                    dist.barrier()
            t1 = time.perf_counter()
            timing["timing/generation_wait"] += t1 - t0
            vllm_utils.sync_weights(engine, model)
            timing["timing/weight_sync"] = time.perf_counter() - t1
        weights_version = global_step  # (without vLLM, `generate` samples from the trained model itself)

        # 7. evaluate every --eval-steps steps and after the last one. Here the generator holds this step's weights and
        # no request is in flight (--async-generation: step 6 waited for the next round before the push, and the round
        # after it starts only at the top of the loop), so evaluation samples the current policy
        evaluated = eval_set is not None and (global_step % args.eval_steps == 0 or global_step >= args.max_steps)
        eval_results = run_eval() if evaluated else {}

        # TRY NOT TO MODIFY: logging (TRL's metric names, over all ranks) and checkpoints
        metrics.update(step=global_step, grad_norm=grad_norm.item(), learning_rate=scheduler.get_last_lr()[0])
        batch = (scores, prompt_lengths, completion_lengths, truncated, advantages)
        metrics |= round_metrics(args, batch, step_loss, train_stats, is_stats, reward_fns, reward_weights, world_size)
        metrics.update({**timing, "sampling/staleness": staleness, "step_time": time.perf_counter() - round_start})
        if device.type == "cuda":
            metrics["memory/peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        metrics.update(eval_results)
        if is_main:
            kl, length = metrics.get("kl/k1_token_mean", 0), metrics["completions/mean_length"]
            progress.set_postfix(reward=f"{metrics['reward']:.3f}", kl=f"{kl:.4f}", len=f"{length:.0f}")
            if args.log_completions and global_step % args.logging_steps == 0:  # rank 0's rows
                total = (scores * reward_weights).nansum(-1)
                log_completions(args, wandb, tokenizer, prompt_ids, completion_ids, total, global_step)
        log_metrics(metrics_file, wandb, metrics, show=global_step % args.logging_steps == 0 or evaluated)
        preempted = global_sum(preemption.is_set(), world_size, device) > 0 and global_step < args.max_steps  # SIGTERM
        if preempted or (args.save_steps and global_step % args.save_steps == 0 and global_step < args.max_steps):
            # a round generated in the background is not trained yet: a resume generates it again
            consumed = prompts_consumed - (args.prompts_per_step if next_round else 0)
            save_checkpoint(args, run, model, tokenizer, optimizer, scheduler, global_step, consumed, world_size)
        if preempted:
            stop_preempted(wandb, global_step, world_size)  # exit status 143

    # final model + tokenizer, loadable with from_pretrained(output_dir); --max-steps 0 only evaluated: nothing to save
    progress.close()
    finish(args, wandb, model, tokenizer, metrics_file, output_lock, world_size)


# ======================================================================================================================
# TRY NOT TO MODIFY: plumbing. Start-up, generation, scoring and logging of the loop's phases, then data loading,
# log-probs, FSDP2 helpers, `generate`, evaluation, checkpoints and the start-up checks
# ======================================================================================================================


# ------------------------------------------------------------------------------------------------------------------
# The loop's set-up and phases


def start_processes(world_size):
    """This process's device (torchrun: the GPU of LOCAL_RANK) and, with several processes, the process group."""
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1:
        # rank 0 alone may spend minutes writing a checkpoint while the others wait in the next collective
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(hours=1))
    return device


def warn_truncated_sampling(args):
    truncated_sampling = args.top_p < 1 or args.top_k > 0 or args.min_p > 0 or args.repetition_penalty != 1
    if args.use_vllm and args.vllm_importance_sampling_correction and truncated_sampling:
        print(
            "warning: with top_p / top_k / min_p / repetition_penalty, vLLM's processed log-probs come from a truncated "
            "distribution that the trainer does not model: the importance ratio is biased below 1, and at the sequence "
            "level (product over tokens) it shrinks the updates of long completions. Prefer neutral values, or "
            "--vllm-importance-sampling-mode sequence_truncate with a --vllm-importance-sampling-clip-min (e.g. 0.5) "
            "that bounds the shrinking."
        )


def from_rank_0(value, world_size):
    """Rank 0's value of a picklable object, on every rank."""
    if world_size == 1:
        return value
    shared = [value]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def load_models(args, model_path, device, world_size):
    """The policy (from model_path: the model, or the checkpoint to resume), the frozen reference model (--beta > 0),
    the tokenizer, the padding id and the EOS ids; FSDP2-sharded with several processes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer, dtype = AutoTokenizer.from_pretrained(model_path), getattr(torch, args.param_dtype)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
    for module in model.modules():  # dropout would make two passes over the same tokens disagree (ratio != 1)
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref_model = None
    if args.beta > 0:  # the starting model, also when resuming, in the policy's dtype and compute: KL 0 at step 1
        ref_model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=dtype)
        ref_model = ref_model.to(device).eval().requires_grad_(False)
    if args.torch_compile and device.type == "cuda" and args.use_vllm and world_size == 1:  # one graph per layer type
        for layer in (layer for each in (model, ref_model) if each is not None for layer in decoder_layers(each)):
            layer.forward = torch.compile(layer.forward, dynamic=True)
    if world_size > 1:  # FSDP2: every rank keeps 1/world_size of the weights, gradients and AdamW states
        for m in (model, ref_model) if ref_model is not None else (model,):
            shard_model(m, mixed_precision=args.bf16 and device.type == "cuda")
    # a forward that transforms its logits in a way the trainer does not model fails now, not after training on them
    sentence = "The quick brown fox jumps over the lazy dog, and then it ran away."
    check_logprobs(model, tokenizer(sentence)["input_ids"], device, world_size)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_ids = model.generation_config.eos_token_id
    eos_ids = sorted((set(eos_ids if isinstance(eos_ids, list) else [eos_ids]) | {tokenizer.eos_token_id}) - {None})
    return model, ref_model, tokenizer, pad_id, eos_ids


def make_optimizer(args, model, device):
    """AdamW and the learning-rate schedule."""
    from transformers import get_scheduler

    # fused: one kernel for all parameters on CUDA, with no full-size temporaries (the foreach default allocates them)
    adamw = dict(lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), weight_decay=args.weight_decay)
    optimizer = torch.optim.AdamW(model.parameters(), **adamw, fused=device.type == "cuda")
    return optimizer, get_scheduler(args.lr_scheduler_type, optimizer, args.warmup_steps, args.max_steps)


def load_checkpoint(checkpoint_dir, model, optimizer, scheduler, device, rank, world_size):
    """Load a checkpoint's optimizer, schedule and random states (its weights are loaded as the model); returns
    (global_step, prompts_consumed)."""
    # mmap: pages of the full optimizer state are read as used, not all into every rank's memory (copy-on-write)
    state = torch.load(os.path.join(checkpoint_dir, "trainer_state.pt"), weights_only=False, mmap=True)
    if world_size == 1 and all(isinstance(key, int) for key in state["optimizer"]["state"]):  # written by one rank
        # directly: torch's set_optimizer_state_dict first builds a throw-away AdamW state, 2x the weights' memory
        optimizer.load_state_dict(state["optimizer"])
    else:  # written by several ranks (by parameter name), or resumed on several (sharded like the weights). Not strict:
        # a parameter that never had a gradient (a multimodal model's unused tower) has no AdamW state
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        full = StateDictOptions(full_state_dict=world_size > 1, strict=False)
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=full)
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"][rank])
    if device.type == "cuda" and state.get("cuda_rng") is not None:  # GPU sampling; older checkpoints have none
        torch.cuda.set_rng_state(state["cuda_rng"][rank])
    # optimizer tensors left on the CPU (AdamW's step counts; all of them on a CPU run) still point into the mapped
    # file: copy them, so that --save-total-limit can delete that checkpoint and its disk space is freed
    for per_param in optimizer.state.values():
        per_param.update({k: v.clone() for k, v in per_param.items() if torch.is_tensor(v) and v.device.type == "cpu"})
    print(f"resumed from {checkpoint_dir} at step {state['global_step']}")
    return state["global_step"], state["prompts_consumed"]


def make_generator(args, model, model_path, train_set, eval_set, pad_id, eos_ids, world_size):
    """(engine, generate): Hugging Face generate (engine None), or vLLM, a colocated engine or a `vllm serve` server.
    generate(prompt_ids, num_generations=None, temperature=None) returns (completion ids, vLLM's log-probs or None),
    prompt-major; num_generations and temperature None: the training ones."""
    if not args.use_vllm:

        def generate(prompt_ids, num_generations=None, temperature=None):
            with unsharded(model, world_size):  # FSDP2: full weights while decoding, ranks stop at different steps
                return hf_generate(model, prompt_ids, args, eos_ids, pad_id, num_generations, temperature)

        return None, generate
    longest = max(len(p) for p in train_set.prompt_ids + (eval_set.prompt_ids if eval_set else []))
    engine = vllm_utils.start(args, model_path, longest)
    if args.vllm_mode == "server":  # the server may hold other weights (an earlier run, or this one before a resume)
        vllm_utils.sync_weights(engine, model)
    return engine, partial(vllm_utils.generate, engine)


def open_metrics(args, run, checkpoint_dir, global_step):
    """Rank 0: start wandb (--track; a resumed run continues its wandb run) and open metrics.jsonl for appending, once
    the lines of the steps after a resumed checkpoint are dropped (they are done again). Returns (the open file, the
    wandb module with --track, else None)."""
    wandb = None
    if args.track:
        import wandb

        identity = dict(name=run["run_name"], id=run["run_id"], resume="allow")  # resumed: continued
        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, config=asdict(args), **identity)
    path = os.path.join(args.output_dir, "metrics.jsonl")
    if checkpoint_dir and os.path.exists(path):
        kept = [line for line in open(path) if json.loads(line)["step"] <= global_step]
        with open(path, "w") as f:
            f.writelines(kept)
    return open(path, "a"), wandb


def log_metrics(metrics_file, wandb, metrics, show):
    """Rank 0 (metrics_file None elsewhere): print the line if `show`, append it to metrics.jsonl, log it to wandb."""
    if metrics_file is None:
        return
    if show:
        tqdm.write(" | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()))
    print(json.dumps(metrics), file=metrics_file, flush=True)
    if wandb:
        wandb.log(metrics, step=metrics["step"])


def start_round(args, prompts, prompt_set, generate, weights_version, rank, world_size):
    """Draw the next prompts_per_step prompts (the same on every rank), keep this rank's share and start generating
    them: in the background with --async-generation, else now. Returns (rows, the optimizer step of the weights that
    generate them, a Future of ((completion ids, vLLM log-probs), seconds))."""
    per_rank = args.prompts_per_step // world_size
    rows = [next(prompts) for _ in range(args.prompts_per_step)][rank * per_rank : (rank + 1) * per_rank]

    def work():
        t0 = time.perf_counter()
        return generate([prompt_set.prompt_ids[i] for i in rows]), time.perf_counter() - t0

    return rows, weights_version, future_of(work, background=args.async_generation)


def clock(device):
    """Phase timings: wait for the GPU's queued work so that each phase is charged its own time."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def score(args, tokenizer, reward_fns, prompt_set, rows, completion_ids, num_generations):
    """The reward functions' scores (len(rows) * num_generations, num_funcs) of num_generations completions per prompt
    row (prompt-major): each function gets the decoded completions and, by name, the rows' dataset columns (training
    set, or eval set). The completions are chat messages only when the dataset's prompts are (TRL's rule): a plain-text
    prompt that the chat template wraps still gets plain-text completions."""
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    completions = [[{"role": "assistant", "content": t}] for t in texts] if prompt_set.prompts_are_messages else texts
    repeated = lambda values: [values[i] for i in rows for _ in range(num_generations)]
    reward_columns = {c: repeated(v) for c, v in prompt_set.columns.items()}
    prompts = repeated({i: tokenizer.decode(prompt_set.prompt_ids[i]) for i in rows})
    passed = dict(prompts=prompts, completion_ids=completion_ids, max_completion_length=args.max_completion_length)
    reward_columns.update(**passed, **args.reward_kwargs)  # a --reward-kwargs key that repeats one: a TypeError
    return score_completions(reward_fns, completions, reward_columns)


def no_grad_logprobs(args, model, ref_model, prompt_ids, completion_ids, C, device, pad_id, autocast, world_size):
    """The old and (with a reference model, else None) reference log-probs of the round's completions, (N, C) on the
    CPU: forward passes without gradient over token-budget micro-batches."""
    N = len(prompt_ids)
    prompt_lengths, completion_lengths = [len(p) for p in prompt_ids], [len(c) for c in completion_ids]
    old_logprobs = torch.zeros(N, C)
    ref_logprobs = torch.zeros(N, C) if ref_model is not None else None
    model.eval()
    ref_unsharded = unsharded(ref_model, world_size) if ref_model is not None else nullcontext()
    with torch.no_grad(), torch.autocast(**autocast), unsharded(model, world_size), ref_unsharded:
        for mb in token_budget_batches(range(N), prompt_lengths, completion_lengths, args.micro_batch_tokens):
            batch = collate([prompt_ids[i] for i in mb], [completion_ids[i] for i in mb], device, pad_id)
            for net, logprobs in ((model, old_logprobs), (ref_model, ref_logprobs)):
                if net is not None:
                    logprobs[mb, : batch[3].shape[1]] = per_token_logprobs(net, *batch, args.temperature).cpu()
    return old_logprobs, ref_logprobs


def round_metrics(args, batch, step_loss, train_stats, is_stats, reward_fns, reward_weights, world_size):
    """The round's metrics over every rank (TRL's names): rewards, completion lengths, advantages, loss, tokens, the
    importance-sampling ratio, each reward function's mean and std, and the micro-batches' entropy and clip ratios.
    batch: (scores, prompt lengths, completion lengths, truncated, advantages) of this rank's rows."""
    scores, prompt_lengths, completion_lengths, truncated, advantages = batch
    num_tokens = global_sum(sum(prompt_lengths) + sum(completion_lengths), world_size, step_loss.device)
    completion_lengths = torch.tensor(completion_lengths, dtype=torch.float)
    train_means = {k: torch.stack(v).mean() for k, v in train_stats.items() if v}
    abs_advantages = advantages.abs()
    if world_size > 1:
        gathered = [None] * world_size
        dist.all_gather_object(gathered, (scores, completion_lengths, truncated, abs_advantages))
        scores, completion_lengths, truncated, abs_advantages = (torch.cat([g[i] for g in gathered]) for i in range(4))
        for value in [step_loss, *train_means.values()]:
            dist.all_reduce(value)
            value /= world_size
    total = (scores * reward_weights).nansum(-1)
    metrics = {
        "reward": total.mean().item(),
        "reward_std": total.std().item(),
        "frac_reward_zero_std": (total.view(-1, args.num_generations).std(1) < 1e-6).float().mean().item(),
        "completions/mean_length": completion_lengths.mean().item(),
        "completions/min_length": int(completion_lengths.min()),
        "completions/max_length": int(completion_lengths.max()),
        "completions/clipped_ratio": truncated.float().mean().item(),  # TRL's name for the truncated share
        "advantages/mean_abs": abs_advantages.mean().item(),
        "loss": step_loss.item(),
        "num_tokens": num_tokens,
    }
    if is_stats:
        logp_difference, ratio = torch.cat(is_stats["logp_difference"]), torch.cat(is_stats["ratio"])
        metrics["sampling/sampling_logp_difference/mean"] = logp_difference.mean().item()
        metrics["sampling/sampling_logp_difference/max"] = logp_difference.max().item()
        metrics["sampling/importance_sampling_ratio/min"] = ratio.min().item()
        metrics["sampling/importance_sampling_ratio/mean"] = ratio.mean().item()
        metrics["sampling/importance_sampling_ratio/max"] = ratio.max().item()
    for k, fn in enumerate(reward_fns):
        column = scores[:, k][~scores[:, k].isnan()]
        metrics[f"rewards/{fn.__name__}/mean"] = column.mean().item() if column.numel() else float("nan")
        metrics[f"rewards/{fn.__name__}/std"] = column.std().item() if column.numel() > 1 else 0.0
    return {**metrics, **{k: v.item() for k, v in train_means.items()}}


# ------------------------------------------------------------------------------------------------------------------
# Data


PromptSet = namedtuple("PromptSet", "prompt_ids columns prompts_are_messages")


def load_prompts(args, dataset, tokenizer, max_context):
    """Tokenize the prompts of `dataset` ({column: values}, from read_dataset) and return a PromptSet: token ids per
    row, the other columns (answer column renamed to `answer`) that reward functions receive by name, and whether the
    dataset's prompts are chat messages (lists of {"role", "content"}; not when the chat template wraps plain text)."""
    prompts = dataset[args.prompt_column]
    prompts_are_messages = isinstance(prompts[0], list)
    use_template = prompts_are_messages or (args.use_chat_template and tokenizer.chat_template is not None)
    system = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    prompt_ids = []
    for prompt in prompts:
        if use_template:
            messages = system + (prompt if prompts_are_messages else [{"role": "user", "content": prompt}])
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # a dict or BatchEncoding
        else:
            text = f"{args.system_prompt}\n\n{prompt}" if args.system_prompt else prompt
            ids = tokenizer(text)["input_ids"]
        prompt_ids.append(list(ids))
    columns = {c: values for c, values in dataset.items() if c != args.prompt_column}
    if args.answer_column and args.answer_column != "answer":
        columns["answer"] = columns.pop(args.answer_column)

    keep = list(range(len(prompt_ids)))
    if args.max_prompt_length is not None:
        keep = [i for i in keep if len(prompt_ids[i]) <= args.max_prompt_length]
        print(f"--max-prompt-length {args.max_prompt_length}: kept {len(keep)} of {len(prompt_ids)} prompts")
        if not keep:
            raise ValueError(f"no prompt is at most {args.max_prompt_length} tokens long; raise --max-prompt-length")
    longest = max(keep, key=lambda i: len(prompt_ids[i]))
    if len(prompt_ids[longest]) + args.max_completion_length > max_context:
        raise ValueError(
            f"prompt {longest} has {len(prompt_ids[longest])} tokens, and with --max-completion-length "
            f"{args.max_completion_length} it exceeds the model's context of {max_context} tokens. Pass "
            f"--max-prompt-length {max_context - args.max_completion_length} to drop such prompts, or lower "
            f"--max-completion-length."
        )
    kept_columns = {c: [v[i] for i in keep] for c, v in columns.items()}
    return PromptSet([prompt_ids[i] for i in keep], kept_columns, prompts_are_messages)


def prompt_stream(num_prompts, seed, start=0):
    """Yield prompt indices forever: a new seeded permutation each epoch. `start` skips that many (for resuming)."""
    order = lambda epoch: torch.randperm(num_prompts, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    yield from itertools.islice(itertools.chain.from_iterable(map(order, itertools.count())), start, None)


def score_completions(reward_fns, completions, columns):
    """Call each reward function; returns rewards (num_completions, num_funcs) with NaN where a function gave None."""
    scores = torch.full((len(completions), len(reward_fns)), float("nan"))
    for k, fn in enumerate(reward_fns):
        try:
            values = fn(completions=completions, **columns)
        except Exception as error:
            raise RuntimeError(
                f"reward function '{fn.__name__}' raised {type(error).__name__}: {error}. It receives completions and "
                f"the keyword columns {sorted(columns)}; fix the function or the dataset columns it reads."
            ) from error
        if len(values) != len(completions):
            raise ValueError(
                f"reward function '{fn.__name__}' returned {len(values)} values for {len(completions)} completions"
            )
        scores[:, k] = torch.tensor([float("nan") if v is None else float(v) for v in values])
    return scores


# ------------------------------------------------------------------------------------------------------------------
# Log-probabilities: chunked, temperature-scaled, the model's own logit transform


def collate(prompt_ids, completion_ids, device, pad_id):
    """Left-pad prompts and right-pad completions into one batch: input_ids, attention_mask, position_ids (B, P + C),
    completion_mask (B, C) and P."""
    P = max(len(p) for p in prompt_ids)
    C = max(max(len(c) for c in completion_ids), 1)
    input_ids = torch.full((len(prompt_ids), P + C), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        input_ids[i, P - len(p) : P + len(c)] = torch.tensor(p + c)
        attention_mask[i, P - len(p) : P + len(c)] = 1
    # positions count from each prompt's first real token, as in generation
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    completion_mask = attention_mask[:, P:].float()
    return input_ids.to(device), attention_mask.to(device), position_ids.to(device), completion_mask.to(device), P


def final_logits(logits, config):
    """The model's own transform of its LM head's output, as its forward applies it (transformers' modeling code) and
    vLLM samples from it: Cohere multiplies by logit_scale, the Granite family divides by logits_scaling (HyperCLOVAX
    multiplies by it), Gemma 2/3 soft-cap with final_logit_softcapping. check_logprobs catches any other transform."""
    text = config.get_text_config()
    if text.model_type.startswith("cohere") and getattr(text, "logit_scale", None) is not None:
        logits = logits * text.logit_scale
    if getattr(text, "logits_scaling", None) is not None:
        logits = logits * text.logits_scaling if text.model_type == "hyperclovax" else logits / text.logits_scaling
    if getattr(text, "final_logit_softcapping", None) is not None:
        logits = torch.tanh(logits / text.final_logit_softcapping) * text.final_logit_softcapping
    return logits


class TokenLogprobs(torch.autograd.Function):
    """log pi(target) and the entropy (None unless asked) of each final hidden state, (n,) each, computed `chunk` tokens
    at a time so that no (n, vocabulary) tensor exists: the forward saves the hidden states and the log-sum-exp; the
    backward recomputes each chunk's logits once and writes their gradient in one pass, d log pi(t) / dz = onehot(t) -
    softmax(z), where z are the logits after the model's own transform and the temperature. The LM head's weight is cast
    once per pass, and its gradient is summed over the chunks in one buffer, or in its .grad with into_grad (with fp32
    weights under autocast: 0.8 GiB less at a bench step's peak than one per chunk, benchmarks/results/README.md)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, config, temperature, with_entropy, chunk, into_grad):
        # the LM head computes in autocast's dtype when autocast is on, as the model's own forward would
        device = hidden.device.type
        ctx.dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
        ctx.config, ctx.temperature, ctx.chunk, ctx.into_grad = config, temperature, chunk, into_grad
        w, b = (None if x is None else x.to(ctx.dtype) for x in (weight, bias))
        lse, logprobs, entropy = (torch.empty(len(hidden), device=hidden.device) for _ in range(3))
        for rows in (slice(start, start + chunk) for start in range(0, len(hidden), chunk)):
            logits = final_logits(torch.nn.functional.linear(hidden[rows].to(ctx.dtype), w, b), config)
            lse[rows], logprobs[rows], entropy[rows] = fused(softmax_stats, hidden)(logits, targets[rows], temperature)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        return logprobs, entropy if with_entropy else None

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):  # the entropy is a metric: no gradient flows from it
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        w, b = (None if x is None else x.to(ctx.dtype) for x in (weight, bias))
        probe = weight.new_empty(0, weight.shape[0], dtype=ctx.dtype)  # no rows: whether the model transforms logits
        plain = final_logits(probe, ctx.config) is probe
        # the weight's gradient in its own dtype: fp32 weights (autocast) sum the bf16 chunks' products in fp32; with
        # into_grad, straight into the .grad that earlier micro-batches left (no second vocabulary-sized buffer)
        into_grad = ctx.into_grad and ctx.needs_input_grad[1] and type(weight.grad) is torch.Tensor
        grad_hidden, grad_weight = torch.empty_like(hidden), weight.grad if into_grad else torch.zeros_like(weight)
        grad_bias = None if bias is None else torch.zeros_like(bias)
        for rows in (slice(start, start + ctx.chunk) for start in range(0, len(hidden), ctx.chunk)):
            h, t = hidden[rows].to(ctx.dtype), targets[rows]
            raw = torch.nn.functional.linear(h, w, b)
            with torch.enable_grad():  # otherwise autograd differentiates the elementwise transform (no parameters)
                logits = final_logits(raw.requires_grad_(not plain), ctx.config)
            grad = fused(softmax_grad, h)(logits.detach(), lse[rows], grad_logprobs[rows], t, ctx.temperature)
            grad = grad if plain else torch.autograd.grad(logits, raw, grad)[0]  # through the model's transform
            grad_hidden[rows] = grad @ w
            add_matmul(grad_weight, grad.T, h)
            if grad_bias is not None:
                grad_bias += grad.sum(0, dtype=torch.float32)
        return grad_hidden, None if into_grad else grad_weight, grad_bias, *[None] * 6


def softmax_stats(logits, targets, temperature):
    """One chunk's log-sum-exp, log pi(target) and entropy -sum_v p_v log p_v of z = logits / T, in float32."""
    z = logits.float() / temperature
    lse = z.logsumexp(-1)
    log_softmax = z - lse[:, None]
    return lse, z.gather(-1, targets[:, None]).squeeze(-1) - lse, -(log_softmax.exp() * log_softmax).sum(-1)


def softmax_grad(logits, lse, grad_logprobs, targets, temperature):
    """One chunk's g d log pi(t) / d logits = g (onehot(t) - softmax(z)) / T, in the logits' dtype."""
    onehot = torch.arange(logits.shape[-1], device=logits.device) == targets[:, None]
    softmax = (logits.float() / temperature - lse[:, None]).exp()
    return (grad_logprobs[:, None] / temperature * (onehot.float() - softmax)).to(logits.dtype)


def fused(fn, like):
    """fn, torch.compile'd on CUDA: one kernel instead of ~8 passes over a chunk's logits (the LM head's forward and
    backward of a bench step: 408 -> 180 ms, benchmarks/logprob_variants.py). TORCHDYNAMO_DISABLE=1 runs it eagerly."""
    return compiled(fn) if like.is_cuda else fn


@functools.cache
def compiled(fn):
    return torch.compile(fn, dynamic=True)


def add_matmul(out, a, b):
    """out += a @ b, with the product summed in out's dtype (float32) rather than rounded to a's (bf16) first."""
    if a.dtype == out.dtype:
        out.addmm_(a, b)
    elif out.is_cuda:
        torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
    else:  # the CPU has no mixed-dtype addmm
        out += (a @ b).to(out.dtype)


def per_token_logprobs(
    model, ids, attn, pos, cmask, P, temperature=1.0, chunk_tokens=1024, with_entropy=False, into_grad=False
):
    """log pi(token) of each completion token at the sampling temperature, (B, C), 0 on padding, from a batch of
    collate's (input ids, attention mask, position ids, completion mask, prompt length P).

    The fp32 logits of a 150k vocabulary would be the memory peak, so they never exist for the whole batch: the LM
    head runs on chunks of `chunk_tokens` completion tokens (TokenLogprobs), and the backward pass recomputes one chunk
    at a time too. into_grad: the caller runs loss.backward(), so the LM head's gradient may go straight into .grad."""
    # the model's own forward (not its backbone alone), so that FSDP2 gathers every parameter; it computes the logits
    # of one position only, and its last hidden state is the final, normed one
    inputs = dict(input_ids=ids, attention_mask=attn, position_ids=pos)
    hidden = model(**inputs, use_cache=False, logits_to_keep=1, output_hidden_states=True).hidden_states[-1]
    hidden = hidden[:, P - 1 : -1]  # (B, C, H): position t predicts completion token t
    targets = ids[:, P:]
    mask = cmask.bool()
    hidden, targets = hidden[mask], targets[mask]  # (n_tokens, H), (n_tokens,)
    lm_head = model.get_output_embeddings()
    args = lm_head.weight, lm_head.bias, targets, model.config, temperature, with_entropy, chunk_tokens, into_grad
    logprobs, entropy = TokenLogprobs.apply(hidden, *args)
    # masked_scatter keeps the output connected to the model even when no token is masked in
    logprobs = torch.zeros(mask.shape, device=ids.device).masked_scatter(mask, logprobs)
    return (logprobs, torch.zeros_like(logprobs).masked_scatter(mask, entropy)) if with_entropy else logprobs


def check_logprobs(model, input_ids, device, world_size):
    """Raise unless per_token_logprobs of one short sequence match log_softmax of the model's own logits, which the
    sampler uses: an architecture whose forward transforms its logits in a way final_logits does not know would
    otherwise train on wrong log-probs. Every rank calls it: `unsharded` gathers the FSDP2 shards, a collective."""
    ids, attn, pos, cmask, P = collate([input_ids[:1]], [input_ids[1:]], device, 0)
    with torch.no_grad(), unsharded(model, world_size):
        ours = per_token_logprobs(model, ids, attn, pos, cmask, P)
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False).logits[:, P - 1 : -1]
    theirs = logits.float().log_softmax(-1).gather(-1, ids[:, P:, None]).squeeze(-1)
    error = (ours - theirs).abs().mean().item()
    # in bf16 the LM head's GEMM on other shapes may round a logit of ~20 differently, by 0.125 (some forwards
    # return float32 logits computed in bf16, hence the weights' dtype too)
    exact = logits.dtype == model.get_output_embeddings().weight.dtype == torch.float32
    if error > (1e-3 if exact else 0.1):
        raise ValueError(
            f"{type(model).__name__}: the trainer's log-probs (LM head on the last hidden state, then final_logits) "
            f"differ from those of the model's own logits by {error:.3g} nats per token, so they would not match the "
            f"sampler's. Its forward transforms the logits in a way final_logits does not know: add it there."
        )


def clip_gradients(model, max_norm):
    """Clip the gradients' global norm to max_norm (<= 0: no clipping) and return the norm before clipping."""
    # max_norm 0 would scale every gradient to 0; inf still computes the norm (the grad_norm metric)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else float("inf"))
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor


def token_budget_batches(rows, prompt_lengths, completion_lengths, budget):
    """Split `rows` into micro-batches whose padded size (rows x (max prompt + max completion)) fits `budget`.
    Rows are sorted by length so that similar lengths share a micro-batch (less padding)."""
    order = sorted(rows, key=lambda i: prompt_lengths[i] + completion_lengths[i])
    batches, current, max_p, max_c = [], [], 0, 0
    for i in order:
        p, c = max(max_p, prompt_lengths[i]), max(max_c, completion_lengths[i])
        if current and (len(current) + 1) * (p + c) > budget:
            batches.append(current)
            current, p, c = [], prompt_lengths[i], completion_lengths[i]
        current.append(i)
        max_p, max_c = p, c
    return batches + [current] if current else batches


# ------------------------------------------------------------------------------------------------------------------
# Several GPUs (torchrun): FSDP2 shards the weights, each rank generates and scores whole groups of its own prompts


def decoder_layers(model):
    """The model's repeated blocks (LlamaDecoderLayer, GPT2Block, ...: transformers' _no_split_modules), the units FSDP2
    shards and --torch-compile compiles."""
    return [module for module in model.modules() if type(module).__name__ in (model._no_split_modules or ())]


def shard_model(model, mixed_precision):
    """FSDP2: shard every decoder layer, then the rest (embeddings, final norm, LM head) as the root. With
    mixed_precision, each layer computes in bf16 while the sharded fp32 weights and gradient reduction stay fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    bf16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else {}
    policy = MixedPrecisionPolicy(**bf16)
    for module in [*decoder_layers(model), model]:  # every decoder layer, then the root
        fully_shard(module, mp_policy=policy)
    return model


@contextmanager
def unsharded(model, world_size):
    """Hold an FSDP2 model's full weights for forward-only passes (generation, old/reference log-probs): no collective
    per forward, so ranks may run different numbers of passes (decoding steps, micro-batches)."""
    if world_size == 1:
        yield
        return
    layers = decoder_layers(model)
    for module in [*layers, model]:
        module.unshard()
    for layer in layers:
        layer.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for layer in layers:
            layer.set_reshard_after_forward(True, recurse=False)
        for module in [*layers, model]:
            module.reshard()


def same_count_on_all_ranks(micro_batches, world_size, device):
    """Pad this rank's micro-batch list with None (a pass whose loss is multiplied by 0) up to the longest list of any
    rank: every FSDP2 backward is a collective, so all ranks must run the same number of them."""
    if world_size == 1:
        return micro_batches
    count = torch.tensor(len(micro_batches), device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return micro_batches + [None] * (int(count) - len(micro_batches))


def gather_rows(tensor, world_size):
    """Concatenate a tensor's rows from every rank, in rank order (all ranks hold the same shape)."""
    if world_size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts)


def global_sum(value, world_size, device):
    """Sum of a number over all ranks."""
    if world_size == 1:
        return float(value)
    total = torch.tensor(float(value), device=device)
    dist.all_reduce(total)
    return total.item()


# ------------------------------------------------------------------------------------------------------------------
# Generation with Hugging Face `generate` (the vLLM paths live in vllm_utils.py)


@torch.no_grad()
def hf_generate(model, prompt_ids, args, eos_ids, pad_id, num_generations=None, temperature=None):
    """Sample num_generations completions per prompt (None: --num-generations) at `temperature` (None: the training one;
    0: greedy); returns their token ids, prompt-major, each cut after its first EOS (kept as the last token)."""
    from transformers import GenerationConfig

    temperature = args.temperature if temperature is None else temperature
    repeated = [p for p in prompt_ids for _ in range(num_generations or args.num_generations)]
    input_ids, attention_mask, _, _, P = collate(repeated, [[]] * len(repeated), model.device, pad_id)
    input_ids, attention_mask = input_ids[:, :P], attention_mask[:, :P]  # the prompts, left-padded
    sampling = dict(do_sample=True, temperature=temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p)
    decoding = sampling if temperature > 0 else dict(do_sample=False)  # temperature 0: greedy
    stopping = dict(max_new_tokens=args.max_completion_length, eos_token_id=eos_ids, pad_token_id=pad_id)
    config = GenerationConfig(**decoding, **stopping, repetition_penalty=args.repetition_penalty, use_cache=True)
    model.eval()
    # generate fills every field left None here from model.generation_config (the checkpoint's generation_config.json:
    # no_repeat_ngram_size, suppress_tokens, ...), which neither the trainer's log-probs nor vLLM model; as the model's
    # own config, this one is completed with the library's neutral defaults only
    model_config, model.generation_config = model.generation_config, config
    try:
        with torch.autocast(model.device.type, torch.bfloat16, enabled=args.bf16 and model.device.type == "cuda"):
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
    finally:
        model.generation_config = model_config
    cut_after_eos = lambda row: row[: next((t + 1 for t, token in enumerate(row) if token in eos_ids), len(row))]
    return [cut_after_eos(row) for row in out[:, P:].tolist()], None


def future_of(fn, background=True):
    """fn() as a Future: run in a daemon thread (--async-generation: the trainer trains meanwhile; a daemon never
    holds up the exit after an error), or right now. future.result() returns the value or raises fn's error."""
    future = Future()

    def run():
        try:
            future.set_result(fn())
        except BaseException as error:  # noqa: BLE001 - re-raised by future.result() in the training loop
            future.set_exception(error)

    threading.Thread(target=run, daemon=True).start() if background else run()
    return future


# ------------------------------------------------------------------------------------------------------------------
# Evaluation and sample completions (README.md, "Evaluation")


def rank_share(num_prompts, rank, world_size):
    """This rank's contiguous share of range(num_prompts), padded with prompt 0 to ceil(num_prompts / world_size) rows
    so that every rank makes the same generate calls (FSDP2's unshard and a tensor-parallel engine's gather are
    collectives). Returns (rows, how many of them are real); the ranks' real rows, in rank order, are all prompts."""
    per_rank = -(-num_prompts // world_size)
    rows = list(range(num_prompts))[rank * per_rank : (rank + 1) * per_rank]
    return rows + [0] * (per_rank - len(rows)), len(rows)


def evaluate(args, eval_set, generate, tokenizer, reward_fns, reward_weights, device, rank, world_size):
    """Greedy (temperature 0) and, with --eval-num-generations k > 1, k sampled completions of every eval prompt,
    from the run's generator (which must hold the current weights: the loop calls this right after the weight push),
    scored by the reward functions. Each rank generates its share of the prompts, in calls of one training round's
    size; the scores are gathered, so every rank returns the eval/... metrics of all prompts."""
    t0 = time.perf_counter()
    rows, real = rank_share(len(eval_set.prompt_ids), rank, world_size)
    num_generations = args.eval_num_generations  # the k of mean@k and pass@k
    round_size = args.prompts_per_step // world_size * args.num_generations  # completions per generate call

    def complete(per_prompt, temperature):  # this rank's rows, per_prompt completions each, prompt-major
        size, ids = max(1, round_size // per_prompt), []
        for start in range(0, len(rows), size):
            ids += generate([eval_set.prompt_ids[i] for i in rows[start : start + size]], per_prompt, temperature)[0]
        return ids

    # HF sampling draws from the global RNG: fork it, so that training samples what it would without evaluation
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(args.seed + rank)
        greedy_ids = complete(1, 0.0)
        sampled_ids = complete(num_generations, args.temperature) if num_generations > 1 else None
    greedy = score(args, tokenizer, reward_fns, eval_set, rows, greedy_ids, 1)[:real]  # (real, num_funcs)
    sampled = None  # (real, num_generations, num_funcs)
    if num_generations > 1:
        sampled = score(args, tokenizer, reward_fns, eval_set, rows, sampled_ids, num_generations)
        sampled = sampled.view(len(rows), num_generations, -1)[:real]
    lengths = torch.tensor([len(c) for c in greedy_ids[:real]], dtype=torch.float)
    if world_size > 1:  # every rank's scores, in rank order: the prompts in order, as on one rank
        parts = [None] * world_size
        dist.all_gather_object(parts, (greedy, sampled, lengths))
        greedy, lengths = torch.cat([p[0] for p in parts]), torch.cat([p[2] for p in parts])
        sampled = torch.cat([p[1] for p in parts]) if num_generations > 1 else None
    metrics = eval_metrics(greedy, sampled, reward_weights, [fn.__name__ for fn in reward_fns])
    metrics.update({"eval/num_prompts": len(greedy), "eval/completions/mean_length": lengths.mean().item()})
    return {**metrics, "timing/eval": time.perf_counter() - t0}


def eval_metrics(greedy, sampled, reward_weights, names):
    """eval/... metrics from the reward functions' scores of each prompt's greedy completion, greedy (P, num_funcs),
    and of its k samples at the training temperature, sampled (P, k, num_funcs) or None. NaN (unscorable) counts as 0
    in the weighted total, as in training. A completion solves its prompt when its total reward is > 0, so
      pass@1 = share of prompts whose greedy completion solves them,
      mean@k = mean total reward of the samples,
      pass@k = share of prompts that one of their k samples solves (exactly k samples: no unbiased estimator needed)."""
    total = (greedy * reward_weights).nansum(-1)  # (P,)
    metrics = {"eval/reward": total.mean().item(), "eval/pass@1": (total > 0).float().mean().item()}
    metrics.update({f"eval/rewards/{name}/mean": greedy[:, j].nanmean().item() for j, name in enumerate(names)})
    if sampled is not None:
        k, total = sampled.shape[1], (sampled * reward_weights).nansum(-1)  # (P, k)
        metrics[f"eval/mean@{k}"] = total.mean().item()
        metrics[f"eval/pass@{k}"] = (total > 0).any(-1).float().mean().item()
        for j, name in enumerate(names):
            metrics[f"eval/rewards/{name}/mean@{k}"] = sampled[..., j].nanmean().item()
    return metrics


def log_completions(args, wandb, tokenizer, prompt_ids, completion_ids, rewards, step):
    """Print the step's first --log-completions (prompt, completion, reward) rows, one short line each, and with --track
    log them to wandb as a table (TRL's "completions" table)."""
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    count = args.log_completions
    rows = [[step, decode(p), decode(c), r] for p, c, r in zip(prompt_ids[:count], completion_ids, rewards.tolist())]
    for _, prompt, completion, reward in rows:
        short = lambda text: textwrap.shorten(text, 70, placeholder=" ...") or repr(text)  # noqa: E731
        tqdm.write(f"  reward {reward:.3g} | {short(prompt)} => {short(completion)}")
    if wandb:
        table = wandb.Table(columns=["step", "prompt", "completion", "reward"], data=rows)
        wandb.log({"completions": table}, step=step)


# ------------------------------------------------------------------------------------------------------------------
# Checkpoints


@contextmanager
def written_atomically(path):
    """Yield a temporary directory to write into, then rename it to `path`: a crash never leaves `path` half written."""
    tmp = f"{path}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    yield tmp
    if os.path.isdir(path):
        old = f"{path}.old-{os.getpid()}"
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old)
    else:
        os.replace(tmp, path)


def save_checkpoint(args, run, model, tokenizer, optimizer, scheduler, global_step, prompts_consumed, world_size):
    """output_dir/checkpoint-<global_step>: weights and tokenizer (save_pretrained), trainer_state.pt (optimizer,
    schedule, step, prompts consumed, every rank's RNG states) and run.json; then this run's checkpoints beyond
    --save-total-limit are deleted. Every rank calls it (gathering the state is a collective); rank 0 writes."""
    model_state, optimizer_state = full_state(model, optimizer)
    cuda = model.device.type == "cuda"
    rng = (torch.get_rng_state(), torch.cuda.get_rng_state() if cuda else None)
    rng_states = [rng] * world_size
    if world_size > 1:
        dist.all_gather_object(rng_states, rng)
    if run is None:
        return
    with written_atomically(os.path.join(args.output_dir, f"checkpoint-{global_step}")) as tmp:
        model.save_pretrained(tmp, state_dict=model_state)
        tokenizer.save_pretrained(tmp)
        state = {"optimizer": optimizer_state, "scheduler": scheduler.state_dict(), "global_step": global_step}
        state.update(prompts_consumed=prompts_consumed, torch_rng=[r[0] for r in rng_states])
        state["cuda_rng"] = [r[1] for r in rng_states] if cuda else None
        torch.save(state, os.path.join(tmp, "trainer_state.pt"))
        write_json(os.path.join(tmp, "run.json"), {**run, "script": "rloo.py", "global_step": global_step})
    if args.save_total_limit:
        for old in run_checkpoints(args.output_dir, run["run_id"])[: -args.save_total_limit]:
            shutil.rmtree(old)  # this run's older checkpoints only, never another run's


def stop_preempted(wandb, global_step, world_size):
    """After the SIGTERM checkpoint: say how to continue, and exit with 143 (128 + SIGTERM: stopped, not finished)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        tip = "the same command with --resume-from-checkpoint latest continues the run"
        print(f"SIGTERM: wrote checkpoint-{global_step} and stopped; {tip}", flush=True)
        if wandb:
            wandb.mark_preempting()
    if world_size > 1:
        dist.destroy_process_group()
    sys.exit(143)


def finish(args, wandb, model, tokenizer, metrics_file, output_lock, world_size):
    """The final model + tokenizer in output_dir (not after --max-steps 0, which only evaluated), then close the
    metrics, wandb, the output directory's lock and the process group."""
    model_state = full_state(model, None)[0] if args.max_steps else None
    if metrics_file is not None:  # rank 0
        if args.max_steps:
            save_final(args.output_dir, model, tokenizer, model_state)
            print(f"saved the final model to {args.output_dir}")
        metrics_file.close()
        if wandb:
            wandb.finish()
    if output_lock is not None:
        os.close(output_lock)  # the run is over: the directory is free for the next one
    if world_size > 1:
        dist.barrier()  # no rank tears down gloo while another is still saving (a rank aborted at exit under load)
        dist.destroy_process_group()


def full_state(model, optimizer):
    """Unsharded weights and optimizer state: on one rank the model's and optimizer's own tensors (torch.save copies GPU
    tensors one by one); with FSDP2 gathered onto rank 0's CPU by name (a collective; others get empty dicts)."""
    if not dist.is_initialized():
        return model.state_dict(), optimizer.state_dict() if optimizer is not None else None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    optimizer_state = optimizer.state_dict() if optimizer is not None else None
    if optimizer is not None and optimizer.state:  # torch would fill an empty state with an AdamW step at lr 0
        optimizer_state = get_optimizer_state_dict(model, optimizer, options=options)
    return get_model_state_dict(model, options=options), optimizer_state


def save_final(output_dir, model, tokenizer, state_dict=None):
    """save_pretrained into output_dir itself, next to checkpoints and metrics: the files are written to a temporary
    folder, then each is moved in with an atomic rename, config.json last, so a config.json means a complete model."""
    tmp = os.path.join(output_dir, f".final-tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=state_dict)
    tokenizer.save_pretrained(tmp)
    for name in sorted(os.listdir(tmp), key=lambda n: n == "config.json"):
        os.replace(os.path.join(tmp, name), os.path.join(output_dir, name))
    os.rmdir(tmp)


# ------------------------------------------------------------------------------------------------------------------
# Start-up: arguments, data and the output directory, all checked before any model loads


def looks_local(path):
    """A path that cannot be a hub name: absolute, ./ ../ ~, several '/', or its first folder exists here."""
    return path.startswith(("/", ".", "~")) or path.count("/") > 1 or "\\" in path or os.path.isdir(path.split("/")[0])


def check_args(args, world_size=1):
    """Every check that needs neither a model nor the data: value ranges, flag combinations, and that local paths exist
    (a missing local model would otherwise surface later, as a hub error); exits with one line per problem."""
    problems = []
    floor = args.vllm_importance_sampling_clip_min or 0  # --vllm-importance-sampling-clip-max must exceed it
    rules = [  # (field, true for a valid value, what it must be); None (an option left unset) is always valid
        ("num_generations", lambda v: v >= 2, "at least 2: the leave-one-out baseline needs another completion"),
        ("prompts_per_step", lambda v: v >= 1, "at least 1"),
        ("max_prompt_length", lambda v: v >= 1, "at least 1"),
        ("max_completion_length", lambda v: v >= 1, "at least 1 (new tokens per completion)"),
        ("temperature", lambda v: v > 0, "> 0"),
        ("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
        ("top_k", lambda v: v >= 0, ">= 0 (0 = off)"),
        ("min_p", lambda v: 0 <= v <= 1, "in [0, 1] (0 = off)"),
        ("repetition_penalty", lambda v: v > 0, "> 0 (1 = off)"),
        ("vllm_gpu_memory_utilization", lambda v: 0 < v <= 1, "in (0, 1]"),
        ("vllm_tensor_parallel_size", lambda v: v >= 1, "at least 1"),
        ("vllm_max_model_len", lambda v: v >= 1, "at least 1"),
        ("vllm_server_port", lambda v: 0 < v < 65536, "a TCP port (1-65535)"),
        ("vllm_server_timeout", lambda v: v > 0, "> 0 seconds"),
        ("vllm_group_port", lambda v: 0 < v < 65536, "a TCP port (1-65535)"),
        ("vllm_importance_sampling_clip_min", lambda v: v >= 0, ">= 0"),
        ("vllm_importance_sampling_clip_max", lambda v: v > floor, "> --vllm-importance-sampling-clip-min (and > 0)"),
        ("epsilon", lambda v: v >= 0, ">= 0"),
        ("epsilon_high", lambda v: v >= 0, ">= 0"),
        ("beta", lambda v: v >= 0, ">= 0"),
        ("reward_clip_range", lambda v: v[0] < v[1], "LOW HIGH with LOW < HIGH"),
        ("num_iterations", lambda v: v >= 1, "at least 1"),
        ("steps_per_generation", lambda v: v >= 1, "at least 1"),
        ("learning_rate", lambda v: v >= 0, ">= 0"),
        ("weight_decay", lambda v: v >= 0, ">= 0"),
        ("adam_beta1", lambda v: 0 <= v < 1, "in [0, 1)"),
        ("adam_beta2", lambda v: 0 <= v < 1, "in [0, 1)"),
        ("warmup_steps", lambda v: v >= 0, ">= 0"),
        ("max_steps", lambda v: v >= 0, ">= 0 (0 = evaluate the model and exit)"),
        ("micro_batch_tokens", lambda v: v >= 1, "at least 1"),
        ("logging_steps", lambda v: v >= 1, "at least 1"),
        ("save_steps", lambda v: v >= 0, ">= 0 (0 = only the final model)"),
        ("save_total_limit", lambda v: v >= 0, ">= 0"),
        ("log_completions", lambda v: v >= 0, ">= 0 (0 = off)"),
        ("eval_steps", lambda v: v >= 0, ">= 0 (0 = no evaluation during training)"),
        ("eval_max_samples", lambda v: v >= 1, "at least 1"),
        ("eval_num_generations", lambda v: v >= 1, "at least 1"),
    ]
    for name, valid, must in rules:
        value = getattr(args, name)
        if value is not None and not valid(value):
            problems.append(f"--{name.replace('_', '-')} must be {must}, got {value}")
    if args.steps_per_generation >= 1 and args.prompts_per_step % (args.steps_per_generation * world_size):
        problems.append(
            f"--prompts-per-step {args.prompts_per_step} must be divisible by --steps-per-generation x the "
            f"number of processes ({args.steps_per_generation} x {world_size}): whole groups per rank and step"
        )
    steps_per_round = args.steps_per_generation * args.num_iterations
    if steps_per_round > 0 and args.save_steps % steps_per_round:
        problems.append(
            f"--save-steps {args.save_steps} must be a multiple of the optimizer steps per generation round "
            f"(--steps-per-generation x --num-iterations = {steps_per_round}): checkpoints are written between rounds"
        )
    if steps_per_round > 0 and args.eval_steps % steps_per_round:
        problems.append(
            f"--eval-steps {args.eval_steps} must be a multiple of the optimizer steps per generation "
            f"round ({steps_per_round}): evaluation runs between rounds, after the weight push"
        )
    if args.reward_weights is not None and len(args.reward_weights) != len(args.reward_funcs):
        problems.append(
            f"--reward-weights has {len(args.reward_weights)} values for {len(args.reward_funcs)} --reward-funcs"
        )
    if args.use_vllm:
        problems += vllm_utils.setup_problems()
    if args.async_generation and not (args.use_vllm and args.vllm_mode == "server"):
        problems.append(
            "--async-generation needs --use-vllm --vllm-mode server: a colocated engine or `generate` share "
            "the trainer's GPU, so generation cannot overlap training"
        )
    # local paths: a directory that is not there is reported as such, not as a hub name that does not parse
    for name, marker, kind in (
        ("model_name_or_path", "config.json", "model"),
        ("resume_from_checkpoint", "trainer_state.pt", "checkpoint"),
    ):
        path = getattr(args, name)
        if path is None or (name == "resume_from_checkpoint" and path == "latest"):
            continue
        if os.path.isdir(path) and not os.path.exists(os.path.join(path, marker)):
            problems.append(f"--{name.replace('_', '-')} {path}: that directory has no {marker}, so it is not a {kind}")
        elif not os.path.isdir(path) and (kind == "checkpoint" or looks_local(path)):
            problems.append(f"--{name.replace('_', '-')} {path}: no such directory")
    for flag, name in (("--dataset-name", args.dataset_name), ("--eval-dataset", args.eval_dataset)):
        if name is not None and is_local_data(name) and not os.path.exists(name):
            problems.append(f"{flag} {name} does not exist (no such file or directory)")
    evaluating = args.eval_steps > 0 or args.max_steps == 0
    if evaluating and eval_source(args) is None:
        problems.append(
            f"{'--eval-steps' if args.eval_steps else '--max-steps 0 (evaluate and exit)'} needs an eval dataset: "
            f"--dataset-name {args.dataset_name} is a local file, with no test split; pass --eval-dataset"
        )
    if args.eval_dataset and not evaluating:
        problems.append(
            "--eval-dataset is evaluated with --eval-steps N (during training) or --max-steps 0 (once): pass one"
        )
    if os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir):
        problems.append(f"--output-dir {args.output_dir} is a file, not a directory")
    if problems:
        raise SystemExit("\n".join(["error: " + p for p in problems]))


def reward_functions(names):
    """The functions of rewards.py that --reward-funcs names."""
    public = sorted(n for n, f in vars(rewards).items() if n[0] != "_" and callable(f) and f.__module__ == "rewards")
    for name in names:
        if name not in public:
            raise SystemExit(
                f"error: unknown reward function '{name}'. --reward-funcs takes names from rewards.py: {public}"
            )
    return [getattr(rewards, name) for name in names]


def is_local_data(name):
    """A dataset name that is a local file (or directory), not a hub dataset."""
    return name.endswith((".json", ".jsonl", ".parquet")) or looks_local(name)


def eval_source(args):
    """(name, config, split) of the eval dataset: --eval-dataset, else the training dataset's --eval-dataset-split if it
    is a hub dataset (a local file has no splits); None if there is none."""
    if not args.eval_dataset and is_local_data(args.dataset_name):
        return None
    name = args.eval_dataset or args.dataset_name
    config = args.eval_dataset_config or (args.dataset_config if name == args.dataset_name else None)
    return name, config, args.eval_dataset_split


def read_dataset(args, reward_fns, evaluation=False):
    """Read the dataset (with `evaluation`, the eval dataset of eval_source, its first --eval-max-samples records) once,
    before any model loads, and check it (check_dataset): {column: list of values}. Local .jsonl / .json files are
    parsed here, so that a malformed record is reported with its file and line; .parquet files and hub datasets
    through `datasets`."""
    source = eval_source(args) if evaluation else (args.dataset_name, args.dataset_config, args.dataset_split)
    flag, (name, config, split) = "--eval-dataset" if evaluation else "--dataset-name", source
    if name.endswith((".json", ".jsonl")):
        with open(name, encoding="utf-8") as f:
            text = f.read()
        try:  # a .json file may hold one array of records; anything else is read as one record per line
            array = json.loads(text)
        except json.JSONDecodeError:
            array = None
        where, records = ("record", list(enumerate(array, 1))) if isinstance(array, list) else ("line", [])
        if where == "line":
            for number, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    records.append((number, json.loads(line)))
                except json.JSONDecodeError as error:
                    raise SystemExit(
                        f"error: {flag} {name}, line {number}: not valid JSON ({error.msg}, column "
                        f"{error.colno}): {line[:120]}"
                    ) from None
        for number, record in records:
            if not isinstance(record, dict):
                raise SystemExit(
                    f"error: {flag} {name}, {where} {number}: a JSON object per record is expected, "
                    f"got {type(record).__name__}"
                )
        columns = dict.fromkeys(column for _, record in records for column in record)  # in order of appearance
        dataset = {column: [record.get(column) for _, record in records] for column in columns}
    else:
        from datasets import load_dataset

        if name.endswith(".parquet"):
            dataset = load_dataset("parquet", data_files=name, split="train").to_dict()
        else:
            try:
                dataset = load_dataset(name, config, split=split).to_dict()
            except ValueError as error:  # e.g. no such split
                raise SystemExit(f"error: {flag} {name}, split {split}: {error}") from None
    if not dataset or not next(iter(dataset.values())):
        raise SystemExit(f"error: {flag} {name} holds no records")
    if evaluation:
        dataset = {c: v[: args.eval_max_samples] for c, v in dataset.items()}
    check_dataset(args, dataset, reward_fns, flag, name)
    return dataset


def check_dataset(args, dataset, reward_fns, flag, name):
    """The columns that the flags name exist in the dataset of `flag` (training or eval), and each reward function
    finds every argument it requires (its signature against the dataset's columns and what the trainer passes)."""
    columns = list(dataset)
    for option, column in (("--prompt-column", args.prompt_column), ("--answer-column", args.answer_column)):
        if (column or option == "--prompt-column") and column not in columns:
            raise SystemExit(
                f"error: dataset {name} has no column '{column}' (its columns: {columns}). "
                f"Pass {option} with one of those"
                + (', or --answer-column "" if it has none.' if "answer" in option else ".")
            )
    # what reward functions receive (load_prompts: answer column as `answer`)
    given = set(columns) - {args.prompt_column}
    if args.answer_column and args.answer_column != "answer":
        given = given - {args.answer_column} | {"answer"}
    given |= {"completions", "prompts", "completion_ids", "max_completion_length", *args.reward_kwargs}
    for fn in reward_fns:
        for p in inspect.signature(fn).parameters.values():
            if p.default is not p.empty or p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) or p.name in given:
                continue  # optional, *args / **kwargs, or given by a column or the trainer
            if p.name == "answer":
                raise SystemExit(
                    f"error: reward function '{fn.__name__}' needs the reference answer, and --answer-column "
                    f"'{args.answer_column}' gives none: pass --answer-column with the column of {name} that "
                    f"holds it (its columns: {columns})"
                )
            raise SystemExit(
                f"error: reward function '{fn.__name__}' (--reward-funcs) needs a column '{p.name}', which "
                f"{flag} {name} does not have (its columns: {columns})"
            )


def read_json(path):
    """The JSON value in the file `path`, or None if there is none (or it is unreadable)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_json(path, value):
    """Write `value` as JSON through a temporary file and a rename: a reader never sees half a file."""
    with open(f"{path}.tmp-{os.getpid()}", "w") as f:
        json.dump(value, f, indent=1)
    os.replace(f"{path}.tmp-{os.getpid()}", path)


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        pass
    return True


CHECKPOINT = r"checkpoint-\d+"  # the name of a checkpoint directory in output_dir (a regular expression)


def run_checkpoints(output_dir, run_id):
    """The checkpoint-N directories in output_dir that belong to run `run_id` (their run.json says so), oldest first.
    Checkpoints written before runs had ids have no run.json: they match run_id None (a directory without run.json)."""
    found = []
    for name in os.listdir(output_dir) if os.path.isdir(output_dir) else []:
        path = os.path.join(output_dir, name)
        if re.fullmatch(CHECKPOINT, name) and (read_json(os.path.join(path, "run.json")) or {}).get("run_id") == run_id:
            found.append((int(name.removeprefix("checkpoint-")), path))
    return [path for _, path in sorted(found)]


def remove_dead_temporaries(output_dir):
    """Remove what a dead process left while saving: checkpoint-N.tmp-PID (half written), .final-tmp-PID, and
    checkpoint-N.old-PID (a complete checkpoint moved aside for its replacement: put back if that never arrived)."""
    for name in sorted(os.listdir(output_dir)):
        match = re.fullmatch(rf"({CHECKPOINT}|run\.json)\.(tmp|old)-(\d+)|\.final-tmp-(\d+)", name)
        if not match or pid_alive(int(match[3] or match[4])):
            continue
        path = os.path.join(output_dir, name)
        if match[2] == "old" and not os.path.exists(os.path.join(output_dir, match[1])):
            os.replace(path, os.path.join(output_dir, match[1]))
            print(f"{output_dir}: put back {match[1]} from {name}, left by a process that died while replacing it")
        else:
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
            print(f"{output_dir}: removed {name}, left by a process that died while saving")


def claim_output_dir(args, script):
    """Make --output-dir this run's (rank 0, before any model loads); returns (run, checkpoint to resume or None, the
    lock's file descriptor).

    run = {"run_id", "run_name"}: the identity written into output_dir/run.json and into every checkpoint, so that
    `latest`, --save-total-limit and a resumed wandb run concern this run only.
    * A lock (flock on output_dir/.lock, held for the life of the process and released by the kernel however it
      ends, SIGKILL included) keeps a second live run out of the directory.
    * Temporaries of dead processes (a SIGINT during a save) are removed.
    * A directory holding another run's files is refused, unless --resume-from-checkpoint continues that run or
      --overwrite-output-dir starts a new run there (its metrics.jsonl and final model are replaced; its
      checkpoints stay, never resumed or deleted by this run).
    * A checkpoint at or past --max-steps is refused: there would be nothing to train."""
    out, locked = args.output_dir, False
    created, lock_created = not os.path.isdir(out), not os.path.exists(os.path.join(out, ".lock"))
    os.makedirs(out, exist_ok=True)
    lock = os.open(os.path.join(out, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
        except BlockingIOError:
            holder = os.pread(lock, 300, 0).decode(errors="replace").strip() or "another process"
            raise SystemExit(
                f"error: --output-dir {out} is in use by a run that is still going ({holder}): two runs in "
                f"one directory overwrite each other's checkpoints and metrics. Wait for it to end, or pass "
                f"another --output-dir."
            ) from None
        except OSError as error:  # a file system without flock (some network mounts): run, but say so
            print(f"warning: cannot lock {out}/.lock ({error}): nothing keeps a second run out of this directory")
        os.ftruncate(lock, 0)
        now = time.strftime("%Y-%m-%d %H:%M:%S")
        os.pwrite(lock, f"{script}, pid {os.getpid()} on {socket.gethostname()}, since {now}".encode(), 0)
        remove_dead_temporaries(out)
        owner = read_json(os.path.join(out, "run.json")) or {}
        files = sorted(set(os.listdir(out)) - {".lock", "run.json"})
        checkpoint = args.resume_from_checkpoint
        if checkpoint == "latest":
            checkpoint = run_checkpoints(out, owner.get("run_id"))[-1:]
            if not checkpoint:
                others = ", ".join(f for f in files if re.fullmatch(CHECKPOINT, f))
                tip = f" ({others} are another run's: pass one's path to --resume-from-checkpoint to continue that run)"
                raise SystemExit(
                    f"error: --resume-from-checkpoint latest: no checkpoint-N directory in {out} of the run that owns "
                    f"it{tip if others else ''}"
                )
            checkpoint = checkpoint[0]
        resumed = (read_json(os.path.join(checkpoint, "run.json")) or {}) if checkpoint else {}
        if resumed.get("script", script) != script:
            raise SystemExit(
                f"error: --resume-from-checkpoint {checkpoint} is a checkpoint of {resumed['script']}: "
                f"continue that run with {resumed['script']}, not {script}"
            )
        if files and not (checkpoint and resumed.get("run_id") == owner.get("run_id")):
            if not args.overwrite_output_dir:
                listed = ", ".join(files[:5]) + (f" and {len(files) - 5} more" if len(files) > 5 else "")
                whose = f"files that are not this run's ({listed})"
                if owner.get("script"):
                    whose = f"another run's files ({listed}; a {owner['script']} run started {owner['started']})"
                raise SystemExit(
                    f"error: --output-dir {out} holds {whose}. A new run there would replace its model and mix its "
                    "metrics and checkpoints with this one's. To continue that run, pass --resume-from-checkpoint "
                    "latest (or a checkpoint's path); to start a new run there anyway, pass --overwrite-output-dir "
                    "(its metrics.jsonl and final model are replaced, its checkpoints are kept and never resumed or "
                    "deleted by the new run); or pass another --output-dir."
                )
            for name in ("metrics.jsonl", "config.json"):  # a new metrics file; no complete model until this run's
                if os.path.exists(os.path.join(out, name)):
                    os.remove(os.path.join(out, name))
            print(
                f"--overwrite-output-dir: a new run in {out}; the earlier run's metrics.jsonl is deleted, its model "
                f"files are replaced at the end, its checkpoints are left alone"
            )
        if checkpoint:
            step = resumed.get("global_step")
            if step is None:  # a checkpoint written before run.json existed
                state = torch.load(os.path.join(checkpoint, "trainer_state.pt"), weights_only=False, mmap=True)
                step = state["global_step"]
            if step >= args.max_steps:
                raise SystemExit(
                    f"error: --resume-from-checkpoint {checkpoint} is at step {step} and --max-steps is "
                    f"{args.max_steps}: there is nothing left to train. Raise --max-steps to train on from it "
                    f"(the learning-rate schedule follows --max-steps), or load it as a model."
                )
        if checkpoint and resumed.get("run_id"):
            run = {"run_id": resumed["run_id"], "run_name": resumed["run_name"]}  # the same run continues
        else:
            run = {"run_id": uuid.uuid4().hex[:12], "run_name": f"{args.exp_name}__{args.seed}__{int(time.time())}"}
            atexit.register(forget_unstarted_run, out, run["run_id"], created)
        if run["run_id"] != owner.get("run_id"):
            write_json(os.path.join(out, "run.json"), {**run, "script": script, "started": now, "args": asdict(args)})
        return run, checkpoint, lock
    except BaseException:
        if locked and lock_created:  # refused before writing anything: leave the directory as it was
            os.remove(os.path.join(out, ".lock"))
            if created and not os.listdir(out):
                os.rmdir(out)
        os.close(lock)  # the lock goes with it
        raise


def forget_unstarted_run(output_dir, run_id, created):
    """At exit: a run that wrote only run.json (it failed to start) removes it, and the directory if the run made it."""
    try:
        only_run_json = set(os.listdir(output_dir)) <= {".lock", "run.json"}
        if only_run_json and read_json(os.path.join(output_dir, "run.json"))["run_id"] == run_id:
            os.remove(os.path.join(output_dir, "run.json"))
            os.remove(os.path.join(output_dir, ".lock"))
            if created:
                os.rmdir(output_dir)
    except (OSError, TypeError, KeyError):
        pass


def on_sigterm():
    """Preemption: a cluster scheduler sends SIGTERM, then SIGKILL after a grace period. SIGTERM sets the returned
    event; the loop then writes a checkpoint at the end of the current step and exits (resume with
    --resume-from-checkpoint latest). A second SIGTERM ends the process at once."""
    requested = threading.Event()

    def handler(signum, frame):
        requested.set()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    signal.signal(signal.SIGTERM, handler)
    return requested


def parse_args(argv=None):
    """tyro.cli(Args), with --help in the groups of the "# ..." comment headers in Args (those of README.md's option
    table). tyro groups the options of nested dataclasses, so each header's fields become one nested dataclass whose
    flags keep their names (OmitArgPrefixes); the parsed groups are merged back into one flat Args."""
    source = inspect.getsource(Args)
    body = ast.parse(textwrap.dedent(source)).body[0].body
    pairs = [(a, b) for a, b in itertools.pairwise(body) if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr)]
    docs = {a.target.id: " ".join(b.value.value.split()) for a, b in pairs}  # each field's docstring, on one line
    groups, title = {}, None
    for line in source.splitlines():
        if header := re.match(r" {4}# (.+?)(?: \(.*)?$", line):
            title = header[1]
        elif name := re.match(r" {4}(\w+):", line):
            groups.setdefault(title, []).append(name[1])
    fields = {f.name: f for f in dataclasses.fields(Args)}

    def option(f):  # an Args field as a field of its group, with its docstring as the --help text
        default = dataclasses.field(default=f.default, default_factory=f.default_factory)
        return f.name, Annotated[f.type, tyro.conf.arg(help=docs[f.name])], default

    parts = []
    for title, names in groups.items():
        group = dataclasses.make_dataclass(title, [option(fields[n]) for n in names])
        group.__doc__ = ""
        name = re.sub(r"\W+", "_", title).lower()
        parts.append((name, tyro.conf.OmitArgPrefixes[group], dataclasses.field(default_factory=group)))
    description = "\n\n".join(__doc__.split("\n\n")[:3])  # what it does, and the CPU example
    parsed = tyro.cli(dataclasses.make_dataclass("Args", parts), args=argv, description=description)
    return Args(**{k: v for part in dataclasses.fields(parsed) for k, v in vars(getattr(parsed, part.name)).items()})


if __name__ == "__main__":
    train(parse_args())
