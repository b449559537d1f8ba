"""vLLM for online RL, shared by grpo.py / rloo.py / online_dpo.py and their forks (docs/vllm.md: modes, versions,
fixes). colocate: a `vllm.LLM` in the training process, fed new weights through vLLM's reload path; server: a stock
`vllm serve`, sent concurrent token-id requests and, after each optimizer step, the weights while paused, by NCCL (a
server on other GPUs) or CUDA IPC (one on the trainer's GPU). Both return completion ids and each sampled token's vLLM
log-prob (after temperature). `start`, `generate`, `sleep`, `sync_weights` consist of small functions forks can call."""

import base64
import concurrent.futures
import contextlib
import importlib.util
import io
import logging
import math
import os
import pickle
import socket
import threading
import time
from typing import NamedTuple

import psutil
import requests
import torch
import transformers
from packaging.version import Version
from torch.multiprocessing.reductions import reduce_tensor
from transformers.core_model_loading import revert_weight_conversion

SUPPORTED_VLLM = ((0, 26), (0, 33))  # (major, minor), both ends tested as docs/vllm.md "Supported vLLM versions" says
PACKED_NUM_BUFFERS = 2  # packed-broadcast chunks in flight on each side; both sides must agree
# the server-mode Args fields an engine carries (docs/vllm.md, "Server flags"), with the Args' defaults (a test checks)
SERVER_OPTIONS = dict(vllm_group_port=None, vllm_generation_chunk_size=8, vllm_generation_timeout=1800.0)
SERVER_OPTIONS.update(vllm_weight_sync_timeout=300.0, vllm_weight_sync_buffer_mb=1024, vllm_server_timeout=240.0)
_listed = lambda value: list(value) if isinstance(value, (list, tuple)) else [value]  # noqa: E731 - one or several
_urls = lambda engine: engine.get("base_urls", [engine["base_url"]])  # noqa: E731 - a server engine's servers
_port = lambda base_url: base_url.rsplit(":", 1)[1] if base_url else 8000  # noqa: E731 - 8000 if unknown
LOCAL_HOSTS = ("127.0.0.1", "localhost", "0.0.0.0", "::1", socket.gethostname())
TOKEN_IDS = {"return_token_ids": True, "return_tokens_as_token_ids": True, "skip_special_tokens": False}
TRUST_REMOTE_CODE = False  # the trainer's --trust-remote-code (start sets it): the serve commands it prints carry it
_strip = lambda name: (  # noqa: E731 - wrappers' infixes: activation checkpointing's, FSDP's, peft's
    name.replace("_checkpoint_wrapped_module.", "").replace("_fsdp_wrapped_module.", "").replace(".base_layer.", ".")
).removeprefix("base_model.model.")


# ------------------------------------------------------------------------------------------------------------------
# Weights (what is sent, in which order, in which message format) and colocate: vllm.LLM in this process


def _checkpoint_tensors(model, name, tensor):
    """(name, tensor) pairs as save_pretrained writes this parameter, the names vLLM's loaders know: no wrapper infixes,
    transformers' load-time conversions reversed (fused MoE gate_up_proj split per expert, as vLLM 0.26 needs)."""
    model = model.get_base_model() if hasattr(model, "peft_config") else model  # peft: the transformers model inside
    if "_converted_names" not in vars(model):  # once per model, on the meta device: which parameters change at all
        meta = {_strip(n): torch.empty(p.shape, device="meta") for n, p in base_parameters(model)}
        saved = revert_weight_conversion(model, dict(meta))
        model._converted_names = {n for n, t in meta.items() if n not in saved or saved[n].shape != t.shape}
        model._renamed = {}  # those whose reverse hands back the same tensor under another name (a VLM's every one)
    name = _strip(name)
    if name not in model._converted_names:  # the reverse is slow (~0.3 ms a weight): only for those that change
        return [(name, tensor)]
    if name in model._renamed:
        return [(model._renamed[name], tensor)]
    saved = revert_weight_conversion(model, {name: tensor})
    if len(saved) == 1 and next(iter(saved.values())) is tensor:
        model._renamed[name] = next(iter(saved))
    return list(saved.items())


def base_parameters(model, changed_only=False):
    """(name, parameter) of the weights vLLM holds: all of them, but a peft model's LoRA matrices (merged in instead);
    changed_only: not those that training never changes, the frozen ones of a model trained in full (a vision tower)."""
    keep = lambda p: p.requires_grad or not changed_only or hasattr(model, "peft_config")  # noqa: E731 - peft: all
    return ((name, param) for name, param in model.named_parameters() if ".lora_" not in name and keep(param))


def named_weights(model, dtype=torch.bfloat16, changed_only=False):
    """(checkpoint name, tensor) per parameter in `dtype` (bf16 halves the bytes sent), tied ones once; FSDP2 gathers
    each (a collective: all ranks iterate alike) only when reached. peft's adapted weights go merged, W + (alpha/r) B A
    in fp32 rounded once, under the base's names (the base stays: a bf16 merge and unmerge would not restore it)."""
    full = lambda param: param.detach().full_tensor() if hasattr(param, "full_tensor") else param.detach()  # noqa: E731
    lora = {f"{n}.base_layer.weight": m for n, m in model.named_modules() if "default" in getattr(m, "lora_A", {})}
    if other := [n for n, m in lora.items() if not isinstance(m.base_layer, torch.nn.Linear)]:  # e.g. MoE experts
        raise NotImplementedError(
            f"LoRA on {other[0].removesuffix('.base_layer.weight')}, not a Linear layer, is not merged for vLLM: "
            "name Linear layers in --lora-target-modules (peft adapts a MoE model's 3-D experts otherwise)"
        )
    for name, param in base_parameters(model, changed_only):
        tensor = full(param)  # FSDP2: gathered
        if (layer := lora.get(name)) is not None:
            delta = full(layer.lora_B["default"].weight).float() @ full(layer.lora_A["default"].weight).float()
            tensor = tensor.float() + layer.scaling["default"] * (delta.T if layer.fan_in_fan_out else delta)
        yield from _checkpoint_tensors(model, name, tensor.to(dtype))


def weight_metadata(model, dtype=torch.bfloat16, changed_only=False):
    """The lists vLLM allocates its receive buffers from: exactly the tensors `named_weights` streams, in its order.
    Read from the parameters without gathering anything (an FSDP2 DTensor's shape is the full one)."""
    meta = [(n, torch.empty(p.shape, device="meta")) for n, p in base_parameters(model, changed_only)]
    meta = [pair for n, t in meta for pair in _checkpoint_tensors(model, n, t)]
    dtype_names = [str(dtype).removeprefix("torch.")] * len(meta)
    return {"names": [n for n, _ in meta], "dtype_names": dtype_names, "shapes": [list(t.shape) for _, t in meta]}


