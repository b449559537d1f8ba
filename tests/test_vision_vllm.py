"""vLLM with images in the prompts (docs/vision.md), on the CPU: the prompts the trainer hands vLLM expand, in the
installed vLLM's own multimodal processor, into exactly the trainer's prompt ids; the server's request and answer are
vLLM's protocol classes field by field; server mode sends each prompt in one chat request (n completions), checks the
prompt ids vLLM made, and moves a lost server's prompts to another; colocate passes each prompt's images, refuses
prompt ids that differ from the trainer's and resets vLLM's image features after a push. The GPU half: tests/gpu/."""

import base64
import io
import json
import types

import numpy as np
import pytest
import torch
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
    """The request is a ChatCompletionRequest asking n samples, the sampled tokens' ids and log-probs, the prompt's
    ids, no text changes; its image parts decode to the dataset's pixels, in order; a ChatCompletionResponse parses
    back (prompt-major choices, a missing log-prob as None)."""
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionLogProbs,
        ChatCompletionLogProbsContent,
        ChatCompletionRequest,
        ChatCompletionResponse,
        ChatCompletionResponseChoice,
        ChatMessage,
    )
    from vllm.entrypoints.openai.engine.protocol import UsageInfo

    _, processor, prompt_set = vlm
    prompt = grpo.vllm_images(types.SimpleNamespace(processor=processor), prompt_set, [1])[0]
    fields = {"temperature": 0.7, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "max_tokens": 8}
    body = vllm_utils.chat_request("served", prompt, 4, fields)
    request = ChatCompletionRequest.model_validate(body)
    assert (request.model, request.n, request.logprobs, request.top_logprobs) == ("served", 4, True, 0)
    assert request.return_token_ids and request.return_tokens_as_token_ids and not request.skip_special_tokens
    assert request.add_generation_prompt and (request.temperature, request.max_completion_tokens, request.top_k) == (
        0.7,
        8,
        -1,
    )
    assert "max_tokens" not in body  # (deprecated in chat requests)
    params = request.to_sampling_params(8, {})
    assert (params.n, params.logprobs, params.temperature, params.max_tokens) == (4, 0, 0.7, 8)
    content = body["messages"][0]["content"]
    assert [part["type"] for part in content] == ["image_url", "text", "image_url", "text"]
    for part, image in zip([p for p in content if p["type"] == "image_url"], prompt.images):
        data = base64.b64decode(part["image_url"]["url"].removeprefix("data:image/png;base64,"))
        assert Image.open(io.BytesIO(data)).tobytes() == image.tobytes()
    assert prompt.messages[0]["content"][0] == {"type": "image"}  # the dataset's messages are left as they were

    logprobs = lambda *lps: ChatCompletionLogProbs(  # noqa: E731
        content=[
            ChatCompletionLogProbsContent(token=f"token_id:{t}", **({} if lp is None else {"logprob": lp}))
            for t, lp in lps
        ]
    )
    message = ChatMessage(role="assistant", content="")
    choices = [ChatCompletionResponseChoice(index=1, message=message, logprobs=logprobs((7, -0.5), (2, None)))]
    choices.append(ChatCompletionResponseChoice(index=0, message=message, logprobs=logprobs((5, -1.25))))
    choices[0].token_ids, choices[1].token_ids = [7, 2], [5]
    usage = UsageInfo(prompt_tokens=3, completion_tokens=3, total_tokens=6)
    answer = ChatCompletionResponse(model="served", choices=choices, usage=usage, prompt_token_ids=[1, 2, 3])
    response = json.loads(answer.model_dump_json())
    assert response["prompt_token_ids"] == [1, 2, 3]
    assert vllm_utils.parse_completions(response, 1, 2) == ([[5], [7, 2]], [[-1.25], [-0.5, None]])
    with pytest.raises(RuntimeError, match="2 completions for 1 prompts x 3"):
        vllm_utils.parse_completions(response, 1, 3)


