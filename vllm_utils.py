"""vLLM for online RL: generation and weight sync, for grpo.py / rloo.py / online_dpo.py and their forks.

Two ways to run vLLM next to a trainer (README.md, "Using vLLM"):

* colocate: a `vllm.LLM` inside the training process, on the training GPU. New weights are copied in with the
  model's own `load_weights` (full HF-named tensors). With sleep mode, vLLM frees its memory while the trainer
  trains: level-2 sleep, then wake weights -> load every weight -> reset the prefix cache -> wake the KV cache ->
  generate -> sleep.
* server: a stock `vllm serve` on other GPUs, started with VLLM_SERVER_DEV_MODE=1 and
  `--weight-transfer-config '{"backend": "nccl"}' --logprobs-mode processed_logprobs --max-logprobs -1`.
  Generation goes through /v1/completions with token-id prompts; after each optimizer step the trainer broadcasts
  its weights over NCCL (vLLM's packed protocol) while the server receives them in /update_weights.

Both return completion token ids and vLLM's log-prob of each sampled token (after temperature and other
processors: "processed_logprobs"), which the trainer uses to correct the vLLM/trainer mismatch.

The entry points `start`, `generate`, `sleep` and `sync_weights` take the script's `Args` / the engine they return;
every step they take is a small function below that a fork can call directly. vLLM is imported only inside functions
that need it.
"""
import os
import socket
import subprocess
import threading
import time

import requests
import torch

GENERATION_TIMEOUT_S = 1800.0  # one /v1/completions call (a whole generation round)
WEIGHT_SYNC_TIMEOUT_S = 300.0  # init of the NCCL group, and one full weight update
PACKED_BUFFER_BYTES = 1 << 30  # vLLM's packed-broadcast chunk size; both sides must agree
PACKED_NUM_BUFFERS = 2


# ------------------------------------------------------------------------------------------------------------------
# Weights: what is sent, in which order


def _checkpoint_name(name):
    # activation-checkpoint / FSDP wrappers insert these into names; vLLM knows the checkpoint names
    return name.replace("_checkpoint_wrapped_module.", "").replace("_fsdp_wrapped_module.", "")


def named_weights(model, dtype=torch.bfloat16):
    """(HF name, tensor) for every parameter, cast to `dtype` (vLLM copies into its own dtype anyway; bf16 halves the
    bytes sent). Tied embeddings appear once, as in the checkpoint; vLLM skips lm_head when it is tied.

    A generator on purpose: with FSDP2 each parameter is gathered from the shards only when it is reached (a
    collective: every rank must iterate, in the same order) and is dropped once the consumer has packed or loaded it,
    so the whole unsharded model never sits on one GPU."""
    for name, param in model.named_parameters():
        tensor = param.detach()
        if hasattr(tensor, "full_tensor"):  # FSDP2 DTensor: gather the full parameter
            tensor = tensor.full_tensor()
        yield _checkpoint_name(name), tensor.to(dtype)


def weight_metadata(model, dtype=torch.bfloat16):
    """The `update_info` lists vLLM needs to receive `named_weights(model, dtype)`: the receiver allocates buffers from
    these, so they must describe exactly the tensors streamed, in the same order. Read from the parameters without
    gathering anything (an FSDP2 DTensor's shape is the full one)."""
    params = list(model.named_parameters())
    return {
        "names": [_checkpoint_name(name) for name, _ in params],
        "dtype_names": [str(dtype).removeprefix("torch.")] * len(params),
        "shapes": [list(param.shape) for _, param in params],
    }


# ------------------------------------------------------------------------------------------------------------------
# Colocate: vllm.LLM in this process