def vllm_version(version=None, who=None):
    """(major, minor) of a vLLM version string ("0.28.1.dev3+g12ab" -> (0, 28)), the installed vLLM's by default. With
    `who`, refuse one outside SUPPORTED_VLLM: this file knows the weight-transfer messages of those versions only."""
    if version is None:
        from vllm import __version__ as version
    low, high = (".".join(map(str, v)) for v in SUPPORTED_VLLM)
    if who and not SUPPORTED_VLLM[0] <= Version(version).release[:2] <= SUPPORTED_VLLM[1]:
        raise RuntimeError(f"{who} runs vLLM {version}, outside the supported range {low} to {high} (vllm==0.26.0)")
    return Version(version).release[:2]


def weight_sync_messages(server_version, init_info, update_info, buffer_bytes=1 << 30, backend="nccl"):
    """(init_info, update_info) as a server running `server_version` takes them: `packed` (NCCL: with the broadcast's
    geometry) must go in each update before the version that `moved` it (NCCL 0.28, IPC 0.27), in the init from it."""
    nccl = {"packed": True, "packed_buffer_size_bytes": buffer_bytes, "packed_num_buffers": PACKED_NUM_BUFFERS}
    packed, moved = ({"packed": True}, (0, 27)) if backend == "ipc" else (nccl, (0, 28))
    if vllm_version(server_version) >= moved:
        return {**init_info, **packed}, update_info
    return init_info, {**update_info, **packed}


def free_port():
    """A TCP port that is free on this host now (the OS picks it)."""
    with socket.create_server(("", 0)) as s:
        return s.getsockname()[1]


def colocate_engine(model_path, tensor_parallel_size=1, seed=0, **llm_args):
    """A vllm.LLM in this (torchrun or plain) process, on its GPU; `llm_args` go to vllm.LLM. external_launcher runs
    the engine's worker in this process, which lets the trainer hand it weights; env:// variables are filled in."""
    if (world_size := int(os.environ.get("WORLD_SIZE", "1"))) % tensor_parallel_size:
        raise ValueError(f"--vllm-tensor-parallel-size {tensor_parallel_size} must divide the {world_size} processes")
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", **os.environ})  # the environment's first
    if "MASTER_PORT" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    from vllm import LLM

    fixed = {"distributed_executor_backend": "external_launcher", "logprobs_mode": "processed_logprobs"}
    llm_args = {"gpu_memory_utilization": 0.3, "dtype": "bfloat16", **llm_args, **fixed}
    if tensor_parallel_size > 1 and os.environ.get("NCCL_NVLS_ENABLE") == "0":
        # FlashInfer's fused TP all-reduce + RMSNorm maps NVLink multicast memory, which NCCL_NVLS_ENABLE=0 turned off
        llm_args["compilation_config"] = {"pass_config": {"fuse_allreduce_rms": False}}
    seed += int(os.environ["RANK"]) // tensor_parallel_size  # ranks of one TP group must sample identically
    return LLM(model=model_path, tensor_parallel_size=tensor_parallel_size, seed=seed, **llm_args)


def sampling_fields(args):
    """Both modes' sampling settings, all explicit (a server fills gaps from the model's generation_config.json)."""
    top_k = args.top_k if args.top_k > 0 else -1
    fields = {"temperature": args.temperature, "top_p": args.top_p, "top_k": top_k, "min_p": args.min_p}
    return {**fields, "repetition_penalty": args.repetition_penalty, "max_tokens": args.max_completion_length}


class ImagePrompt(NamedTuple):
    """A prompt with images, as vLLM takes it: vLLM expands the placeholders, into the trainer's prompt ids (checked)."""

    token_ids: list  # the chat template's ids, one placeholder token per image (colocate; expanded by vLLM)
    messages: list  # the chat messages, an {"type": "image"} part per image in order (a server renders them)
    images: list  # the PIL images, in order


def colocate_generate(llm, prompt_ids, n, fields, images=None):
    """n completions per prompt from `llm`: (completion ids, token log-probs), prompt-major; images: ImagePrompts."""
    from vllm import SamplingParams

    # no text (detokenizing stalls decoding); logprobs=0, flat: one float per token
    params = SamplingParams(n=n, logprobs=0, detokenize=False, flat_logprobs=True, **fields)
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]
    if images is not None:
        prompts = [{"prompt_token_ids": p.token_ids, "multi_modal_data": {"image": p.images}} for p in images]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for output, ids in zip(outputs, prompt_ids) if images is not None else ():
        same_prompt(output.prompt_token_ids, ids)
    samples = [sample for output in outputs for sample in output.outputs]
    return [list(s.token_ids) for s in samples], [list(s.logprobs.logprobs) for s in samples]


def same_prompt(vllm_ids, ids):
    """Raise unless vLLM's expanded prompt ids of an image prompt are the trainer's."""
    if list(vllm_ids) != list(ids):
        at = next((i for i, (a, b) in enumerate(zip(vllm_ids, ids)) if a != b), min(len(vllm_ids), len(ids)))
        raise RuntimeError(
            f"vLLM expanded an image prompt into {len(vllm_ids)} token ids and the trainer's processor into {len(ids)},"
            f" first differing at {at}: the two would not train on what was sampled. Use the same processor settings"
        )


def tensor_parallel_group(tensor_parallel_size):
    """The process group of this rank's tensor-parallel engine (consecutive ranks, same prompts), None without TP."""
    if tensor_parallel_size > 1 and torch.distributed.is_initialized():
        return torch.distributed.new_subgroups(tensor_parallel_size)[0]  # every rank creates every group, in order


# ------------------------------------------------------------------------------------------------------------------
# Server: a stock `vllm serve` over HTTP, weights by NCCL or CUDA IPC


def serve_command(model, port=8000, gpus=None, backend="nccl", servers=1, trust_remote_code=None, kv_bytes=None):
    """The command that starts a server this codebase can train against: backend "nccl" on GPUs the trainer leaves
    free (`gpus`, default 1) or "ipc" on the trainer's (the default: 0.35 of memory split between `servers`, leaving it
    room; pickled CUDA IPC handles allowed); 4 HTTP front ends (one alone turns log-probs into responses slower than the
    engine samples); on loopback: dev mode has no authentication; --trust-remote-code as asked (None: the trainer's)."""
    model += " --trust-remote-code" * (TRUST_REMOTE_CODE if trust_remote_code is None else trust_remote_code)
    if gpus is None and backend == "ipc":  # the trainer's GPU, as its CUDA_VISIBLE_DEVICES names it
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        visible = [gpu for gpu in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if gpu.strip()]
        gpus = visible[index] if index < len(visible) else str(index)
    transfer = f'\'{{"backend": "{backend}"}}\''
    flags = f"--weight-transfer-config {transfer} --logprobs-mode processed_logprobs --max-logprobs -1"
    env = f"CUDA_VISIBLE_DEVICES={1 if gpus is None else gpus} VLLM_SERVER_DEV_MODE=1"
    if backend == "ipc":
        env += " VLLM_ALLOW_INSECURE_SERIALIZATION=1"
        flags += f" --gpu-memory-utilization {0.35 / servers:.2g}"
    flags += f" --kv-cache-memory-bytes {kv_bytes}" if kv_bytes else ""  # beside a live trainer: no profiling
    return f"{env} vllm serve {model} --host 127.0.0.1 --port {port} {flags} --api-server-count 4"


