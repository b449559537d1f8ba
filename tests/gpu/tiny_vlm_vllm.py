"""Does vLLM run the tiny VLM of tests/make_tiny_vlm.py? (issue 45's first GPU check; run by hand on a GPU host)

    python tests/gpu/tiny_vlm_vllm.py OUT.json [VARIANT[:BACKEND] ...] (default: head8 head32; BACKEND e.g. TRITON_ATTN)

A variant that does not finish within $HANG_S seconds (default 90) dumps every thread's stack to stderr and exits: run
it with VLLM_ENABLE_V1_MULTIPROCESSING=0 to see the engine's own threads.

Builds the fixture twice (stories260K's head size 8, and `--text 128/4`: heads of 32), starts vLLM's colocated engine
on each in turn (enforce_eager, a small memory share) and samples 4 completions of one image prompt, greedy and at
temperature 1, with log-probs; writes what happened (or the error's last lines) per variant to OUT.json."""

import json
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from make_tiny_vlm import make_colour_dataset, make_tiny_vlm  # noqa: E402


def attempt(model_dir, image_path, backend=None):
    from PIL import Image
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is this?"}]}]
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    backend = {"attention_backend": backend} if backend else {}
    # processed log-probs, as the trainer's engine: vLLM then samples with its own kernels, not FlashInfer's sampler,
    # whose first use JIT-compiles it (minutes; it looked like a hang on the GPU hosts, benchmarks/results/README.md)
    llm = LLM(
        model_dir,
        logprobs_mode="processed_logprobs",
        dtype="bfloat16",
        enforce_eager=True,
        gpu_memory_utilization=0.1,
        max_model_len=256,
        seed=0,
        **backend,
    )
    prompt = {
        "prompt_token_ids": list(prompt_ids),
        "multi_modal_data": {"image": Image.open(image_path).convert("RGB")},
    }
    out = {}
    for temperature in (0.0, 1.0):
        params = SamplingParams(n=4 if temperature else 1, temperature=temperature, max_tokens=8, logprobs=0)
        result = llm.generate([prompt], params)[0]
        out[f"t{temperature}"] = [tokenizer.decode(c.token_ids) for c in result.outputs]
        out["prompt_tokens_vllm"] = len(result.prompt_token_ids)
    del llm
    return out


if __name__ == "__main__":
    results, work = {}, Path(tempfile.mkdtemp())
    data = make_colour_dataset(work / "colours", 4, seed=0)
    image = data.parent / json.loads(data.read_text().splitlines()[0])["image"]
    import faulthandler
    import os

    texts = {"head8": None, "head32": "128/4"}  # stories260K's heads of 8; a random 2-layer text model's of 32
    for variant in sys.argv[2:] or ["head8", "head32"]:
        name, _, backend = variant.partition(":")
        faulthandler.dump_traceback_later(float(os.environ.get("HANG_S", 90)), exit=True)
        try:
            make_tiny_vlm(work / name, text=texts[name])
            results[variant] = {"ok": True, **attempt(str(work / name), image, backend or None)}
        except Exception:  # noqa: BLE001 - the point is to record how it fails
            results[variant] = {"ok": False, "error": traceback.format_exc()[-3000:]}
        faulthandler.cancel_dump_traceback_later()
        print(variant, json.dumps(results[variant])[:600], flush=True)
        Path(sys.argv[1]).write_text(json.dumps(results, indent=1))
    Path(sys.argv[1]).write_text(json.dumps(results, indent=1))
