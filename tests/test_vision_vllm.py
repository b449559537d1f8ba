"""vLLM with images in the prompts (docs/vision.md), on the CPU: the prompts the trainer hands vLLM expand, in the
installed vLLM's own multimodal processor, into exactly the trainer's prompt ids; the server's render and generate
messages are vLLM's protocol classes field by field; server mode renders then samples each prompt (one request, n
completions), checks the rendered ids, and moves a lost server's prompts to another; colocate passes each prompt's
images and refuses prompt ids that differ from the trainer's. The GPU half is tests/gpu/."""

import base64
import io
import json
import types

import pytest
from PIL import Image
from test_vllm_utils import FakeServer

import grpo
import vllm_utils
from grpo_cli import write_jsonl
from make_tiny_vlm import make_colour_dataset, make_tiny_vlm

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """(the tiny VLM, its processor, the PromptSet of 3 rows: one image; two images; a system message and an image)."""
    from transformers import AutoProcessor

    root = tmp_path_factory.mktemp("vllm_vision")
    make_tiny_vlm(root / "vlm")
    row = json.loads(make_colour_dataset(root / "data", 4, seed=0).read_text().splitlines()[0])
    content = [*row["prompt"][0]["content"], {"type": "image"}, {"type": "text", "text": "And this one?"}]
    two = {**row, "prompt": [{"role": "user", "content": content}], "image": [row["image"], "img_00001.png"]}
    system = {**row, "prompt": [{"role": "system", "content": "Answer in one word."}, *row["prompt"]]}
    data = write_jsonl(root / "data" / "mixed.jsonl", [row, two, system])
    args = grpo.parse_args(
        ["--dataset-name", str(data), "--prompt-column", "prompt", "--reward-funcs", "format_reward"]
    )
    processor = AutoProcessor.from_pretrained(root / "vlm")
    prompt_set = grpo.load_prompts(args, grpo.read_dataset(args, []), processor.tokenizer, 10**6, processor=processor)
    return root / "vlm", processor, prompt_set


def test_vision_vllm_expands_the_prompts_into_the_trainers_prompt_ids(vlm):
    """vLLM's multimodal processor (the one its engine and `vllm serve` run; CPU-side) expands each ImagePrompt's
    template ids (one placeholder per image) with its images into exactly the ids the trainer trains on."""
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.processing.context import TimingContext
    from vllm.multimodal.processing.inputs import ProcessorInputs

    path, processor, prompt_set = vlm
    config = ModelConfig(model=str(path), tokenizer=str(path), dtype="float32", limit_mm_per_prompt={"image": 2})
    renderer = MULTIMODAL_REGISTRY.create_processor(config)
    prompts = grpo.vllm_images(types.SimpleNamespace(processor=processor), prompt_set, [0, 1, 2])
    assert [len(p.images) for p in prompts] == [1, 2, 1] and prompts[2].messages[0]["role"] == "system"
    for prompt, ids in zip(prompts, prompt_set.prompt_ids):
        assert len(prompt.token_ids) < len(ids)  # the placeholders are not expanded yet
        items = renderer.info.parse_mm_data({"image": prompt.images})
        expanded = renderer.apply(ProcessorInputs(prompt=prompt.token_ids, mm_data_items=items), TimingContext())
        assert expanded["prompt_token_ids"] == ids
    assert len(prompt_set.prompt_ids[1]) > len(prompt_set.prompt_ids[0])  # two images' tokens


