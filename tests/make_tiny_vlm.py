"""Build a tiny vision-language model and a colour-naming dataset for the VLM tests, offline and deterministically.

The model is an `Idefics3ForConditionalGeneration` (a Llama text model, a SigLIP-like vision encoder and a
pixel-shuffle connector; vLLM 0.26 serves the class natively). Not LLaVA: vLLM 0.26's llava.py (also llava_next,
mistral3) imports `PixtralRotaryEmbedding` from transformers, which transformers 5.17 no longer has, so vLLM cannot
load any LLaVA model with the pinned transformers.

  text       the bundled stories260K (tests/assets/stories260K: Llama, dim 64, 5 layers, 8 heads of 8 / 4 KV heads,
             tied embeddings) with its weights, so it already writes text; its 512-token vocabulary gains Idefics3's 8
             special tokens (ids 512-519, embedding rows the mean of the others). `--text HIDDEN/HEADS` builds a
             random-init 2-layer Llama of that width instead (same tokenizer), for attention kernels that refuse
             stories260K's head size 8 (e.g. `--text 128/4`: heads of 32)
  vision     random: 32x32 tiles in 8x8 patches (16 patch features a tile), hidden 64, 2 heads of 32, 2 layers
  connector  random: pixel shuffle (scale 2: 2x2 patch features -> one) and a linear map to the text width: 4 image
             tokens a tile
  processor  `Idefics3Processor`: an image's longest edge is resized to 64, then it is split into 32x32 tiles (2 x 2
             for a square image) plus the whole image at 32x32, so a square image is 5 tiles = 20 image tokens, 36
             prompt tokens with the tile markers (<fake_token_around_image>, <row_1_col_1>, ..., <global-img>)

The chat template (processor and tokenizer) renders `<s>user: <image> What colour is this?\nassistant:` for a user
message holding an {"type": "image"} part then a text part; plain-string content works too. It starts with BOS: call
the processor on the rendered text with add_special_tokens=False (its default adds a second BOS), or let
processor.apply_chat_template(..., tokenize=True) do it with the image in the part ({"type": "image", "image": PIL}).

`--warm` (make_tiny_vlm(..., warm=True)): a warm start (`warm_start`, deterministic, ~8 s on one CPU core) fits the
language model only, for 40 AdamW steps, to answer the colour question with one of the 4 colour words then EOS, each
word equally likely (~1/4) whatever the image: its training images are random solid colours each paired with every
colour word, so the image carries no information about the target. It teaches the answer's format (a colour word,
spelled right, its first token deciding which) and NOT which colour an image is: before RL, the greedy answer is right
on about 1/4 of held-out images (chance; tests/test_tiny_vlm.py asserts <= 1/4 + 15%). The vision tower and connector
are the random ones of the plain build, byte for byte. tests/test_vision.py's learning runs start from it: RL then has
only the image -> colour mapping to learn, from the reward.

The dataset (`make_colour_dataset`): solid-colour 32x32 PNGs (each colour's RGB jittered) and a JSONL file whose rows
hold `prompt` (chat messages with an image part), `image` (the PNG's path relative to the JSONL file) and `answer` (the
colour word). `load_colour_dataset` reads it back as a `datasets.Dataset` whose `image` column holds PIL images (TRL's
convention for a one-image-per-row dataset).

Usage: python tests/make_tiny_vlm.py OUT_DIR [--text HIDDEN/HEADS] [--seed 0] [--warm] [--colours DIR --rows 64]"""

import argparse
import json
import os
import random
from pathlib import Path

import torch

