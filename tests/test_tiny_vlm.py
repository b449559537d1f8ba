"""The tiny vision-language model and colour dataset of tests/make_tiny_vlm.py: they build offline and the same every
time, load with the Auto classes, the processor's image tokens match the model's image features, forward, generate and
gradients work, vLLM's own input processing agrees with transformers', a few dozen supervised steps teach the model
to name the colour of held-out images (it must look at the image: every prompt's token ids are the same), and the
warm start (make_tiny_vlm(warm=True)) makes it say a colour word but not the image's."""

import json
import time

import pytest
import torch
from PIL import Image

from make_tiny_vlm import (
    COLOURS,
    IMAGE_SEQ_LEN,
    QUESTION,
    STORIES,
    load_colour_dataset,
    make_colour_dataset,
    make_tiny_vlm,
    parse_text,
)

PROMPT = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
RENDERED = f"<s>user: <image> {QUESTION}\nassistant:"


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_vlm")
    return out, make_tiny_vlm(out)


def load(path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    return AutoModelForImageTextToText.from_pretrained(path), AutoProcessor.from_pretrained(path)


def encode(processor, prompts, images):
    """The processor's batch for chat-message prompts, one image each (no padding: the tests' images all give prompts
    of one length)."""
    texts = [processor.apply_chat_template(p, add_generation_prompt=True) for p in prompts]
    return processor(text=texts, images=[[image] for image in images], add_special_tokens=False, return_tensors="pt")


def image_features(model, batch):
    """The image embeddings the model puts in place of the image tokens: (tiles, tokens per tile, text width)."""
    return model.model.get_image_features(
        pixel_values=batch["pixel_values"], pixel_attention_mask=batch["pixel_attention_mask"]
    ).pooler_output


def test_vision_fixture_builds_small_and_the_same_every_time(vlm, tmp_path):
    out, summary = vlm
    assert summary["architecture"] == "Idefics3ForConditionalGeneration"
    assert summary["bytes"] < 3_000_000
    assert sum(f.stat().st_size for f in out.iterdir()) == summary["bytes"]
    again = make_tiny_vlm(tmp_path)
    assert again == {**summary, "dir": str(tmp_path)}
    assert sorted(f.name for f in out.iterdir()) == sorted(f.name for f in tmp_path.iterdir())
    for f in out.iterdir():
        assert f.read_bytes() == (tmp_path / f.name).read_bytes(), f.name


def test_vision_fixture_loads_with_stories260K_as_its_text_model(vlm):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, summary = vlm
    model, processor = load(out)
    assert type(model).__name__ == "Idefics3ForConditionalGeneration"
    assert type(processor).__name__ == "Idefics3Processor"
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template == processor.chat_template is not None
    assert model.lm_head.weight is model.model.text_model.embed_tokens.weight  # tied, as stories260K's
    # the text model is stories260K: its weights (the 512 old embedding rows among them), its tokenization, its stories
    stories = AutoModelForCausalLM.from_pretrained(STORIES)
    ours = model.model.text_model.state_dict()
    for name, weight in stories.model.state_dict().items():
        assert torch.equal(ours[name][: weight.shape[0]], weight), name
    old = AutoTokenizer.from_pretrained(STORIES)
    texts = [json.loads(line)["prompt"] for line in (STORIES.parent / "stories_prompts.jsonl").open()]
    for text in texts + ["<s>user: hi", "x</s> y"]:
        assert tokenizer(text)["input_ids"] == old(text)["input_ids"], text
    assert len(tokenizer) == summary["vocab"] == model.config.text_config.vocab_size
    ids = tokenizer("Once upon a time, there was a little girl named", return_tensors="pt")
    story = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert tokenizer.decode(story[0, ids["input_ids"].shape[1] :]).startswith("Lily.")


def test_vision_fixture_image_tokens_match_the_image_features(vlm):
    out, summary = vlm
    model, processor = load(out)
    assert processor.apply_chat_template(PROMPT, add_generation_prompt=True) == RENDERED
    image_token_id = model.config.image_token_id
    square, wide = Image.new("RGB", (32, 32), (220, 30, 30)), Image.new("RGB", (64, 32), (30, 50, 220))
    # a square image: 2 x 2 tiles and the whole image, 4 image tokens each; a 2:1 one: 1 x 2 tiles and the whole image
    for image, tiles in [(square, 5), (wide, 3)]:
        batch = encode(processor, [PROMPT], [image])
        ids = batch["input_ids"][0].tolist()
        assert ids.count(processor.tokenizer.bos_token_id) == 1
        assert batch["pixel_values"].shape == (1, tiles, 3, 32, 32)
        with torch.no_grad():
            features = image_features(model, batch)
        assert features.shape == (tiles, IMAGE_SEQ_LEN, model.config.text_config.hidden_size)
        assert ids.count(image_token_id) == tiles * IMAGE_SEQ_LEN
        # the same from apply_chat_template(tokenize=True) with the image in the message's part
        with_image = [{**PROMPT[0], "content": [{"type": "image", "image": image}, PROMPT[0]["content"][1]]}]
        direct = processor.apply_chat_template(with_image, add_generation_prompt=True, tokenize=True, return_dict=True)
        assert list(direct["input_ids"][0]) == ids
        assert torch.equal(torch.as_tensor(direct["pixel_values"]), batch["pixel_values"])
    assert summary["image_tokens_per_square_image"] == 5 * IMAGE_SEQ_LEN


def test_vision_fixture_forward_and_generate_with_an_image(vlm):
    out, _ = vlm
    model, processor = load(out)
    images = [Image.new("RGB", (32, 32), rgb) for rgb in COLOURS.values()]
    batch = encode(processor, [PROMPT] * len(images), images)
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (*batch["input_ids"].shape, model.config.text_config.vocab_size)
    assert torch.isfinite(logits).all()
    # the image changes the next-token distribution (the prompts' token ids are all the same)
    assert not torch.allclose(logits[0, -1], logits[2, -1])
    generated = model.generate(**batch, max_new_tokens=8, do_sample=False)
    assert generated.shape[1] > batch["input_ids"].shape[1]
    torch.manual_seed(0)
    sampled = model.generate(**batch, max_new_tokens=8, do_sample=True)
    assert sampled.shape[0] == len(images)


def test_vision_fixture_gradient_reaches_every_part(vlm):
    out, _ = vlm
    model, processor = load(out)
    batch = encode(processor, [PROMPT], [Image.new("RGB", (32, 32), (30, 180, 40))])
    answer = processor.tokenizer(" green", add_special_tokens=False)["input_ids"]
    input_ids = torch.cat([batch["input_ids"], torch.tensor([answer])], 1)
    labels = torch.full_like(input_ids, -100)
    labels[0, -len(answer) :] = torch.tensor(answer)
    loss = model(
        input_ids=input_ids,
        pixel_values=batch["pixel_values"],
        pixel_attention_mask=batch["pixel_attention_mask"],
        labels=labels,
    ).loss
    loss.backward()
    parts = {
        "connector": model.model.connector.modality_projection.proj.weight,
        "vision tower (first layer)": model.model.vision_model.encoder.layers[0].self_attn.q_proj.weight,
        "vision patch embedding": model.model.vision_model.embeddings.patch_embedding.weight,
        "language model (first layer)": model.model.text_model.layers[0].self_attn.q_proj.weight,
        "language model (embeddings = lm_head)": model.model.text_model.embed_tokens.weight,
    }
    for name, weight in parts.items():
        assert weight.grad is not None and weight.grad.abs().sum() > 0, name


def test_vision_fixture_colour_dataset(tmp_path):
    path = make_colour_dataset(tmp_path / "a", 8, seed=0)
    assert path == tmp_path / "a" / "colours.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [row["answer"] for row in rows] == list(COLOURS) * 2
    assert all(row["prompt"] == PROMPT and (path.parent / row["image"]).is_file() for row in rows)
    again = make_colour_dataset(tmp_path / "b", 8, seed=0)
    assert again.read_bytes() == path.read_bytes()
    assert all((path.parent / r["image"]).read_bytes() == (again.parent / r["image"]).read_bytes() for r in rows)
    dataset = load_colour_dataset(path)
    assert dataset.column_names == ["prompt", "image", "answer"]
    for row in dataset:
        assert isinstance(row["image"], Image.Image) and row["image"].size == (32, 32)
        pixel, base = row["image"].getpixel((5, 5)), COLOURS[row["answer"]]
        assert max(abs(a - b) for a, b in zip(pixel, base)) <= 30
    # the answers are plain words to the stories260K tokenizer (no unknown pieces), told apart by their first token
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(STORIES)
    pieces = {word: tokenizer(" " + word, add_special_tokens=False)["input_ids"] for word in COLOURS}
    assert all(tokenizer.unk_token_id not in ids and tokenizer.decode(ids) == word for word, ids in pieces.items())
    assert len({ids[0] for ids in pieces.values()}) == len(COLOURS)


def greedy_accuracy(model, tokenizer, batch, answers):
    """{colour: share of its rows whose greedy completion's first word is the colour}."""
    with torch.no_grad():
        generated = model.generate(**batch, max_new_tokens=6, do_sample=False)
    prompt_length = batch["input_ids"].shape[1]
    words = [tokenizer.decode(row[prompt_length:], skip_special_tokens=True).split() for row in generated]
    right = [bool(w) and w[0].strip(".,!?\"'") == answer for w, answer in zip(words, answers)]
    return {c: sum(r for r, a in zip(right, answers) if a == c) / answers.count(c) for c in COLOURS}


def test_vision_fixture_learns_colours_from_the_image(vlm, tmp_path):
    """A few dozen AdamW steps of cross-entropy on the answer word (and EOS) make the greedy answer right on >= 90% of
    held-out images of each colour. The prompt's token ids are the same for every row, so only the image tells."""
    out, _ = vlm
    model, processor = load(out)
    tokenizer = processor.tokenizer
    train = load_colour_dataset(make_colour_dataset(tmp_path / "train", 64, seed=0))
    held_out = load_colour_dataset(make_colour_dataset(tmp_path / "held_out", 40, seed=1))
    train_batch = encode(processor, train["prompt"], train["image"])
    held_batch = encode(processor, held_out["prompt"], held_out["image"])
    prompt = train_batch["input_ids"]
    assert (prompt == prompt[0]).all() and torch.equal(held_batch["input_ids"][0], prompt[0])
    before = greedy_accuracy(model.eval(), tokenizer, held_batch, held_out["answer"])
    assert max(before.values()) < 0.5, before
    # prompt + answer + EOS, right-padded with EOS (the padding is after the labels: causal attention never sees it)
    answers = [
        tokenizer(" " + a, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for a in train["answer"]
    ]
    width = max(map(len, answers))
    input_ids = torch.full((len(answers), prompt.shape[1] + width), tokenizer.eos_token_id)
    labels = torch.full_like(input_ids, -100)
    input_ids[:, : prompt.shape[1]] = prompt
    for row, ids in enumerate(answers):
        input_ids[row, prompt.shape[1] : prompt.shape[1] + len(ids)] = torch.tensor(ids)
        labels[row, prompt.shape[1] : prompt.shape[1] + len(ids)] = torch.tensor(ids)
    torch.manual_seed(0)
    order = torch.Generator().manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start, history, learned_at = time.perf_counter(), [], None
    for step in range(1, 61):
        model.train()
        rows = torch.randperm(len(answers), generator=order)[:16]
        loss = model(
            input_ids=input_ids[rows],
            pixel_values=train_batch["pixel_values"][rows],
            pixel_attention_mask=train_batch["pixel_attention_mask"][rows],
            labels=labels[rows],
        ).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 5 == 0:
            accuracy = greedy_accuracy(model.eval(), tokenizer, held_batch, held_out["answer"])
            history.append((step, round(loss.item(), 3), accuracy))
            if min(accuracy.values()) >= 0.9:
                learned_at = step
                break
    seconds = time.perf_counter() - start
    print(f"colours learned at step {learned_at} in {seconds:.1f} s (evaluation included): {history}")
    assert learned_at is not None, history


def test_vision_fixture_warm_start_says_a_colour_word_but_not_which(vlm, tmp_path):
    """make_tiny_vlm(warm=True) (tests/test_vision.py's learning runs start from it): the same bytes every time; only
    the language model differs from the plain build (the vision tower and connector are the same random ones). Asked
    the colour question, it answers a colour word, spelled right, for every held-out image, but not the image's: each
    word's first token has about 1/4 of the probability on every image, and the greedy answer is right no more often
    than chance (1/4) + 15%. So RL has the image -> colour mapping still to learn."""
    from transformers import AutoModelForImageTextToText

    out, summary = tmp_path / "warm", make_tiny_vlm(tmp_path / "warm", warm=True)
    again = make_tiny_vlm(tmp_path / "again", warm=True)
    assert again == {**summary, "dir": str(tmp_path / "again")} and summary["warm_start_loss"] is not None
    for f in out.iterdir():
        assert f.read_bytes() == (tmp_path / "again" / f.name).read_bytes(), f.name
    plain = AutoModelForImageTextToText.from_pretrained(vlm[0]).state_dict()
    model, processor = load(out)
    warm = model.state_dict()
    language = [k for k in plain if ".text_model." in k or k == "lm_head.weight"]  # (lm_head: the tied embeddings)
    assert all(torch.equal(plain[k], warm[k]) for k in plain if k not in language) and len(language) < len(plain)
    assert not all(torch.equal(plain[k], warm[k]) for k in plain if ".text_model." in k)
    tokenizer = processor.tokenizer
    held_out = load_colour_dataset(make_colour_dataset(tmp_path / "held_out", 40, seed=1))
    batch = encode(processor, held_out["prompt"], held_out["image"])
    first = [tokenizer(" " + word, add_special_tokens=False)["input_ids"][0] for word in COLOURS]
    with torch.no_grad():
        chances = model.eval()(**batch).logits[:, -1].softmax(-1)[:, first]  # (image, colour word)
    assert chances.sum(1).min() >= 0.95 and 0.15 <= chances.min() and chances.max() <= 0.35, chances
    with torch.no_grad():
        generated = model.generate(**batch, max_new_tokens=6, do_sample=False)
    prompt_length = batch["input_ids"].shape[1]
    said = [tokenizer.decode(row[prompt_length:], skip_special_tokens=True).strip() for row in generated]
    assert all(word in COLOURS for word in said), said
    right = sum(word == answer for word, answer in zip(said, held_out["answer"])) / len(said)
    assert right <= 1 / len(COLOURS) + 0.15, (right, said)
    print(f"warm start: greedy right on {right:.0%} of held-out images; first-token chances {chances.mean(0)}")


def test_vision_fixture_random_text_model_option(tmp_path):
    """--text HIDDEN/HEADS: a random-init text model with heads of HIDDEN/HEADS (for kernels that refuse size 8)."""
    with pytest.raises(ValueError):
        parse_text("100/3")
    summary = make_tiny_vlm(tmp_path, text="128/4")
    assert summary["bytes"] < 3_000_000
    model, processor = load(tmp_path)
    text_config = model.config.text_config
    assert (text_config.hidden_size, text_config.num_attention_heads, text_config.head_dim) == (128, 4, 32)
    batch = encode(processor, [PROMPT], [Image.new("RGB", (32, 32), (230, 220, 40))])
    with torch.no_grad():
        assert torch.isfinite(model(**batch).logits).all()


def test_vision_fixture_vllm_processes_inputs_as_transformers_does(vlm):
    """vLLM 0.26 resolves the architecture, and its multimodal processor (the one `vllm serve` and LLM use; it runs on
    the CPU) turns a prompt of token ids with one <image> plus the image into the ids and pixel values that
    transformers' processor gives: the same tiles, image tokens and tile markers."""
    pytest.importorskip("vllm")
    from transformers import AutoProcessor
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.processing.context import TimingContext
    from vllm.multimodal.processing.inputs import ProcessorInputs

    out, _ = vlm
    config = ModelConfig(model=str(out), tokenizer=str(out), dtype="float32")
    assert config.architectures == ["Idefics3ForConditionalGeneration"] and config.is_multimodal_model
    vllm_processor = MULTIMODAL_REGISTRY.create_processor(config)
    processor = AutoProcessor.from_pretrained(out)
    prompt_ids = list(processor.tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True)["input_ids"])
    for image in [Image.new("RGB", (32, 32), (220, 30, 30)), Image.new("RGB", (40, 64), (30, 50, 220))]:
        items = vllm_processor.info.parse_mm_data({"image": [image]})
        result = vllm_processor.apply(ProcessorInputs(prompt=prompt_ids, mm_data_items=items), TimingContext())
        expected = encode(processor, [PROMPT], [image])
        assert result["prompt_token_ids"] == expected["input_ids"][0].tolist()
        data = result["mm_kwargs"].get_data()
        assert torch.equal(data["pixel_values"], expected["pixel_values"][0])
