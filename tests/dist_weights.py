"""Run under `torchrun --nproc_per_node 2` (gloo): weight sync from an FSDP2-sharded policy. In server mode rank 0
streams the weights to the server from a side thread (as server_sync_weights does) while rank 1 takes part in every
parameter's gather; over CUDA IPC (a server on rank 0's GPU) rank 0 packs them into chunks, one /update_weights each,
the real server_sync_weights_ipc with the HTTP and the IPC export played here; in colocate mode every rank loads the
full weights into its own engine. Both must deliver exactly
the unsharded model's weights, in the order and shapes that weight_metadata announced before anything was gathered."""

import base64
import os
import pickle
import sys
import threading
from types import SimpleNamespace

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import grpo  # noqa: E402
import vllm_utils  # noqa: E402

STORIES = os.path.join(os.path.dirname(__file__), "assets", "stories260K")
dist.init_process_group("gloo")
rank = dist.get_rank()
full = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32)
model = grpo.shard_model(AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32), mixed_precision=False)
expected = {name: p.detach().to(torch.bfloat16) for name, p in full.named_parameters()}

meta = vllm_utils.weight_metadata(model)  # from the shards: names and full shapes, nothing gathered
assert meta == vllm_utils.weight_metadata(full), meta
assert meta["names"] == list(expected) and meta["shapes"] == [list(t.shape) for t in expected.values()]


def check(received, where):
    assert list(received) == meta["names"], (where, list(received))
    for name, tensor in received.items():
        assert torch.equal(tensor, expected[name]), (where, name)


# server mode: only rank 0 talks to the server, from a thread, consuming the stream lazily
received = {}


def fake_server_sync_weights(base_url, group, model_, *options, **named_options):
    thread = threading.Thread(target=lambda: received.update(vllm_utils.named_weights(model_)))
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), "rank 0's stream waited forever: the other ranks did not gather in step"


vllm_utils.server_sync_weights = fake_server_sync_weights
engine = {
    "mode": "server",
    "base_url": "http://unused",
    "group": "joined",
    "model_checked": True,
    "model": "m",
    "server": {"version": "0.26.0", "backend": "nccl"},
    "vllm_weight_sync_timeout": 1,
    "vllm_weight_sync_buffer_mb": 1,
}
vllm_utils.sync_weights(engine, model)
if rank == 0:
    check(received, "server")
else:
    assert received == {}

# server mode over CUDA IPC: the stand-in /update_weights rebuilds each chunk's tensors (vLLM's packed_ipc_consumer)
exported, ipc_received = [], {}  # the exported tensors themselves, read when /update_weights arrives


def fake_post(base_url, path, timeout, **kwargs):
    if path == "/update_weights":
        info = kwargs["json"]["update_info"]
        data = exported[pickle.loads(base64.b64decode(info["ipc_handles_pickled"]))["GPU-0"]]
        for name, dtype, shape, part in zip(
            info["names"], info["dtype_names"], info["shapes"], data.split(info["tensor_sizes"])
        ):
            ipc_received[name] = part.view(getattr(torch, dtype)).view(shape).clone()
    return {}


vllm_utils._post, vllm_utils.probe_server = fake_post, lambda *a, **k: False
vllm_utils.ipc_handle = lambda buffer: exported.append(buffer) or {"GPU-0": len(exported) - 1}
vllm_utils.sync_weights(
    {**engine, "server": {"version": "0.26.0", "backend": "ipc"}, "vllm_weight_sync_buffer_mb": 1}, model
)
if rank == 0:
    check(ipc_received, "server over IPC")
else:
    assert ipc_received == {} and exported == []

# colocate mode: every rank's engine loads every full weight
loaded = {}
llm = SimpleNamespace(
    reset_prefix_cache=lambda: None,
    collective_rpc=lambda method, kwargs: method == "reload_weights" and loaded.update(kwargs["weights_iterator"]),
)
vllm_utils.sync_weights({"mode": "colocate", "llm": llm}, model)
check(loaded, "colocate")
dist.barrier()
if rank == 0:
    print("WEIGHT SYNC OK", file=sys.stderr)
dist.destroy_process_group()