def colocate_engine(model_path, gpu_memory_utilization=0.3, tensor_parallel_size=1, max_model_len=None,
                    enable_sleep_mode=False, seed=0, max_num_seqs=256, dtype="bfloat16"):
    """A vllm.LLM that lives in this (torchrun or plain) process and shares its GPU.

    external_launcher runs the engine's single worker inside this process (no subprocess), which is what lets the
    trainer copy weights straight into it. Without torchrun, the env:// variables it needs are filled in."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size % tensor_parallel_size:
        raise ValueError(f"--vllm-tensor-parallel-size {tensor_parallel_size} must divide the number of processes {world_size}")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        os.environ.setdefault(key, value)
    from vllm import LLM

    rank = int(os.environ["RANK"])
    extra = {}
    if tensor_parallel_size > 1 and os.environ.get("NCCL_NVLS_ENABLE") == "0":
        # With TP > 1, vLLM fuses all-reduce + RMSNorm through FlashInfer, whose default "mnnvl" workspace maps NVLink
        # multicast memory. A host that switched multicast off (NCCL_NVLS_ENABLE=0) must not get it: plain all-reduce.
        extra["compilation_config"] = {"pass_config": {"fuse_allreduce_rms": False}}
    return LLM(
        model=model_path, tensor_parallel_size=tensor_parallel_size, gpu_memory_utilization=gpu_memory_utilization,
        max_model_len=max_model_len, enable_sleep_mode=enable_sleep_mode, dtype=dtype, max_num_seqs=max_num_seqs,
        distributed_executor_backend="external_launcher", logprobs_mode="processed_logprobs",
        seed=seed + rank // tensor_parallel_size,  # ranks of one TP group must sample identically
        **extra,
    )


def sampling_fields(args):
    """Sampling settings shared by both modes, every one explicit (a server would otherwise fill gaps from the
    model's generation_config.json)."""
    return {
        "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k if args.top_k > 0 else -1,
        "min_p": args.min_p, "repetition_penalty": args.repetition_penalty, "max_tokens": args.max_completion_length,
    }


def colocate_generate(llm, prompt_ids, n, fields):
    """Sample n completions per prompt with an in-process engine: (completion ids, sampled-token log-probs), both
    prompt-major lists (completion k belongs to prompt k // n)."""
    from vllm import SamplingParams

    params = SamplingParams(n=n, logprobs=0, **fields)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    completion_ids, logprobs = [], []
    for output in outputs:
        for sample in output.outputs:
            completion_ids.append(list(sample.token_ids))
            logprobs.append([step[token].logprob for token, step in zip(sample.token_ids, sample.logprobs)])
    return completion_ids, logprobs


def tensor_parallel_group(tensor_parallel_size):
    """With torchrun and a colocated engine split over tensor_parallel_size GPUs, consecutive ranks form one engine
    and must submit the same prompts: the process group of this rank's engine (None without tensor parallelism)."""
    if tensor_parallel_size == 1 or not torch.distributed.is_initialized():
        return None
    world_size, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    mine = None
    for start in range(0, world_size, tensor_parallel_size):  # every rank creates every group, in the same order
        ranks = list(range(start, start + tensor_parallel_size))
        group = torch.distributed.new_group(ranks)
        mine = group if rank in ranks else mine
    return mine


def colocate_load_weights(llm, weights):
    """Copy (name, tensor) pairs into the engine's model in place (CUDA graphs stay valid); each TP rank slices its
    own shard from the full tensors. Fine for bf16/fp16 engines (online-quantized ones need reload_weights)."""
    llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights(weights)


# ------------------------------------------------------------------------------------------------------------------
# Server: a stock `vllm serve` over HTTP + NCCL


def serve_command(model, host="0.0.0.0", port=8000, gpus="1"):
    """The command that starts a server this codebase can train against."""
    return (f"CUDA_VISIBLE_DEVICES={gpus} VLLM_SERVER_DEV_MODE=1 vllm serve {model} --host {host} --port {port} "
            "--weight-transfer-config '{\"backend\": \"nccl\"}' --logprobs-mode processed_logprobs --max-logprobs -1")


def wait_for_server(base_url, timeout, model):
    """Poll GET /health until it answers 200; after `timeout` seconds raise with the command that starts it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if requests.get(f"{base_url}/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            host, port = base_url.removeprefix("http://").rsplit(":", 1)
            raise ConnectionError(
                f"no vLLM server answered at {base_url}/health within {timeout:.0f} s (--vllm-server-timeout). "
                f"Start one on GPUs the trainer does not use, e.g.\n  {serve_command(model, port=port)}\n"
                f"or point --vllm-server-host / --vllm-server-port at it."
            )
        time.sleep(2)


def check_server(base_url, model):
    """Fail early, with the fix, when the server cannot do RL: no dev mode, no NCCL weight transfer, or a vLLM version
    other than the trainer's (both sides of the NCCL protocol are version-specific). Returns (model id, max_model_len)."""
    import vllm

    response = requests.get(f"{base_url}/server_info", params={"config_format": "json"}, timeout=30)
    if response.status_code == 404:
        raise RuntimeError(f"the server at {base_url} has no /server_info: it was started without VLLM_SERVER_DEV_MODE=1, "
                           f"which the weight-sync endpoints need. Restart it as:\n  {serve_command(model)}")
    response.raise_for_status()
    config = response.json()["vllm_config"]
    if not config.get("weight_transfer_config"):
        raise RuntimeError(f"the server at {base_url} was started without --weight-transfer-config, so it cannot receive "
                           f"weights. Restart it as:\n  {serve_command(model)}")
    logprobs_mode = config.get("model_config", {}).get("logprobs_mode")
    if logprobs_mode != "processed_logprobs":  # raw log-probs ignore the temperature: every importance ratio is biased
        raise RuntimeError(f"the server at {base_url} returns {logprobs_mode} log-probs, which leave out the temperature "
                           f"the trainer samples with, so the importance-sampling correction would be wrong. Restart it as:\n  {serve_command(model)}")
    server_version = requests.get(f"{base_url}/version", timeout=30).json()["version"]
    if server_version != vllm.__version__:
        raise RuntimeError(f"the server runs vLLM {server_version} but the trainer has vLLM {vllm.__version__}; the NCCL "
                           f"weight-transfer protocol differs between versions. Install the same version on both sides (pip install vllm=={vllm.__version__}).")
    served = requests.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]
    return served["id"], served.get("max_model_len")