def _restart(model, backend="nccl", base_url=None, servers=1, verb="Restart it"):
    """An error's last line: the command for the server at base_url (its port; 8000 if unknown) in `backend`, or, with
    backend None, the two layouts that work, each in full: the server on this GPU (IPC) or on others (NCCL)."""
    command = lambda backend: serve_command(model, port=_port(base_url), backend=backend, servers=servers)  # noqa: E731
    if backend:
        return f"{verb} as:\n  {command(backend)}"
    ray = "a vLLM 0.26 server also needs ray, which requirements.txt installs"
    ipc = f"{verb} on this GPU (weights by CUDA IPC; {ray}):\n  {command('ipc')}"
    return f"{ipc}\nor on other GPUs (weights by NCCL):\n  {command('nccl')}"


def wait_for_server(base_url, timeout, model, servers=1):
    """Poll GET /health until it answers 200; after `timeout` s raise with the commands that start one of `servers`."""
    deadline = time.monotonic() + timeout
    while not _answers(base_url):
        if time.monotonic() > deadline:
            start_one = _restart(model, None, base_url, servers, "Start one before the trainer,")
            raise ConnectionError(
                f"no vLLM server answered at {base_url}/health within {timeout:.0f} s (--vllm-server-timeout). "
                f"{start_one}\nor point --vllm-server-host / --vllm-server-port at it."
            )
        time.sleep(2)


def probe_server(base_url, model, timeout=10.0, backend="nccl"):
    """Whether the engine is paused: GET /is_paused, unlike /health, needs its loop (a stuck NCCL receive blocks it)."""
    try:
        response = requests.get(f"{base_url}/is_paused", timeout=timeout)
    except requests.Timeout:
        raise RuntimeError(
            f"the server at {base_url} answers /health but its engine not /is_paused within {timeout:.0f} s: it is "
            f"likely stuck receiving a weight update whose trainer died (NCCL has no timeout). "
            + _restart(model, backend, base_url)
        ) from None
    return response.status_code == 200 and response.json().get("is_paused", False)


def check_server(base_url, model):
    """Refuse, with the fix, a server that cannot do RL (no dev mode or weight transfer, raw log-probs, a vLLM outside
    SUPPORTED_VLLM, a stuck or sleeping engine); resume one a dead trainer left paused. Returns its facts."""
    get = lambda path, **params: requests.get(f"{base_url}{path}", params=params, timeout=30)  # noqa: E731
    at, restart = f"the server at {base_url}", _restart(model, base_url=base_url)
    response = get("/server_info", config_format="json")
    if response.status_code == 404:  # the weight-sync endpoints need dev mode too
        raise RuntimeError(f"{at} was started without VLLM_SERVER_DEV_MODE=1. {restart}")
    response.raise_for_status()
    config = response.json()["vllm_config"]
    if not config.get("weight_transfer_config"):
        raise RuntimeError(f"{at} has no --weight-transfer-config. {restart}")
    if (backend := config["weight_transfer_config"].get("backend", "nccl")) not in ("nccl", "ipc"):
        raise RuntimeError(f"{at} transfers weights by {backend}, not nccl or ipc. {restart}")
    model_config, restart = config.get("model_config", {}), _restart(model, backend, base_url)  # now in its backend
    if (mode := model_config.get("logprobs_mode")) != "processed_logprobs":  # raw ones leave out the temperature
        raise RuntimeError(f"{at} returns {mode}, which biases every ratio. {restart}")
    version = get("/version").json()["version"]
    vllm_version(version, who=at)  # any mix with the trainer's: messages follow the server
    if probe_server(base_url, model, backend=backend):  # a trainer died between /pause and /resume
        _post(base_url, "/resume", 30)
    asleep = get("/is_sleeping")
    if asleep.status_code == 200 and asleep.json().get("is_sleeping"):  # an update of its freed weights segfaults it
        raise RuntimeError(f"{at} is asleep: POST {base_url}/wake_up first, or restart it")
    served, workers = get("/v1/models").json()["data"][0], get("/get_world_size").json()["world_size"]
    info = {"model_id": served["id"], "max_model_len": served.get("max_model_len"), "backend": backend, "url": base_url}
    info |= {"cache_config": config.get("cache_config") or {}, "model_config": model_config, "workers": workers}
    return {**info, "version": version}


def check_same_model(server, model, model_path, trust_remote_code=False):
    """Refuse a server of another model before any NCCL or /start_weight_update: vLLM reports no parameter names, so the
    model /server_info names, built on the meta device, needs weight_metadata's names and shapes (vLLM casts dtypes)."""
    served = server["model_config"]
    name, remote = served.get("model", server["model_id"]), {"trust_remote_code": trust_remote_code}
    try:  # the served model's parameters, on the meta device; its code only if the trainer, not the server, trusts it
        config = transformers.AutoConfig.from_pretrained(name, revision=served.get("revision"), **remote)
        config.update(served.get("hf_overrides") or {})
        vision = getattr(config, "vision_config", None) is not None  # a vision-language model: its own class
        auto = transformers.AutoModelForImageTextToText if vision else transformers.AutoModelForCausalLM
        with torch.device("meta"):
            served_model = auto.from_config(config, **remote)
    except (OSError, ValueError, TypeError, KeyError):
        return print(f"vllm_utils: cannot build the served {name} here to compare it with the trainer's {model_path}")
    sent, shapes = (dict(zip(*(weight_metadata(m)[key] for key in ("names", "shapes")))) for m in (model, served_model))
    if (first := next((key for key in [*sent, *shapes] if sent.get(key) != shapes.get(key)), None)) is not None:
        got = f"{first} is {sent.get(first, 'not sent')} in the trainer, {shapes.get(first, 'absent')} on the server"
        restart = _restart(model_path, server.get("backend", "nccl"), server.get("url"))
        raise RuntimeError(f"the server serves {name}, not {model_path} ({got}); nothing sent. {restart}")


def check_transport(base_url, server, model):
    """Before anything is sent, refuse a layout CUDA IPC cannot serve (one worker on trainer rank 0's GPU, on this host,
    in exportable memory) and warn where it answers beyond loopback; a wrong GPU shows at the first push (_with_fix)."""
    if server["backend"] != "ipc":
        return
    host, port = base_url.split("//")[-1].rsplit(":", 1)
    if host not in LOCAL_HOSTS or server["workers"] > 1:
        where = f"on {host}" if host not in LOCAL_HOSTS else f"with {server['workers']} workers (tensor/data parallel)"
        raise RuntimeError(
            f"the server at {base_url} runs {where}, and CUDA IPC reaches only one worker on trainer rank 0's GPU: "
            f"serve it with NCCL weight transfer, on GPUs the trainer does not use. {_restart(model, 'nccl', base_url)}"
        )
    allocator = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    if "expandable_segments:true" in allocator.lower().replace(" ", ""):
        raise RuntimeError(
            "PYTORCH_CUDA_ALLOC_CONF (or PYTORCH_ALLOC_CONF) has expandable_segments:True, whose memory cannot be "
            "exported as a CUDA IPC handle (pytorch#165685). Unset it for the trainer or serve with NCCL on other GPUs."
        )
    nics = [a.address for nic in psutil.net_if_addrs().values() for a in nic if a.family == socket.AF_INET]
    for address in (a for a in nics if not a.startswith("127.")):  # a server bound to 0.0.0.0 answers on each
        with contextlib.suppress(OSError), socket.create_connection((address, int(port)), timeout=0.5):
            return print(
                f"warning: the server at {base_url} also answers on {address}:{port}, and it runs any code it is sent "
                "(VLLM_ALLOW_INSECURE_SERIALIZATION=1): restart it with --host 127.0.0.1 (docs/vllm.md, Security)"
            )


