"""Images in the prompts (docs/vision.md), on the CPU with the tiny VLM of tests/make_tiny_vlm.py: the data checks, the
tokenization's image tokens, the trainer's forward against the model's own (Idefics3, and a tiny random Qwen2.5-VL for
M-RoPE), the vision encoder once per prompt, the frozen tower, rewards that ask for images, and each script learning
to name the colour of an image from the reward alone (tests/conftest.py runs those in the background)."""

import json
import time
import types

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import grpo
import rewards
from grpo_cli import STORIES, check, read_metrics, run_grpo, write_jsonl
from make_tiny_vlm import COLOURS, QUESTION, make_colour_dataset, make_tiny_vlm

PROMPT = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
# the colour task (docs/vision.md's CPU recipe), from the warm-started tiny VLM (make_tiny_vlm(..., warm=True): it says
# a colour word, each about as likely whatever the image): 4 prompts a step, at most 8 new tokens, rewarded 1 when the
# first word is the answer, else 0 (`partial 0`: partial credit would reward a truncated or misspelled colour word over
# a wrong one, and RL then wrecks the spelling the warm start taught)
TASK = ["--prompt-column", "prompt", "--reward-funcs", "first_word_reward", "--reward-kwargs", "partial", 0]
TASK += ["--no-bf16", "--max-completion-length", 8, "--prompts-per-step", 4, "--lr-scheduler-type", "constant"]
TASK += ["--seed", 0, "--num-generations", 16, "--temperature", 1.0, "--max-steps", 80]
LEARN = {  # each script's own flags for the colour task (learned at seeds 0, 1 and 2: docs/vision.md)
    "grpo.py": ["--learning-rate", 5e-4, "--beta", 0.1],
    "rloo.py": ["--learning-rate", 5e-4, "--beta", 0.1, "--no-kl-in-reward", "--normalize-advantages"],
    "online_dpo.py": ["--learning-rate", 3e-4, "--beta", 0.3],
}


def colour_task(root, warm=False):
    """(the tiny VLM's folder, the training set's JSONL, the held-out set's JSONL), built under root; warm: the
    warm-started VLM (the learning runs start from it)."""
    make_tiny_vlm(root / "vlm", warm=warm)
    return root / "vlm", make_colour_dataset(root / "train", 64, seed=0), make_colour_dataset(root / "held_out", 40, 1)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return colour_task(tmp_path_factory.mktemp("colours"))


def learn(background, task, out, script):
    """A Background job (tests/conftest.py): the script's colour-task run in `out`; (out, the held-out set, seconds)."""
    from grpo_cli import background_run

    vlm, train, held_out = task
    t0 = time.perf_counter()
    background_run(
        background,
        script,
        "--model-name-or-path",
        vlm,
        "--dataset-name",
        train,
        *TASK,
        *LEARN[script],
        "--output-dir",
        out,
    )
    return out, held_out, time.perf_counter() - t0


def parse(*argv):
    return grpo.parse_args([str(a) for a in argv])