def test_vision_server_messages_are_vllms_protocol_classes(vlm):
    """The render request is a ChatCompletionRequest whose image parts decode to the dataset's pixels; the generate
    request, built from a render answer (GenerateRequest with MultiModalFeatures), is a GenerateRequest asking n
    samples, their log-probs, every choice at the end (FINAL_ONLY) and no text; a GenerateResponse parses back, a
    missing log-prob as None."""
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionLogProbs,
        ChatCompletionLogProbsContent,
        ChatCompletionRequest,
    )
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
        GenerateRequest,
        GenerateResponse,
        GenerateResponseChoice,
        MultiModalFeatures,
        PlaceholderRangeInfo,
    )
    from vllm.sampling_params import RequestOutputKind

    _, processor, prompt_set = vlm
    prompt = grpo.vllm_images(types.SimpleNamespace(processor=processor), prompt_set, [1])[0]
    body = vllm_utils.render_request("served", prompt)
    request = ChatCompletionRequest.model_validate(body)
    assert request.model == "served" and request.add_generation_prompt
    parts = [part for part in body["messages"][0]["content"] if part["type"] == "image_url"]
    assert len(parts) == 2 and [p["type"] for p in body["messages"][0]["content"]] == [
        "image_url",
        "text",
        "image_url",
        "text",
    ]
    for part, image in zip(parts, prompt.images):
        data = base64.b64decode(part["image_url"]["url"].removeprefix("data:image/png;base64,"))
        assert Image.open(io.BytesIO(data)).tobytes() == image.tobytes()
    assert prompt.messages[0]["content"][0] == {"type": "image"}  # the dataset's messages are left as they were

    features = MultiModalFeatures(
        mm_hashes={"image": ["a", "b"]},
        mm_placeholders={"image": [PlaceholderRangeInfo(offset=3, length=20)] * 2},
        kwargs_data={"image": ["ZGF0YQ==", None]},
    )
    rendered = GenerateRequest.model_validate(
        {"token_ids": prompt_set.prompt_ids[1], "features": features.model_dump(), "sampling_params": {}}
    ).model_dump(mode="json")
    fields = {"temperature": 0.7, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "max_tokens": 8}
    request = GenerateRequest.model_validate(vllm_utils.generate_request(rendered, 4, fields))
    assert request.token_ids == prompt_set.prompt_ids[1] and request.features == features
    params = request.sampling_params
    assert (params.n, params.logprobs, params.output_kind, params.detokenize) == (
        4,
        0,
        RequestOutputKind.FINAL_ONLY,
        False,
    )
    assert (params.temperature, params.max_tokens, params.top_k) == (0.7, 8, -1)

    content = lambda *lps: ChatCompletionLogProbs(  # noqa: E731
        content=[
            ChatCompletionLogProbsContent(token=f"token_id:{t}", **({} if lp is None else {"logprob": lp}))
            for t, lp in lps
        ]
    )
    choices = [GenerateResponseChoice(index=1, logprobs=content((7, -0.5), (2, None)), token_ids=[7, 2])]
    choices.append(GenerateResponseChoice(index=0, logprobs=content((5, -1.25)), token_ids=[5]))
    response = json.loads(GenerateResponse(choices=choices).model_dump_json())
    assert vllm_utils.parse_completions(response, 1, 2) == ([[5], [7, 2]], [[-1.25], [-0.5, None]])
    with pytest.raises(RuntimeError, match="2 completions for 1 prompts x 3"):
        vllm_utils.parse_completions(response, 1, 3)