class ServerLost(ConnectionError):
    """Every server of the run stopped answering (refused, reset, or a 5xx while /health fails): a restart may come."""


def _answers(base_url, timeout=5.0):
    """Whether a server answers GET /health with 200 (a restarting one does once it can serve)."""
    with contextlib.suppress(requests.RequestException):
        return requests.get(f"{base_url}/health", timeout=timeout).status_code == 200
    return False


def _post(base_url, path, timeout, **kwargs):
    # one attempt, never retried: a repeated /update_weights would wait forever for a broadcast that never comes
    response = requests.post(f"{base_url}{path}", timeout=timeout, **kwargs)
    if response.status_code != 200:
        raise RuntimeError(f"POST {base_url}{path} failed with {response.status_code}: {response.text[:500]}")
    return response.json() if response.content else {}


def _run_beside(nccl_work, http_call, timeout):
    """Run the trainer's NCCL side beside the HTTP call blocking in the server's side (daemon threads); NCCL's result.
    NCCL has no timeout: the first failure is raised at once, the other left behind (both: NCCL's, mostly the cause)."""
    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    nccl, http = concurrent.futures.Future(), concurrent.futures.Future()

    def run(future, work):
        try:
            if device is not None:
                torch.cuda.set_device(device)  # the current device is per thread
            future.set_result(work())
        except BaseException as error:  # noqa: BLE001
            future.set_exception(error)

    for future, work in ((nccl, nccl_work), (http, http_call)):
        threading.Thread(target=run, args=(future, work), daemon=True).start()
    concurrent.futures.wait((nccl, http), return_when=concurrent.futures.FIRST_COMPLETED)
    if not nccl.done() and (error := http.exception()) is not None:  # the HTTP side failed first
        if concurrent.futures.wait((nccl,), 1.0).done and nccl.exception() is not None:
            raise nccl.exception() from error  # a NCCL error that caused the server's failure is the one to report
        raise error
    if not nccl.done() and concurrent.futures.wait((nccl,), timeout).not_done:  # the HTTP side is done
        raise TimeoutError(f"the trainer's NCCL side did not finish within {timeout:.0f} s after the server's")
    result = nccl.result()  # a NCCL failure is raised at once
    http.result()  # the HTTP side ends by itself (requests' timeout)
    return result


def server_init_weight_sync(
    base_url, port=None, address="127.0.0.1", version=None, buffer_bytes=1 << 30, timeout=300, name="MODEL"
):
    """Form the NCCL group trainer (rank 0) + server workers at address:port (None: a free one); `version`: the server's
    vLLM (0.26-0.33 agree on the wire). A refusal (NCCL's of two ranks on one GPU) is raised with its fix."""
    from vllm.distributed.weight_transfer.nccl_common import trainer_init

    world_size = requests.get(f"{base_url}/get_world_size", timeout=30).json()["world_size"] + 1
    info = {"master_address": address, "master_port": port or free_port(), "rank_offset": 1, "world_size": world_size}
    info = weight_sync_messages(version, info, {}, buffer_bytes)[0]
    init = lambda: _post(base_url, "/init_weight_transfer_engine", timeout, json={"init_info": info})  # noqa: E731
    try:
        return _run_beside(lambda: trainer_init(info), init, timeout)
    except RuntimeError as error:
        raise RuntimeError(_with_fix(base_url, str(error), name)) from error


def restore_after_failed_update(base_url, model, timeout=30.0, backend="nccl"):
    """Best effort after a failed update: finishing it gives layers that got nothing their weights back. A raising
    /update_weights ends it itself (0.26-0.33 v1/worker/gpu_worker.py): start again (layers stay waiting), finish."""
    try:
        try:
            _post(base_url, "/finish_weight_update", timeout, json={})
        except RuntimeError:  # "without a matching start_weight_update"
            for path in ("/start_weight_update", "/finish_weight_update"):
                _post(base_url, path, timeout, json={})
    except (RuntimeError, requests.RequestException) as error:  # a timeout: the engine is stuck in the NCCL receive
        return f"could not be restored ({error}): it may serve garbage. {_restart(model, backend, base_url)}"
    return "was restored: layers that received nothing keep their previous weights (the next sync sends all)."


def _start_update(base_url, name, backend, timeout):
    """POST /start_weight_update; an update a dead trainer left active is finished first (that repairs an engine that
    still answers) and the start tried once more. A refusal is raised with the command that restarts the server."""
    for retry in (True, False):
        try:
            return _post(base_url, "/start_weight_update", timeout, json={})
        except RuntimeError as error:  # "already active" (0.26 to 0.33 v1/worker/gpu_worker.py): a trainer died
            dead = "a previous trainer died inside a weight update: " if "already active" in str(error) else ""
            if not (retry and dead):
                raise RuntimeError(f"{dead}{error}\n{_restart(name, backend, base_url)}") from error
            restore_after_failed_update(base_url, name, timeout, backend)  # finishing it repairs an engine that answers


def _reset_prefix_cache(base_url, timeout):
    """After an update, while paused: no request holds blocks, so a refused reset is an error, not one to retry."""
    if not _post(base_url, "/reset_prefix_cache", timeout).get("success", True):
        raise RuntimeError(f"the server at {base_url}: its prefix cache could not be reset after a weight update")


def paused_update(base_url, send, name="MODEL", backend="nccl", timeout=300.0):
    """Probe -> /pause (running requests end on the old weights) -> /start_weight_update -> send() -> finish -> reset
    the prefix cache -> /resume, on one server or several (a list), each step on all at once: send() runs once. A
    failure restores the updates left open (a finished one stays), resumes every server, and is raised once."""
    urls = _listed(base_url)
    with concurrent.futures.ThreadPoolExecutor(len(urls)) as pool:

        def each(step, among=urls):  # step(url) on the servers at once: {url: error} of those that raised
            futures = {url: pool.submit(step, url) for url in among}
            return {url: error for url, future in futures.items() if (error := future.exception()) is not None}

        if stuck := each(lambda url: probe_server(url, name, backend=backend)):  # a wedged engine: nothing is paused
            raise next(iter(stuck.values()))
        errors, started, finished = each(lambda url: _post(url, "/pause", timeout, params={"mode": "wait"})), [], []
        if not errors:
            errors = each(lambda url: _start_update(url, name, backend, timeout))
            started = [url for url in urls if not isinstance(errors.get(url), RuntimeError)]  # a refusal started none
        if not errors:
            try:
                send()
            except BaseException as error:  # noqa: BLE001 - raised below, once every server is restored and resumed
                errors = {None: error}
        if not errors:
            errors = each(lambda url: _post(url, "/finish_weight_update", timeout, json={}))
            finished = [url for url in urls if url not in errors]
        left_open = [url for url in started if url not in finished]
        restored = pool.map(lambda url: restore_after_failed_update(url, name, backend=backend), left_open)  # at once
        said = [f"The server at {url} {text}" for url, text in zip(left_open, restored)]
        errors |= each(lambda url: _reset_prefix_cache(url, timeout), finished)
        resumed = each(lambda url: _post(url, "/resume", 30 if errors else timeout))  # every one, after a failure too
    if errors := errors or resumed:
        cause = next(iter(errors.values()))
        if said := [*said, *(str(error) for error in errors.values() if error is not cause)]:
            raise RuntimeError("\n".join([f"the weight update failed: {cause}", *said])) from cause
        raise cause


