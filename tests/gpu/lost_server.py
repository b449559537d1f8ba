"""A trainer of tests/gpu/test_faults_ipc.py's test_5, against a running IPC server on this GPU: joins it as
vllm_utils.start does, trains its weights (gpu_helpers.change_weights) until the server's stale log-probs differ from
its own by >= 0.2 (the control), pushes them (vllm_utils.sync_weights) and compares; then touches MARKER and samples until the server is lost
(the test SIGKILLs and restarts it). Once the restarted server answers it measures the restarted server's log-probs
against its own before any push (the unsynced control: the server's start-up weights), then lets vllm_utils recover it
as the scripts do (wait_for_lost: the checks again and the push in full) and compares once more. Prints a RESULT line.

    python tests/gpu/lost_server.py URL MODEL MARKER
"""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from gpu_helpers import change_weights  # noqa: E402
from tiny_models import CONTROL_TARGET, FIELDS, compare, emit, prompts  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import vllm_utils  # noqa: E402


def main():
    url, model_path, marker = sys.argv[1:4]
    torch.cuda.set_device(0)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).cuda()
    prompt_ids, result = prompts(tokenizer), {"model": model_path, "ok": False}
    try:
        vllm_utils.wait_for_server(url, 300, model_path)
        server = vllm_utils.check_server(url, model_path)
        vllm_utils.check_transport(url, server, model_path)
        engine = {"mode": "server", "base_url": url, "base_urls": [url], "server": server, "servers": [server]}
        engine |= {
            "fields": FIELDS,
            "n": 4,
            "model": model_path,
            **vllm_utils.SERVER_OPTIONS,
            "vllm_server_timeout": 400,
        }
        sample = lambda p, n: vllm_utils.generate(engine, p, n=n)  # noqa: E731
        for _ in range(8):  # trained as training does (random noise makes a real model garbage in bf16)
            change_weights(model, tokenizer)
            if (control := compare(sample, model, prompt_ids))["mean"] >= CONTROL_TARGET:
                break
        result["control_before_push"] = control
        vllm_utils.sync_weights(engine, model)
        result["after_push"] = compare(sample, model, prompt_ids)
        open(marker, "w").close()  # the test kills the server now, and starts it again
        t0 = time.monotonic()
        while True:
            try:
                compare(sample, model, prompt_ids)
            except vllm_utils.ServerLost as error:
                result["lost"] = f"{error} (after {time.monotonic() - t0:.1f} s)"
                break
            time.sleep(0.2)
        while not vllm_utils._answers(url):
            time.sleep(1)
        result["restart_s"] = time.monotonic() - t0
        direct = lambda p, n: vllm_utils.server_generate(url, server["model_id"], p, n, FIELDS)  # noqa: E731
        result["control_after_restart"] = compare(direct, model, prompt_ids)  # its start-up weights, not pushed
        t1 = time.monotonic()
        vllm_utils.wait_for_lost(engine, model)  # as the scripts' generate does: checks again, pushes in full
        result["repush_s"] = time.monotonic() - t1
        result["lost_after_repush"] = dict(engine["lost"])
        result["after_repush"] = compare(sample, model, prompt_ids)
        result["ok"] = True
    except Exception as error:  # noqa: BLE001
        result["error"] = f"{type(error).__name__}: {error}"[:3000]
    emit("server_lost_ipc", result)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