def test_vision_server_generate_renders_then_samples_each_prompt(vlm):
    """Each prompt: one render, then one generate of n completions carrying the render's ids and features; the
    completions come back prompt-major; render ids that differ from the trainer's stop the round; a server that stops
    answering joins `lost` and its prompts go to the other."""
    _, processor, prompt_set = vlm
    prompts = grpo.vllm_images(types.SimpleNamespace(processor=processor), prompt_set, [0, 1, 2])

    def render(body):  # the trainer's ids, as vLLM renders them; the row in the features, so that generate can say it
        parts = body["messages"][-1]["content"]
        row = 2 if len(body["messages"]) == 2 else sum(p["type"] == "image_url" for p in parts) - 1  # (see vlm)
        features = {"mm_hashes": {"image": [str(row)]}, "mm_placeholders": {"image": []}}
        return 200, {"token_ids": prompt_set.prompt_ids[row], "features": features, "sampling_params": {}}

    def sample(body):
        row, n = int(body["features"]["mm_hashes"]["image"][0]), body["sampling_params"]["n"]
        assert body["token_ids"] == prompt_set.prompt_ids[row]
        choices = [
            {
                "index": k,
                "token_ids": [row, k],
                "logprobs": {"content": [{"token": "a", "logprob": -row}, {"token": "b", "logprob": -k}]},
            }
            for k in range(n)
        ]
        return 200, {"choices": choices}

    one, two = FakeServer({"/v1/chat/completions/render": render, "/inference/v1/generate": sample}), None
    try:
        fields = {"temperature": 1.0, "max_tokens": 8}
        out = vllm_utils.server_generate(one.url, "m", prompt_set.prompt_ids, 2, fields, images=prompts)
        assert out[0] == [[0, 0], [0, 1], [1, 0], [1, 1], [2, 0], [2, 1]]
        assert out[1][2:4] == [[-1, 0], [-1, -1]]
        assert sorted(one.paths()) == ["/inference/v1/generate"] * 3 + ["/v1/chat/completions/render"] * 3
        assert all(body["sampling_params"]["n"] == 2 for path, _, body in one.calls if path.startswith("/inference"))

        wrong = [prompt_set.prompt_ids[1]] + prompt_set.prompt_ids[1:]
        with pytest.raises(RuntimeError, match="vLLM expanded an image prompt into"):
            vllm_utils.server_generate(one.url, "m", wrong, 2, fields, images=prompts)

        two = FakeServer({"/v1/chat/completions/render": render, "/inference/v1/generate": sample})
        one.close()
        one.httpd.server_close()  # connections refused: the server is gone
        lost = {}
        out = vllm_utils.server_generate(
            [one.url, two.url], "m", prompt_set.prompt_ids, 1, fields, lost=lost, images=prompts
        )
        assert out[0] == [[0, 0], [1, 0], [2, 0]] and list(lost) == [one.url]
    finally:
        for server in (one, two):
            if server is not None:
                server.httpd.server_close()


def test_vision_colocate_passes_the_images_and_checks_the_prompt_ids(vlm):
    """The colocated engine gets each prompt's template ids and images (multi_modal_data); its expanded prompt ids
    must be the trainer's, or the round stops with the reason."""
    _, processor, prompt_set = vlm
    prompts = grpo.vllm_images(types.SimpleNamespace(processor=processor), prompt_set, [0, 1])
    seen = []

    class LLM:  # plays vllm.LLM.generate: the expanded prompt ids, one sample per prompt
        def generate(self, requests, params, use_tqdm):
            seen.extend(requests)
            sample = types.SimpleNamespace(token_ids=[9], logprobs=types.SimpleNamespace(logprobs=[-0.5]))
            return [types.SimpleNamespace(prompt_token_ids=expanded, outputs=[sample]) for expanded in answer]

    answer = prompt_set.prompt_ids[:2]
    fields = {"temperature": 1.0, "max_tokens": 4}
    assert vllm_utils.colocate_generate(LLM(), answer, 1, fields, prompts) == ([[9], [9]], [[-0.5], [-0.5]])
    assert [r["prompt_token_ids"] for r in seen] == [p.token_ids for p in prompts]
    assert [r["multi_modal_data"]["image"] for r in seen] == [p.images for p in prompts]
    answer = [prompt_set.prompt_ids[0], prompt_set.prompt_ids[0]]  # the second prompt expanded otherwise
    with pytest.raises(RuntimeError, match="first differing at"):
        vllm_utils.colocate_generate(LLM(), prompt_set.prompt_ids[:2], 1, fields, prompts)


def test_vision_vllm_model_impl_reaches_the_colocated_engine_and_needs_colocate(monkeypatch, tmp_path):
    """--vllm-model-impl goes to vllm.LLM (model_impl), with limit_mm_per_prompt the most images of a prompt; without
    colocate it is refused (a server takes `vllm serve --model-impl`)."""
    started = {}
    monkeypatch.setattr(vllm_utils, "vllm_version", lambda *a, **k: (0, 26))
    monkeypatch.setattr(vllm_utils, "colocate_engine", lambda path, tp, seed, **kw: started.update(kw))
    monkeypatch.setattr(vllm_utils, "tensor_parallel_group", lambda tp: None)
    args = grpo.parse_args(["--use-vllm", "--vllm-model-impl", "transformers", "--reward-funcs", "format_reward"])
    vllm_utils.start(args, "m", 10, max_images=2)
    assert started["model_impl"] == "transformers" and started["limit_mm_per_prompt"] == {"image": 2}
    started.clear()
    vllm_utils.start(args, "m", 10)  # a text model: vLLM's own limits
    assert started["model_impl"] == "transformers" and "limit_mm_per_prompt" not in started
    server = grpo.parse_args(["--use-vllm", "--vllm-mode", "server", "--vllm-model-impl", "vllm"])
    monkeypatch.setattr(vllm_utils, "setup_problems", lambda: [])
    with pytest.raises(SystemExit, match="--vllm-model-impl is ignored without --vllm-mode colocate"):
        grpo.check_args(server, 1)