def server_sync_weights(
    base_url, group, model, version=None, buffer_bytes=1 << 30, timeout=300.0, name="MODEL", changed_only=False
):
    """NCCL: named_weights' packed broadcast beside /update_weights (other torchrun ranks iterate them too), inside
    paused_update. `group`: server_init_weight_sync's; `version`: the server's vLLM; `name`: the model."""
    from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer as producer

    update_info = weight_sync_messages(version, {}, weight_metadata(model, changed_only=changed_only), buffer_bytes)[1]
    update = lambda: _post(base_url, "/update_weights", timeout, json={"update_info": update_info})  # noqa: E731
    weights = lambda: named_weights(model, changed_only=changed_only)  # noqa: E731 - gathered only when sent
    broadcast = lambda: producer(weights(), group, 0, lambda item: item[1], buffer_bytes, PACKED_NUM_BUFFERS)  # noqa: E731

    def send():
        if torch.cuda.is_available():  # the optimizer step ran on this stream; the producer packs on its own
            torch.cuda.current_stream().synchronize()
        _run_beside(broadcast, update, timeout)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # 0.26's producer does not drain its streams

    paused_update(base_url, send, name, "nccl", timeout)


def ipc_handle(buffer):
    """{physical GPU's UUID (vLLM's key): args that rebuild `buffer` in another process}, a fresh CUDA IPC export."""
    torch.cuda.current_stream().synchronize()  # the copies into `buffer` are done before the server reads it
    return {str(torch.cuda.get_device_properties(buffer.device).uuid): reduce_tensor(buffer)[1]}


def packed_chunks(weights, capacity):
    """Pack (name, tensor) pairs into one reused byte buffer of `capacity` bytes, yielding (the filled part, its names,
    dtype_names, shapes and tensor_sizes) when the next would not fit: the caller is done with a chunk before it asks
    for the next. A tensor above `capacity` goes alone, as a copy (an exported parameter gains a CUDA IPC record)."""
    buffer, used, meta = None, 0, {key: [] for key in ("names", "dtype_names", "shapes", "tensor_sizes")}
    for name, tensor in weights:
        flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
        if used and used + flat.numel() > capacity:
            yield buffer[:used], meta
            used, meta = 0, {key: [] for key in meta}
        for key, value in zip(meta, (name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), flat.numel())):
            meta[key].append(value)
        if flat.numel() > capacity:
            yield flat.clone(), meta
            meta = {key: [] for key in meta}
        else:
            buffer = torch.empty(capacity, dtype=torch.uint8, device=flat.device) if buffer is None else buffer
            buffer[used : used + flat.numel()].copy_(flat)
            used += flat.numel()
    if used:
        yield buffer[:used], meta


def server_sync_weights_ipc(
    base_url, model, version=None, buffer_bytes=1 << 30, timeout=300.0, name="MODEL", changed_only=False
):
    """CUDA IPC to a server on this GPU, or several (`base_url` a list) in one paused_update: named_weights in chunks of
    at most `buffer_bytes`, each packed once and sent to all at once, one /update_weights with its handle (other ranks
    iterate weights too); 0.27+ takes `packed` at /init_weight_transfer_engine, sent each sync (a restart forgets)."""
    urls = _listed(base_url)
    total = sum(2 * math.prod(shape) for shape in weight_metadata(model, changed_only=changed_only)["shapes"])  # bf16
    for url in urls:
        if init_info := weight_sync_messages(version, {}, {}, backend="ipc")[0]:
            _post(url, "/init_weight_transfer_engine", timeout, json={"init_info": init_info})

    def update(url, handle, chunk):
        info = weight_sync_messages(version, {}, {**chunk, "ipc_handles_pickled": handle}, backend="ipc")[1]
        try:
            _post(url, "/update_weights", timeout, json={"update_info": info})
        except RuntimeError as error:
            raise RuntimeError(_with_fix(url, str(error), name)) from error

    def send():
        with concurrent.futures.ThreadPoolExecutor(len(urls)) as pool:
            for data, chunk in packed_chunks(named_weights(model, changed_only=changed_only), min(buffer_bytes, total)):
                # an export per server (each releases its own), pickled: HTTP carries JSON; all answer before the refill
                handles = [base64.b64encode(pickle.dumps(ipc_handle(data))).decode() for _ in urls]
                list(pool.map(update, urls, handles, [chunk] * len(urls)))

    try:
        paused_update(urls, send, name, "ipc", timeout)
    finally:  # after /finish_weight_update, where a 0.28+ server releases its mapping of the last chunk
        if torch.cuda.is_initialized():
            torch.cuda.ipc_collect()  # the exported buffers the server has released go back to the allocator


def _with_fix(base_url, error, model):
    """A refusal of a weight transfer (the server's answer, or NCCL's), with the fix where the cause is known."""
    at, both = f"the server at {base_url}", _restart(model, None, base_url)
    if "IPC handle not found for GPU UUID" in error:  # its worker is on another GPU than trainer rank 0's
        mine = torch.cuda.get_device_properties(torch.cuda.current_device()).uuid
        return f"{at} runs elsewhere, not on trainer rank 0's GPU GPU-{mine}, which CUDA IPC needs. {both}"
    if "NCCL error: invalid usage" in error:  # vLLM's pynccl, as NCCL refuses two ranks on one GPU (NVIDIA/nccl#418)
        return f"{at} likely runs on the trainer's GPU: NCCL refused the group ({error}). {both}"
    if "VLLM_ALLOW_INSECURE_SERIALIZATION" in error:
        return f"{at} was started without VLLM_ALLOW_INSECURE_SERIALIZATION=1. {_restart(model, 'ipc', base_url)}"
    return error


def completions_request(model_id, prompt_ids, n, fields):
    """Body of POST /v1/completions: token-id prompts, each sampled n times, the sampled tokens' ids and log-probs."""
    return {"model": model_id, "prompt": prompt_ids, "n": n, **fields, "logprobs": 0, **TOKEN_IDS}