def test_vision_server_samples_each_prompt_in_one_chat_request(vlm):
    """Each prompt: one /v1/chat/completions request of n completions; the completions come back prompt-major; a
    prompt that the server expands into other ids than the trainer's stops the round; a server that stops answering
    joins `lost` and its prompts go to the other."""
    _, processor, prompt_set = vlm
    prompts = grpo.vllm_images(types.SimpleNamespace(processor=processor), prompt_set, [0, 1, 2])

    def chat(body):  # rows: one image; two; a system message and one (see vlm)
        parts = body["messages"][-1]["content"]
        row = 2 if len(body["messages"]) == 2 else sum(p["type"] == "image_url" for p in parts) - 1
        content = lambda k: {"content": [{"token": "a", "logprob": -row}, {"token": "b", "logprob": -k}]}  # noqa: E731
        choices = [{"index": k, "token_ids": [row, k], "logprobs": content(k)} for k in range(body["n"])]
        return 200, {"prompt_token_ids": prompt_set.prompt_ids[row], "choices": choices}

    one, two = FakeServer({"/v1/chat/completions": chat}), None
    try:
        fields = {"temperature": 1.0, "max_tokens": 8}
        out = vllm_utils.server_generate(one.url, "m", prompt_set.prompt_ids, 2, fields, images=prompts)
        assert out[0] == [[0, 0], [0, 1], [1, 0], [1, 1], [2, 0], [2, 1]]
        assert out[1][2:4] == [[-1, 0], [-1, -1]]
        assert one.paths() == ["/v1/chat/completions"] * 3 and all(body["n"] == 2 for _, _, body in one.calls)

        wrong = [prompt_set.prompt_ids[1]] + prompt_set.prompt_ids[1:]
        with pytest.raises(RuntimeError, match="vLLM expanded an image prompt into"):
            vllm_utils.server_generate(one.url, "m", wrong, 2, fields, images=prompts)

        two = FakeServer({"/v1/chat/completions": chat})
        one.close()
        one.httpd.server_close()  # connections refused: the server is gone
        lost = {}
        ids = prompt_set.prompt_ids
        out = vllm_utils.server_generate([one.url, two.url], "m", ids, 1, fields, lost=lost, images=prompts)
        assert out[0] == [[0, 0], [1, 0], [2, 0]] and list(lost) == [one.url]
    finally:
        for server in (one, two):
            if server is not None:
                server.httpd.server_close()


def test_vision_colocated_push_resets_vllms_image_features(monkeypatch):
    """After a colocated engine reloads the weights, its cached image features (of the old weights; the scheduler's
    record of them would also outlive the reload's clearing, and vLLM would then miss them) are reset; a text engine
    is left alone."""
    calls = []
    llm = types.SimpleNamespace(
        collective_rpc=lambda name, kwargs: calls.append(name),
        reset_prefix_cache=lambda: calls.append("reset_prefix_cache"),
        llm_engine=types.SimpleNamespace(reset_encoder_cache=lambda: calls.append("reset_encoder_cache")),
    )
    monkeypatch.setattr(vllm_utils, "named_weights", lambda model, changed_only: iter(()))
    vllm_utils.sync_weights({"mode": "colocate", "llm": llm, "images": 1}, torch.nn.Linear(1, 1))
    assert calls == ["reload_weights", "reset_prefix_cache", "reset_encoder_cache"]
    calls.clear()
    vllm_utils.sync_weights({"mode": "colocate", "llm": llm, "images": 0}, torch.nn.Linear(1, 1))
    assert calls == ["reload_weights", "reset_prefix_cache"]


