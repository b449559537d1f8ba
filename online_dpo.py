# Online DPO (and online IPO) in one file. Docs: docs/online_dpo.md.
"""Online Direct Preference Optimization for language models, with vLLM or Hugging Face `generate` for sampling.

Every step: sample G completions per prompt from the current policy, score them (reward functions or a reward model),
pair the best with the worst, and take one optimizer step on the DPO loss against a frozen copy of the initial
model (online AI feedback: Guo et al. 2024, arXiv 2402.04792; DPO: arXiv 2305.18290 eq. 7; IPO: arXiv 2310.12036
eq. 17). A run writes its model, checkpoints and metrics.jsonl to a directory of its own:
runs/{exp_name}__{seed}__{unix time}, or --output-dir.

Example, on the CPU (no download; docs/online_dpo.md says how long it takes): the bundled 260K-parameter TinyStories model,
rewarded for the word "play", puts it into almost every story:
  OMP_NUM_THREADS=1 python online_dpo.py --model-name-or-path tests/assets/stories260K \\
      --dataset-name tests/assets/stories_prompts.jsonl --prompt-column prompt --answer-column "" \\
      --reward-funcs keyword_reward --no-use-chat-template --num-generations 4 --prompts-per-step 8 \\
      --max-completion-length 24 --learning-rate 3e-4 --max-steps 30

More examples:
  # one GPU, vLLM inside the training process
  python online_dpo.py --reward-funcs gsm8k_accuracy --use-vllm --vllm-mode colocate --vllm-enable-sleep-mode
  # a stock `vllm serve` on the trainer's GPU or on others (docs/vllm.md), scored by a reward model
  python online_dpo.py --reward-model-path Skywork/Skywork-Reward-V2-Qwen3-0.6B --use-vllm --vllm-mode server

Reading order: Args, ALGO LOGIC (pairs, the DPO / IPO loss), train() (the loop: generate, score, pairs, loss, optimizer
step, push, evaluate, log) and the reward model's scoring, then the PLUMBING block that all three scripts share
(grpo.py holds its master copy).
"""

import atexit
import contextlib
import fcntl
import functools
import itertools
import json
import math
import os
import pickle
import re
import shlex
import shutil
import signal
import socket
import sys
import textwrap
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, wait
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Literal, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
import tyro
from tqdm import tqdm

import rewards
import vllm_utils


@dataclass
class Args:
    # Experiment
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (the run directory is runs/{exp_name}__{seed}__{unix time})"""
    seed: int = 1
    """seed of the experiment: prompt order, sampling and initialisation"""
    track: bool = False
    """log metrics to Weights & Biases"""
    wandb_project_name: str = "vllm-rl"
    """the wandb project name"""
    wandb_entity: str | None = None
    """the wandb entity (team)"""
    output_dir: str | None = None
    """where checkpoints, metrics.jsonl and the final model + tokenizer are written (None: a new
    runs/{exp_name}__{seed}__{unix time}); a new run refuses a directory that holds files"""

    # Model
    model_name_or_path: str = "Qwen/Qwen2.5-0.5B-Instruct"
    """Hugging Face causal LM: a hub name or a local path (also the frozen reference model)"""
    trust_remote_code: bool = False
    """allow the model's own Python code (its config's auto_map) for every load (policy, tokenizer, reference model,
    served model's comparison); off: never run code from the model's directory or from a server's answer"""
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of the trained weights and of the reference model (float32 keeps small AdamW updates from rounding away)"""
    bf16: bool = True
    """run forward/backward under bfloat16 autocast on CUDA (ignored on the CPU)"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory"""
    torch_compile: bool = True
    """torch.compile each decoder layer's forward (CUDA, with --use-vllm, one process); the first step compiles"""
    use_chat_template: bool = True
    """wrap plain-text prompts as a user message and apply the tokenizer's chat template (if it has one)"""
    system_prompt: str | None = None
    """optional system message put before every prompt"""
    freeze_vision_tower: bool = True
    """with images: train the language model and the projector, not the vision encoder (docs/vision.md)"""

    # LoRA (peft): a frozen bf16 base, adapters in --param-dtype; vLLM gets the merged weights (docs/grpo.md)
    use_peft: bool = False
    """train LoRA adapters instead of the whole model; the reference model is the base (adapters disabled, no copy)"""
    lora_r: int = 16
    """LoRA rank r"""
    lora_alpha: int = 32
    """LoRA alpha: the update is (alpha / r) B A"""
    lora_dropout: float = 0.0
    """dropout on the adapters' input (TRL: 0.05; here 0: with dropout two passes over the same tokens disagree)"""
    lora_target_modules: list[str] | None = None
    """names of the modules to adapt (None: every linear layer of the decoder, peft's all-linear; TRL's None is
    peft's per-model default, q/v only for Qwen2); for a MoE model name its attention and dense layers (docs/lora.md)"""
    save_merged_model: bool = False
    """with --use-peft: also write the merged model (base + adapter, bf16) to {output_dir}/merged at the end"""

    # Data
    dataset_name: str = "openai/gsm8k"
    """hub dataset name, or a local .json / .jsonl / .csv / .parquet file"""
    dataset_config: str | None = "main"
    """dataset configuration name (hub datasets only)"""
    dataset_split: str = "train"
    """split to train on"""
    prompt_column: str = "question"
    """column holding the prompt: a string, or a list of chat messages"""
    answer_column: str = "answer"
    """column holding the reference answer, passed to rewards as `answer` ("" if there is none)"""
    image_column: str = "image"
    """column holding each prompt's image, or a list of them (untyped: `image`, else `images`, if there; "" = none): a
    path relative to the dataset file, or datasets' Image; a reward naming `images` gets them (docs/vision.md)"""
    mm_processor_kwargs: dict[str, int | float | str] = field(default_factory=dict)
    """with images: the image processor's settings, for the trainer's processor and a colocated vLLM alike (e.g.
    Qwen2.5-VL's `min_pixels 3136 max_pixels 401408`; a server: `vllm serve --mm-processor-kwargs`)"""
    max_prompt_length: int | None = None
    """drop prompts with more tokens than this (None = keep all, and an over-long prompt is an error)"""

    # Generation
    num_generations: int = 2
    """G: completions sampled per prompt; the highest- and lowest-scored form the preference pair"""
    prompts_per_step: int = 16
    """unique prompts per generation round (at most one pair each)"""
    max_completion_length: int = 64
    """maximum new tokens per completion"""
    temperature: float = 0.9
    """sampling temperature (policy and reference log-probs are computed at the same temperature)"""
    top_p: float = 1.0
    """nucleus sampling"""
    top_k: int = 0
    """top-k sampling (0 = off)"""
    min_p: float = 0.0
    """min-p sampling (0 = off)"""
    repetition_penalty: float = 1.0
    """repetition penalty (1 = off)"""

    # vLLM (docs/vllm.md)
    use_vllm: bool = False
    """generate with vLLM instead of Hugging Face `generate`"""
    vllm_mode: Literal["colocate", "server"] = "colocate"
    """colocate: a vllm.LLM inside this process; server: a separate `vllm serve` reached over HTTP, on other GPUs
    (weights over NCCL) or on this one GPU (weights as CUDA IPC handles): its --weight-transfer-config decides"""
    vllm_gpu_memory_utilization: float = 0.3
    """colocate: share of the GPU's memory vLLM may take (weights + KV cache)"""
    vllm_tensor_parallel_size: int = 1
    """colocate: tensor-parallel size of the in-process engine"""
    vllm_max_model_len: int | None = None
    """colocate: context length of the engine (None = longest prompt + max_completion_length)"""
    vllm_enable_sleep_mode: bool = False
    """colocate: free vLLM's memory (sleep level 2) while training"""
    vllm_model_impl: Literal["auto", "vllm", "transformers"] = "auto"
    """colocate: vLLM's model code, or its transformers backend for a model vLLM has none for (a server: `vllm serve
    --model-impl`)"""
    vllm_server_host: str = "127.0.0.1"
    """server: host of `vllm serve`"""
    vllm_server_port: list[int] = field(default_factory=lambda: [8000])
    """server: port of `vllm serve`; several (`--vllm-server-port 8000 8001`): servers of one model on this GPU
    (CUDA IPC), each round shared by them (docs/vllm.md, "Several servers")"""
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
    """server: size of each packed weight chunk (NCCL: two in flight on each side; IPC: one, reused; lower it if
    memory is short)"""
    async_generation: bool = False
    """server: generate the next round while training on this one (a step costs about max(generation, training)
    instead of their sum). Each round is sampled by the weights one step behind the ones it trains: the DPO loss
    needs no correction for that (it is off-policy by construction), and sampling/staleness logs it"""

    # Rewards (and the pairs they rank)
    reward_funcs: list[str] = field(default_factory=list)
    """names of functions in rewards.py; their weighted sum is the reward (e.g. gsm8k_accuracy); or --reward-model-path"""
    reward_weights: list[float] | None = None
    """one weight per reward function (None = all 1)"""
    reward_kwargs: dict[str, float | str] = field(default_factory=dict)
    """extra keyword arguments (numbers or strings) for every reward function, e.g. overlong_buffer_length 128 or
    keyword play; a key may not be a dataset column's name"""
    reward_model_path: str | None = None
    """instead of --reward-funcs: a sequence-classification model (num_labels 1) that scores prompt + completion"""
    missing_eos_penalty: float | None = None
    """subtract this from the reward of every completion that did not end with EOS (None = off)"""

    # Loss
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    """sigmoid: DPO, -log sigmoid(beta z) (arXiv 2305.18290 eq. 7); ipo: (z - 1/(2 beta))^2 (arXiv 2310.12036 eq. 17)"""
    beta: list[float] = field(default_factory=lambda: [0.1])
    """strength of the pull towards the reference model; one value per epoch over the prompts, the last one reused"""

    # Optimization
    learning_rate: float = 5e-7
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
    """total steps (generation rounds; a round with no pair takes no optimizer step but counts; 0: only evaluate)"""
    micro_batch_tokens: int | None = None
    """token budget (rows x padded length) of one forward/backward micro-batch; gradients accumulate over them
    (None: 16384, or 8192 with --use-peft: LoRA is for large models, docs/lora.md)"""

    # Logging and checkpoints
    logging_steps: int = 1
    """print a metrics line every this many steps"""
    log_completions: int = 0
    """every logging step, print this many (prompt, completion, reward) rows (--track: also a wandb table; 0 = off)"""
    save_steps: int = 0
    """write a resumable checkpoint every this many steps (0 = only the final model)"""
    save_total_limit: int | None = 2
    """keep only the newest this many checkpoints (0 or None = keep every checkpoint)"""
    resume_from_checkpoint: str | None = None
    """a checkpoint directory, whose run continues in its directory; or "latest": the newest complete checkpoint in
    --output-dir"""

    # Evaluation (docs/evaluation.md)
    eval_steps: int = 0
    """evaluate at step 0, every this many steps and after the last step (0 = no evaluation in training)"""
    eval_dataset: str | None = None
    """hub dataset name, or a local .json / .jsonl / .csv / .parquet file, read with the training column flags (None =
    the training dataset's --eval-dataset-split, when it is a hub dataset)"""
    eval_dataset_config: str | None = None
    """configuration of --eval-dataset (None = --dataset-config when evaluating on the training dataset)"""
    eval_dataset_split: str = "test"
    """split to evaluate on (hub datasets only)"""
    eval_max_samples: int | None = None
    """evaluate on the first this many prompts (None = all)"""
    eval_num_generations: int = 1
    """k: besides the greedy completion of each prompt (pass@1), sample k at --temperature for mean@k and pass@k (1 =
    greedy only). A completion solves its prompt when its weighted total reward is > 0"""


# ==================================================================================================================
# ALGO LOGIC: rewards -> preference pairs -> the DPO loss (what a fork changes)


def truncated_completions(completion_ids, eos_ids):
    """(N,) float: 1 for each completion whose last token is not an EOS (it hit max_completion_length), else 0."""
    return torch.tensor([not (c and c[-1] in eos_ids) for c in completion_ids], dtype=torch.float32)


def apply_missing_eos_penalty(rewards, completion_ids, eos_ids, penalty):
    """rewards - penalty for each completion whose last token is not an EOS (it hit max_completion_length)."""
    return rewards - penalty * truncated_completions(completion_ids, eos_ids)


def select_pairs(rewards, num_generations):
    """Pick one (chosen, rejected) pair per prompt: the highest- and the lowest-rewarded of its G completions.

    rewards: (N,) with N = num_prompts * G, groups contiguous; NaN marks an unscorable completion, left out of the
    choice. A prompt with fewer than 2 scorable completions, or whose scorable completions all tie, gives no pair.
    Returns chosen and rejected indices into the N completions, the number of tied prompts and of unscorable ones."""
    grouped = rewards.view(-1, num_generations)  # (num_prompts, G)
    chosen, rejected, num_tied, num_unscorable = [], [], 0, 0
    for g, group in enumerate(grouped.tolist()):
        valid = [k for k, r in enumerate(group) if not math.isnan(r)]
        if len(valid) < 2:
            num_unscorable += 1
            continue
        best = max(valid, key=lambda k: group[k])  # the first of equals: completions are exchangeable
        worst = min(valid, key=lambda k: group[k])
        if group[best] == group[worst]:
            num_tied += 1
            continue
        chosen.append(g * num_generations + best)
        rejected.append(g * num_generations + worst)
    return chosen, rejected, num_tied, num_unscorable


def sequence_logprobs(model, prompt_ids, completion_ids, temperature, device, pad_id, images=None):
    """log pi(completion | prompt) = sum_t log pi(c_t | prompt, c_<t) at the sampling temperature, (B,); a gradient
    through it comes from loss.backward() (into_grad). images: the prompts' Images (image_inputs), or None."""
    batch = collate(prompt_ids, completion_ids, device, pad_id)
    return per_token_logprobs(model, *batch, temperature, into_grad=True, images=images).sum(-1)  # (B,): padding is 0


def dpo_loss(chosen_logprobs, rejected_logprobs, ref_chosen_logprobs, ref_rejected_logprobs, beta, loss_type="sigmoid"):
    """Per-pair loss, (num_pairs,), from sequence log-probs. With
    z = (log pi(chosen) - log pi(rejected)) - (log pi_ref(chosen) - log pi_ref(rejected)):
      sigmoid (DPO, arXiv 2305.18290 eq. 7):              -log sigmoid(beta * z)
      ipo     (IPO, arXiv 2310.12036 eq. 17, tau = beta):  (z - 1 / (2 * beta))^2"""
    z = (chosen_logprobs - rejected_logprobs) - (ref_chosen_logprobs - ref_rejected_logprobs)
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * z)
    if loss_type == "ipo":
        return (z - 1 / (2 * beta)) ** 2
    raise ValueError(f"unknown loss_type {loss_type}")