def parse_completions(response, num_prompts, n):
    """Completion ids and per-token log-probs (None if missing: chat writes -9999) from a /v1/completions or chat
    response, prompt-major (choice k belongs to prompt k // n); a stop on EOS leaves the EOS as the last token."""
    choices = sorted(response["choices"], key=lambda choice: choice["index"])
    if len(choices) != num_prompts * n:
        raise RuntimeError(f"the server returned {len(choices)} completions for {num_prompts} prompts x {n}")
    completion_ids = [list(choice["token_ids"]) for choice in choices]
    chat = lambda content: [lp["logprob"] if lp.get("logprob", -9999) > -9999 else None for lp in content]  # noqa: E731
    logprobs = [c["logprobs"].get("token_logprobs") or chat(c["logprobs"].get("content") or []) for c in choices]
    if bad := next(((len(i), len(lp)) for i, lp in zip(completion_ids, logprobs) if len(i) != len(lp)), None):
        raise RuntimeError(f"the server returned {bad[1]} log-probs for {bad[0]} tokens")
    return completion_ids, [list(lp) for lp in logprobs]


def chat_request(model_id, prompt, n, fields):
    """Body of POST /v1/chat/completions: an ImagePrompt's messages, images as lossless PNG data URLs, sampled n times;
    the answer holds vLLM's expanded prompt ids (checked against the trainer's), the sampled ids and log-probs."""
    images = iter(prompt.images)
    url = lambda: {"type": "image_url", "image_url": {"url": data_url(next(images))}}  # noqa: E731 - the next image
    content = lambda c: c if isinstance(c, str) else [url() if p.get("type") == "image" else p for p in c]  # noqa: E731
    messages = [{**m, "content": content(m["content"])} for m in prompt.messages]  # a string content holds no image
    fields = {"max_completion_tokens" if k == "max_tokens" else k: v for k, v in fields.items()}  # (chat's name)
    return {"model": model_id, "messages": messages, "n": n, **fields, "logprobs": True, "top_logprobs": 0, **TOKEN_IDS}


def data_url(image):
    """A PIL image as a PNG data URL."""
    image.save(png := io.BytesIO(), format="PNG")
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()


def server_generate(base_url, model_id, prompt_ids, n, fields, chunk_size=8, timeout=1800.0, lost=None, images=None):
    """n completions per prompt on the server: (completion ids, log-probs) prompt-major, by concurrent requests of
    `chunk_size` prompts (vLLM batches them; no response holds a round), each within `timeout` s. `base_url`: one URL,
    or servers of the same weights taking the chunks in turn; one that stops answering joins `lost` ({url: since}), its
    chunks go to the others; ServerLost if none is left. images: an ImagePrompt per prompt, one chat request each."""
    urls, lost = _listed(base_url), {} if lost is None else lost
    first = int(os.environ.get("RANK", "0"))  # torchrun ranks start at different servers
    chunk_size = 1 if images is not None else chunk_size
    post = lambda url, path, body: requests.post(f"{url}{path}", json=body, timeout=timeout)  # noqa: E731

    def complete(i, start):
        chunk, deadline = prompt_ids[start : start + chunk_size], time.monotonic() + timeout
        if images is None:
            path, body = "/v1/completions", completions_request(model_id, chunk, n, fields)
        else:
            path, body = "/v1/chat/completions", chat_request(model_id, images[start], n, fields)
        for url in [u for u in (urls[(first + i + k) % len(urls)] for k in range(len(urls))) if u not in lost]:
            try:  # again while the server is paused (503), until the deadline
                while (response := post(url, path, body)).status_code == 503 and time.monotonic() < deadline:
                    time.sleep(1)
            except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError):
                response = None
            if response is not None and (response.status_code < 500 or _answers(url)):
                break
            lost.setdefault(url, time.time())  # a dead engine's 5xx or a closed port: the server is gone
        else:
            raise ServerLost(f"no server of {', '.join(urls)} answers")
        if response.status_code != 200:
            raise RuntimeError(f"{path} failed with {response.status_code}: {response.text[:500]}")
        if images is not None:  # the prompt ids vLLM made of the messages and images
            same_prompt(response.json()["prompt_token_ids"], chunk[0])
        return parse_completions(response.json(), len(chunk), n)

    starts = range(0, len(prompt_ids), chunk_size)
    with concurrent.futures.ThreadPoolExecutor(max(1, len(starts))) as pool:
        parts = list(pool.map(complete, range(len(starts)), starts))
    return [ids for part in parts for ids in part[0]], [lps for part in parts for lps in part[1]]


# ------------------------------------------------------------------------------------------------------------------
# The calls the training scripts make: the start-up checks (before any model loads), the generator, its weights


def setup_problems():
    """Why vLLM cannot run in this process ([] if it can), each with its fix: the scripts ask before any model loads."""
    if not torch.cuda.is_available():
        return ["--use-vllm needs a CUDA GPU and none is visible: drop --use-vllm to sample with Hugging Face generate"]
    return [] if importlib.util.find_spec("vllm") else ["--use-vllm needs vllm: pip install -r requirements.txt"]


def check_args(args):
    """The vLLM flags' problems, one line each naming its flag and fix ([] if none), and their warnings; asked with the
    scripts' own checks, before any model loads (the importance-sampling flags where a script has them)."""
    problems = setup_problems() if args.use_vllm else []
    floor = getattr(args, "vllm_importance_sampling_clip_min", None) or 0  # the clip max must exceed it
    ports = lambda v: 0 < len(set(_listed(v))) == len(_listed(v)) and all(0 < p < 65536 for p in _listed(v))
    rules = [  # (field, true for a valid value, what it must be); None (left unset, or not a field) is always valid
        ("vllm_gpu_memory_utilization", lambda v: 0 < v <= 1, "in (0, 1]"),
        ("vllm_tensor_parallel_size", lambda v: v >= 1, "at least 1"),
        ("vllm_max_model_len", lambda v: v >= 1, "at least 1"),
        ("vllm_server_port", ports, "TCP ports (1-65535), at least one, each once"),
        ("vllm_server_timeout", lambda v: v > 0, "> 0 seconds"),
        ("vllm_group_port", lambda v: 0 < v < 65536, "a TCP port (1-65535)"),
        ("vllm_importance_sampling_clip_min", lambda v: v >= 0, ">= 0"),
        ("vllm_importance_sampling_clip_max", lambda v: v > floor, "> --vllm-importance-sampling-clip-min (and > 0)"),
    ]
    for name, valid, must in rules:
        if (value := getattr(args, name, None)) is not None and not valid(value):
            problems.append(f"--{name.replace('_', '-')} must be {must}, got {value}")
    if args.async_generation and not (args.use_vllm and args.vllm_mode == "server"):
        problems.append(
            "--async-generation needs --use-vllm --vllm-mode server: only a server (on other GPUs or on the trainer's "
            "own) generates in another process, so that generation overlaps training"
        )
    if args.use_vllm and args.use_peft and args.torch_compile:
        print("warning: --torch-compile is off with --use-peft: peft's LoRA layers are not compiled (not measured)")
    truncated = args.top_p < 1 or args.top_k > 0 or args.min_p > 0 or args.repetition_penalty != 1
    if args.use_vllm and getattr(args, "vllm_importance_sampling_correction", False) and truncated:
        print(
            "warning: with top_p / top_k / min_p / repetition_penalty, vLLM's processed log-probs come from a truncated "
            "distribution that the trainer does not model: the importance ratio is biased below 1, and at the sequence "
            "level (product over tokens) it shrinks the updates of long completions. Prefer neutral values, or a "
            "*_truncate --vllm-importance-sampling-mode (token_truncate where the script has it; sequence_truncate "
            "with a --vllm-importance-sampling-clip-min such as 0.5 bounds the shrinking)."
        )
    return problems