def test_vision_colocated_push_keeps_the_frozen_tower_while_the_engine_is_awake(vlm):
    """An awake colocated engine holds the frozen tower since it started (training never changes it): a push sends the
    rest, and vLLM's warnings of each layer that got no weights are dropped during that push; after sleep mode's level
    2, which discards every weight, a push sends them all, its warnings kept."""
    import logging

    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(vlm[0])
    for param in model.get_encoder("image").parameters():  # as grpo.py's --freeze-vision-tower (the projector aside)
        param.requires_grad_(False)
    reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    record = lambda msg: logging.makeLogRecord({"msg": msg, "args": ("Linear",)})  # noqa: E731
    sent, warned = [], []  # the weights each push sent; whether vLLM's warning of a layer without weights got through

    def reload(name, kwargs):
        sent.append([name for name, _ in kwargs["weights_iterator"]])
        warned.append(bool(reload_log.filter(record("%s: Failed to load weights"))))
        assert reload_log.filter(record("%s: other"))

    llm = types.SimpleNamespace(
        collective_rpc=reload,
        reset_prefix_cache=lambda: None,
        wake_up=lambda tags: None,
        llm_engine=types.SimpleNamespace(reset_encoder_cache=lambda: None),
    )
    vllm_utils.sync_weights({"mode": "colocate", "llm": llm, "images": 1}, model)
    vllm_utils.sync_weights({"mode": "colocate", "llm": llm, "images": 1, "weights_asleep": True}, model)
    everything = [name for name, _ in vllm_utils.named_weights(model)]
    tower = [name for name in everything if "vision_model" in name]
    assert len(tower) > 10 and sent == [[name for name in everything if name not in tower], everything]
    assert warned == [False, True] and reload_log.filter(record("%s: Failed to load weights"))  # the push's only


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


def test_vision_bench_is_qwen2_5_vl_3b_and_a_counting_task_that_the_scripts_read(tmp_path):
    """benchmarks/make_vlm_bench.py: the 3b shape has Qwen2.5-VL-3B-Instruct's 3,754,622,976 parameters (built on the
    meta device here); its tiny shape and the counting task (224x224 images: 64 image tokens each) go through grpo.py."""
    import sys

    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from grpo_cli import ROOT, STORIES, check, read_metrics, run_grpo

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import make_vlm_bench

    config, _ = make_vlm_bench.bench_config(STORIES, "3b")
    with torch.device("meta"):
        assert sum(p.numel() for p in Qwen2_5_VLForConditionalGeneration(config).parameters()) == 3_754_622_976
    make_vlm_bench.make_model(STORIES, tmp_path / "tiny", "tiny")
    data = make_vlm_bench.make_counting(tmp_path / "count", rows=4)
    assert {json.loads(line)["answer"] for line in data.read_text().splitlines()} <= set("12345")
    flags = ["--model-name-or-path", tmp_path / "tiny", "--dataset-name", data, "--prompt-column", "prompt"]
    flags += ["--reward-funcs", "first_word_reward", "--no-bf16", "--max-completion-length", 4, "--max-steps", 1]
    check(run_grpo(*flags, "--prompts-per-step", 2, "--num-generations", 2, "--output-dir", tmp_path / "run"))
    (metrics,) = read_metrics(tmp_path / "run")
    assert metrics["num_tokens"] > 2 * 2 * 64  # each prompt holds its image's 64 tokens


def test_vision_push_sends_a_frozen_tower_only_to_a_server_that_needs_every_weight(vlm, monkeypatch):
    """With --freeze-vision-tower (the default) a server's first push, and the push to a restarted server, carry every
    weight (it holds its start-up ones, or another run's); the pushes after the optimizer steps carry what training
    changes, never the tower. named_weights and weight_metadata (the receive buffers) agree on what is sent."""
    from transformers import AutoModelForImageTextToText

    path, _, _ = vlm
    model = AutoModelForImageTextToText.from_pretrained(path)
    for param in model.get_encoder("image").parameters():  # as load_models freezes it
        param.requires_grad_(False)
    every = [name for name, _ in vllm_utils.named_weights(model)]
    changed = [name for name, _ in vllm_utils.named_weights(model, changed_only=True)]
    assert any("vision_model" in name for name in every) and not any("vision_model" in name for name in changed)
    assert 0 < len(changed) < len(every) and vllm_utils.weight_metadata(model, changed_only=True)["names"] == changed

    pushes = []  # (urls, changed_only) of each IPC push
    monkeypatch.setattr(
        vllm_utils, "server_sync_weights_ipc", lambda urls, *a, **k: pushes.append((urls, k["changed_only"]))
    )
    urls = ["http://127.0.0.1:8001", "http://127.0.0.1:8011"]
    engine = {"mode": "server", "base_urls": urls, "base_url": urls[0], "model": str(path), "model_checked": True}
    engine |= {"server": {"version": "0.26.0", "backend": "ipc"}, "vllm_weight_sync_timeout": 1}
    engine |= {"vllm_weight_sync_buffer_mb": 1}
    for _ in range(2):
        vllm_utils.sync_weights(engine, model)
    assert pushes == [(urls, False), (urls, True)]
    engine["lost"] = {urls[1]: 0.0}  # restarted: it answers again
    monkeypatch.setattr(vllm_utils, "_answers", lambda url: True)
    monkeypatch.setattr(vllm_utils, "check_server", lambda url, model: {"url": url})
    monkeypatch.setattr(vllm_utils, "check_same_model", lambda *a: None)
    vllm_utils.sync_weights(engine, model)
    vllm_utils.sync_weights(engine, model)
    assert pushes[2:] == [(urls, False), (urls, True)] and engine["lost"] == {}