def check_gpu_not_shared(base_url):
    """NCCL cannot put two ranks of one group on the same GPU: refuse to start when a local vLLM process already runs
    on the trainer's GPU (set CUDA_VISIBLE_DEVICES differently for the two)."""
    host = base_url.removeprefix("http://").rsplit(":", 1)[0]
    if host not in ("127.0.0.1", "localhost", "0.0.0.0", socket.gethostname()):
        return
    uuid = "GPU-" + str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=gpu_uuid,pid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return
    for line in out.splitlines():
        gpu, pid = [part.strip() for part in line.split(",")]
        if gpu == uuid and int(pid) != os.getpid():
            try:
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            # a server's GPU process is its engine core, titled "VLLM::EngineCore..." (or "vllm serve ..." itself);
            # a colocated engine inside another trainer is not a server and may share the GPU
            if any(mark in cmdline for mark in ("VLLM::", "vllm serve", "vllm.entrypoints")):
                raise RuntimeError(f"the vLLM server (pid {pid}) runs on the trainer's GPU {uuid}. Give them different "
                                   f"GPUs, e.g. CUDA_VISIBLE_DEVICES=0 for the trainer and CUDA_VISIBLE_DEVICES=1 for "
                                   f"`vllm serve`.")


def _post(base_url, path, timeout, **kwargs):
    # one attempt, never retried: a repeated /update_weights would wait forever for a broadcast that never comes
    response = requests.post(f"{base_url}{path}", timeout=timeout, **kwargs)
    if response.status_code != 200:
        raise RuntimeError(f"POST {path} failed with {response.status_code}: {response.text[:500]}")
    return response.json() if response.content else {}


def _run_beside(nccl_work, http_call, timeout):
    """Run the trainer's NCCL side and the matching HTTP call (which blocks inside the server's side of the same
    collective) side by side, each in a daemon thread; return the NCCL side's result. NCCL has no timeout, so the first
    failure is raised at once and the other side is left behind rather than waited for. When both fail, the NCCL
    side's error is raised (it is usually the cause: a taken --vllm-group-port, an out-of-memory while packing)."""
    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    outcome = {}  # side -> (ok, result or exception)
    failed = lambda side: outcome.get(side, (True,))[0] is False  # noqa: E731

    def run(side, work):
        try:
            if device is not None:
                torch.cuda.set_device(device)  # the current device is per thread
            outcome[side] = (True, work())
        except BaseException as error:  # noqa: BLE001
            outcome[side] = (False, error)

    nccl = threading.Thread(target=run, args=("nccl", nccl_work), daemon=True)
    nccl.start()
    threading.Thread(target=run, args=("http", http_call), daemon=True).start()
    http_done = None
    while True:  # the HTTP side ends by itself (requests' timeout); the NCCL side gets `timeout` s after it
        if failed("nccl"):
            raise outcome["nccl"][1]
        if failed("http"):
            nccl.join(1.0)  # a NCCL error that caused the server's failure is the one to report
            if failed("nccl"):
                raise outcome["nccl"][1] from outcome["http"][1]
            raise outcome["http"][1]
        if len(outcome) == 2:
            return outcome["nccl"][1]
        if "http" in outcome:
            http_done = http_done or time.monotonic()
            if time.monotonic() - http_done > timeout:
                raise TimeoutError(f"the trainer's NCCL side did not finish within {timeout:.0f} s after the server's")
        time.sleep(0.01)