def beta_for_epoch(betas, epoch):
    """--beta holds one value per epoch over the prompt set; after the list ends its last value is reused."""
    return betas[min(epoch, len(betas) - 1)]


# the algorithm's flags for the start-up checks (check_args, with the shared ones): (field, true for a valid value,
# what it must be); None (an option left unset) is always valid
RULES = [
    ("num_generations", lambda v: v >= 2, "at least 2: a preference pair compares two completions of a prompt"),
    ("beta", lambda v: len(v) > 0 and min(v) > 0, "one or more values > 0"),
    ("missing_eos_penalty", lambda v: v > 0, "> 0 (it is subtracted from the reward)"),
]


def train(args):
    """One generation round per step: generate -> score -> pairs -> loss -> optimizer step -> push -> evaluate -> log
    and checkpoint. The set-up, and each phase's plumbing, are in the PLUMBING block below. On several processes
    (torchrun) each rank takes an equal share of every step's prompts."""
    # TRY NOT TO MODIFY: start-up (set_up): checks, then the run directory, models, optimizer, resume, generator
    problems = [path_problem("--reward-model-path", args.reward_model_path)]
    if bool(args.reward_funcs) == bool(args.reward_model_path):
        problems.append(
            ("no reward given: " if not args.reward_funcs else "both --reward-funcs and --reward-model-path given: ")
            + "pass either --reward-funcs with names from rewards.py (e.g. gsm8k_accuracy) or "
            "--reward-model-path with a sequence-classification reward model, not both"
        )
    if (args.eval_steps > 0 or args.max_steps == 0) and args.reward_model_path:
        problems.append(
            "evaluation (--eval-steps, --max-steps 0) scores with --reward-funcs: pass those instead of "
            "--reward-model-path (a reward model's scores have no success threshold for pass@k)"
        )
    run = set_up(args, RULES, problems, reference_model=True)
    model, device, world_size, eos_ids = run.model, run.device, run.world_size, run.eos_ids
    # (model, tokenizer) of --reward-model-path, which scores instead of reward functions
    reward_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    reward_model = load_reward_model(args.reward_model_path, device, reward_dtype) if args.reward_model_path else None
    global_step, skipped_steps = run.global_step, run.counters.get("skipped_steps", 0)
    num_generations = args.num_generations
    next_round = None  # --async-generation: the round generating in the background while this one trains
    if run.eval_set is not None and (global_step == 0 or args.max_steps == 0):  # the model before training
        log_metrics(run, {"step": global_step, **evaluate(run)}, show=True)
    while global_step < args.max_steps:
        round_start = time.perf_counter()
        timing = {"timing/weight_sync": 0.0}
        # prompts of the rounds before this one (a round generating in the background is drawn but not trained yet)
        epoch = (next_round.start if next_round else run.prompts_consumed) // len(run.train_set.prompt_ids)
        beta = beta_for_epoch(args.beta, epoch)

        # ALGO LOGIC: 1. generate: sample prompts, G completions each. --async-generation: this round was generated
        # during the last step, by the weights before it; the next starts now, from the current weights, while we train
        round = next_round or start_round(run)
        if args.async_generation:
            next_round = start_round(run) if global_step + 1 < args.max_steps else None
        t0, rows = time.perf_counter(), round.rows
        # prompt-major: completion k is rows[k // G]'s. The DPO loss needs no sampling_logprobs (no IS ratio)
        (completion_ids, _sampling_logprobs), timing["timing/generation"], version = round_output(run, round)
        timing["timing/generation_wait"] = time.perf_counter() - t0  # what generation costs the trainer
        staleness = global_step - version  # optimizer steps between the sampling and the trained weights
        if args.use_vllm:
            vllm_utils.sleep(run.engine)  # sleep mode: vLLM's memory goes to training until the next generation
        prompt_ids = [run.train_set.prompt_ids[i] for i in rows for _ in range(num_generations)]

        # 2. score: the reward functions (decoded completions, the rows' dataset columns by name) or the reward model
        t0 = clock(device)
        if reward_model is not None:
            rewards = reward_model_rewards(run, reward_model, rows, completion_ids)
            scores = torch.zeros(len(completion_ids), 0)  # (N, no reward functions)
        else:
            scores = score(run, run.train_set, rows, completion_ids, num_generations)
            rewards = (scores * run.reward_weights).nansum(-1).masked_fill(scores.isnan().all(-1), float("nan"))  # (N,)
        if args.missing_eos_penalty is not None:
            rewards = apply_missing_eos_penalty(rewards, completion_ids, eos_ids, args.missing_eos_penalty)
        timing["timing/scoring"] = clock(device) - t0

        # 3. pairs: the best and the worst completion of each prompt
        chosen, rejected, num_tied, num_unscorable = select_pairs(rewards, num_generations)
        num_pairs = len(chosen)
        all_pairs = int(global_sum(num_pairs, world_size, device))  # every rank's pairs weigh the same in the loss

        # 4. loss: the DPO loss of the pairs, in micro-batches of whole pairs (no pair on any rank: no optimizer step)
        pair_logprobs = torch.zeros(num_pairs, 2, 2, device=device)  # (chosen, rejected) x (policy, reference)
        t0 = clock(device)
        if all_pairs:
            model.train()
            step_loss = 0.0
            pair_prompt_lengths = [len(prompt_ids[c]) for c in chosen]
            pair_lengths = [max(len(completion_ids[c]), len(completion_ids[r])) for c, r in zip(chosen, rejected)]
            budget = args.micro_batch_tokens // 2  # a micro-batch of k pairs is 2k rows
            micro_batches = token_budget_batches(range(num_pairs), pair_prompt_lengths, pair_lengths, budget)
            for mb in same_count_on_all_ranks(micro_batches, world_size, device):
                padding_pass = mb is None  # only to keep FSDP's collectives in step with the other ranks
                mb_rows = [0, 0] if padding_pass else [chosen[j] for j in mb] + [rejected[j] for j in mb]  # k + k
                mb_prompts = [prompt_ids[i] for i in mb_rows]
                mb_completions = [completion_ids[i] for i in mb_rows]
                images = image_inputs(run, run.train_set, [rows[i // num_generations] for i in mb_rows])  # or None
                with torch.no_grad(), torch.autocast(**run.autocast), unsharded(run.ref_model, world_size):
                    ref_logprobs = sequence_logprobs(
                        run.ref_model, mb_prompts, mb_completions, args.temperature, device, run.pad_id, images
                    )
                with torch.autocast(**run.autocast):
                    logprobs = sequence_logprobs(
                        model, mb_prompts, mb_completions, args.temperature, device, run.pad_id, images
                    )
                # (2k,) -> (2, k): chosen, rejected; then the loss of each pair, (k,)
                logprobs, ref_logprobs = logprobs.view(2, -1), ref_logprobs.view(2, -1)
                pair_loss = dpo_loss(logprobs[0], logprobs[1], ref_logprobs[0], ref_logprobs[1], beta, args.loss_type)
                # every pair of every rank weighs 1 / all_pairs, however the pairs are micro-batched; FSDP averages
                # gradients over ranks, hence x world_size
                loss = pair_loss.sum() / all_pairs * (0 if padding_pass else world_size)
                loss.backward()
                step_loss += loss.detach()  # summed on the device: no host sync per micro-batch
                if not padding_pass:
                    pair_logprobs[mb] = torch.stack([logprobs.detach().T, ref_logprobs.T], -1)
            # 5. optimizer step: clip the gradients, step (and below, with or without a pair: schedule)
            t1 = clock(device)
            timing["timing/forward_backward"] = t1 - t0  # the reference model's log-probs included
            grad_norm = clip_gradients(model, args.max_grad_norm)
            timing.update(pushed := weights_pushed(run))  # --async-generation: the last push reads the weights
            run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)  # now: the weight sync and generation get the memory
            timing["timing/optimizer"] = clock(device) - t1 - pushed.get("timing/weight_sync_wait", 0.0)
        else:
            skipped_steps += 1  # every prompt tied (or was unscorable): no pair, no update; the step still counts
        learning_rate = run.scheduler.get_last_lr()[0]  # the rate this step used: the one logged
        with warnings.catch_warnings():  # so the schedule moves on without an update, which PyTorch warns about
            warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)` before")
            run.scheduler.step()
        global_step += 1
        run.progress.update(1)

        # 6. push the new weights to vLLM before the next generation round. --async-generation: once the round in
        # flight is complete, and in the background: the next round waits for the push, the next optimizer step too
        if not args.use_vllm:
            run.weights_version = global_step  # `generate` samples from the trained model itself
        elif all_pairs or run.engine.get("weights_asleep"):  # asleep: refill before generating
            push_weights(run, next_round, timing)
            run.weights_version = global_step

        # 7. evaluate every --eval-steps steps and after the last one, once the push is in: the generator holds this
        # step's weights and no request is in flight (step 6 waited for the round in flight), so it samples this policy
        evaluated = run.eval_set is not None and (global_step % args.eval_steps == 0 or global_step >= args.max_steps)
        eval_results = evaluate(run) if evaluated else {}

        # TRY NOT TO MODIFY: 8. log (TRL's metric names, over all ranks) and checkpoint
        lengths = torch.tensor([len(c) for c in completion_ids], dtype=torch.float)
        truncated = truncated_completions(completion_ids, eos_ids)  # (N,): 1 where no EOS ended the completion
        pair_rewards = torch.stack([rewards[chosen], rewards[rejected]], -1)  # (num_pairs, 2): chosen, rejected
        counts = torch.tensor([[num_tied, num_unscorable, len(rows)]], dtype=torch.float)
        parts = gather_objects(
            (rewards, scores, lengths, truncated, pair_rewards, pair_logprobs.cpu(), counts), world_size
        )
        rewards, scores, lengths, truncated, pair_rewards, pair_logprobs, counts = (torch.cat(p) for p in zip(*parts))
        counts = counts.sum(0)  # tied, unscorable, prompts
        if world_size > 1 and all_pairs:
            dist.all_reduce(step_loss)
        metrics = {
            "step": global_step,
            "beta": beta,
            "learning_rate": learning_rate,
            "objective/scores": rewards.nanmean().item(),
            "reward": rewards.nanmean().item(),  # the other scripts' name: the mean reward of the step's completions
            "frac_tied": (counts[0] / counts[2]).item(),
            "frac_unscorable": (counts[1] / counts[2]).item(),
            "num_pairs": all_pairs,
            "skipped_steps": skipped_steps,
            "completions/mean_length": lengths.mean().item(),
            "completions/clipped_ratio": truncated.mean().item(),  # TRL's name for the share of truncated completions
            **timing,
            "sampling/staleness": staleness,
        }
        metrics |= sampling_metrics(run, {})  # the peak GPU memory
        metrics |= {f"scores/{fn.__name__}/mean": scores[:, k].nanmean().item() for k, fn in enumerate(run.reward_fns)}
        if all_pairs:
            logprobs, ref_logprobs = pair_logprobs[..., 0], pair_logprobs[..., 1]  # (all_pairs, 2): chosen, rejected
            implicit = beta * (logprobs - ref_logprobs)  # DPO's implicit rewards of chosen, rejected
            metrics |= {
                "loss": step_loss.item() / world_size,
                "grad_norm": grad_norm.item(),
                "rewards/chosen": implicit[:, 0].mean().item(),
                "rewards/rejected": implicit[:, 1].mean().item(),
                "rewards/margins": (implicit[:, 0] - implicit[:, 1]).mean().item(),
                "rewards/accuracies": (implicit[:, 0] > implicit[:, 1]).float().mean().item(),
                "logps/chosen": logprobs[:, 0].mean().item(),
                "logps/rejected": logprobs[:, 1].mean().item(),
                "objective/scores_margin": (pair_rewards[:, 0] - pair_rewards[:, 1]).mean().item(),
                # k1 = log pi - log pi_ref, summed over each paired completion's tokens, mean over the completions
                "kl/k1_sequence_sum": (logprobs - ref_logprobs).mean().item(),
            }
        metrics["step_time"] = time.perf_counter() - round_start
        metrics.update(eval_results)
        kl = {"kl": f"{metrics['kl/k1_sequence_sum']:.3f}"} if all_pairs else {}  # (no pair: none computed)
        run.progress.set_postfix(score=f"{metrics['objective/scores']:.3f}", **kl, pairs=all_pairs)
        if run.is_main and args.log_completions and global_step % args.logging_steps == 0:  # rank 0's rows
            log_completions(run, prompt_ids, completion_ids, rewards, global_step)
        log_metrics(run, metrics, show=global_step % args.logging_steps == 0 or evaluated)
        # the checkpoint every --save-steps, or SIGTERM's, and the stop
        end_step(run, global_step, next_round, skipped_steps=skipped_steps)
    finish(run)


# The reward model (--reward-model-path): scores instead of reward functions


def reward_model_rewards(run, reward_model, rows, completion_ids):
    """The reward model's score of each completion, (len(rows) * num_generations,). A prompt wrapped in chat messages
    (a chat template was applied) goes to it as those messages; a plain-text prompt as the decoded prompt and its exact
    continuation (decoding a completion alone may drop a leading space)."""
    model, reward_tokenizer = reward_model
    args, tokenizer, prompt_set = run.args, run.tokenizer, run.train_set
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    prompt_ids = [prompt_set.prompt_ids[i] for i in rows for _ in range(args.num_generations)]
    if isinstance(prompt_set.prompts[0], list):
        prompts, completions = [prompt_set.prompts[i] for i in rows for _ in range(args.num_generations)], texts
    else:
        prompts = tokenizer.batch_decode(prompt_ids, skip_special_tokens=True)
        full = tokenizer.batch_decode([p + c for p, c in zip(prompt_ids, completion_ids)], skip_special_tokens=True)
        completions = [f[len(p) :] if f.startswith(p) else t for f, p, t in zip(full, prompts, texts)]
    inputs = reward_model_inputs(reward_tokenizer, prompts, completions)
    return reward_model_scores(model, inputs, args.micro_batch_tokens, run.device)


def reward_model_inputs(tokenizer, prompts, completions):
    """Token ids the reward model reads, one list per sample. prompts[i] is a list of chat messages or a text;
    completions[i] the completion text. Chat prompts go through the reward tokenizer's chat template with the
    completion as the assistant's reply, if it has a template; otherwise prompt text + completion text is scored
    (chat messages' contents joined by blank lines)."""
    inputs = []
    for prompt, completion in zip(prompts, completions):
        if isinstance(prompt, list) and tokenizer.chat_template:
            messages = prompt + [{"role": "assistant", "content": completion}]
            text = tokenizer.apply_chat_template(messages, tokenize=False)
            inputs.append(tokenizer(text, add_special_tokens=False)["input_ids"])  # the template has its own BOS
        else:
            parts = [m["content"] for m in prompt] + [completion] if isinstance(prompt, list) else [prompt + completion]
            inputs.append(tokenizer("\n\n".join(parts))["input_ids"])
    return inputs


def load_reward_model(path, device, dtype=torch.float32):
    """A sequence-classification model with one output (the reward) and its tokenizer, frozen, in eval mode."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype).to(device)
    model.eval().requires_grad_(False)
    if model.config.num_labels != 1:
        raise ValueError(f"--reward-model-path {path} has {model.config.num_labels} labels; a reward model has 1")
    if model.config.pad_token_id is None:  # needed for batches; the model reads its score at the last non-pad token
        pad_id = tokenizer.pad_token_id
        model.config.pad_token_id = pad_id if pad_id is not None else tokenizer.eos_token_id
    return model, tokenizer


@torch.no_grad()
def reward_model_scores(reward_model, input_ids, micro_batch_tokens, device):
    """logits[:, 0] of a sequence-classification model for each token-id list, (N,), in token-budget micro-batches.
    Rows are right-padded with the model's config.pad_token_id: the model reads a row's score at its last token that
    is not that id, so a row scores the same padded or alone."""
    pad_id = reward_model.config.pad_token_id
    lengths = [len(ids) for ids in input_ids]
    scores = torch.zeros(len(input_ids))
    for mb in token_budget_batches(range(len(input_ids)), [0] * len(input_ids), lengths, micro_batch_tokens):
        # (B, L): each row as a "completion" of an empty prompt, so collate right-pads it
        batch = collate([[]] * len(mb), [input_ids[i] for i in mb], device, pad_id)
        logits = reward_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits  # (B, 1)
        scores[mb] = logits[:, 0].float().cpu()
    return scores


# ==== PLUMBING: identical in grpo.py, rloo.py and online_dpo.py (tests/test_plumbing.py) ====
# TRY NOT TO MODIFY: set-up, data and prompts, log-probs, FSDP2, generation, evaluation, checkpoints and run
# directories, start-up checks. Change it in grpo.py, then copy it to the others: python tests/test_plumbing.py --write


@dataclass
class Run:  # what train() and the plumbing share, one per process: made by set_up, the counters moved on by the loop
    args: "Args"  # the flags
    rank: int = 0  # this process's rank (torchrun); rank 0 alone writes the run directory's files and logs
    world_size: int = 1  # processes; each takes an equal share of every step's prompts, whole groups
    is_main: bool = True  # rank 0
    prompts_per_rank: int = None  # this rank's share of --prompts-per-step
    device: torch.device = None  # this rank's GPU, or the CPU
    output_dir: str = None  # the run directory (claim_run_dir)
    identity: dict = None  # run_id and run_name (wandb's): a new run's, or the resumed checkpoint's
    lock: int = None  # rank 0's open and locked output_dir/.lock
    preemption: threading.Event = None  # set by SIGTERM or Ctrl-C: a checkpoint at the end of the step, then exit
    reward_fns: list = None  # the --reward-funcs
    reward_weights: torch.Tensor = None  # (num_funcs,) the --reward-weights
    tokenizer: object = None
    processor: object = None  # the AutoProcessor when a dataset has images (docs/vision.md), else None
    tokenizer_files: dict = None  # {name: bytes}: the tokenizer's files, saved with every model (tokenizer_files)
    train_set: "PromptSet" = None  # the training prompts
    eval_set: "PromptSet" = None  # the eval prompts, or None
    model: torch.nn.Module = None  # the policy (peft's model with --use-peft, sharded by FSDP2 on several ranks)
    ref_model: torch.nn.Module = None  # the frozen initial model (WithoutAdapters with --use-peft), or None
    autocast: dict = None  # torch.autocast's arguments for the forward passes
    pad_id: int = None  # the token that pads batches
    eos_ids: list = None  # the tokens that end a completion
    optimizer: torch.optim.Optimizer = None
    scheduler: object = None  # the learning rate schedule
    engine: object = None  # vllm_utils' engine (colocated or servers), or None: Hugging Face generate
    counters: dict = None  # the resumed checkpoint's counters (global_step, prompts_consumed, the script's own), or {}
    global_step: int = 0  # optimizer steps taken
    prompts_consumed: int = 0  # prompts drawn from the prompt stream
    prompts: Iterator = None  # the prompt stream (prompt_stream) from prompts_consumed on
    trained: dict = None  # the counters of the last completed step: what its checkpoint holds
    weights_version: int = 0  # the optimizer step whose weights the generator holds
    push: Future = None  # --async-generation's background weight push, until weights_pushed waits for it
    pushed: dict = field(default_factory=dict)  # the timings of a push that evaluation waited for (the next step's)
    push_stream: torch.cuda.Stream = None  # the background push's CUDA stream
    wandb: object = None  # rank 0's wandb module, with --track
    metrics_file: object = None  # metrics.jsonl, opened by the first log
    progress: tqdm = None  # the progress bar (rank 0's)


def set_up(args, rules, problems=(), reference_model=False, steps_per_generation=1, num_iterations=1):
    """The Run; the flags (shared, `rules`, `problems`) and the data are checked before anything loads or is written."""
    world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    run = Run(args, rank, world_size, is_main=rank == 0, prompts_per_rank=args.prompts_per_step // world_size)
    check_args(args, world_size, rules, problems, steps_per_generation * num_iterations, steps_per_generation)
    run.reward_fns = rewards.functions(args.reward_funcs)
    run.reward_weights = torch.tensor(args.reward_weights or [1.0] * len(run.reward_fns))
    dataset = read_dataset(args, run.reward_fns)
    evaluating = args.eval_steps or args.max_steps == 0  # the eval prompts, read and checked like the training ones
    eval_dataset = read_dataset(args, run.reward_fns, evaluation=True) if evaluating else None
    local_rank = os.environ.get("LOCAL_RANK", "0")
    run.device = device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1:  # (rank 0 alone may spend minutes writing a checkpoint while the others wait in a collective)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(hours=1))
    claimed = claim_run_dir(args) if run.is_main else (None,) * 4  # the run directory (locked) and checkpoint to resume
    (run.output_dir, checkpoint_dir, run.identity), run.lock = gather_objects(claimed[:3], world_size)[0], claimed[3]
    run.preemption = on_stop_signal()  # SIGTERM or Ctrl-C (SIGINT): a checkpoint at the end of the step, then exit

    from transformers import AutoConfig, AutoProcessor, AutoTokenizer, get_scheduler, set_seed

    set_seed(args.seed)  # random, numpy, torch: the same on every rank until sampling, so the ranks' weights agree
    # no weight cache: each weight is cast once per forward anyway, and the cache would outlive gradient checkpointing
    bf16 = args.bf16 and device.type == "cuda"
    run.autocast = dict(device_type=device.type, dtype=torch.bfloat16, enabled=bf16, cache_enabled=False)

    # tokenizer and prompts before the weights (a prompt too long stops the run now), then the model and the reference
    model_path = checkpoint_dir or args.model_name_or_path
    remote = {"trust_remote_code": args.trust_remote_code}
    run.tokenizer = tokenizer = AutoTokenizer.from_pretrained(model_path, **remote)
    run.tokenizer_files = tokenizer_files(model_path, tokenizer)
    if "images" in dataset or "images" in (eval_dataset or {}):  # (read_dataset's image column; a checkpoint's too)
        run.processor = AutoProcessor.from_pretrained(model_path, **remote, **args.mm_processor_kwargs)
    elif args.mm_processor_kwargs:
        raise SystemExit("error: --mm-processor-kwargs is ignored without images in the dataset: drop it")
    sentence = tokenizer("The quick brown fox jumps over the lazy dog, and then it ran away.")["input_ids"]
    if len(sentence) < 5:  # a tokenizer that lost its vocabulary knows only special tokens
        raise SystemExit(f"error: the tokenizer files in {model_path} are incomplete (no tokenizer.json?)")
    model_path = args.model_name_or_path if args.use_peft else model_path  # a LoRA checkpoint holds only the adapter
    config = AutoConfig.from_pretrained(model_path, **remote)
    max_context = getattr(config.get_text_config(), "max_position_embeddings", None) or 10**9
    if run.processor is not None and getattr(config, "vision_config", None) is None:
        raise SystemExit(f"error: the dataset has images but {model_path} is a text-only model (no vision_config)")
    run.train_set = load_prompts(args, dataset, tokenizer, max_context, processor=run.processor)
    run.eval_set = eval_dataset and load_prompts(args, eval_dataset, tokenizer, max_context, True, run.processor)
    if args.prompts_per_step > (count := len(run.train_set.prompt_ids)):
        print(f"warning: --prompts-per-step {args.prompts_per_step} > the {count} prompts kept: steps repeat prompts")
    load_models(run, model_path, checkpoint_dir, reference_model, sentence)

    # optimizer and schedule; fused: one CUDA kernel for all parameters, without foreach's full-size temporaries
    adamw = dict(lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), weight_decay=args.weight_decay)
    trained = [param for param in run.model.parameters() if param.requires_grad]  # --use-peft: the adapters only
    run.optimizer = torch.optim.AdamW(trained, **adamw, fused=device.type == "cuda")
    run.scheduler = get_scheduler(args.lr_scheduler_type, run.optimizer, args.warmup_steps, args.max_steps)
    torch.manual_seed(args.seed + rank)  # from here on each rank samples its own completions
    run.counters = load_checkpoint(run, checkpoint_dir) if checkpoint_dir else {}  # global_step, prompts_consumed, ...
    run.global_step, run.prompts_consumed = run.counters.get("global_step", 0), run.counters.get("prompts_consumed", 0)
    run.trained = {**run.counters, "global_step": run.global_step, "prompts_consumed": run.prompts_consumed}
    if checkpoint_dir:
        print(f"resumed from {checkpoint_dir} at step {run.global_step}")
    run.prompts = prompt_stream(len(run.train_set.prompt_ids), args.seed, start=run.prompts_consumed)
    run.weights_version = run.global_step

    # generator: Hugging Face generate, or vLLM (colocated engine or a `vllm serve` server)
    longest = max(map(len, run.train_set.prompt_ids + (run.eval_set.prompt_ids if run.eval_set else [])))
    images = max((len(x) for s in (run.train_set, run.eval_set) if s and s.images for x in s.images), default=0)
    run.engine = vllm_utils.start_with_weights(args, run.model, model_path, longest, images) if args.use_vllm else None

    # logs: wandb (a resumed run continues its wandb run), metrics.jsonl (rank 0), the progress bar
    if args.track and run.is_main:
        import wandb

        identity = dict(name=run.identity["run_name"], id=run.identity["run_id"], resume="allow")
        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, config=asdict(args), **identity)
        run.wandb = wandb
    metrics_path = own_path(run.output_dir, "metrics.jsonl")
    if checkpoint_dir and run.is_main and os.path.exists(metrics_path):  # steps logged after the checkpoint are redone
        logged = [line for line in open(metrics_path) if json.loads(line)["step"] <= run.global_step]
        with open(metrics_path, "w") as f:
            f.writelines(logged)
    name = os.path.basename(__file__).removesuffix(".py")
    run.progress = tqdm(total=args.max_steps, initial=run.global_step, desc=name, dynamic_ncols=True, disable=rank > 0)
    return run


def load_models(run, model_path, checkpoint_dir, reference_model, sentence):
    """The policy (--use-peft: LoRA adapters on a frozen bf16 base) and, with reference_model, the initial model."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    args, device = run.args, run.device
    remote = {"trust_remote_code": args.trust_remote_code}
    dtype = getattr(torch, args.param_dtype)  # --use-peft: the adapters'; the frozen base's is bf16 (no updates)
    auto = AutoModelForCausalLM if run.processor is None else AutoModelForImageTextToText
    model = auto.from_pretrained(model_path, dtype=torch.bfloat16 if args.use_peft else dtype, **remote)
    if run.processor is not None and args.freeze_vision_tower:  # the language model and the projector train
        for name, param in model.get_encoder("image").named_parameters():  # (Qwen2-VL's projector, merger, is in it)
            param.requires_grad_(name.startswith("merger."))
    for dropout in (m for m in model.modules() if isinstance(m, torch.nn.Dropout)):  # else two passes would disagree
        dropout.p = 0.0
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.use_peft:
        model = add_lora(args, model, dtype, checkpoint_dir, autocast=run.autocast["enabled"])
    run.model = model = model.to(device)
    run.ref_model = WithoutAdapters(model) if reference_model and args.use_peft else None  # the base: no copy
    if reference_model and not args.use_peft:  # the initial model, also when resuming, in the policy's dtype: KL 0
        run.ref_model = auto.from_pretrained(args.model_name_or_path, dtype=dtype, **remote)
        run.ref_model.to(device).eval().requires_grad_(False)
    models = [model] + ([run.ref_model] if reference_model and not args.use_peft else [])
    if args.torch_compile and not args.use_peft and device.type == "cuda" and args.use_vllm and run.world_size == 1:
        for layer in (layer for each in models for layer in decoder_layers(each)):  # one graph per layer type
            layer.forward = torch.compile(layer.forward, dynamic=True)
    for each in models if run.world_size > 1 else ():  # FSDP2: each rank holds 1/world_size of all weights and states
        shard_model(each, mixed_precision=args.bf16 and device.type == "cuda")
    # a forward that transforms its logits in a way the trainer does not model fails now, not after training on them.
    # LoRA under autocast only: its adapters (fp32) take their bf16 inputs as autocast casts them (add_lora)
    with torch.autocast(**{**run.autocast, "enabled": run.autocast["enabled"] and args.use_peft}):
        check_logprobs(model, sentence, device, run.world_size)
        if images := image_inputs(run, run.train_set, [0]):  # and with the first prompt's images: features, positions
            check_logprobs(model, run.train_set.prompt_ids[0] + sentence, device, run.world_size, images)
    run.pad_id = run.tokenizer.pad_token_id if run.tokenizer.pad_token_id is not None else run.tokenizer.eos_token_id
    eos = model.generation_config.eos_token_id
    run.eos_ids = sorted({*(eos if isinstance(eos, list) else [eos]), run.tokenizer.eos_token_id} - {None})


def generate(run, prompt_set, rows, n=None, temperature=None):
    """(completion ids, vLLM log-probs or None) of prompt_set's `rows`, prompt-major; None: training's G / temperature
    (0: greedy). A lost server is waited for, given the weights (main thread); none back, a dead engine: stop_lost."""
    prompt_ids = [prompt_set.prompt_ids[i] for i in rows]
    while run.engine is not None:
        try:
            return vllm_utils.generate(run.engine, prompt_ids, n, temperature, vllm_images(run, prompt_set, rows))
        except vllm_utils.ServerLost:
            if threading.current_thread() is not threading.main_thread() or run.world_size > 1:
                raise
            try:
                vllm_utils.wait_for_lost(run.engine, run.model)
            except vllm_utils.ServerLost as gone:
                stop_lost(run, gone)
        except Exception as error:  # a dead engine: vLLM's EngineDeadError (told by name), in process a CUDA error
            if run.world_size > 1 or not (type(error).__name__ == "EngineDeadError" or "CUDA error" in str(error)):
                raise
            stop_lost(run, error)
    with unsharded(run.model, run.world_size):  # FSDP2: full weights while decoding, ranks stop at different steps
        images = image_inputs(run, prompt_set, rows)
        return hf_generate(run.model, prompt_ids, run.args, run.eos_ids, run.pad_id, n, temperature, images)


class Round(NamedTuple):
    rows: list  # this rank's prompt rows
    start: int  # the prompt stream's position before they were drawn: where a resume starts if it is not trained
    version: int  # the optimizer step of the weights that sample it
    generation: Future  # of (generate's output, seconds)


def start_round(run):
    """Draw the next --prompts-per-step prompts (the same on every rank) and start generating this rank's share."""
    args, start = run.args, run.prompts_consumed
    rows = [next(run.prompts) for _ in range(args.prompts_per_step)]
    rows = rows[run.rank * run.prompts_per_rank : (run.rank + 1) * run.prompts_per_rank]
    run.prompts_consumed += args.prompts_per_step

    def work(push=run.push):  # a round never starts before the weights it is credited to are in (push_weights)
        if push is not None:
            push.result()
        t0 = time.perf_counter()
        return generate(run, run.train_set, rows), time.perf_counter() - t0

    return Round(rows, start, run.weights_version, future_of(work, background=args.async_generation))


def round_output(run, round):
    """(generate's output, seconds, the weights' step) of a round. One generated in the background whose servers were
    all lost is generated again here, once one is back with the current weights: the same prompts, nothing skipped."""
    try:
        return (*round.generation.result(), round.version)
    except vllm_utils.ServerLost:
        if run.world_size > 1:
            raise
        if run.push is not None:  # the push in flight first: one push at a time, and the round samples its weights
            run.push.result()
        t0 = time.perf_counter()
        return generate(run, run.train_set, round.rows), time.perf_counter() - t0, run.weights_version


def push_weights(run, next_round, timing):
    """The trained weights to vLLM once the round in flight is complete (never inside a round); --async-generation with
    one process: in the background on its own CUDA stream (weights_pushed); not on several ranks (FSDP2 collectives)."""
    t0 = time.perf_counter()
    if next_round is not None:
        wait([next_round.generation])  # (a round whose servers were lost is generated again by round_output)
        if run.world_size > 1:
            dist.barrier()
    t1 = time.perf_counter()
    timing["timing/generation_wait"] += t1 - t0
    timing.update(weights_pushed(run))  # (a step without an optimizer step did not wait for the last one)
    if not (run.args.async_generation and run.world_size == 1):
        vllm_utils.sync_weights(run.engine, run.model)
        timing["timing/weight_sync"] = time.perf_counter() - t1
        return
    if run.device.type == "cuda":
        run.push_stream = run.push_stream or torch.cuda.Stream(run.device)
        run.push_stream.wait_stream(torch.cuda.current_stream(run.device))  # it reads the weights after the optimizer

    def push():
        with torch.cuda.stream(run.push_stream):  # (None, on the CPU: no stream)
            vllm_utils.sync_weights(run.engine, run.model)
        return time.perf_counter() - t1

    # not a daemon: an exit (an error in training included) waits for it, so that no server is left inside an update
    run.push = future_of(push, background=True, daemon=False)


def weights_pushed(run):
    """Wait for push_weights' background push (before the weights change or are sampled, and at the end): timings."""
    if (push := run.push) is None:
        pushed, run.pushed = run.pushed, {}  # a push evaluation waited for: the next step logs it
        return pushed
    run.push, t0 = None, time.perf_counter()
    return {"timing/weight_sync": push.result(), "timing/weight_sync_wait": time.perf_counter() - t0}


def clock(device):
    """Phase timings: wait for this thread's queued GPU work so that each phase is charged its own time. Not the whole
    device's: --async-generation's push runs on a stream of its own, where a NCCL broadcast waits for the server."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return time.perf_counter()


def score(run, prompt_set, rows, completion_ids, num_generations):
    """The reward functions' scores (len(rows) * num_generations, num_funcs) of the completions of prompt_set's `rows`
    (prompt-major), as chat messages when the dataset's prompts are, else strings (as in TRL); the rest by name."""
    texts = run.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    completions = [[{"role": "assistant", "content": t}] for t in texts] if prompt_set.prompts_are_messages else texts
    repeated = lambda values: [values[i] for i in rows for _ in range(num_generations)]
    columns = {c: repeated(v) for c, v in prompt_set.columns.items()}
    prompts = repeated({i: run.tokenizer.decode(prompt_set.prompt_ids[i]) for i in rows})
    passed = dict(prompts=prompts, completion_ids=completion_ids, max_completion_length=run.args.max_completion_length)
    columns.update(**passed, **run.args.reward_kwargs)  # read_dataset: no --reward-kwargs key repeats one
    if prompt_set.images is not None and any(map(rewards.takes_images, run.reward_fns)):  # opened only if asked for
        columns["images"] = repeated({i: [open_image(image) for image in prompt_set.images[i]] for i in rows})
    return rewards.score(run.reward_fns, completions, columns)


def old_and_ref_logprobs(run, prompt_ids, completion_ids, need_old, prompt_rows):
    """The policy's log-probs before any update (if need_old) and the reference model's (if there is one), (N, C) on
    the CPU or None, in token-budget micro-batches without gradient; prompt_rows: each one's training row (images)."""
    args, model, ref_model, world_size = run.args, run.model, run.ref_model, run.world_size
    nets = [model if need_old else None, ref_model]  # (None: not asked for)
    if all(net is None for net in nets):
        return None, None
    prompt_lengths, completion_lengths = [len(p) for p in prompt_ids], [len(c) for c in completion_ids]
    shape = (len(completion_ids), max(max(completion_lengths), 1))
    logprobs = [None if net is None else torch.zeros(shape) for net in nets]
    model.eval()
    ref_unsharded = unsharded(ref_model, world_size) if ref_model is not None else nullcontext()
    with torch.no_grad(), torch.autocast(**run.autocast), unsharded(model, world_size), ref_unsharded:
        for mb in token_budget_batches(range(shape[0]), prompt_lengths, completion_lengths, args.micro_batch_tokens):
            batch = collate([prompt_ids[i] for i in mb], [completion_ids[i] for i in mb], run.device, run.pad_id)
            images = image_inputs(run, run.train_set, [prompt_rows[i] for i in mb])  # None: a text dataset
            for net, out in zip(nets, logprobs):
                if net is not None:
                    logprobs_mb = per_token_logprobs(net, *batch, args.temperature, images=images)
                    out[mb, : batch.completion_mask.shape[1]] = logprobs_mb.cpu()
    return logprobs


def sampling_metrics(run, is_stats):
    """This rank's peak GPU memory and the vLLM importance-sampling correction's log-prob differences and ratios."""
    metrics = {}
    if run.device.type == "cuda":
        metrics["memory/peak_gib"] = torch.cuda.max_memory_allocated(run.device) / 2**30
    if is_stats:
        difference, ratio = torch.cat(is_stats["logp_difference"]), torch.cat(is_stats["ratio"])
        ratio_name = "sampling/importance_sampling_ratio"
        metrics |= {f"sampling/sampling_logp_difference/{f}": getattr(difference, f)().item() for f in ("mean", "max")}
        metrics |= {f"{ratio_name}/{f}": getattr(ratio, f)().item() for f in ("min", "mean", "max")}
    return metrics


def evaluate(run):
    """The eval/... metrics of all eval prompts, on every rank: the rewards of a greedy completion and, with
    --eval-num-generations k > 1, of k sampled ones, with the current weights; each rank generates its share."""
    run.pushed = weights_pushed(run)  # the current weights (its timings go to the next step's metrics)
    t0 = time.perf_counter()
    args, k = run.args, run.args.eval_num_generations
    rows, real = rank_share(len(run.eval_set.prompt_ids), run.rank, run.world_size)

    def complete(n, temperature):  # this rank's rows, n completions each, prompt-major; a round's worth per call
        size, ids = max(1, run.prompts_per_rank * args.num_generations // n), []
        for batch in (rows[start : start + size] for start in range(0, len(rows), size)):
            ids += generate(run, run.eval_set, batch, n, temperature)[0]
        return ids

    # HF sampling draws from the global RNG: fork it, so that training samples what it would without evaluation; the
    # scoring comes after both generations, in the fork: a reward that draws from it changes neither
    scores = lambda ids, n: score(run, run.eval_set, rows, ids, n).view(len(rows), n, -1)[:real]  # (real, n, funcs)
    with torch.random.fork_rng(devices=[run.device] if run.device.type == "cuda" else []):
        torch.manual_seed(args.seed + run.rank)
        greedy_ids = complete(1, 0.0)
        sampled_ids = complete(k, args.temperature) if k > 1 else None
        greedy, sampled = scores(greedy_ids, 1), (scores(sampled_ids, k) if k > 1 else None)
    lengths = torch.tensor([len(c) for c in greedy_ids[:real]], dtype=torch.float)
    parts = gather_objects((greedy[:, 0], sampled, lengths), run.world_size)  # in rank order: the prompts in order
    greedy, sampled, lengths = (None if part[0] is None else torch.cat(part) for part in zip(*parts))
    metrics = eval_metrics(greedy, sampled, run.reward_weights, [fn.__name__ for fn in run.reward_fns])
    metrics.update({"eval/num_prompts": len(greedy), "eval/completions/mean_length": lengths.mean().item()})
    return {**metrics, "timing/eval": time.perf_counter() - t0}


def log_metrics(run, metrics, show):
    """Rank 0: print the metrics line if `show`, append it to metrics.jsonl and log it to wandb."""
    if not run.is_main:
        return
    if show:
        tqdm.write(" | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()))
    run.metrics_file = run.metrics_file or open(own_path(run.output_dir, "metrics.jsonl"), "a")
    print(json.dumps(metrics), file=run.metrics_file, flush=True)
    if run.wandb:
        run.wandb.log(metrics, step=metrics["step"])


# ------------------------------------------------------------------------------------------------------------------
# Data


class PromptSet(NamedTuple):  # a dataset's prompts, tokenized by load_prompts
    prompt_ids: list  # token ids per row
    prompts: list  # each prompt as chat messages (when a chat template was applied) or text
    columns: dict  # the other columns (the answer column renamed to `answer`) that reward functions receive by name
    prompts_are_messages: bool  # the dataset's prompts are chat messages (then so are the completions rewards get)
    images: list = None  # per row, its images (paths or PIL images: open_image), or None: a text dataset


def load_prompts(args, dataset, tokenizer, max_context, evaluation=False, processor=None):
    """`dataset`'s prompts tokenized (images through the processor). A text prompt goes to the chat template as a user
    message, yet only chat-message prompts make the reward functions get messages (TRL's rule)."""
    raw, images = dataset[args.prompt_column], dataset.get("images")
    prompts_are_messages = isinstance(raw[0], list)
    if prompts_are_messages or (args.use_chat_template and tokenizer.chat_template is not None):
        system = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
        prompts = [system + (p if prompts_are_messages else [{"role": "user", "content": p}]) for p in raw]
        chat = dict(add_generation_prompt=True, return_dict=True)
        if images is None:
            prompt_ids = [list(tokenizer.apply_chat_template(messages, **chat)["input_ids"]) for messages in prompts]
        else:
            prompt_ids = [process_prompt(processor, p, row)["input_ids"][0].tolist() for p, row in zip(prompts, images)]
    else:
        prompts = [f"{args.system_prompt}\n\n{p}" if args.system_prompt else p for p in raw]
        prompt_ids = [list(tokenizer(text)["input_ids"]) for text in prompts]
    source = f"--eval-dataset {eval_source(args)[0]}" if evaluation else f"--dataset-name {args.dataset_name}"
    keep = list(range(len(prompt_ids)))
    if args.max_prompt_length is not None:
        keep = [i for i in keep if len(prompt_ids[i]) <= args.max_prompt_length]
        print(f"--max-prompt-length {args.max_prompt_length}: kept {len(keep)} of {len(prompt_ids)} prompts")
        if not keep:
            raise SystemExit(
                f"error: no prompt of {source} is at most --max-prompt-length {args.max_prompt_length} tokens long "
                f"(the shortest has {min(map(len, prompt_ids))}): raise --max-prompt-length"
            )
    longest = max(keep, key=lambda i: len(prompt_ids[i]))
    if len(prompt_ids[longest]) + args.max_completion_length > max_context:
        raise SystemExit(
            f"error: {source}, row {longest}: the prompt has {len(prompt_ids[longest])} tokens, and with "
            f"--max-completion-length {args.max_completion_length} it exceeds the model's context of {max_context} "
            f"tokens. Pass --max-prompt-length {max_context - args.max_completion_length} to drop such prompts, or "
            f"lower --max-completion-length."
        )
    pick = lambda values: [values[i] for i in keep]
    columns = {c: pick(values) for c, values in dataset.items() if c not in (args.prompt_column, "images")}
    return PromptSet(pick(prompt_ids), pick(prompts), columns, prompts_are_messages, images and pick(images))


def prompt_stream(num_prompts, seed, start=0):
    """Yield prompt indices forever: a new seeded permutation each epoch. `start` skips that many (for resuming)."""
    order = lambda epoch: torch.randperm(num_prompts, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    yield from itertools.islice(itertools.chain.from_iterable(map(order, itertools.count())), start, None)


def eval_source(args):
    """Eval (name, config, split): --eval-dataset, else the --eval-dataset-split of a hub --dataset-name; or None."""
    if not args.eval_dataset and is_local(args.dataset_name):
        return None
    name = args.eval_dataset or args.dataset_name
    config = args.eval_dataset_config or (args.dataset_config if name == args.dataset_name else None)
    return name, config, args.eval_dataset_split


def read_dataset(args, reward_fns, evaluation=False):
    """The training dataset (`evaluation`: eval_source's first --eval-max-samples rows) as {column: values}, the answer
    column as `answer`, checked before any model loads. A failure to read is one line."""
    from datasets import load_dataset

    training = args.dataset_name, args.dataset_config, args.dataset_split
    name, config, split = eval_source(args) if evaluation else training
    source = f"{'--eval-dataset' if evaluation else '--dataset-name'} {name}"
    try:
        if os.path.isfile(name) and not open(name, "rb").read(1 << 16).strip():  # (not all of a large file)
            dataset = {}  # (`datasets` fails on an empty file)
        elif name.endswith((".json", ".jsonl", ".csv", ".parquet")):  # the builder: json (.jsonl's too), csv, parquet
            dataset = load_dataset(name.rsplit(".", 1)[1].replace("jsonl", "json"), data_files=name, split="train")[:]
        else:  # a local directory gets no --dataset-config (its default, gsm8k's "main", is not a builder config)
            dataset = load_dataset(name, None if os.path.isdir(name) else config, split=split)[:]
    except Exception as error:  # noqa: BLE001 - any failure to read the data is the flag's problem
        where, message, keys = ("" if is_local(name) else f", split {split}"), repr(error), None
        if os.path.isdir(name):
            message = "a directory of .json / .jsonl / .csv / .parquet files (or a dataset script) expected: " + message
        lines = enumerate(open(name, encoding="utf-8") if name.endswith(".jsonl") else [], 1)
        for number, line, text in ((n, line, line.strip()[:120]) for n, line in lines if line.strip()):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as bad:
                where, message = f", line {number}", f"not valid JSON ({bad.msg}, column {bad.colno}): {text}"
                break
            keys = keys or (sorted(record) if isinstance(record, dict) else None)
            if not isinstance(record, dict) or sorted(record) != keys:
                where, message = f", line {number}", f"a JSON object with the keys {keys} expected, got {text}"
                break
        raise SystemExit(f"error: {source}{where}: {message}") from None
    if not dataset or not next(iter(dataset.values())):
        raise SystemExit(f"error: {source} holds no records")
    dataset = {c: v[: args.eval_max_samples] for c, v in dataset.items()} if evaluation else dataset
    typed = "--image-column" in getattr(args, "flags_given", ())  # if not, `image` or else `images` where there is one
    image_column = next((c for c in [args.image_column, *["images"] * (not typed)] if c and c in dataset), None)
    options = ("--prompt-column", args.prompt_column), ("--answer-column", args.answer_column)
    for option, column in (*options, ("--image-column", args.image_column if typed else "")):
        if (column or option == "--prompt-column") and column not in dataset:
            none = f', or {option} "" if it has none' if option != "--prompt-column" else ""
            raise SystemExit(
                f"error: {source} has no column '{column}' (its columns: {list(dataset)}): pass {option} with one of "
                f"those{none}"
            )
    prompts = dataset[args.prompt_column]
    kind = list if isinstance(prompts[0], list) else str
    if (row := next((i for i, prompt in enumerate(prompts) if not isinstance(prompt, kind)), None)) is not None:
        raise SystemExit(
            f"error: {source}, row {row}: --prompt-column '{args.prompt_column}' holds {prompts[row]!r}, not a "
            f"prompt: every row holds a string, or every row a list of chat messages"
        )
    if image_column:  # as `images`: each row's list, paths relative to a local dataset file resolved, then checked
        folder = os.path.dirname(os.path.abspath(name)) if os.path.isfile(name) else ""
        resolve = lambda x: os.path.join(folder, x) if isinstance(x, str) else x
        listed = lambda v: v if isinstance(v, list) else [] if v is None else [v]
        dataset["images"] = [list(map(resolve, listed(v))) for v in dataset.pop(image_column)]
        is_image = lambda part: isinstance(part, dict) and part.get("type") == "image"  # (not a string's letters)
        for row, (images, prompt) in enumerate(zip(dataset["images"], prompts)):
            count = sum(is_image(part) for message in (prompt if kind is list else []) for part in message["content"])
            found = [f"no image file {x}" for x in images if isinstance(x, str) and not os.path.isfile(x)]
            found += [f'{len(images)} image(s), {count} {{"type": "image"}} part(s)'] if len(images) != count else []
            if found:
                raise SystemExit(f"error: {source}, row {row}: {found[0]} (one part per image in its messages)")
    rewards.check_arguments(reward_fns, list(dataset), source, args)
    if args.answer_column:  # reward functions get the answer column as `answer`
        dataset["answer"] = dataset.pop(args.answer_column)
    return dataset


class Images(NamedTuple):  # image_inputs' output: the images of a batch's prompts, each prompt's once
    inputs: list  # per distinct prompt, the processor's output (input_ids, pixel_values, ...) on the model's device
    index: list  # per batch row, its prompt's place in `inputs`


def open_image(image):
    """A dataset's image (a path, or a PIL image from datasets' Image feature) as a PIL image in RGB."""
    from PIL import Image

    return (image if isinstance(image, Image.Image) else Image.open(image)).convert("RGB")


def process_prompt(processor, messages, images):
    """The processor's inputs of a prompt: its chat template's text (with its BOS), each image part its image tokens."""
    text, images = processor.apply_chat_template(messages, add_generation_prompt=True), [list(map(open_image, images))]
    return processor(text=[text], images=images, add_special_tokens=False, return_tensors="pt")


def image_inputs(run, prompt_set, rows):
    """The Images of a batch whose row b is (a completion of) prompt_set's prompt rows[b], or None for a text set."""
    if prompt_set.images is None:
        return None
    place = {row: i for i, row in enumerate(dict.fromkeys(rows))}  # distinct prompts, in order
    process = lambda row: process_prompt(run.processor, prompt_set.prompts[row], prompt_set.images[row])
    return Images([process(row).to(run.device) for row in place], [place[row] for row in rows])


def vllm_images(run, prompt_set, rows):
    """prompt_set's `rows` as vllm_utils.ImagePrompts (one placeholder per image, which vLLM expands), or None: text."""
    if prompt_set.images is None:
        return None
    template = lambda row: run.processor.apply_chat_template(prompt_set.prompts[row], add_generation_prompt=True)
    ids = lambda row: run.processor.tokenizer(template(row), add_special_tokens=False)["input_ids"]
    images = lambda row: list(map(open_image, prompt_set.images[row]))
    return [vllm_utils.ImagePrompt(ids(row), prompt_set.prompts[row], images(row)) for row in rows]


@contextmanager
def images_in(model, images, P, length):
    """A batch's inputs besides ids, mask and pixels ({} without images), its prompts ending at column P of `length`.
    Within it a hook on the embeddings (inside the model's forward, where FSDP2 holds the weights) puts each prompt's
    image features, computed once per prompt, in place of its prompt's image tokens (as vLLM does)."""
    if images is None:
        yield {}
        return
    first = images.inputs[0]
    per_image = [key for key, value in first.items() if value.shape != first["input_ids"].shape]
    pad = lambda x: torch.nn.functional.pad(x, (P - x.shape[1], length - P))  # a prompt's tokens end at column P
    per_token = first.keys() - {*per_image, "input_ids", "attention_mask"}
    kwargs = {key: torch.cat([pad(images.inputs[u][key]) for u in images.index]) for key in per_token}
    kwargs |= {k: torch.cat([images.inputs[u][k] for u in images.index]) for k in per_image if "pixel" not in k}
    kwargs |= {"position_ids": None} if any(hasattr(m, "get_rope_index") for m in model.modules()) else {}  # M-RoPE

    def put_features(module, args, embeds):
        if args[0].shape[1] < P:  # a decoding step
            return None
        pooled = [model.get_image_features(**{k: x[k] for k in per_image}).pooler_output for x in images.inputs]
        # per prompt, (image tokens, hidden) from (tiles, tokens, hidden) or, Qwen2-VL's, one tensor per image
        features = [torch.cat([f.flatten(0, -2) for f in (p if isinstance(p, tuple) else [p])]) for p in pooled]
        rows, is_image = torch.cat([features[u] for u in images.index]), args[0][:, :P] == model.config.image_token_id
        if len(rows) != is_image.sum():
            raise ValueError(f"{int(is_image.sum())} image tokens in the prompts but {len(rows)} image features")
        return torch.cat([embeds[:, :P].masked_scatter(is_image[..., None], rows.to(embeds.dtype)), embeds[:, P:]], 1)

    handle = model.get_input_embeddings().register_forward_hook(put_features)
    try:
        yield kwargs
    finally:
        handle.remove()


# ------------------------------------------------------------------------------------------------------------------
# Log-probabilities (chunked, at the sampling temperature, with the model's own logit transform)


class Batch(NamedTuple):  # collate's output; per_token_logprobs(model, *batch) takes it in this order
    input_ids: torch.Tensor  # (B, P + C)
    attention_mask: torch.Tensor  # (B, P + C)
    position_ids: torch.Tensor  # (B, P + C)
    completion_mask: torch.Tensor  # (B, C): 1 on completion tokens, 0 on padding
    prompt_length: int  # P: every row's completion starts at column P


def collate(prompt_ids, completion_ids, device, pad_id):
    """Left-pad prompts and right-pad completions into one Batch."""
    P = max(len(p) for p in prompt_ids)
    C = max(max(len(c) for c in completion_ids), 1)
    input_ids = torch.full((len(prompt_ids), P + C), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        input_ids[i, P - len(p) : P + len(c)] = torch.tensor(p + c)
        attention_mask[i, P - len(p) : P + len(c)] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # from each prompt's first real token, as in generation
    completion_mask = attention_mask[:, P:].float()
    return Batch(*(t.to(device) for t in (input_ids, attention_mask, position_ids, completion_mask)), P)


def final_logits(logits, config):
    """The model's own transform of its LM head's output, as its forward applies it and vLLM samples from it (Cohere,
    Granite, HyperCLOVAX, Gemma 2/3's soft-cap). check_logprobs catches any other transform."""
    text = config.get_text_config()
    if text.model_type.startswith("cohere") and getattr(text, "logit_scale", None) is not None:
        logits = logits * text.logit_scale
    if getattr(text, "logits_scaling", None) is not None:
        logits = logits * text.logits_scaling if text.model_type == "hyperclovax" else logits / text.logits_scaling
    if getattr(text, "final_logit_softcapping", None) is not None:
        logits = torch.tanh(logits / text.final_logit_softcapping) * text.final_logit_softcapping
    return logits


class TokenLogprobs(torch.autograd.Function):
    """log pi(target) and the entropy (None unless asked) of each final hidden state, (n,) each, `chunk` tokens at a
    time so that no (n, vocabulary) tensor exists. The backward recomputes each chunk's logits z (after the model's
    transform and the temperature) from the saved hidden states: d log pi(t) / dz = onehot(t) - softmax(z)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, config, temperature, with_entropy, chunk, into_grad):
        device = hidden.device.type  # the LM head computes in autocast's dtype when autocast is on, as the model would
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
        # the weight's gradient in its own dtype (fp32 under autocast); into_grad: summed into .grad (no second buffer)
        into_grad = ctx.into_grad and ctx.needs_input_grad[1] and type(weight.grad) is torch.Tensor
        grad_weight = weight.grad if into_grad else torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        grad_hidden, grad_bias = torch.empty_like(hidden), None if bias is None else torch.zeros_like(bias)
        for rows in (slice(start, start + ctx.chunk) for start in range(0, len(hidden), ctx.chunk)):
            h, t = hidden[rows].to(ctx.dtype), targets[rows]
            raw = torch.nn.functional.linear(h, w, b).requires_grad_()  # (a leaf: no graph unless transformed)
            with torch.enable_grad():  # otherwise autograd differentiates the elementwise transform (no parameters)
                logits = final_logits(raw, ctx.config)
            grad = fused(softmax_grad, h)(logits.detach(), lse[rows], grad_logprobs[rows], t, ctx.temperature)
            grad = grad if logits is raw else torch.autograd.grad(logits, raw, grad)[0]  # through the model's transform
            grad_hidden[rows] = grad @ w
            if ctx.needs_input_grad[1]:  # (not for a frozen LM head: --use-peft)
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
    """fn, torch.compile'd on CUDA: one kernel, not ~8 passes over a chunk's logits (TORCHDYNAMO_DISABLE=1: eager)."""
    return compiled(fn) if like.is_cuda else fn


compiled = functools.cache(functools.partial(torch.compile, dynamic=True))  # one compiled function per fn


def add_matmul(out, a, b):
    """out += a @ b, with the product summed in out's dtype (float32) rather than rounded to a's (bf16) first."""
    if a.dtype == out.dtype:
        out.addmm_(a, b)
    elif out.is_cuda:
        torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
    else:  # the CPU has no mixed-dtype addmm
        out += (a @ b).to(out.dtype)


def per_token_logprobs(
    model, ids, attn, pos, cmask, P, temperature=1, chunk_tokens=1024, with_entropy=False, into_grad=False, images=None
):
    """log pi(token) of each completion token at the sampling temperature, (B, C), 0 on padding, from a collate batch,
    the LM head on `chunk_tokens` tokens at a time. into_grad (backward() follows): its gradient may go to .grad."""
    # the whole model's forward, so that FSDP2 gathers every parameter: logits of one position, the final normed states
    inputs = dict(input_ids=ids, attention_mask=attn, position_ids=pos)
    with images_in(model, images, P, ids.shape[1]) as extra:  # (the prompts' Images, or None)
        hidden = model(**inputs | extra, use_cache=False, logits_to_keep=1, output_hidden_states=True).hidden_states[-1]
    mask = cmask.bool()  # position t predicts completion token t: (n_tokens, H) and (n_tokens,)
    hidden, targets = hidden[:, P - 1 : -1][mask], ids[:, P:][mask]
    lm_head = model.get_output_embeddings()
    args = lm_head.weight, lm_head.bias, targets, model.config, temperature, with_entropy, chunk_tokens, into_grad
    logprobs, entropy = TokenLogprobs.apply(hidden, *args)
    # masked_scatter keeps the output connected to the model even when no token is masked in
    logprobs = torch.zeros(mask.shape, device=ids.device).masked_scatter(mask, logprobs)
    return (logprobs, torch.zeros_like(logprobs).masked_scatter(mask, entropy)) if with_entropy else logprobs


def check_logprobs(model, input_ids, device, world_size, images=None):
    """Raise unless per_token_logprobs of one short sequence match log_softmax of the model's own logits, which the
    sampler uses (final_logits may not know its transform). Every rank calls it (`unsharded` is a collective). images:
    a prompt's, that input_ids begins with; the model's own forward encodes them (and computes M-RoPE's positions)."""
    prompt = {} if images is None else images.inputs[0]  # the processor's inputs (text: the first token is the prompt)
    P = prompt["input_ids"].shape[1] if prompt else 1
    ids, attn, pos, cmask, P = collate([input_ids[:P]], [input_ids[P:]], device, 0)
    pad = lambda v: torch.nn.functional.pad(v, (0, ids.shape[1] - P)) if v.shape == prompt["input_ids"].shape else v
    own = {k: pad(v) for k, v in prompt.items() if k not in ("input_ids", "attention_mask")}  # the pixels too
    own |= {"position_ids": None} if prompt and any(hasattr(m, "get_rope_index") for m in model.modules()) else {}
    with torch.no_grad(), unsharded(model, world_size):
        ours = per_token_logprobs(model, ids, attn, pos, cmask, P, images=images)
        inputs = dict(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False) | own
        logits = model(**inputs).logits[:, P - 1 : -1]
    theirs = logits.float().log_softmax(-1).gather(-1, ids[:, P:, None]).squeeze(-1)
    error = (ours - theirs).abs().mean().item()
    # in bf16 the LM head's GEMM on other shapes may round a logit differently (float32 logits may be bf16 products)
    exact = logits.dtype == model.get_output_embeddings().weight.dtype == torch.float32
    if error > (1e-3 if exact else 0.1):
        raise ValueError(
            f"{type(model).__name__}: the trainer's log-probs would not match the sampler's ({error:.3g} nats/token "
            f"from the model's own logits): its forward transforms them in a way unknown to final_logits: add it there"
        )


def clip_gradients(model, max_norm):
    """Clip the gradients' global norm to max_norm (<= 0: inf, as 0 would zero them) and return the norm before."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else float("inf"))
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor


def token_budget_batches(rows, prompt_lengths, completion_lengths, budget):
    """`rows` sorted by length (less padding) in micro-batches of at most `budget` padded tokens; a longer row alone."""
    batches, p, c = [], 0, 0
    for i in sorted(rows, key=lambda i: prompt_lengths[i] + completion_lengths[i]):
        p, c = max(p, prompt_lengths[i]), max(c, completion_lengths[i])
        if not batches or (len(batches[-1]) + 1) * (p + c) > budget:  # a new micro-batch, starting with row i
            batches.append([])
            p, c = prompt_lengths[i], completion_lengths[i]
        batches[-1].append(i)
    return batches


def add_lora(args, model, dtype, checkpoint_dir=None, autocast=False):
    """--use-peft: peft's LoRA adapters in `dtype` on --lora-target-modules (None: all-linear), all else frozen. Under
    autocast, no cast of their inputs to `dtype`: autocast casts them back, and autograd saved each copy (7B OOM)."""
    import peft

    head = model.get_output_embeddings()  # trained through its weight alone: never adapted (TokenLogprobs reads it)
    vlm = getattr(model.config, "vision_config", None) is not None
    language = set((model.get_decoder() if vlm else model).modules())  # a VLM's LoRA adapts its language model only
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head and m in language]
    if missing := [t for t in args.lora_target_modules or () if not any(n == t or n.endswith(f".{t}") for n in names)]:
        linear = ", ".join(sorted({n.rsplit(".", 1)[-1] for n in names}))  # (peft would ignore some of several)
        raise SystemExit(f"error: --lora-target-modules {' '.join(missing)}: no linear layer is so named ({linear})")
    targets = args.lora_target_modules or "all-linear"
    if vlm:  # full names: peft would also adapt the vision tower's layers of the same short names
        targets = [n for n in names if targets == "all-linear" or any(n == t or n.endswith(f".{t}") for t in targets)]
    lora = dict(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, target_modules=targets)
    model = peft.get_peft_model(model, peft.LoraConfig(**lora), autocast_adapter_dtype=dtype == torch.float32)
    for layer in (m for m in model.modules() if autocast and isinstance(m, peft.tuners.tuners_utils.BaseTunerLayer)):
        layer.cast_input_dtype_enabled = False
    if checkpoint_dir:
        peft.set_peft_model_state_dict(model, peft.utils.load_peft_weights(checkpoint_dir))
    return model


class WithoutAdapters:
    """--use-peft's reference model: the policy with its adapters disabled, i.e. the frozen base itself (no copy)."""

    def __init__(self, model):
        self.model = model

    def __getattr__(self, name):  # config, LM head, FSDP2's unshard: the policy's
        return getattr(self.model, name)

    def __call__(self, *args, **kwargs):
        with self.model.disable_adapter():
            return self.model(*args, **kwargs)


# ------------------------------------------------------------------------------------------------------------------
# Several GPUs (torchrun): FSDP2 shards the weights, each rank generates and scores whole groups of its own prompts


def decoder_layers(model):
    """The model's repeated blocks (_no_split_modules): the units FSDP2 shards and --torch-compile compiles."""
    return [module for module in model.modules() if type(module).__name__ in (model._no_split_modules or ())]


def shard_model(model, mixed_precision):
    """FSDP2 on each decoder layer, then the root; mixed_precision: bf16 compute, fp32 weights and gradient reduce."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    bf16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else {}
    for module in [*decoder_layers(model), model]:  # every decoder layer, then the root
        fully_shard(module, mp_policy=MixedPrecisionPolicy(**bf16))
    return model


@contextmanager
def unsharded(model, world_size):
    """Hold an FSDP2 model's full weights for forward-only passes (generation, old/reference log-probs): no collective
    per forward, so ranks may run different numbers of passes (decoding steps, micro-batches)."""
    modules = [*decoder_layers(model), model] if world_size > 1 else []  # one rank: nothing is sharded
    for module in modules:
        module.unshard()
    for layer in modules[:-1]:  # (the root stays unsharded after forward anyway)
        layer.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for layer in modules[:-1]:
            layer.set_reshard_after_forward(True, recurse=False)
        for module in modules:
            module.reshard()


def same_count_on_all_ranks(micro_batches, world_size, device):
    """Pad this rank's micro-batch list with None (a pass whose loss is multiplied by 0) up to the longest list of any
    rank: every FSDP2 backward is a collective, so all ranks must run the same number of them."""
    most = global_sum(len(micro_batches), world_size, device, op="MAX")
    return micro_batches + [None] * (int(most) - len(micro_batches))


def gather_objects(value, world_size):
    """Every rank's `value` (any picklable object), in rank order."""
    if world_size == 1:
        return [value]
    parts = [None] * world_size
    dist.all_gather_object(parts, value)
    return parts


def global_sum(value, world_size, device, op="SUM"):
    """Sum (op="MAX": the largest) of a number over all ranks."""
    if world_size == 1:
        return float(value)
    total = torch.tensor(float(value), device=device)
    dist.all_reduce(total, op=getattr(dist.ReduceOp, op))
    return total.item()


# ------------------------------------------------------------------------------------------------------------------
# Generation with Hugging Face `generate` (the vLLM paths live in vllm_utils.py), evaluation, sample completions


@torch.no_grad()
def hf_generate(model, prompt_ids, args, eos_ids, pad_id, num_generations=None, temperature=None, images=None):
    """num_generations completions per prompt (None: --num-generations) at `temperature` (None: the training one; 0:
    greedy), as token ids, prompt-major, each cut after its first EOS (kept), and None (no sampler log-probs)."""
    from transformers import GenerationConfig

    num_generations = num_generations or args.num_generations
    temperature = args.temperature if temperature is None else temperature
    repeated = [p for p in prompt_ids for _ in range(num_generations)]
    input_ids, attention_mask, _, _, P = collate(repeated, [[]] * len(repeated), model.device, pad_id)  # left-padded
    input_ids, attention_mask = input_ids[:, :P], attention_mask[:, :P]
    images = images and Images(images.inputs, [u for u in images.index for _ in range(num_generations)])
    sampling = dict(do_sample=True, temperature=temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p)
    decoding = sampling if temperature > 0 else dict(do_sample=False)  # temperature 0: greedy
    stopping = dict(max_new_tokens=args.max_completion_length, eos_token_id=eos_ids, pad_token_id=pad_id)
    config = GenerationConfig(**decoding, **stopping, repetition_penalty=args.repetition_penalty, use_cache=True)
    model = (model.get_base_model() if hasattr(model, "peft_config") else model).eval()  # peft: its transformers model
    # generate fills every field left None from model.generation_config (generation_config.json: suppress_tokens, ...),
    # which neither the trainer's log-probs nor vLLM model; as the model's own, this one gets neutral defaults only
    model_config, model.generation_config = model.generation_config, config
    autocast = torch.autocast(model.device.type, torch.bfloat16, enabled=args.bf16 and model.device.type == "cuda")
    try:
        with autocast, images_in(model, images, P, P) as kwargs:
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config, **kwargs)
    finally:
        model.generation_config = model_config
    cut_after_eos = lambda row: row[: next((t + 1 for t, token in enumerate(row) if token in eos_ids), len(row))]
    return [cut_after_eos(row) for row in out[:, P:].tolist()], None


def future_of(fn, background, daemon=True):
    """fn() as a Future (result(): its value, or its error raised), run now or in a thread (daemon: exit won't wait)."""
    future = Future()

    def run():
        try:
            future.set_result(fn())
        except BaseException as error:  # noqa: BLE001 - re-raised by future.result() in the training loop
            future.set_exception(error)

    threading.Thread(target=run, daemon=daemon).start() if background else run()
    return future


def rank_share(num_prompts, rank, world_size):
    """(this rank's contiguous share of range(num_prompts), padded with prompt 0 to ceil(num_prompts / world_size) rows
    so that all ranks make the same generate calls, collectives; how many are real: in rank order, all prompts)."""
    per_rank = -(-num_prompts // world_size)
    rows = list(range(num_prompts))[rank * per_rank : (rank + 1) * per_rank]
    return rows + [0] * (per_rank - len(rows)), len(rows)


def eval_metrics(greedy, sampled, reward_weights, names):
    """eval/... metrics from the reward functions' scores of each prompt's greedy completion, greedy (P, num_funcs), and
    of its k samples, sampled (P, k, num_funcs) or None (NaN: 0 in the total). Total reward > 0 solves a prompt: pass@1
    = share of prompts solved greedily, mean@k = mean total reward of the samples, pass@k = share one sample solves."""
    total = (greedy * reward_weights).nansum(-1)  # (P,)
    metrics = {"eval/reward": total.mean().item(), "eval/pass@1": (total > 0).float().mean().item()}
    metrics.update({f"eval/rewards/{name}/mean": greedy[:, j].nanmean().item() for j, name in enumerate(names)})
    if sampled is not None:
        k, total = sampled.shape[1], (sampled * reward_weights).nansum(-1)  # (P, k)
        metrics |= {f"eval/mean@{k}": total.mean().item(), f"eval/pass@{k}": (total > 0).any(-1).float().mean().item()}
        metrics |= {f"eval/rewards/{name}/mean@{k}": sampled[..., j].nanmean().item() for j, name in enumerate(names)}
    return metrics


def log_completions(run, prompt_ids, completion_ids, rewards, step):
    """--log-completions: print that many of the step's (prompt, completion, reward) rows (--track: a wandb table)."""
    count = run.args.log_completions
    decode = lambda ids: run.tokenizer.decode(ids, skip_special_tokens=True)
    short = lambda text: textwrap.shorten(text, 70, placeholder=" ...") or repr(text)
    rows = [[step, decode(p), decode(c), r] for p, c, r in zip(prompt_ids[:count], completion_ids, rewards.tolist())]
    for _, prompt, completion, reward in rows:
        tqdm.write(f"  reward {reward:.3g} | {short(prompt)} => {short(completion)}")
    if run.wandb:
        table = run.wandb.Table(columns=["step", "prompt", "completion", "reward"], data=rows)
        run.wandb.log({"completions": table}, step=step)


# ------------------------------------------------------------------------------------------------------------------
# Checkpoints and run directories (CleanRL's convention: runs/{exp_name}__{seed}__{unix time}, one run each)


def load_checkpoint(run, checkpoint_dir):
    """Restore a checkpoint's optimizer, schedule and RNG states (its weights load as the model): its counters."""
    try:  # weights_only: unpickling an object could run its code; mmap: pages are read as used, not copied per rank
        state = torch.load(os.path.join(checkpoint_dir, "trainer_state.pt"), weights_only=True, mmap=True)
    except pickle.UnpicklingError:
        raise SystemExit(f"error: {checkpoint_dir}/trainer_state.pt holds objects beyond tensors: not loaded") from None
    if run.world_size == 1 and all(isinstance(key, int) for key in state["optimizer"]["state"]):  # written by one rank
        run.optimizer.load_state_dict(state["optimizer"])  # (set_optimizer_state_dict first builds a throw-away state)
    else:  # by parameter name; not strict: a parameter never trained (a VLM's unused tower) has no AdamW state
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        full = StateDictOptions(full_state_dict=run.world_size > 1, strict=False)
        set_optimizer_state_dict(run.model, run.optimizer, state["optimizer"], options=full)
    run.scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"][run.rank])
    if run.device.type == "cuda" and state.get("cuda_rng") is not None:  # GPU sampling; older checkpoints have none
        torch.cuda.set_rng_state(state["cuda_rng"][run.rank])
    # CPU tensors (AdamW's step counts) still point into the mapped file: copy them, so that deleting it frees the disk
    for per_param in run.optimizer.state.values():
        per_param.update({k: v.clone() for k, v in per_param.items() if torch.is_tensor(v) and v.device.type == "cpu"})
    return {k: v for k, v in state.items() if k not in ("optimizer", "scheduler", "torch_rng", "cuda_rng")}


def save_checkpoint(run):
    """output_dir/checkpoint-N of run.trained (weights, tokenizer, run.json, trainer_state.pt), renamed from .tmp when
    complete; then the checkpoints beyond --save-total-limit go. Every rank calls it (a collective)."""
    args, cuda, step = run.args, run.device.type == "cuda", run.trained["global_step"]
    model_state, optimizer_state = full_state(run.model, run.optimizer)
    rng_states = gather_objects((torch.get_rng_state(), torch.cuda.get_rng_state() if cuda else None), run.world_size)
    if not run.is_main:
        return
    path = own_path(run.output_dir, f"checkpoint-{step}")
    info = json.dumps({**run.identity, "script": os.path.basename(__file__), "global_step": step}, indent=1).encode()
    save_model(own_path(f"{path}.tmp"), run.model, {**run.tokenizer_files, "run.json": info}, model_state)
    state = {"optimizer": optimizer_state, "scheduler": run.scheduler.state_dict(), **run.trained}
    state |= {"torch_rng": [r[0] for r in rng_states], "cuda_rng": [r[1] for r in rng_states] if cuda else None}
    torch.save(state, own_path(f"{path}.tmp", "trainer_state.pt"))  # (a crash's checkpoint-N.tmp went at the resume)
    shutil.rmtree(path, ignore_errors=True)  # a step done again after a resume from an earlier checkpoint
    os.rename(f"{path}.tmp", path)
    for old in checkpoints(run.output_dir)[: -args.save_total_limit] if args.save_total_limit else []:
        shutil.rmtree(old)


def end_step(run, global_step, next_round, **counters):
    """After a step's log: what a checkpoint of it holds (a round in flight is not trained: a resume draws it again),
    written every --save-steps and when SIGTERM or Ctrl-C asked for it, then the stop."""
    args, start = run.args, next_round.start if next_round else run.prompts_consumed
    run.trained = {**counters, "global_step": global_step, "prompts_consumed": start}
    preempted = global_sum(run.preemption.is_set(), run.world_size, run.device) > 0 and global_step < args.max_steps
    if preempted or (args.save_steps and global_step % args.save_steps == 0 and global_step < args.max_steps):
        save_checkpoint(run)
    if preempted:  # after the checkpoint SIGTERM or Ctrl-C asked for: exit with 128 + the signal (143, 130)
        weights_pushed(run)  # no server is left inside an update
        signum = getattr(run.preemption, "signum", signal.SIGTERM)  # (another rank may have got the signal alone)
        stop(run, 128 + signum, f"{signum.name}: wrote checkpoint-{global_step} and stopped")


def stop_lost(run, error):
    """No server came back within --vllm-server-timeout, or the colocated engine died: the last completed step's
    checkpoint (else name the newest on disk), then stop with 75 (EX_TEMPFAIL: try again later)."""
    step, wrote = run.trained["global_step"], ""
    if run.scheduler.last_epoch == step > 0:  # the weights are still the last completed step's
        with contextlib.suppress(Exception):  # a dead engine may have taken the CUDA context with it
            if not os.path.isdir(os.path.join(run.output_dir, f"checkpoint-{step}")):
                save_checkpoint(run)
            wrote = f"wrote checkpoint-{step}"
    if not wrote and (newest := checkpoints(run.output_dir)):
        wrote = f"the newest checkpoint is {newest[-1]}"
    said = f"error: {type(error).__name__}: {error}; " + (wrote or "no checkpoint to resume: start the run again")
    stop(run, 75, said.replace("\n", " "), resume=bool(wrote))


def stop(run, status, said, resume=True):
    """Exit with `status`, saying so and the command that resumes the run (a repeated flag's last value counts)."""
    if run.is_main:
        latest = ["--output-dir", run.output_dir, "--resume-from-checkpoint", "latest"]
        launcher = ["torchrun", f"--nproc-per-node={run.world_size}"] if run.world_size > 1 else ["python"]
        said += f"; resume with: {shlex.join([*launcher, *sys.argv, *latest])}" if resume else ""
        run.progress.close()  # the bar ends its line first: the message is a line of its own
        print(said, file=sys.stderr if status == 75 else sys.stdout, flush=True)
        if run.wandb:
            run.wandb.mark_preempting()
        os.close(run.lock)  # (the process ends: only a caller that goes on, as a test does, would hold it)
    if run.world_size > 1:
        dist.destroy_process_group()
    sys.exit(status)


def finish(run):
    """Save the final model + tokenizer for from_pretrained(output_dir) (not after --max-steps 0), then release all."""
    weights_pushed(run)  # the last push is in before the servers are left to others
    run.progress.close()
    model_state = full_state(run.model, None)[0] if run.args.max_steps else None
    merged = {n: t.cpu() for n, t in vllm_utils.named_weights(run.model)} if run.args.save_merged_model else None
    if run.is_main:
        if run.args.max_steps:
            save_final(run.output_dir, run.model, run.tokenizer_files, model_state)
            if merged:  # what vLLM got (gathered on every rank), which vLLM and from_pretrained load; a new folder
                save_final(f"{run.output_dir}/merged", run.model.get_base_model(), run.tokenizer_files, merged)
            print(f"saved the final {'adapter' if run.args.use_peft else 'model'} to {run.output_dir}")
        if run.metrics_file:
            run.metrics_file.close()
        if run.wandb:
            run.wandb.finish()
        os.close(run.lock)  # the run is over: no process holds its directory now
    if run.world_size > 1:
        dist.barrier()  # no rank tears down gloo while another is still saving (a rank aborted at exit under load)
        dist.destroy_process_group()


def full_state(model, optimizer):
    """Unsharded weights and optimizer state: on one rank their own tensors (torch.save copies GPU tensors one at a
    time); with FSDP2 gathered onto rank 0's CPU by parameter name (a collective; the other ranks get empty dicts)."""
    optimizer_state = optimizer.state_dict() if optimizer is not None else None
    if not dist.is_initialized():
        return model.state_dict(), optimizer_state
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if optimizer is not None and optimizer.state:  # torch would fill an empty state with an AdamW step at lr 0
        optimizer_state = get_optimizer_state_dict(model, optimizer, options=options)
    return get_model_state_dict(model, options=options), optimizer_state


def save_final(output_dir, model, tokenizer_files, state_dict=None):
    """save_model into output_dir via a temporary folder: each file renamed in, config.json last (so: a whole model)."""
    tmp = own_path(output_dir, ".final.tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # (output_dir/merged's: a resume removes only the run directory's .tmp)
    save_model(tmp, model, tokenizer_files, state_dict)
    for name in sorted(os.listdir(tmp), key=lambda n: n == "config.json"):
        os.replace(os.path.join(tmp, name), os.path.join(output_dir, name))
    os.rmdir(tmp)


def save_model(directory, model, files, state_dict=None):
    """save_pretrained, then `files` ({name: bytes}: the tokenizer's as tokenizer_files read them, run.json)."""
    model.save_pretrained(directory, state_dict=state_dict)
    for name, data in files.items():
        with open(os.path.join(directory, name), "wb") as f:
            f.write(data)


def tokenizer_files(model_path, tokenizer):
    """{name: bytes}: model_path's tokenizer (and processor) files as they are (save_pretrained drops `legacy`)."""
    from transformers.utils import cached_file

    names = {"tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja"}
    names |= {"processor_config.json", "preprocessor_config.json", "chat_template.json"}  # a VLM's processor
    names |= set(tokenizer.vocab_files_names.values()) | {"tokenizer.json"}  # transformers 5 loads it, listed or not
    missing_ok = dict(_raise_exceptions_for_missing_entries=False, _raise_exceptions_for_connection_errors=False)
    paths = (cached_file(model_path, name, **missing_ok) for name in sorted(names))
    return {os.path.basename(path): open(path, "rb").read() for path in paths if path}


def own_path(*parts):
    """os.path.join(*parts), a file or folder of the run's own: never a symbolic link (a write changes its target)."""
    if os.path.islink(path := os.path.join(*parts)):
        raise SystemExit(f"error: {path} is a symbolic link: a run writes its own files, not through links. Remove it")
    return path


def checkpoints(output_dir):
    """A run directory's complete checkpoint-N directories, oldest first (one being written is checkpoint-N.tmp)."""
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    complete = [n for n in names if re.fullmatch(r"checkpoint-\d+", n)]
    return [own_path(output_dir, n) for n in sorted(complete, key=lambda n: int(n.split("-")[1]))]


def run_info(checkpoint):
    """A checkpoint's run.json: its run (run_id, run_name: wandb's), script and global_step; {} without one."""
    with contextlib.suppress(OSError, ValueError), open(own_path(checkpoint, "run.json")) as f:
        return json.load(f)
    return {}


def claim_run_dir(args):
    """Rank 0, before any model loads: (run directory, checkpoint to resume or None, the run's identity, lock). A new
    run takes --output-dir or a new runs/..., refusing one that holds files; a resume goes on in its checkpoint's
    directory. Nothing is written before every check passed; a flock on DIR/.lock (the kernel drops it however the
    process ends) then keeps a second live process out."""
    script, out, checkpoint = os.path.basename(__file__), args.output_dir, args.resume_from_checkpoint
    stamp = f"{args.exp_name}__{args.seed}__{int(time.time())}"
    if checkpoint == "latest" and out is None:
        raise SystemExit("error: --resume-from-checkpoint latest needs --output-dir DIR, the run directory to resume")
    if checkpoint not in (None, "latest"):
        parent = os.path.dirname(os.path.abspath(checkpoint))
        if out is not None and os.path.abspath(out) != parent:
            raise SystemExit(
                f"error: --resume-from-checkpoint {checkpoint} continues its run in {parent}: pass --output-dir "
                f"{parent}, or no --output-dir"
            )
        out = parent
    created = out is None or not os.path.isdir(out)
    for n in itertools.count(1) if out is None else ():  # a new run; the second of two in one second gets __2
        with contextlib.suppress(FileExistsError):
            os.makedirs(out := os.path.join("runs", stamp + (f"__{n}" if n > 1 else "")))
            break
    lock_path, _ = own_path(out, ".lock"), own_path(out, "metrics.jsonl")  # (a link refused before models load)
    with contextlib.suppress(FileNotFoundError), os.fdopen(os.open(lock_path, os.O_RDONLY | os.O_NOFOLLOW)) as lock:
        check_unlocked(out, lock.fileno())  # (a free lock is released again as the file closes)
    if checkpoint == "latest" and not (checkpoint := (checkpoints(out) or [None])[-1]):
        raise SystemExit(
            f"error: --resume-from-checkpoint latest: {out} holds no complete checkpoint-N to continue. Start a "
            f"new run: the same command without --resume-from-checkpoint and with another --output-dir, or none"
        )
    if checkpoint is None and (files := sorted(set(os.listdir(out)) - {".lock"}) if os.path.isdir(out) else []):
        listed = ", ".join(files[:5]) + (f" and {len(files) - 5} more" if len(files) > 5 else "")
        resume = ", or --resume-from-checkpoint latest to continue its run" if checkpoints(out) else ""
        raise SystemExit(
            f"error: --output-dir {out} holds files ({listed}): a new run there would mix its files with "
            f"them. Pass another --output-dir, or none (a new runs/{stamp}){resume}."
        )
    identity = {"run_id": uuid.uuid4().hex[:12], "run_name": stamp} if checkpoint is None else run_info(checkpoint)
    if checkpoint is not None:
        if not identity:
            raise SystemExit(
                f"error: --resume-from-checkpoint {checkpoint} has no run.json, so its script and run are unknown: "
                f"start a new run from its weights with --model-name-or-path {checkpoint}"
            )
        if identity["script"] != script:
            raise SystemExit(
                f"error: --resume-from-checkpoint {checkpoint} is a checkpoint of {identity['script']}: continue that "
                f"run with {identity['script']}, not {script}"
            )
        if identity["global_step"] >= args.max_steps:
            raise SystemExit(
                f"error: --resume-from-checkpoint {checkpoint} is at step {identity['global_step']} and --max-steps "
                f"is {args.max_steps}: there is nothing left to train. Raise --max-steps, or load it as a model"
            )
        if others := [c for c in checkpoints(out) if run_info(c).get("run_id") != identity["run_id"]]:
            raise SystemExit(  # `latest`, --save-total-limit and a redone step's save would take or delete them
                f"error: {out} also holds checkpoints of another run ({os.path.basename(others[0])}): copy "
                f"{checkpoint} into a directory of its own and resume it from there"
            )
    os.makedirs(out, exist_ok=True)
    lock = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    check_unlocked(out, lock, exclusive=True)  # (a run that took the directory since the check above)
    os.ftruncate(lock, 0)
    os.pwrite(lock, f"{script}, pid {os.getpid()} on {socket.gethostname()}, since {time.ctime()}".encode(), 0)
    for name in [n for n in os.listdir(out) if n.endswith(".tmp")]:  # what a crash of this run left half-written
        shutil.rmtree(own_path(out, name))
        print(f"{out}: removed {name}, left half-written by a crash")
    if created:  # a run that fails before its first log (metrics.jsonl opens then) removes the directory it made
        path = os.path.abspath(out)
        atexit.register(lambda: os.path.isdir(path) and os.listdir(path) == [".lock"] and shutil.rmtree(path, True))
    return out, checkpoint, identity, lock


def check_unlocked(out, lock, exclusive=False):
    """Take the flock of out/.lock (`lock`, an open descriptor), or exit naming the live run that holds it."""
    try:
        fcntl.flock(lock, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(lock, 300, 0).decode(errors="replace").strip() or "another process"
        raise SystemExit(
            f"error: --output-dir {out} is in use by a run that is still going ({holder}). Wait for it to end, or "
            f"pass another --output-dir."
        ) from None
    except OSError as error:  # a file system without flock (some network mounts): run, but say so (once)
        if exclusive:
            print(f"warning: cannot lock {out}/.lock ({error}): nothing keeps a second run out of this directory")


def on_stop_signal():
    """SIGTERM (a cluster scheduler's preemption) and Ctrl-C set the returned event: the loop writes a checkpoint at
    the end of the step and exits (end_step). A second SIGTERM or Ctrl-C ends the process at once."""
    requested, previous = threading.Event(), {}

    def handler(signum, frame):
        requested.signum = signal.Signals(signum)
        os.write(2, f"\n{requested.signum.name}: stopping after this step's checkpoint (again: stop now)\n".encode())
        requested.set()
        signal.signal(signum, previous[signum])

    for signum in (signal.SIGTERM, signal.SIGINT):
        previous[signum] = signal.signal(signum, handler) or signal.SIG_DFL
    return requested


# ------------------------------------------------------------------------------------------------------------------
# Start-up checks of the flags, all before any model loads

COMMON_RULES = [  # (the shared flags' fields, true for a valid value, what they must be); None (unset) is always valid
    ("prompts_per_step max_prompt_length micro_batch_tokens logging_steps lora_r", lambda v: v >= 1, "at least 1"),
    ("eval_max_samples eval_num_generations", lambda v: v >= 1, "at least 1"),
    ("max_completion_length", lambda v: v >= 1, "at least 1 (new tokens per completion)"),
    ("learning_rate weight_decay warmup_steps save_total_limit", lambda v: v >= 0, ">= 0"),
    ("top_k log_completions", lambda v: v >= 0, ">= 0 (0 = off)"),
    ("max_steps", lambda v: v >= 0, ">= 0 (0 = evaluate the model and exit)"),
    ("save_steps", lambda v: v >= 0, ">= 0 (0 = only the final model)"),
    ("eval_steps", lambda v: v >= 0, ">= 0 (0 = no evaluation during training)"),
    ("lora_dropout adam_beta1 adam_beta2", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("temperature", lambda v: v > 0, "> 0"),
    ("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("min_p", lambda v: 0 <= v <= 1, "in [0, 1] (0 = off)"),
    ("repetition_penalty", lambda v: v > 0, "> 0 (1 = off)"),
]
IGNORED = [  # (a regex of flags, true where they are read, what that takes): typed where nothing reads them, refused
    (r"--vllm-", lambda a: a.use_vllm, "--use-vllm"),
    (r"--vllm-(server|group|generation|weight-sync)-", lambda a: a.vllm_mode == "server", "--vllm-mode server"),
    (r"--vllm-(gpu|tensor|max|enable|model)", lambda a: a.vllm_mode == "colocate", "--vllm-mode colocate"),
    (r"--lora-|--save-merged-model", lambda a: a.use_peft, "--use-peft"),
    (r"--dataset-(config|split)", lambda a: not os.path.isfile(a.dataset_name), "a hub --dataset-name"),
    (r"--eval-(dataset|max|num)", lambda a: a.eval_steps > 0 or a.max_steps == 0, "--eval-steps N (or --max-steps 0)"),
]


def parse_args(argv=None):
    """The flags: tyro's plain --help box of Args, every flag with its docstring; args.flags_given: the flags typed."""
    argv = sys.argv[1:] if argv is None else argv
    args = tyro.cli(Args, args=argv, description="\n\n".join(__doc__.split("\n\n")[:3]))
    args.flags_given = {re.sub("^--no-", "--", a.split("=")[0].replace("_", "-")) for a in argv if a.startswith("--")}
    return args


def is_local(path):
    """A local path, not a hub name: .json/.jsonl/.csv/.parquet, absolute, ./ ../ ~, several '/', or its folder here."""
    local = path.startswith(("/", ".", "~")) or path.count("/") > 1 or "\\" in path
    return local or path.endswith((".json", ".jsonl", ".csv", ".parquet")) or os.path.isdir(path.split("/")[0])


def path_problem(flag, path, marker="config.json", kind="model"):
    """Why a directory flag is wrong (None if it is not): a file; a local directory that is not there or lacks its
    marker file; a hub name neither cached nor reachable (HF_HUB_OFFLINE too): from_pretrained retries, then fails."""
    if path is not None and os.path.isfile(path):
        return f"{flag} {path} is a file, not a {kind} directory"
    if path is not None and os.path.isdir(path) and not os.path.exists(os.path.join(path, marker)):
        return f"{flag} {path}: that directory has no {marker}, so it is not a {kind}"
    if path is not None and not os.path.isdir(path) and (kind == "checkpoint" or is_local(path)):
        return f"{flag} {path}: no such directory"
    if path is not None and not os.path.isdir(path):  # a hub name: cached, or one HEAD request to the hub
        import huggingface_hub as hub

        try:
            if not isinstance(hub.try_to_load_from_cache(path, marker), str):
                hub.get_hf_file_metadata(hub.hf_hub_url(path, marker), timeout=10)
        except Exception as error:  # noqa: BLE001 - the hub's answer (no such repo, a gated one) is from_pretrained's
            if not isinstance(error, (hub.errors.HfHubHTTPError, ValueError)):  # no answer (offline, no network)
                return f"{flag} {path} is not in the local Hugging Face cache and the hub cannot be reached: {error!r}"


def check_args(args, world_size, rules=(), problems=(), steps_per_round=1, steps_per_generation=1):
    """Every check that needs neither a model nor the data: value ranges (the shared flags', the algorithm's `rules`,
    vLLM's), flag combinations (and `problems`) and paths. Exits with one line per problem, each naming its flag."""
    problems = list(problems)
    if args.micro_batch_tokens is None:  # the default, sized for the models each mode is for
        args.micro_batch_tokens = 8192 if args.use_peft else 16384
    for names, valid, must in COMMON_RULES + list(rules):  # a rule's fields: one, or several separated by spaces
        for name in names.split():
            value = getattr(args, name)
            if value is not None and not valid(value):
                problems.append(f"--{name.replace('_', '-')} must be {must}, got {value}")
    if steps_per_generation >= 1 and args.prompts_per_step % (steps_per_generation * world_size):
        problems.append(
            f"--prompts-per-step {args.prompts_per_step} must be divisible by the number of processes ({world_size}) "
            f"x the optimizer steps per generated batch ({steps_per_generation}): whole groups per rank and step"
        )
    for flag, steps in (("--save-steps", args.save_steps), ("--eval-steps", args.eval_steps)):
        if steps_per_round > 0 and steps % steps_per_round:
            problems.append(
                f"{flag} {steps} must be a multiple of the optimizer steps per generation round (--steps-per-generation"
                f" x --num-iterations = {steps_per_round}): checkpoints and evaluations come between rounds"
            )
    if (weights := args.reward_weights) is not None and len(weights) != len(funcs := args.reward_funcs):
        problems.append(f"--reward-weights has {len(weights)} values for {len(funcs)} --reward-funcs")
    problems += vllm_utils.check_args(args)
    problems.append(path_problem("--model-name-or-path", args.model_name_or_path))
    resume = None if args.resume_from_checkpoint == "latest" else args.resume_from_checkpoint  # (latest: claim_run_dir)
    problems.append(path_problem("--resume-from-checkpoint", resume, "trainer_state.pt", "checkpoint"))
    for flag, name in (("--dataset-name", args.dataset_name), ("--eval-dataset", args.eval_dataset)):
        if name is not None and is_local(name) and not os.path.exists(name):
            problems.append(f"{flag} {name} does not exist (no such file or directory)")
        elif name is not None and os.path.isfile(name) and not name.endswith((".json", ".jsonl", ".csv", ".parquet")):
            problems.append(f"{flag} {name}: a .json / .jsonl / .csv / .parquet file (or a directory of them) expected")
    if (args.eval_steps > 0 or args.max_steps == 0) and eval_source(args) is None:
        problems.append(
            f"{'--eval-steps' if args.eval_steps else '--max-steps 0 (evaluate and exit)'} needs an eval dataset: "
            f"--dataset-name {args.dataset_name} is a local file, with no test split; pass --eval-dataset"
        )
    for flag in sorted(getattr(args, "flags_given", ())):  # typed, yet nothing would read it: a mistake, said
        if need := next((need for regex, read, need in IGNORED if re.match(regex, flag) and not read(args)), None):
            problems.append(f"{flag} is ignored without {need}: add {need} or drop {flag}")
    if args.output_dir is not None and os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir):
        problems.append(f"--output-dir {args.output_dir} is a file, not a directory")
    if problems := [p for p in problems if p]:
        raise SystemExit("\n".join(["error: " + p for p in problems]))
    if 0 < args.max_steps <= args.warmup_steps:
        print(
            f"warning: --warmup-steps {args.warmup_steps} >= --max-steps {args.max_steps}: the learning rate never "
            f"reaches --learning-rate {args.learning_rate}"
        )


if __name__ == "__main__":
    train(parse_args())