# The field names of vLLM 0.33.0's chat classes (vllm/entrypoints/openai/chat_completion/protocol.py of `pip download
# --no-deps vllm==0.33.0`, read with ast), the newest supported version; 0.26's are the installed ones.
CHAT_FIELDS_0_33 = {
    "ChatCompletionRequest": """_DEFAULT_SAMPLING_PARAMS _grammar_from_parser add_generation_prompt add_special_tokens
        allowed_token_ids bad_words cache_salt chat_template chat_template_kwargs continue_final_message documents
        ec_transfer_params echo frequency_penalty ignore_eos include_reasoning include_stop_str_in_output
        kv_transfer_params length_penalty logit_bias logprob_token_ids logprobs max_completion_tokens max_tokens
        media_io_kwargs messages min_p min_tokens mm_payload mm_processor_kwargs model n parallel_tool_calls
        presence_penalty priority prompt_logprobs reasoning_effort repetition_detection repetition_penalty request_id
        response_format return_mm_kwargs return_prompt_text return_token_ids return_token_offsets
        return_tokens_as_token_ids return_weight_versions routed_experts_prompt_start seed session_id
        skip_special_tokens spaces_between_special_tokens stop stop_token_ids stream stream_interval stream_options
        structured_outputs temperature thinking_token_budget tool_choice tools top_k top_logprobs top_p
        truncate_prompt_tokens truncation_side use_beam_search user vllm_xargs watermarking""",
    "ChatCompletionResponse": """id object created model choices service_tier system_fingerprint usage prompt_logprobs
        prompt_token_ids prompt_text kv_transfer_params ec_transfer_params metrics""",
    "ChatCompletionResponseChoice": "index message logprobs finish_reason stop_reason token_ids routed_experts "
    "weight_versions",
    "ChatCompletionLogProbsContent": "token logprob bytes top_logprobs",  # (with ChatCompletionLogProb's)
}


@pytest.mark.parametrize("version", ["0.26", "0.33"])
def test_vision_chat_request_and_answer_fields_exist_in_each_supported_version(vlm, version):
    """Every key of the request is a field of that version's ChatCompletionRequest (pydantic would ignore an unknown
    one, silently), and every key parse_completions and the prompt check read is a field of its answer's classes."""
    from vllm.entrypoints.openai.chat_completion import protocol

    fields = {name: set(names.split()) for name, names in CHAT_FIELDS_0_33.items()}
    if version == "0.26":
        fields = {name: set(getattr(protocol, name).model_fields) for name in CHAT_FIELDS_0_33}
    _, processor, prompt_set = vlm
    prompt = grpo.vllm_images(types.SimpleNamespace(processor=processor), prompt_set, [0])[0]
    fields_ = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "max_tokens": 8}
    assert set(vllm_utils.chat_request("m", prompt, 2, fields_)) <= fields["ChatCompletionRequest"]
    assert {"choices", "prompt_token_ids"} <= fields["ChatCompletionResponse"]
    assert {"index", "token_ids", "logprobs"} <= fields["ChatCompletionResponseChoice"]
    assert "logprob" in fields["ChatCompletionLogProbsContent"]