def start(args, model_path, max_prompt_length, max_images=0):
    """The generator `args.vllm_mode` asks for, a dict handed back to generate / sync_weights. A server is checked (its
    layout on rank 0); over NCCL the group forms at the first sync_weights, once the served model has been compared."""
    global TRUST_REMOTE_CODE  # vLLM, the model comparison and the serve commands printed load the model alike
    vllm_version(None, who="this trainer")
    engine = {"mode": args.vllm_mode, "fields": sampling_fields(args), "n": args.num_generations, "model": model_path}
    TRUST_REMOTE_CODE = engine["trust_remote_code"] = args.trust_remote_code
    max_len = max_prompt_length + args.max_completion_length
    if args.vllm_mode == "colocate":
        dtype, seqs = ("bfloat16" if args.bf16 else "auto"), args.prompts_per_step * engine["n"]
        llm_args = dict(max_model_len=args.vllm_max_model_len or max_len, enable_sleep_mode=args.vllm_enable_sleep_mode)
        llm_args.update(gpu_memory_utilization=args.vllm_gpu_memory_utilization, dtype=dtype, max_num_seqs=seqs)
        llm_args.update(trust_remote_code=TRUST_REMOTE_CODE, model_impl=getattr(args, "vllm_model_impl", "auto"))
        if max_images:  # the most images of any prompt; the trainer's processor settings
            llm_args.update(limit_mm_per_prompt={"image": max_images}, mm_processor_kwargs=args.mm_processor_kwargs)
        engine.update(images=max_images, sleep=args.vllm_enable_sleep_mode)  # starts awake, with model_path's weights
        engine["llm"] = colocate_engine(model_path, args.vllm_tensor_parallel_size, args.seed, **llm_args)
        return engine | {"tp_group": tensor_parallel_group(args.vllm_tensor_parallel_size)}
    # serve the base model: a resume's checkpoint-N may be deleted, and start_with_weights sends this run's at once
    engine["model"] = model_path = args.model_name_or_path
    ports = _listed(args.vllm_server_port)  # several: servers of one model on this GPU, sharing each round
    engine["base_urls"] = urls = [f"http://{args.vllm_server_host}:{port}" for port in ports]
    for url in urls:
        wait_for_server(url, args.vllm_server_timeout, model_path, servers=len(urls))
    engine["servers"] = servers = [check_server(url, model_path) for url in urls]
    if len({(s["version"], s["model_id"]) for s in servers}) > 1:  # one message format, one model name for all
        found = ", ".join(f"{s['url']}: {s['model_id']} on vLLM {s['version']}" for s in servers)
        raise RuntimeError(f"the servers of --vllm-server-port must run one vLLM and serve one model; found {found}")
    if len(servers) > 1 and (nccl := [s["url"] for s in servers if s["backend"] != "ipc"]):
        raise RuntimeError(
            f"several --vllm-server-port need servers on this GPU with CUDA IPC weight transfer, and {nccl[0]} uses "
            "NCCL: on other GPUs serve one server with --data-parallel-size instead. One command per port:\n  "
            + "\n  ".join(serve_command(model_path, port=port, backend="ipc", servers=len(ports)) for port in ports)
        )
    for server in servers:
        if (limit := server["max_model_len"]) and max_len > limit:
            lengths = f"({max_prompt_length} tokens) + --max-completion-length {args.max_completion_length}"
            raise ValueError(f"the longest prompt {lengths} exceeds {server['url']}'s --max-model-len {limit}")
    engine.update({key: getattr(args, key) for key in SERVER_OPTIONS}, base_url=urls[0], server=servers[0])
    if os.environ.get("RANK", "0") == "0":  # with torchrun every rank generates over HTTP, rank 0 alone syncs
        for url, server in zip(urls, servers):
            check_transport(url, server, model_path)
        # the server's workers connect here: loopback for a local server, else this host's IP (VLLM_HOST_IP picks one)
        from vllm.utils.network_utils import get_ip

        engine["master_address"] = "127.0.0.1" if args.vllm_server_host in ("127.0.0.1", "localhost") else get_ip()
    return engine


def start_with_weights(args, model, model_path, max_prompt_length, max_images=0):
    """start(), then the trainer's weights at once, as every round must sample the trained policy: a server may hold
    others (an earlier run's, this one's before a resume); with --use-peft a colocated one too (it loaded the base)."""
    engine = start(args, model_path, max_prompt_length, max_images)
    if args.vllm_mode == "server" or args.use_peft:
        sync_weights(engine, model)
    return engine


def generate(engine, prompt_ids, n=None, temperature=None, images=None):
    """(completion ids, vLLM log-probs), prompt-major; n per prompt, temperature (0: greedy): None = training's;
    images: an ImagePrompt per prompt (prompt_ids then hold the trainer's expanded ids, which vLLM's must equal)."""
    n, fields = n or engine["n"], {**engine["fields"], **({} if temperature is None else {"temperature": temperature})}
    if engine["mode"] == "server":
        lost = engine.setdefault("lost", {})
        if not (urls := [url for url in _urls(engine) if url not in lost]):
            raise ServerLost(f"no server of the run answers (lost: {', '.join(lost)})")
        chunking = engine["vllm_generation_chunk_size"], engine["vllm_generation_timeout"], lost
        return server_generate(urls, engine["server"]["model_id"], prompt_ids, n, fields, *chunking, images)
    llm, group = engine["llm"], engine["tp_group"]
    if engine.get("weights_asleep"):
        raise RuntimeError("the colocated engine's weights are asleep (level 2 discards them): call sync_weights first")
    if engine.get("kv_asleep"):
        torch.cuda.empty_cache()  # the blocks the weight load cached go back before vLLM maps its KV cache
        llm.wake_up(tags=["kv_cache"])  # scheduling resumes once weights and KV cache are both awake
        engine["kv_asleep"] = False
    if group is None:
        return colocate_generate(llm, prompt_ids, n, fields, images)
    # the ranks of one tensor-parallel engine generate everyone's prompts together, then keep their own
    parts = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(parts, (prompt_ids, images), group=group)
    all_ids = [p for part in parts for p in part[0]]
    all_images = None if images is None else [p for part in parts for p in part[1]]
    completion_ids, logprobs = colocate_generate(llm, all_ids, n, fields, all_images)
    start = sum(len(part[0]) for part in parts[: torch.distributed.get_rank(group)]) * n
    mine = slice(start, start + len(prompt_ids) * n)  # this rank's prompts, prompt-major
    return completion_ids[mine], logprobs[mine]


