"""The vision-language bench (issue 45): a random-init Qwen2.5-VL model and a counting task of 224x224 images.

    python benchmarks/make_vlm_bench.py TOKENIZER_DIR MODEL_DIR DATA_DIR [--size 3b|tiny] [--rows 256]
    python benchmarks/make_vlm_bench.py --encoder MODEL_DIR DATA_DIR [--prompts 4] [--generations 8] [--out F.json]

MODEL_DIR: Qwen2_5_VLForConditionalGeneration in bf16, seed 0, of Qwen2.5-VL-3B-Instruct's shape (text: 36 layers of
width 2048, 16 heads / 2 KV heads, tied embeddings; vision: 32 blocks of width 1280, 14x14 patches merged 2x2, window
attention but in blocks 7, 15, 23, 31), 3,754,622,976 parameters as Qwen2.5-VL-3B-Instruct, built on the GPU when there is one; `tiny`: 2 text layers of
width 64 and 2 vision blocks of width 32, for the CPU tests. Its processor: Qwen2.5-VL's image processor (a 224x224
image: 16x16 patches, 64 image tokens) and chat template, on the tokenizer of TOKENIZER_DIR (the Qwen2.5 tokenizer,
../shared/assets/tokenizers/qwen2.5, whose vocabulary holds the vision tokens; another tokenizer gets them added).
Random weights never emit EOS: every completion runs to --max-completion-length, a fixed workload.

DATA_DIR/count.jsonl: --rows rows {"prompt": [a user message: the image, "How many squares are there? Answer with a
number."], "image": "img_00000.png", "answer": "3"}, 1-5 solid squares of random colours on white, seed 0."""

import argparse
import json
import random
from pathlib import Path

import torch

CHAT_TEMPLATE = (  # Qwen2.5-VL-Instruct's, images only
    "{%- for message in messages -%}{%- if loop.first and message['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}{%- if message['content'] is string -%}"
    "{{- message['content'] -}}{%- else -%}{%- for part in message['content'] -%}{%- if part['type'] == 'image' -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}{%- elif part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}{{- '<|im_end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
SHAPES = {  # text: hidden, intermediate, layers, heads, KV heads; vision: depth, hidden, intermediate, heads
    "3b": ((2048, 11008, 36, 16, 2), (32, 1280, 3420, 16)),
    "tiny": ((64, 128, 2, 4, 2), (2, 32, 64, 2)),
}
QUESTION = "How many squares are there? Answer with a number."


def bench_config(tokenizer_dir, size="3b"):
    """(the model's Qwen2_5_VLConfig, the tokenizer with the vision tokens and the chat template)."""
    from transformers import AutoTokenizer, Qwen2_5_VLConfig

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if missing := [t for t in VISION_TOKENS if t not in tokenizer.get_vocab()]:
        tokenizer.add_special_tokens({"additional_special_tokens": missing})
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = dict(
        zip(
            ["vision_start", "vision_end", "image", "video"],
            tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]),
        )
    )
    (hidden, inter, layers, heads, kv), (depth, v_hidden, v_inter, v_heads) = SHAPES[size]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else None
    tokens = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos or tokenizer.eos_token_id)
    head_dim = hidden // heads
    text = dict(
        vocab_size=151936 if size == "3b" else len(tokenizer),  # (Qwen2.5-VL-3B's embedding rows, padded)
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        rope_theta=1e6,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_scaling={"type": "mrope", "mrope_section": [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16]},
        **tokens,
    )
    last = [depth // 4 * (i + 1) - 1 for i in range(4)] if depth >= 4 else [depth - 1]  # full attention blocks
    vision = dict(
        depth=depth,
        hidden_size=v_hidden,
        intermediate_size=v_inter,
        num_heads=v_heads,
        out_hidden_size=hidden,
        fullatt_block_indexes=last,
        window_size=112,
        spatial_merge_size=2,
        patch_size=14,
        temporal_patch_size=2,
        tokens_per_second=2,
    )
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=True,
        **tokens,
        **{f"{name}_token_id": i for name, i in ids.items()},
    )
    return config, tokenizer