STORIES = Path(__file__).resolve().parent / "assets" / "stories260K"
IMAGE_TOKEN = "<image>"
TILE = 32  # the vision encoder's image size: each tile, and the global (whole) image, is resized to TILE x TILE
PATCH_SIZE = 8
SCALE_FACTOR = 2  # the connector's pixel shuffle: each 2x2 block of patch features becomes one image token
IMAGE_SEQ_LEN = (TILE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2  # image tokens per tile: 4
# An image's longest edge is first resized to LONGEST_EDGE, then split into TILE-sized tiles (at most 2 x 2). Why split:
# transformers 5.17's Idefics3ImageProcessor.get_number_of_image_patches counts 0 patches for an image that is not
# split, and vLLM 0.26 sizes the image's pixel values by that count (it would get none).
LONGEST_EDGE = 2 * TILE
GRID = [f"<row_{r}_col_{c}>" for r in (1, 2) for c in (1, 2)]
SPECIAL_TOKENS = ["<fake_token_around_image>", IMAGE_TOKEN, "<end_of_utterance>", "<global-img>", *GRID]
CHAT_TEMPLATE = """{{- bos_token -}}
{%- for message in messages -%}
    {{- message['role'] + ':' -}}
    {%- if message['content'] is string -%}
        {{- ' ' + message['content'] -}}
    {%- else -%}
        {%- for part in message['content'] -%}
            {%- if part['type'] == 'image' -%}
                {{- ' <image>' -}}
            {%- elif part['type'] == 'text' -%}
                {{- ' ' + part['text'] -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
    {{- '\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- 'assistant:' -}}
{%- endif -%}
"""
# base RGB of each answer word; every image jitters each channel by up to JITTER
COLOURS = {"red": (220, 30, 30), "green": (30, 180, 40), "blue": (30, 50, 220), "yellow": (230, 220, 40)}
JITTER = 30
QUESTION = "What colour is this?"
WARM_PROMPT = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
WARM_STEPS, WARM_IMAGES, WARM_LR = 40, 64, 3e-3  # warm_start's optimizer steps (8 images x 4 answers each), images, lr


def parse_text(text):
    """'HIDDEN/HEADS' -> (hidden, heads); the head size hidden // heads must be a whole number."""
    hidden, heads = (int(part) for part in text.split("/"))
    if hidden % heads or (hidden // heads) % 2:
        raise ValueError(f"--text {text}: HIDDEN must be a multiple of HEADS with an even head size")
    return hidden, heads


def text_model(tokenizer, text):
    """The language model (a LlamaForCausalLM over the tokenizer's vocabulary): stories260K's weights, each added token's
    embedding row the mean of the old ones, or (text='HIDDEN/HEADS') a random-init 2-layer Llama of that width."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if text is None:
        model = LlamaForCausalLM.from_pretrained(STORIES, dtype=torch.float32)
        old = model.get_input_embeddings().weight.shape[0]
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
        with torch.no_grad():
            embeddings = model.get_input_embeddings().weight
            embeddings[old:] = embeddings[:old].mean(0)
        model.config._name_or_path = ""  # not this machine's path in the saved config
        return model
    hidden, heads = parse_text(text)
    stories = LlamaConfig.from_pretrained(STORIES)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hidden // heads,
        max_position_embeddings=stories.max_position_embeddings,
        rms_norm_eps=stories.rms_norm_eps,
        tie_word_embeddings=True,
        bos_token_id=stories.bos_token_id,
        eos_token_id=stories.eos_token_id,
    )
    return LlamaForCausalLM(config)


def warm_start(model, processor, steps=WARM_STEPS, images=WARM_IMAGES, seed=0):
    """A short supervised fit of the language model only (vision tower and connector untouched) that makes it answer
    the colour question with one of the colour words (then EOS), each about as likely as the others, whatever the
    image. Each step shows 8 random solid-colour images (uniform over the RGB cube, not the dataset's colours), each
    with every colour word as its target: the cross-entropy's minimum is then the uniform choice, so the fit carries no
    information from the image to the word. It does NOT teach which colour an image is: that is left to RL (the
    held-out greedy accuracy stays near chance, 1 / len(COLOURS); tests/test_tiny_vlm.py checks it). Deterministic
    (its own generators, one thread); a few seconds on a CPU. Returns the last loss."""
    from PIL import Image

    tokenizer = processor.tokenizer
    rng = random.Random(seed)
    pictures = [Image.new("RGB", (TILE, TILE), tuple(rng.randrange(256) for _ in "rgb")) for _ in range(images)]
    text = processor.apply_chat_template(WARM_PROMPT, add_generation_prompt=True)
    batch = processor(
        text=[text] * images, images=[[p] for p in pictures], add_special_tokens=False, return_tensors="pt"
    )
    answers = [
        tokenizer(" " + word, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for word in COLOURS
    ]
    prompt_length, width = batch["input_ids"].shape[1], max(map(len, answers))
    # every image with every answer: the rows of one image differ only in the answer
    input_ids = torch.full((images, len(answers), prompt_length + width), tokenizer.eos_token_id)
    labels = torch.full_like(input_ids, -100)
    input_ids[:, :, :prompt_length] = batch["input_ids"][:, None]
    for j, ids in enumerate(answers):
        input_ids[:, j, prompt_length : prompt_length + len(ids)] = torch.tensor(ids)
        labels[:, j, prompt_length : prompt_length + len(ids)] = torch.tensor(ids)
    trained = [p for name, p in model.named_parameters() if ".text_model." in name]
    frozen = [p for name, p in model.named_parameters() if ".text_model." not in name]
    for parameter in frozen:  # (no gradients for the vision tower and connector: faster)
        parameter.requires_grad_(False)
    optimizer = torch.optim.AdamW(trained, lr=WARM_LR, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)
    order = torch.Generator().manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same sums in the same order on any machine: the same bytes
    try:
        model.train()
        for _ in range(steps):
            rows = torch.randperm(images, generator=order)[:8]
            per_row = len(answers)
            loss = model(
                input_ids=input_ids[rows].flatten(0, 1),
                pixel_values=batch["pixel_values"][rows].repeat_interleave(per_row, 0),
                pixel_attention_mask=batch["pixel_attention_mask"][rows].repeat_interleave(per_row, 0),
                labels=labels[rows].flatten(0, 1),
            ).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
    finally:
        torch.set_num_threads(threads)
        for parameter in frozen:
            parameter.requires_grad_(True)
        model.eval()
        model.zero_grad(set_to_none=True)
    return loss.item()


def make_tiny_vlm(out_dir, text=None, seed=0, warm=False):
    """Write the tiny VLM (model, processor, tokenizer, chat template) to `out_dir`; returns a summary dict. The same
    arguments give the same files. warm: warm_start() its language model first (it then says a colour word, chosen
    without regard to the image)."""
    from PIL import Image
    from transformers import (
        AutoTokenizer,
        GenerationConfig,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
    )
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(STORIES)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    language = text_model(tokenizer, text)
    vision = Idefics3VisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=TILE,
        patch_size=PATCH_SIZE,
    )
    config = Idefics3Config(
        vision_config=vision.to_dict(),
        text_config=language.config.to_dict(),
        image_token_id=image_token_id,
        scale_factor=SCALE_FACTOR,
        pad_token_id=None,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config)
    model.model.text_model.load_state_dict(language.model.state_dict(), strict=True)
    model.tie_weights()
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": LONGEST_EDGE},
        max_image_size={"longest_edge": TILE},
        do_image_splitting=True,
    )
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=IMAGE_SEQ_LEN,
        chat_template=CHAT_TEMPLATE,
    )
    warm_loss = warm_start(model, processor, seed=seed) if warm else None
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    # stories260K's tokenizer is `legacy` (a word right after a special token gets sentencepiece's "▁" too, as vLLM's
    # copy of the tokenizer must agree): save_pretrained drops the flag
    path = Path(out_dir) / "tokenizer_config.json"
    tokenizer_config = json.loads(path.read_text())
    tokenizer_config.update(legacy=True, add_bos_token=True)
    for key in ("is_local", "local_files_only"):  # how this build loaded stories260K, not a setting
        tokenizer_config.pop(key, None)
    path.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    count = lambda module: sum(p.numel() for p in module.parameters())
    square = processor(text=IMAGE_TOKEN, images=[Image.new("RGB", (TILE, TILE))], add_special_tokens=False)
    return {
        "dir": str(out_dir),
        "architecture": type(model).__name__,
        "text": "stories260K" if text is None else f"random {text}",
        "warm_start_loss": None if warm_loss is None else round(warm_loss, 4),
        "params": count(model),
        "params_text": count(model.model.text_model),
        "params_vision": count(model.model.vision_model),
        "params_connector": count(model.model.connector),
        "vocab": len(tokenizer),
        "image_token_id": image_token_id,
        "image_tokens_per_tile": IMAGE_SEQ_LEN,
        "image_tokens_per_square_image": square["input_ids"][0].count(image_token_id),
        "prompt_tokens_per_square_image": len(square["input_ids"][0]),
        "bytes": sum(f.stat().st_size for f in Path(out_dir).iterdir() if f.is_file()),
    }


def make_colour_dataset(out_dir, n, seed, size=TILE):
    """Write `n` rows (colours in turn, so each has n/4 of them) to OUT_DIR/colours.jsonl, each image a solid-colour
    PNG next to it (img_00000.png, ...); returns the JSONL file's path. Rows: {"prompt": [user message: image part,
    text part], "image": "img_00000.png", "answer": "red"}."""
    from PIL import Image

    rng = random.Random(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = list(COLOURS)
    rows = []
    for i in range(n):
        answer = names[i % len(names)]
        rgb = tuple(min(255, max(0, c + rng.randint(-JITTER, JITTER))) for c in COLOURS[answer])
        name = f"img_{i:05d}.png"
        Image.new("RGB", (size, size), rgb).save(out / name)
        prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
        rows.append({"prompt": prompt, "image": name, "answer": answer})
    path = out / "colours.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def load_colour_dataset(path):
    """The JSONL file of make_colour_dataset as a datasets.Dataset whose `image` column holds PIL images."""
    from datasets import Dataset, Image

    path = Path(path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:
        row["image"] = str(path.parent / row["image"])
    return Dataset.from_list(rows).cast_column("image", Image())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--text", default=None, help="HIDDEN/HEADS: a random-init text model instead of stories260K")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warm", action="store_true", help="warm-start the language model (warm_start)")
    parser.add_argument("--colours", default=None, help="also write the colour dataset to this folder")
    parser.add_argument("--rows", type=int, default=64, help="rows of the colour dataset")
    args = parser.parse_args()
    if args.text is not None:
        parse_text(args.text)
    print(json.dumps(make_tiny_vlm(args.out_dir, text=args.text, seed=args.seed, warm=args.warm)))
    if args.colours:
        print(json.dumps({"colours": str(make_colour_dataset(args.colours, args.rows, args.seed))}))


if __name__ == "__main__":
    main()