class ImageOracle:
    """Stands in for vLLM (vllm_utils' start / generate / sync_weights / sleep) behind a script: for each prompt it
    expands the ImagePrompt with vLLM 0.26's own multimodal processor and checks that the ids are the trainer's, then
    answers with the colour its image shows (the nearest of make_tiny_vlm's colours to the mean pixel). So every
    reward is 1 exactly when each prompt reached vLLM with its own row's image, in training and in evaluation."""

    def __init__(self, monkeypatch, vlm):
        from transformers import AutoTokenizer
        from vllm.config import ModelConfig
        from vllm.multimodal import MULTIMODAL_REGISTRY

        self.renderer = MULTIMODAL_REGISTRY.create_processor(ModelConfig(model=str(vlm), tokenizer=str(vlm)))
        self.tokenizer, self.calls = AutoTokenizer.from_pretrained(vlm), []
        for name in ("start", "generate", "sync_weights", "sleep"):
            monkeypatch.setattr(vllm_utils, name, getattr(self, name))
        monkeypatch.setattr(vllm_utils, "setup_problems", lambda: [])

    def start(self, args, model_path, max_prompt_length, max_images=0):
        self.max_images = max_images
        return {"mode": "colocate"}

    def generate(self, engine, prompt_ids, n=None, temperature=None, images=None):
        from vllm.multimodal.processing.context import TimingContext
        from vllm.multimodal.processing.inputs import ProcessorInputs

        from make_tiny_vlm import COLOURS

        completions = []
        for ids, prompt in zip(prompt_ids, images, strict=True):
            items = self.renderer.info.parse_mm_data({"image": prompt.images})
            expanded = self.renderer.apply(
                ProcessorInputs(prompt=prompt.token_ids, mm_data_items=items), TimingContext()
            )
            assert expanded["prompt_token_ids"] == ids
            mean = torch.from_numpy(np.asarray(prompt.images[0])).reshape(-1, 3).float().mean(0)
            colour = min(COLOURS, key=lambda c: (torch.tensor(COLOURS[c], dtype=torch.float) - mean).norm())
            answer = self.tokenizer(f" {colour}.", add_special_tokens=False)["input_ids"] + [
                self.tokenizer.eos_token_id
            ]
            completions += [answer] * (n or 2)
        self.calls.append(len(prompt_ids))
        return completions, [[-1.0] * len(c) for c in completions]

    def sync_weights(self, engine, model):
        pass

    def sleep(self, engine):
        pass


@pytest.mark.parametrize("script", ["grpo.py", "rloo.py", "online_dpo.py"])
def test_vision_each_prompt_reaches_vllm_with_its_own_image(monkeypatch, tmp_path, script):
    """The scripts themselves, with --use-vllm: every round's and every evaluation's prompts reach vLLM with their own
    rows' images (the oracle above answers from the image; the reward compares with the row's answer), and vLLM's
    expansion of each is the trainer's prompt ids."""
    import runpy
    import sys

    from grpo_cli import ROOT, read_metrics

    make_tiny_vlm(tmp_path / "vlm")
    train, held = make_colour_dataset(tmp_path / "train", 8, seed=0), make_colour_dataset(tmp_path / "held", 4, seed=1)
    oracle = ImageOracle(monkeypatch, tmp_path / "vlm")
    args = ["--model-name-or-path", tmp_path / "vlm", "--dataset-name", train, "--prompt-column", "prompt"]
    args += ["--reward-funcs", "first_word_reward", "--no-bf16", "--max-completion-length", 4, "--max-steps", 2]
    args += ["--prompts-per-step", 4, "--num-generations", 2, "--use-vllm", "--eval-steps", 2, "--eval-dataset", held]
    args += ["--no-vllm-importance-sampling-correction"] if script != "online_dpo.py" else []
    monkeypatch.setattr(sys, "argv", [script, *map(str, args), "--output-dir", str(tmp_path / "run")])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    runpy.run_path(str(ROOT / script), run_name="__main__")
    metrics = read_metrics(tmp_path / "run")
    rewards = [
        m["reward"] if "reward" in m else m["objective/scores"] for m in metrics if "step" in m and m["step"] > 0
    ]
    assert rewards == [1.0, 1.0] and metrics[-1]["eval/reward"] == 1.0 and metrics[0]["eval/reward"] == 1.0
    assert oracle.max_images == 1 and len(oracle.calls) >= 4  # 2 rounds, evaluations at steps 0 and 2