def server_init_weight_sync(base_url, group_port, master_address="127.0.0.1"):
    """Form the NCCL group trainer (rank 0) + every server worker (ranks 1..W-1). The trainer hosts the rendezvous at
    master_address:group_port, which the server must be able to reach."""
    from vllm.distributed.weight_transfer.nccl_common import trainer_init

    world_size = requests.get(f"{base_url}/get_world_size", timeout=30).json()["world_size"]
    info = {"master_address": master_address, "master_port": group_port, "rank_offset": 1, "world_size": world_size + 1}
    return _run_beside(lambda: trainer_init(info),
                       lambda: _post(base_url, "/init_weight_transfer_engine", WEIGHT_SYNC_TIMEOUT_S, json={"init_info": info}),
                       WEIGHT_SYNC_TIMEOUT_S)


def server_sync_weights(base_url, group, model):
    """Send the model's weights to the server: start -> packed broadcast beside /update_weights -> finish -> reset the
    prefix cache (its KV was computed by the old weights). The weights are streamed (named_weights): gathered, cast
    and packed a buffer at a time. Under torchrun the other ranks must iterate named_weights(model) meanwhile."""
    from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

    update_info = {**weight_metadata(model), "packed": True, "packed_buffer_size_bytes": PACKED_BUFFER_BYTES,
                   "packed_num_buffers": PACKED_NUM_BUFFERS}
    _post(base_url, "/start_weight_update", 60, json={})

    # the optimizer step ran on this stream; the producer gathers, casts and packs on its own side streams
    torch.cuda.current_stream().synchronize()

    def broadcast():
        packed_nccl_broadcast_producer(named_weights(model), group, 0, lambda item: item[1], PACKED_BUFFER_BYTES, PACKED_NUM_BUFFERS)
        torch.cuda.synchronize()  # 0.26's producer does not drain its streams

    _run_beside(broadcast, lambda: _post(base_url, "/update_weights", WEIGHT_SYNC_TIMEOUT_S, json={"update_info": update_info}),
                WEIGHT_SYNC_TIMEOUT_S)
    _post(base_url, "/finish_weight_update", 60)
    for _ in range(50):  # False while blocks are still held by running requests
        if _post(base_url, "/reset_prefix_cache", 60).get("success", True):
            return
        time.sleep(0.1)
    raise RuntimeError("the server's prefix cache could not be reset after a weight update")


def completions_request(model_id, prompt_ids, n, fields):
    """Body of POST /v1/completions: one token-id prompt per entry (each sampled n times), every sampling field
    explicit, the sampled token's log-prob, and token ids instead of text."""
    return {"model": model_id, "prompt": prompt_ids, "n": n, **fields, "logprobs": 0, "return_token_ids": True,
            "return_tokens_as_token_ids": True, "skip_special_tokens": False}


def parse_completions(response, num_prompts, n):
    """Completion ids and per-token log-probs from a /v1/completions response. Choices come prompt-major (choice k
    belongs to prompt k // n); a stop on EOS leaves the EOS as the last token; a missing log-prob is None."""
    choices = response["choices"]
    if len(choices) != num_prompts * n:
        raise RuntimeError(f"the server returned {len(choices)} completions for {num_prompts} prompts x {n}")
    choices = sorted(choices, key=lambda choice: choice["index"])
    completion_ids = [list(choice["token_ids"]) for choice in choices]
    logprobs = [list(choice["logprobs"]["token_logprobs"]) for choice in choices]
    for ids, lps in zip(completion_ids, logprobs):
        if len(ids) != len(lps):
            raise RuntimeError(f"the server returned {len(lps)} log-probs for {len(ids)} tokens")
    return completion_ids, logprobs


def server_generate(base_url, model_id, prompt_ids, n, fields):
    """Sample n completions per prompt on the server: (completion ids, sampled-token log-probs), prompt-major."""
    response = requests.post(f"{base_url}/v1/completions", json=completions_request(model_id, prompt_ids, n, fields),
                             timeout=GENERATION_TIMEOUT_S)
    if response.status_code != 200:
        raise RuntimeError(f"/v1/completions failed with {response.status_code}: {response.text[:500]}")
    return parse_completions(response.json(), len(prompt_ids), n)


# ------------------------------------------------------------------------------------------------------------------
# The three calls the training scripts make


