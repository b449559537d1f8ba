"""A trainer of tests/gpu/test_faults.py, against a running server: joins it as vllm_utils.start / sync_weights do
(wait, check_server, check_same_model, the NCCL group), changes its weights, syncs them, and compares the server's
log-probs of its own samples with its own. With --die it SIGKILLs itself at a chosen moment instead:

    --die after-start     right after POST /start_weight_update answered (the server paused, its layers waiting)
    --die mid-broadcast   after half the tensors of the packed broadcast went out (1 MiB chunks: many broadcasts)
    --die mid-update      IPC: while the server is inside the /update_weights of the middle chunk (256 KiB chunks):
                          the memory its handle points at vanishes with this process

Against an IPC server (--weight-transfer-config '{"backend": "ipc"}' on this GPU) there is no group: the weights go as
CUDA IPC handles, vllm_utils.server_sync_weights_ipc.

The MoE experts go under the checkpoint's per-expert names (tiny_models.unfused_weights; --fused: the trainer's own
fused ones, as vllm_utils sends them), so that the faults are tested apart from the fused-expert naming.

Prints a RESULT line: ok, error (the message the trainer would show), seconds_to_outcome (from the first vllm_utils
call, after imports and the model load), total_s (from process start) and the log-prob comparison after the sync.

    python tests/gpu/fault_trainer.py URL MODEL [--die after-start|mid-broadcast]
"""

import argparse
import math
import os
import signal
import sys
import time

T_START = time.perf_counter()
MIDDLE_CHUNK = 0  # --die mid-update: the /update_weights (chunk) to die inside, set once the model's size is known

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tiny_models import FIELDS, compare, emit, perturb, prompts  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import vllm_utils  # noqa: E402


def die(why):
    print(f"fault_trainer: SIGKILL myself {why}", flush=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # what was enqueued went out
    os.kill(os.getpid(), signal.SIGKILL)


def arm(mode):
    if mode == "after-start":
        post = vllm_utils._post

        def post_then_die(base_url, path, timeout, **kwargs):
            out = post(base_url, path, timeout, **kwargs)
            if path == "/start_weight_update":
                die("after /start_weight_update")
            return out

        vllm_utils._post = post_then_die
    elif mode == "mid-broadcast":
        weights = vllm_utils.named_weights

        def half_then_die(model, dtype=torch.bfloat16):
            total = len(list(model.parameters()))
            for i, item in enumerate(weights(model, dtype)):
                if i == total // 2:
                    time.sleep(1.0)  # the chunks packed so far are broadcast and received
                    die(f"mid-broadcast, after {i} of {total} tensors")
                yield item

        vllm_utils.named_weights = half_then_die
    elif mode == "mid-update":
        import threading

        post, calls = vllm_utils._post, []

        def post_and_die_inside(base_url, path, timeout, **kwargs):
            if path == "/update_weights" and len(calls) >= 1 and len(calls) == MIDDLE_CHUNK:
                threading.Thread(target=post, args=(base_url, path, timeout), kwargs=kwargs, daemon=True).start()
                time.sleep(0.02)  # the request is in and the server is opening the handle / copying from it
                die("inside /update_weights of the middle chunk")
            if path == "/update_weights":
                calls.append(path)
            return post(base_url, path, timeout, **kwargs)

        vllm_utils._post = post_and_die_inside


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("model")
    parser.add_argument("--die", choices=["after-start", "mid-broadcast", "mid-update"])
    parser.add_argument("--name", default="fault_trainer")
    parser.add_argument("--fused", action="store_true", help="send the trainer's own (fused MoE) names")
    args = parser.parse_args()
    torch.cuda.set_device(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).cuda()
    prompt_ids = prompts(tokenizer)
    result = {"model": args.model, "die": args.die, "ok": False, "stage": "start"}
    t0 = time.perf_counter()
    try:
        vllm_utils.wait_for_server(args.url, 30, args.model)
        result["stage"] = "check_server"
        server = vllm_utils.check_server(args.url, args.model)
        result["stage"] = "check_same_model"
        vllm_utils.check_same_model(server, model, args.model)
        if not args.fused:  # send per-expert checkpoint names: the faults, not the fused-expert naming, are tested here
            from real_model_run import send_unfused

            send_unfused()
        result["stage"] = "init_weight_sync"
        result["backend"], ipc = server["backend"], server["backend"] == "ipc"
        # small chunks: a push of many /update_weights (a tiny model is a few MiB, so 256 KiB ones for mid-update)
        buffer_bytes = {"mid-broadcast": 1 << 20, "mid-update": 1 << 18}.get(args.die, 1 << 30)
        if ipc:  # the layout first: the server must run on this GPU
            vllm_utils.check_transport(args.url, server, args.model)
            global MIDDLE_CHUNK
            # the middle of the chunks the push will send, counted as server_sync_weights_ipc packs them: tensors above
            # a chunk go alone (tiny-dsv2: 79 chunks, two of them the 51 MB embeddings, where its bytes / 256 KiB / 2
            # = 259 was never reached and the trainer lived, two GPU runs); at least the second (0 never matched)
            total = sum(2 * math.prod(shape) for shape in vllm_utils.weight_metadata(model)["shapes"])
            chunks = sum(1 for _ in vllm_utils.packed_chunks(vllm_utils.named_weights(model), min(buffer_bytes, total)))
            assert args.die != "mid-update" or chunks >= 2, (
                f"{args.model} packs into {chunks} chunk: none to die inside"
            )
            MIDDLE_CHUNK = max(1, chunks // 2)
            result["chunks"] = chunks
        else:
            group = vllm_utils.server_init_weight_sync(args.url, None, version=server["version"], timeout=60)
        result["init_s"] = time.perf_counter() - t0
        perturb(model, 2.0, seed=1)
        arm(args.die)
        result["stage"] = "sync"
        t1 = time.perf_counter()
        sync = {"version": server["version"], "buffer_bytes": buffer_bytes, "timeout": 300.0, "name": args.model}
        if ipc:
            vllm_utils.server_sync_weights_ipc(args.url, model, **sync)
        else:
            vllm_utils.server_sync_weights(args.url, group, model, **sync)
        result["sync_s"] = time.perf_counter() - t1
        result["stage"] = "compare"
        engine = {"mode": "server", "base_url": args.url, "server": server, "fields": FIELDS, "n": 4}
        engine.update(vllm_utils.SERVER_OPTIONS)
        result["after_sync"] = compare(lambda p, n: vllm_utils.generate(engine, p, n=n), model, prompt_ids)
        result["ok"] = True
    except Exception as error:  # noqa: BLE001
        result["error"] = f"{type(error).__name__}: {error}"[:3000]
    result["seconds_to_outcome"] = time.perf_counter() - t0
    result["total_s"] = time.perf_counter() - T_START
    emit(args.name, result)
    sys.stdout.flush()
    os._exit(0)  # no teardown: a NCCL kernel of a failed update may wait on this GPU forever


if __name__ == "__main__":
    main()