def sleep(engine):
    """Colocate with sleep mode: free vLLM's GPU memory (weights and KV cache, level 2) for training, once the step's
    generation is done; sync_weights wakes and refills the weights, generate wakes the KV cache. No-op otherwise."""
    if engine["mode"] == "colocate" and engine["sleep"] and not engine.get("weights_asleep"):
        engine["llm"].sleep(level=2)
        engine["weights_asleep"] = engine["kv_asleep"] = True


def server_push(engine, model, urls, changed_only=False):
    """Update the servers at `urls`; changed_only: what training changes (not on a first push or to a restarted one)."""
    sync = {"version": engine["server"]["version"], "timeout": engine["vllm_weight_sync_timeout"]}
    sync.update(buffer_bytes=engine["vllm_weight_sync_buffer_mb"] << 20, name=engine["model"])
    if engine["server"]["backend"] == "ipc":  # no group: each chunk's handle goes over HTTP
        return server_sync_weights_ipc(urls, model, **sync, changed_only=changed_only)
    if (group := engine.pop("group", None)) is None:  # popped: a failed update leaves the group unusable
        group = server_init_weight_sync(engine["base_url"], engine["vllm_group_port"], engine["master_address"], **sync)
    server_sync_weights(engine["base_url"], group, model, **sync, changed_only=changed_only)
    engine["group"] = group


def push_live(engine, model):
    """server_push to each server that answers, lost ones back again included (checked again; NCCL's group formed anew).
    One that stops answering mid-push is marked lost, the rest (resumed by its failure) pushed again (one process;
    several ranks: raised, as any other failure)."""
    lost = engine.setdefault("lost", {})
    # several ranks gather each weight together, the changed ones once a push went (sync_weights): rank 0 can neither
    # send more nor send again, so a server back gets the changed ones (frozen ones never moved from the model's)
    alone = not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1
    back = [url for url in lost if _answers(url)]
    for url in back:  # it may serve another model or vLLM now
        server = check_server(url, engine["model"])
        check_same_model(server, model, engine["model"], engine.get("trust_remote_code", False))
        engine.pop("group", None)
    while urls := [url for url in _urls(engine) if url not in lost or url in back]:
        try:
            server_push(engine, model, urls, changed_only=engine.get("pushed", False) and not (back and alone))
            engine["pushed"] = True
            break
        except (RuntimeError, TimeoutError, requests.RequestException):
            if not alone or not (dead := [url for url in urls if not _answers(url)]):
                raise
            lost.update({url: lost.get(url, time.time()) for url in dead})
            back = [url for url in back if url not in dead]
    for url in back:
        print(f"vllm_utils: the server at {url} is back and holds the trainer's weights again", flush=True)
        del lost[url]


def wait_for_lost(engine, model):
    """Every server of the run is lost: wait up to --vllm-server-timeout for one to answer again, saying which, since
    when and the command that restarts it; then push_live. ServerLost if none is back in time."""
    lost, timeout, backend = engine["lost"], engine["vllm_server_timeout"], engine["server"]["backend"]
    kv, servers = kv_cache_bytes(engine["server"], model.config) if backend == "ipc" else None, len(_urls(engine))
    for url, since in lost.items():
        command = serve_command(engine["model"], _port(url), backend=backend, servers=servers, kv_bytes=kv)
        when = time.strftime("%H:%M:%S", time.localtime(since))
        said = f"the server at {url} stopped answering at {when}; waiting up to {timeout:.0f} s (--vllm-server-timeout)"
        print(f"vllm_utils: {said} for it. Restart it with: {command}", flush=True)
    deadline = time.monotonic() + timeout
    while not any(_answers(url) for url in lost):
        if time.monotonic() > deadline:
            raise ServerLost(f"no server came back within {timeout:.0f} s (--vllm-server-timeout): {', '.join(lost)}")
        time.sleep(2)
    push_live(engine, model)


def kv_cache_bytes(server, config):
    """The KV cache bytes a server had (1 GiB if unknown), fixed in its restart: profiling counts a live trainer's."""
    text, cache = config.get_text_config(), server.get("cache_config") or {}  # a multimodal model's: its decoder's
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    blocks = (cache.get("num_gpu_blocks") or 0) * (cache.get("block_size") or 16)
    return cache.get("kv_cache_memory_bytes") or blocks * 4 * text.num_hidden_layers * kv_heads * head_dim or 1 << 30


def _partial_reload(record):
    """A logging filter: vLLM's reload warns of each layer and weight it does not get (a frozen tower's, each push)."""
    return "Failed to load weights" not in str(record.msg) and "not loaded from checkpoint" not in str(record.msg)


def sync_weights(engine, model):
    """Push the trainer's weights to vLLM after each optimizer step (every torchrun rank: FSDP2 gathers are collective).
    Colocate with sleep mode drops the gradients (the next step recomputes them) so that vLLM can map its memory."""
    if engine["mode"] == "server":
        if not engine.get("model_checked"):  # on every rank, so that all stop together
            for server in engine.get("servers", [engine["server"]]):
                check_same_model(server, model, engine["model"], engine.get("trust_remote_code", False))
            engine["model_checked"] = True
        if os.environ.get("RANK", "0") == "0":
            push_live(engine, model)
        else:  # take part in each parameter's FSDP2 gather, in rank 0's order, and drop the result
            for _ in named_weights(model, changed_only=engine.get("pushed", False)):
                pass
            engine["pushed"] = True
        if torch.distributed.is_initialized():
            torch.distributed.barrier()  # no rank generates before the server has the new weights
        return
    if asleep := engine.get("weights_asleep"):
        model.zero_grad(set_to_none=True)  # the step is done: its gradients would hold memory vLLM is about to map
        torch.cuda.empty_cache()  # give the trainer's cached blocks back so that vLLM can map its weights again
        engine["llm"].wake_up(tags=["weights"])  # level 2 left garbage: every weight is reloaded below
        engine["weights_asleep"] = False
    # vLLM's layerwise reload reruns the post-load processing (MLA, MoE repacking, fp8) a plain load_weights skips, into
    # the same storage (CUDA graphs stay valid); each TP rank takes its shard; streamed: one full parameter at a time.
    # Awake, the engine still holds what training never changes (a frozen vision tower: its start-up weights, as the
    # trainer's) and gets the rest; vLLM keeps each layer that gets none, warning of each one: those warnings go
    reload = {"weights_iterator": named_weights(model, changed_only=not asleep), "is_checkpoint_format": True}
    partial = not asleep and not hasattr(model, "peft_config") and not all(p.requires_grad for p in model.parameters())
    names = ("model_executor.model_loader.reload.layerwise", "v1.worker.gpu_model_runner") if partial else ()
    for name in names:  # this push's only: a full one's warnings would tell of a weight that went missing
        logging.getLogger(f"vllm.{name}").addFilter(_partial_reload)
    try:
        engine["llm"].collective_rpc("reload_weights", kwargs=reload)
    finally:
        for name in names:
            logging.getLogger(f"vllm.{name}").removeFilter(_partial_reload)
    engine["llm"].reset_prefix_cache()
    if engine.get("images"):  # the old weights' image features go (the scheduler would trust ones the reload cleared)
        engine["llm"].llm_engine.reset_encoder_cache()