def make_model(tokenizer_dir, out, size="3b"):
    """Write the random-init model, its processor and tokenizer to `out`; returns the parameter count."""
    from transformers import (
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    config, tokenizer = bench_config(tokenizer_dir, size)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() and size != "tiny" else "cpu"):
        model = Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = config.text_config.eos_token_id
    model.save_pretrained(out)
    image_processor = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
    processor = Qwen2_5_VLProcessor(image_processor, tokenizer, Qwen2VLVideoProcessor(), CHAT_TEMPLATE)
    processor.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def make_counting(out, rows=256, seed=0, size=224):
    """Write the counting task to out/count.jsonl (images beside it); returns its path."""
    from PIL import Image, ImageDraw

    rng, out = random.Random(seed), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(rows):
        count, image = rng.randint(1, 5), Image.new("RGB", (size, size), "white")
        draw = ImageDraw.Draw(image)
        for k in range(count):  # one square per column band, so that none overlap
            side = rng.randint(16, 32)
            x = k * size // 5 + rng.randint(0, size // 5 - side)
            y = rng.randint(0, size - side)
            draw.rectangle([x, y, x + side, y + side], fill=tuple(rng.randint(0, 200) for _ in range(3)))
        image.save(out / f"img_{i:05d}.png")
        prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
        lines.append(json.dumps({"prompt": prompt, "image": f"img_{i:05d}.png", "answer": str(count)}) + "\n")
    (out / "count.jsonl").write_text("".join(lines))
    return out / "count.jsonl"


def encoder_saving(model_dir, data, prompts=4, generations=8, completion_length=32, repeats=3):
    """What computing each prompt's image features once for its G completions saves (grpo.py's images_in) against once
    per completion: the seconds of a training forward + backward over prompts x G rows (median of `repeats`, after one
    warm-up) and, on a GPU, its peak memory. Both sides are grpo.per_token_logprobs on the same batch; they differ only
    in whether the G rows of a prompt share its processed images or each carry a copy (the encoder then runs G times)."""
    import statistics
    import sys
    import time

    from transformers import AutoModelForImageTextToText, AutoProcessor

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import grpo

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).to(device)
    processor, rows = AutoProcessor.from_pretrained(model_dir), [json.loads(line) for line in open(data)][:prompts]
    folder = Path(data).parent
    inputs = [grpo.process_prompt(processor, row["prompt"], [folder / row["image"]]).to(device) for row in rows]
    torch.manual_seed(0)
    vocab = model.get_output_embeddings().weight.shape[0]
    completions = [torch.randint(0, vocab, (completion_length,)).tolist() for _ in range(prompts * generations)]
    prompt_ids = [inputs[i // generations]["input_ids"][0].tolist() for i in range(prompts * generations)]
    batch = grpo.collate(prompt_ids, completions, device, pad_id=0)
    sides = {  # per row, its prompt's processed inputs: shared by the G rows, or a copy each
        "once_per_prompt": grpo.Images(inputs, [i // generations for i in range(len(completions))]),
        "once_per_completion": grpo.Images(
            [inputs[i // generations] for i in range(len(completions))], list(range(len(completions)))
        ),
    }
    with torch.no_grad():  # the same log-probs either way: only the work differs
        ours, copies = (grpo.per_token_logprobs(model, *batch, 1.0, images=images) for images in sides.values())
        assert torch.allclose(ours, copies, atol=1e-4), (ours - copies).abs().max()
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "prompts": prompts,
        "generations": generations,
        "completion_length": completion_length,
        "prompt_tokens": len(prompt_ids[0]),
    }
    for name, images in sides.items():
        seconds = []
        for _ in range(repeats + 1):
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
                grpo.per_token_logprobs(model, *batch, 1.0, images=images).sum().backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - t0)
        result[name] = {"seconds": statistics.median(seconds[1:])}
        if device.type == "cuda":
            result[name]["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    result["seconds_saved"] = result["once_per_completion"]["seconds"] - result["once_per_prompt"]["seconds"]
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", help="TOKENIZER_DIR MODEL_DIR DATA_DIR, or with --encoder MODEL_DIR DATA")
    parser.add_argument("--size", choices=list(SHAPES), default="3b")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--encoder", action="store_true", help="measure encoder_saving on MODEL_DIR and a DATA jsonl")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--out", help="--encoder: also write the result to this JSON file")
    cli = parser.parse_args()
    if cli.encoder:
        result = encoder_saving(*cli.paths, prompts=cli.prompts, generations=cli.generations)
        print(json.dumps(result, indent=1))
        if cli.out:
            Path(cli.out).write_text(json.dumps(result, indent=1))
    else:
        tokenizer_dir, model_dir, data_dir = cli.paths
        print(f"model: {model_dir}, {make_model(tokenizer_dir, model_dir, cli.size):,} parameters")
        print(f"data: {make_counting(data_dir, cli.rows)}")