def test_vision_check_same_model_builds_a_vision_language_model(vlm, tmp_path, capsys):
    """The served model is built as a vision-language model (AutoModelForCausalLM cannot build one, and the comparison
    was skipped): the same VLM passes without the "cannot build" message, another one is refused before any push."""
    from transformers import AutoModelForImageTextToText

    path, _, _ = vlm
    model = AutoModelForImageTextToText.from_pretrained(path)
    server = {"model_config": {"model": str(path)}, "model_id": str(path), "url": "http://127.0.0.1:8000"}
    vllm_utils.check_same_model(server, model, str(path))
    assert "cannot build" not in capsys.readouterr().out
    make_tiny_vlm(tmp_path / "other", text="128/4")  # another text model's width
    other = {**server, "model_config": {"model": str(tmp_path / "other")}}
    with pytest.raises(RuntimeError, match="nothing sent"):
        vllm_utils.check_same_model(other, model, str(path))


def test_vision_mm_processor_kwargs_reach_the_trainers_processor_and_the_engine(monkeypatch, tmp_path):
    """--mm-processor-kwargs sets the trainer's image processor (Qwen2.5-VL's max_pixels: 16 image tokens of a 112x112
    image become 4, so the prompt fits a --max-prompt-length it did not) and the colocated engine's; without images it
    is refused in one line before any weights load."""
    from test_vision import tiny_qwen2_5_vl

    from grpo_cli import STORIES, check, run_grpo

    qwen = tiny_qwen2_5_vl(tmp_path / "qwen")
    data = make_colour_dataset(tmp_path / "big", 4, seed=0, size=112)
    flags = ["--model-name-or-path", qwen, "--dataset-name", data, "--prompt-column", "prompt", "--no-bf16"]
    flags += ["--reward-funcs", "first_word_reward", "--max-prompt-length", 40, "--max-completion-length", 4]
    flags += ["--prompts-per-step", 2, "--num-generations", 2, "--max-steps", 1]
    refused = run_grpo(*flags, "--output-dir", tmp_path / "default")
    assert refused.returncode == 1 and "no prompt of --dataset-name" in refused.stderr + refused.stdout
    check(run_grpo(*flags, "--mm-processor-kwargs", "max_pixels", 3136, "--output-dir", tmp_path / "small"))

    words = write_jsonl(tmp_path / "text.jsonl", [{"question": "Name a colour.", "answer": "red"}] * 2)
    text = run_grpo(
        "--model-name-or-path",
        STORIES,
        "--dataset-name",
        words,
        "--reward-funcs",
        "first_word_reward",
        "--mm-processor-kwargs",
        "max_pixels",
        3136,
        "--output-dir",
        tmp_path / "text",
    )
    lines = [line for line in (text.stdout + text.stderr).splitlines() if line.strip()]
    assert (
        text.returncode == 1
        and lines[-1] == "error: --mm-processor-kwargs is ignored without images in the dataset: drop it"
    )
    assert not any("Loading weights" in line for line in lines)

    started = {}
    monkeypatch.setattr(vllm_utils, "vllm_version", lambda *a, **k: (0, 26))
    monkeypatch.setattr(vllm_utils, "colocate_engine", lambda path, tp, seed, **kw: started.update(kw))
    monkeypatch.setattr(vllm_utils, "tensor_parallel_group", lambda tp: None)
    args = grpo.parse_args(["--use-vllm", "--mm-processor-kwargs", "max_pixels", "3136"])
    vllm_utils.start(args, "m", 10, max_images=1)
    assert started["mm_processor_kwargs"] == {"max_pixels": 3136}