def start(args, model_path, max_prompt_length):
    """Build the generator `args.vllm_mode` asks for; returns a dict handed back to generate / sync_weights."""
    if not torch.cuda.is_available():
        raise RuntimeError("--use-vllm needs a CUDA GPU; on the CPU use --no-use-vllm (Hugging Face generate)")
    engine = {"mode": args.vllm_mode, "fields": sampling_fields(args), "n": args.num_generations}
    if args.vllm_mode == "colocate":
        t0 = time.perf_counter()
        engine["llm"] = colocate_engine(
            model_path, args.vllm_gpu_memory_utilization, args.vllm_tensor_parallel_size,
            args.vllm_max_model_len or max_prompt_length + args.max_completion_length, args.vllm_enable_sleep_mode,
            args.seed, max_num_seqs=args.prompts_per_step * args.num_generations, dtype="bfloat16" if args.bf16 else "auto")
        engine["sleep"] = args.vllm_enable_sleep_mode  # starts awake with the checkpoint's weights (model_path)
        engine["tp_group"] = tensor_parallel_group(args.vllm_tensor_parallel_size)
        engine["startup_s"] = time.perf_counter() - t0
        return engine
    base_url = f"http://{args.vllm_server_host}:{args.vllm_server_port}"
    t0 = time.perf_counter()
    wait_for_server(base_url, args.vllm_server_timeout, model_path)
    engine["model_id"], max_model_len = check_server(base_url, model_path)
    if max_model_len and max_prompt_length + args.max_completion_length > max_model_len:
        raise ValueError(f"the longest prompt ({max_prompt_length} tokens) + --max-completion-length "
                         f"{args.max_completion_length} exceeds the server's --max-model-len {max_model_len}")
    engine["startup_s"] = time.perf_counter() - t0
    engine["base_url"] = base_url
    if _rank() != 0:  # with torchrun every rank generates through HTTP, rank 0 alone sends the weights
        return engine
    check_gpu_not_shared(base_url)
    # the server's workers connect to this address: loopback for a local server, else this host's routable IP
    # (vLLM's get_ip honours VLLM_HOST_IP, the override for hosts with several interfaces)
    if args.vllm_server_host in ("127.0.0.1", "localhost"):
        master_address = "127.0.0.1"
    else:
        from vllm.utils.network_utils import get_ip

        master_address = get_ip()
    engine["group"] = server_init_weight_sync(base_url, args.vllm_group_port, master_address)
    engine["startup_s"] = time.perf_counter() - t0
    return engine


def generate(engine, prompt_ids, args=None):
    """(completion ids, vLLM log-probs), prompt-major, num_generations per prompt."""
    if engine["mode"] == "server":
        return server_generate(engine["base_url"], engine["model_id"], prompt_ids, engine["n"], engine["fields"])
    llm, group = engine["llm"], engine["tp_group"]
    if engine.get("weights_asleep"):
        raise RuntimeError("the colocated engine's weights are asleep (level 2 discards them): call sync_weights first")
    if engine.get("kv_asleep"):
        llm.wake_up(tags=["kv_cache"])  # scheduling resumes once weights and KV cache are both awake
        engine["kv_asleep"] = False
    if group is None:
        out = colocate_generate(llm, prompt_ids, engine["n"], engine["fields"])
    else:  # the ranks of one tensor-parallel engine generate everyone's prompts together, then keep their own
        parts = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(parts, prompt_ids, group=group)
        completion_ids, logprobs = colocate_generate(llm, [p for part in parts for p in part], engine["n"], engine["fields"])
        start = sum(len(part) for part in parts[: torch.distributed.get_rank(group)]) * engine["n"]
        mine = slice(start, start + len(prompt_ids) * engine["n"])  # this rank's prompts, prompt-major
        out = completion_ids[mine], logprobs[mine]
    return out


def sleep(engine):
    """Colocate with sleep mode: free vLLM's GPU memory (weights and KV cache, level 2) for training. Call it once the
    step's generation is done; sync_weights wakes and refills the weights, generate wakes the KV cache. No-op
    otherwise."""
    if engine["mode"] == "colocate" and engine["sleep"] and not engine.get("weights_asleep"):
        engine["llm"].sleep(level=2)
        engine["weights_asleep"] = engine["kv_asleep"] = True


def _rank():
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def sync_weights(engine, model):
    """Push the trainer's current weights to vLLM (call after each optimizer step, before generating). With torchrun
    every rank must call it: gathering FSDP2-sharded weights is a collective."""
    if engine["mode"] == "server":
        if _rank() == 0:
            server_sync_weights(engine["base_url"], engine["group"], model)
        else:  # take part in each parameter's FSDP2 gather, in rank 0's order, and drop the result
            for _ in named_weights(model):
                pass
        if torch.distributed.is_initialized():
            torch.distributed.barrier()  # no rank generates before the server has the new weights
        return
    llm = engine["llm"]
    if engine.get("weights_asleep"):
        torch.cuda.empty_cache()  # give the trainer's cached blocks back so that vLLM can map its weights again
        llm.wake_up(tags=["weights"])  # level 2 left garbage: every weight is reloaded below
        engine["weights_asleep"] = False
    colocate_load_weights(llm, named_weights(model))  # streamed: one full parameter at a time
    llm.reset_prefix_cache()