def first_words(model, processor, images):
    """The first word of each image's greedy answer to the colour question, lower-cased and stripped of punctuation."""
    text = processor.apply_chat_template(PROMPT, add_generation_prompt=True)
    batch = processor(
        text=[text] * len(images), images=[[i] for i in images], add_special_tokens=False, return_tensors="pt"
    )
    with torch.no_grad():
        generated = model.generate(**batch, max_new_tokens=6, do_sample=False)
    texts = processor.tokenizer.batch_decode(generated[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    return [(t.split() or [""])[0].strip(".,!?;:\"'").lower() for t in texts]


def greedy_and_swapped(out, held_out):
    """The run's final model (it loads from the run directory with its processor) on the held-out images: the share of
    right greedy answers, and with each image swapped for one of the next colour, the shares naming the old colour and
    the new one."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model, processor = AutoModelForImageTextToText.from_pretrained(out).eval(), AutoProcessor.from_pretrained(out)
    rows = [json.loads(line) for line in held_out.read_text().splitlines()]
    images = [Image.open(held_out.parent / row["image"]).convert("RGB") for row in rows]
    answers, names = [row["answer"] for row in rows], list(COLOURS)
    by_colour = {c: [image for image, a in zip(images, answers) if a == c] for c in names}
    swapped = [names[(names.index(a) + 1) % len(names)] for a in answers]  # each image's replacement's colour
    said, said_swapped = (
        first_words(model, processor, images),
        first_words(model, processor, [by_colour[c][i % len(by_colour[c])] for i, c in enumerate(swapped)]),
    )
    share = lambda words, truth: sum(w == t for w, t in zip(words, truth)) / len(truth)
    return share(said, answers), share(said_swapped, answers), share(said_swapped, swapped), said[:8]


def test_vision_prompt_ids_count_the_expanded_image_tokens(task, tmp_path):
    from transformers import AutoProcessor

    vlm, train, _ = task
    processor = AutoProcessor.from_pretrained(vlm)
    image_token_id = processor.image_token_id
    args = parse("--model-name-or-path", vlm, "--dataset-name", train, *TASK)
    dataset = grpo.read_dataset(args, rewards.functions(args.reward_funcs))
    assert dataset["images"][0] == [str(train.parent / "img_00000.png")]  # a path relative to the JSONL file
    prompts = grpo.load_prompts(args, dataset, processor.tokenizer, 10**9, processor=processor)
    unexpanded = list(processor.tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True)["input_ids"])
    assert unexpanded.count(image_token_id) == 1  # the placeholder; the processor makes it the image's 5 x 4 tokens
    assert all(ids.count(image_token_id) == 20 for ids in prompts.prompt_ids)
    # the placeholder became 36 tokens: 20 image tokens and 16 markers of its tiles (tests/make_tiny_vlm.py)
    assert {len(ids) for ids in prompts.prompt_ids} == {len(unexpanded) + 35} and "images" not in prompts.columns
    assert prompts.images[5] == dataset["images"][5] and prompts.columns["answer"][:2] == ["red", "green"]
    # --max-prompt-length counts the expanded tokens
    length = len(prompts.prompt_ids[0])
    with pytest.raises(
        SystemExit, match=f"at most --max-prompt-length {length - 1} tokens long .the shortest has {length}"
    ):
        grpo.load_prompts(
            parse(*args_of(args), "--max-prompt-length", length - 1),
            dataset,
            processor.tokenizer,
            10**9,
            processor=processor,
        )
    # several images per prompt, TRL's `images` column (a list per row), and datasets' Image feature (Parquet)
    two = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": QUESTION}]}]
    rows = [{"prompt": two, "images": [f"img_0000{i}.png", f"img_0000{i + 1}.png"], "answer": "red"} for i in (0, 2)]
    pair = write_jsonl(train.parent / "pairs.jsonl", rows)
    dataset = grpo.read_dataset(parse("--dataset-name", pair, *TASK), [])
    pairs = grpo.load_prompts(args, dataset, processor.tokenizer, 10**9, processor=processor)
    assert [ids.count(image_token_id) for ids in pairs.prompt_ids] == [40, 40] and len(pairs.images[1]) == 2
    from make_tiny_vlm import load_colour_dataset

    parquet = tmp_path / "colours.parquet"
    load_colour_dataset(train).select(range(4)).to_parquet(parquet)
    from_parquet = grpo.read_dataset(parse("--dataset-name", parquet, *TASK), [])
    assert all(isinstance(images[0], Image.Image) for images in from_parquet["images"])
    assert (
        grpo.load_prompts(args, from_parquet, processor.tokenizer, 10**9, processor=processor).prompt_ids
        == (prompts.prompt_ids[:4])
    )


def args_of(args):
    """The command line of the parsed `args` that test_vision_prompt_ids_count_the_expanded_image_tokens made."""
    return ["--model-name-or-path", args.model_name_or_path, "--dataset-name", args.dataset_name, *TASK]


def one_line_refusal(error):
    message = str(error.value)
    assert message.startswith("error: ") and "\n" not in message, message
    return message


def test_vision_start_up_refusals_are_one_line_before_any_weights_load(task, tmp_path):
    vlm, train, _ = task
    base = json.loads(train.read_text().splitlines()[0])
    cases = {  # (rows, extra flags) -> what the one line says
        "no image file": ([{**base, "image": "missing.png"}], []),
        '1 image(s), 2 {"type": "image"} part(s)': (
            [{**base, "prompt": [{**PROMPT[0], "content": [{"type": "image"}, *PROMPT[0]["content"]]}]}],
            [],
        ),
        '1 image(s), 0 {"type": "image"} part(s)': ([{**base, "prompt": QUESTION}], []),
        "has no column 'picture'": ([base], ["--image-column", "picture"]),
    }
    for n, (expected, (rows, flags)) in enumerate(cases.items()):
        data = write_jsonl(train.parent / f"bad{n}.jsonl", rows)
        with pytest.raises(SystemExit) as error:
            grpo.read_dataset(parse("--dataset-name", data, *TASK, *flags), [])
        assert expected in one_line_refusal(error), (expected, str(error.value))
    # --image-column "" reads none; a dataset without the column needs none
    assert "images" not in grpo.read_dataset(parse("--dataset-name", train, *TASK, "--image-column", ""), [])
    # a text-only model given images, from the command line: one line, exit 1, nothing loaded or left behind
    out = tmp_path / "text_only"
    result = run_grpo("--model-name-or-path", STORIES, "--dataset-name", train, *TASK, "--output-dir", out)
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode == 1 and lines[-1].startswith("error: the dataset has images but"), lines[-5:]
    assert "text-only model" in lines[-1] and not any("Loading weights" in line for line in lines), lines
    assert not out.exists()


def test_vision_rewards_get_images_only_when_they_name_them(task):
    from transformers import AutoTokenizer

    vlm, train, _ = task
    seen = {}

    def plain(completions, **kwargs):
        seen["plain"] = sorted(kwargs)
        return [0.0] * len(completions)

    def looks(completions, images, answer, **kwargs):  # 1 where the image's centre is the answer's colour
        seen["looks"] = images
        return [
            float(max(map(abs, (a - b for a, b in zip(i[0].getpixel((16, 16)), COLOURS[c])))) <= 30)
            for i, c in zip(images, answer)
        ]

    assert rewards.takes_images(looks) and not rewards.takes_images(plain)
    images = [[Image.new("RGB", (32, 32), COLOURS[c])] for c in ("red", "blue")]
    scores = rewards.score([plain, looks], ["a", "b"], {"answer": ["red", "green"], "images": images})
    assert "images" not in seen["plain"] and seen["looks"] is images and scores[:, 1].tolist() == [1.0, 0.0]
    # the trainer's score(): each completion gets its row's images, opened (PIL) only if a reward names them
    args = parse("--model-name-or-path", vlm, "--dataset-name", train, *TASK)
    dataset = grpo.read_dataset(args, [])
    prompt_set = grpo.PromptSet([[1]] * 64, [PROMPT] * 64, {"answer": dataset["answer"]}, True, dataset["images"])
    run = types.SimpleNamespace(args=args, tokenizer=AutoTokenizer.from_pretrained(vlm), reward_fns=[plain, looks])
    scores = grpo.score(run, prompt_set, [2, 5], [[5, 6]] * 4, 2)  # rows 2 (blue) and 5 (green), 2 completions each
    assert scores[:, 1].tolist() == [1.0] * 4 and len(seen["looks"]) == 4 and seen["looks"][0] == seen["looks"][1]
    assert isinstance(seen["looks"][0][0], Image.Image) and "images" not in seen["plain"]
    run.reward_fns, opened = [plain], []
    original, grpo.open_image = grpo.open_image, lambda image: opened.append(image)
    try:
        grpo.score(run, prompt_set, [2, 5], [[5, 6]] * 4, 2)
    finally:
        grpo.open_image = original
    assert opened == []
    with pytest.raises(SystemExit, match="needs a column 'images'"):  # a reward that names them, on text data
        rewards.check_arguments([looks], ["prompt", "answer"], "--dataset-name x.jsonl", args)


def tiny_qwen2_5_vl(out):
    """A random-init Qwen2.5-VL (M-RoPE: its positions come from the image grids) of stories260K's tokenizer and size,
    with its processor, written to `out`: 2 text layers of width 64, 2 vision layers, 14x14 patches merged 2x2."""
    from transformers import (
        AutoTokenizer,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    tokenizer = AutoTokenizer.from_pretrained(STORIES)
    special = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    tokenizer.chat_template = (
        "{{- bos_token -}}{%- for m in messages -%}{{- m['role'] + ':' -}}{%- if m['content'] is string -%}"
        "{{- ' ' + m['content'] -}}{%- else -%}{%- for p in m['content'] -%}{%- if p['type'] == 'image' -%}"
        "{{- ' <|vision_start|><|image_pad|><|vision_end|>' -}}{%- else -%}{{- ' ' + p['text'] -}}{%- endif -%}"
        "{%- endfor -%}{%- endif -%}{{- '\\n' -}}{%- endfor -%}{%- if add_generation_prompt -%}{{- 'assistant:' -}}"
        "{%- endif -%}"
    )
    ids = dict(zip(["vision_start", "image", "vision_end", "video"], tokenizer.convert_tokens_to_ids(special)))
    tokens = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        **tokens,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
    )
    vision = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, fullatt_block_indexes=[1]
    )
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=True,
        **tokens,
        **{f"{name}_token_id": i for name, i in ids.items()},
    )
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(out)
    image_processor = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112)
    Qwen2_5_VLProcessor(image_processor, tokenizer, Qwen2VLVideoProcessor(), tokenizer.chat_template).save_pretrained(
        out
    )
    return out


@pytest.mark.parametrize("arch", ["idefics3", "qwen2_5_vl"])
def test_vision_logprobs_and_generate_match_the_models_own_forward(task, tmp_path, arch):
    """per_token_logprobs and hf_generate with images (the features of each prompt computed once and put in place of
    its image tokens, per-token inputs padded as collate pads, M-RoPE positions left to the model) equal the model's own
    forward and generate on the processor's left-padded batch, which encodes every row's images."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = task[0] if arch == "idefics3" else tiny_qwen2_5_vl(tmp_path / "qwen")
    model, processor = AutoModelForImageTextToText.from_pretrained(path).eval(), AutoProcessor.from_pretrained(path)
    images = [[Image.new("RGB", (32, 32), COLOURS["red"])], [Image.new("RGB", (64, 32), COLOURS["blue"])]]
    text = processor.apply_chat_template(PROMPT, add_generation_prompt=True)
    distinct = [grpo.process_prompt(processor, PROMPT, each) for each in images]
    prompt_ids = [inputs["input_ids"][0].tolist() for inputs in distinct]
    assert len(prompt_ids[0]) != len(prompt_ids[1])  # so that one is left-padded
    rows, completions = [0, 0, 1, 1, 1], [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14], [15]]
    batch = grpo.collate([prompt_ids[r] for r in rows], completions, "cpu", 0)
    calls = []
    encode = model.get_image_features
    model.get_image_features = lambda **kwargs: calls.append(1) or encode(**kwargs)
    ours = grpo.per_token_logprobs(model, *batch, images=grpo.Images(distinct, rows))
    assert len(calls) == 2  # once per prompt, not once per row
    del model.get_image_features
    # the model's own: the processor's left-padded batch of every row, the completions after it
    processor.tokenizer.padding_side, processor.tokenizer.pad_token = "left", processor.tokenizer.unk_token
    own = processor(
        text=[text] * len(rows),
        images=[images[r] for r in rows],
        padding=True,
        add_special_tokens=False,
        return_tensors="pt",
    )
    P, C = own["input_ids"].shape[1], batch.completion_mask.shape[1]
    assert P == batch.prompt_length
    own["input_ids"] = torch.cat([own["input_ids"], batch.input_ids[:, P:]], 1)
    for key in ("attention_mask", "mm_token_type_ids"):
        if key in own:
            own[key] = torch.cat(
                [
                    own[key],
                    batch.attention_mask[:, P:]
                    if key == "attention_mask"
                    else torch.zeros(len(rows), C, dtype=own[key].dtype),
                ],
                1,
            )
    positions = None if arch == "qwen2_5_vl" else batch.position_ids  # (M-RoPE: the model's own, from the grids)
    with torch.no_grad():
        logits = model(**own, position_ids=positions).logits[:, P - 1 : -1].log_softmax(-1)
    theirs = logits.gather(-1, batch.input_ids[:, P:, None]).squeeze(-1) * batch.completion_mask
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    grpo.check_logprobs(model, prompt_ids[1] + [5, 6, 7], "cpu", 1, grpo.Images(distinct[1:], [0]))  # start-up's
    # greedy generation with the images of 2 prompts x 2 completions, against the model's own generate
    args = parse("--model-name-or-path", path, *TASK)
    args.max_completion_length = 5
    two = grpo.Images(distinct, [0, 1])
    ours, _ = grpo.hf_generate(model, prompt_ids, args, [], 0, num_generations=2, temperature=0, images=two)
    own = processor(
        text=[text] * 4,
        images=[images[r] for r in (0, 0, 1, 1)],
        padding=True,
        add_special_tokens=False,
        return_tensors="pt",
    )
    with torch.no_grad():
        theirs = model.generate(**own, max_new_tokens=5, min_new_tokens=5, do_sample=False)[
            :, own["input_ids"].shape[1] :
        ]
    assert ours == theirs.tolist()


def test_vision_freeze_vision_tower_trains_the_language_model_and_projector(task, tmp_path):
    """Two steps at a high learning rate leave the vision encoder as it was and change the connector (the projector)
    and the language model; --no-freeze-vision-tower trains the encoder too. The run evaluates on images, and its
    checkpoints and final model carry the processor's files. With --use-peft, the adapters are the language model's."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    vlm, train, held_out = task
    flags = ["--model-name-or-path", vlm, "--dataset-name", train, "--prompt-column", "prompt", "--no-bf16"]
    flags += ["--reward-funcs", "keyword_reward", "--reward-kwargs", "keyword", "a", "--max-completion-length", 6]
    flags += ["--prompts-per-step", 2, "--num-generations", 8, "--learning-rate", 1e-2, "--max-steps", 2]
    before = AutoModelForImageTextToText.from_pretrained(vlm).state_dict()
    changed = {}
    for freeze in ("--freeze-vision-tower", "--no-freeze-vision-tower"):
        out = tmp_path / freeze
        evaluation = ["--eval-steps", 2, "--eval-dataset", held_out, "--eval-max-samples", 8, "--save-steps", 1]
        check(run_grpo(*flags, freeze, *(evaluation if freeze == "--freeze-vision-tower" else []), "--output-dir", out))
        after = AutoModelForImageTextToText.from_pretrained(out).state_dict()
        parts = {"vision_model": ".vision_model.", "connector": ".connector.", "text_model": ".text_model.layers."}
        changed[freeze] = {
            part: [not torch.equal(before[k], after[k]) for k in before if name in k] for part, name in parts.items()
        }
    assert not any(changed["--freeze-vision-tower"]["vision_model"])
    assert all(changed["--freeze-vision-tower"]["connector"]) and any(changed["--freeze-vision-tower"]["text_model"]), (
        changed
    )
    assert any(changed["--no-freeze-vision-tower"]["vision_model"])  # the control: the test sees a trained tower
    out = tmp_path / "--freeze-vision-tower"
    assert AutoProcessor.from_pretrained(out).image_token_id == AutoProcessor.from_pretrained(vlm).image_token_id
    assert (out / "checkpoint-1" / "processor_config.json").is_file()  # checkpoints carry the processor's files too
    evaluated = [m for m in read_metrics(out) if "eval/reward" in m]
    assert [m["step"] for m in evaluated] == [0, 2] and evaluated[0]["eval/num_prompts"] == 8
    # LoRA adapts the language model only
    check(run_grpo(*flags, "--use-peft", "--output-dir", tmp_path / "lora"))
    adapted = load_file(tmp_path / "lora" / "adapter_model.safetensors")
    assert adapted and all(".text_model.layers." in name for name in adapted), sorted(adapted)


@pytest.mark.parametrize("script", list(LEARN))
def test_vision_learns_the_colour_from_the_reward_alone(vision_learning_runs, script):
    """The mean reward of 5 steps reaches 0.8; the final model's greedy answer names the colour of >= 90% of the
    held-out images, and it looks at them: with each image swapped for one of another colour, it names the old colour
    <= 20% of the time and the new one >= 80%."""
    out, held_out, seconds = vision_learning_runs[script].result()
    metrics = read_metrics(out)
    rewards_ = [m["reward"] for m in metrics]
    means = [sum(rewards_[i - 5 : i]) / 5 for i in range(5, len(rewards_) + 1)]
    reached = next((i + 5 for i, mean in enumerate(means) if mean >= 0.8), None)  # the step it reached 0.8
    training = sum(m["step_time"] for m in metrics[:reached]) if reached else None
    right, old, new, said = greedy_and_swapped(out, held_out)
    print(
        f"{script}: {len(rewards_)} steps in {seconds:.0f} s (start-up and save included; run in the background); "
        f"5-step reward 0.8 at step {reached} after {training or 0:.0f} s of steps, last 5 steps {means[-1]:.3f}; "
        f"held-out right {right}, swapped: old {old} new {new}; {said}"
    )
    assert reached is not None, [round(r, 2) for r in rewards_]
    assert right >= 0.9 and old <= 0.2 and new >= 0.8, (right, old, new, said)
