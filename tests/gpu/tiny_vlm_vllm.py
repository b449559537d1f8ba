"""Does vLLM run the tiny VLM of tests/make_tiny_vlm.py? (issue 45's first GPU check; run by hand on a GPU host)

    python tests/gpu/tiny_vlm_vllm.py OUT.json

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


def attempt(model_dir, image_path):
    from PIL import Image
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is this?"}]}]
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    llm = LLM(model_dir, dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=0.1, max_model_len=256, seed=0)
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
    for name, text in (("stories260K_head8", None), ("random_128_4_head32", "128/4")):
        try:
            make_tiny_vlm(work / name, text=text)
            results[name] = {"ok": True, **attempt(str(work / name), image)}
        except Exception:  # noqa: BLE001 - the point is to record how it fails
            results[name] = {"ok": False, "error": traceback.format_exc()[-3000:]}
        print(name, json.dumps(results[name])[:600], flush=True)
    Path(sys.argv[1]).write_text(json.dumps(results, indent=1))
