"""CPU tests of vllm_utils.py: the request sent to /v1/completions, how its response is read back, the weight
metadata, and the errors a misconfigured server gets. A small HTTP server on 127.0.0.1 plays `vllm serve`."""

import contextlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import requests
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import vllm_utils


def _args(**fields):
    """The scripts' Args (grpo.py's defaults), with `fields` changed: what vllm_utils.start and check_args read."""
    import grpo

    return SimpleNamespace(**{**vars(grpo.Args()), **fields})


def test_completions_request_sends_every_sampling_field():
    args = SimpleNamespace(
        temperature=0.7, top_p=0.9, top_k=0, min_p=0.05, repetition_penalty=1.1, max_completion_length=64
    )
    fields = vllm_utils.sampling_fields(args)
    body = vllm_utils.completions_request("m", [[1, 2, 3], [4, 5]], 4, fields)
    assert body["prompt"] == [[1, 2, 3], [4, 5]] and body["n"] == 4 and body["model"] == "m"
    # a server fills any missing field from the model's generation_config.json, so none may be missing
    assert {k: body[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")} == {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "max_tokens": 64,
    }
    assert body["logprobs"] == 0 and body["return_token_ids"] is True
    assert json.loads(json.dumps(body)) == body  # JSON-serialisable as is


def _response(choices):
    return {
        "choices": [
            {"index": i, "token_ids": ids, "logprobs": {"token_logprobs": lps}, "finish_reason": fr}
            for i, (ids, lps, fr) in enumerate(choices)
        ]
    }


def test_parse_completions_prompt_major_eos_last_and_alignment():
    eos = 2
    # 2 prompts x n=2; choice k belongs to prompt k // 2; a stop on EOS keeps the EOS as the last token
    response = _response(
        [
            ([5, 6, eos], [-0.1, -0.2, -0.3], "stop"),
            ([7], [-1.0], "length"),
            ([8, eos], [-0.5, None], "stop"),
            ([9, 9, 9], [-0.1, -0.1, -0.1], "length"),
        ]
    )
    response["choices"] = response["choices"][::-1]  # order on the wire does not matter: `index` does
    ids, lps = vllm_utils.parse_completions(response, num_prompts=2, n=2)
    assert ids == [[5, 6, eos], [7], [8, eos], [9, 9, 9]]
    assert lps[0] == [-0.1, -0.2, -0.3] and lps[2] == [-0.5, None]
    assert all(len(i) == len(lp) for i, lp in zip(ids, lps))


def test_parse_completions_rejects_wrong_count_and_misaligned_logprobs():
    with pytest.raises(RuntimeError, match="3 completions for 2 prompts x 2"):
        vllm_utils.parse_completions(_response([([1], [-1.0], "stop")] * 3), 2, 2)
    with pytest.raises(RuntimeError, match="1 log-probs for 2 tokens"):
        vllm_utils.parse_completions(_response([([1, 2], [-1.0], "stop")]), 1, 1)


def test_weight_metadata_describes_exactly_the_streamed_tensors():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    meta = vllm_utils.weight_metadata(model, torch.bfloat16)  # known before any tensor is gathered
    weights = list(vllm_utils.named_weights(model, torch.bfloat16))
    params = list(model.named_parameters())
    assert meta["names"] == [n for n, _ in params]  # every parameter, in order, HF checkpoint names
    assert "lm_head.weight" not in meta["names"]  # tied: the shared tensor is sent once, as embed_tokens
    assert meta["shapes"] == [list(p.shape) for _, p in params]
    assert meta["dtype_names"] == ["bfloat16"] * len(params)
    for (_name, tensor), dtype_name, shape in zip(weights, meta["dtype_names"], meta["shapes"]):
        assert getattr(torch, dtype_name) == tensor.dtype and list(tensor.shape) == shape
    assert torch.equal(weights[0][1], params[0][1].detach().to(torch.bfloat16))
    # packed sizes the receiver derives from the metadata equal the bytes the sender packs
    sent = sum(t.numel() * t.element_size() for _, t in weights)
    derived = sum(
        torch.Size(s).numel() * getattr(torch, d).itemsize for s, d in zip(meta["shapes"], meta["dtype_names"])
    )
    assert sent == derived


class FakeServer:
    """Plays `vllm serve`: answers each path from `routes`, {path: (status, json body)}, where a route may also be a
    list of answers (one per call, the last one repeats) or a function of the request's JSON body returning one.
    Every request is recorded in `calls` as (path, query string, JSON body)."""

    def __init__(self, routes):
        calls = self.calls = []

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                path, _, query = self.path.partition("?")
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                calls.append((path, query, body))
                route = routes.get(path, (404, {"detail": "Not Found"}))
                if isinstance(route, list):
                    route = route.pop(0) if len(route) > 1 else route[0]
                status, answer = route(body) if callable(route) else route
                data = json.dumps(answer).encode()
                with contextlib.suppress(OSError):  # a client that gave up (a probe's timeout) has closed the socket
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        # poll_interval: how often serve_forever checks for shutdown(); its default, 0.5 s, was each test's teardown
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def paths(self):
        return [path for path, _, _ in self.calls]

    def close(self):
        self.httpd.shutdown()


@pytest.fixture
def serve():
    """serve(routes) -> a running FakeServer, closed after the test."""
    servers = []
    yield lambda routes: servers.append(FakeServer(routes)) or servers[-1]
    for server in servers:
        server.close()


def _routes(weight_transfer="nccl", version=None, logprobs_mode="processed_logprobs", model="m"):
    import vllm

    model_config = {"model": model, "logprobs_mode": logprobs_mode}
    return {
        "/health": (200, {}),
        "/version": (200, {"version": version or vllm.__version__}),
        "/is_paused": (200, {"is_paused": False}),
        "/is_sleeping": (200, {"is_sleeping": False}),
        "/get_world_size": (200, {"world_size": 1}),
        "/v1/models": (200, {"data": [{"id": "served-model", "max_model_len": 2048}]}),
        "/server_info": (
            200,
            {
                "vllm_config": {
                    "weight_transfer_config": weight_transfer and {"backend": weight_transfer},
                    "model_config": model_config,
                }
            },
        ),
    }


def test_check_server_accepts_a_correct_server(serve):
    server = serve(_routes(model="/models/m"))
    info = vllm_utils.check_server(server.url, "m")
    assert (info["model_id"], info["max_model_len"], info["model_config"]["model"]) == (
        "served-model",
        2048,
        "/models/m",
    )
    assert "/is_paused" in server.paths() and "/resume" not in server.paths()  # probed, and not paused


@pytest.mark.parametrize(
    "routes, message",
    [
        ({**_routes(), "/server_info": (404, {})}, "VLLM_SERVER_DEV_MODE=1"),
        (_routes(weight_transfer=None), "--weight-transfer-config"),
        (_routes(version="0.25.1"), "vLLM 0.25.1, outside the supported range 0.26 to 0.33"),
        (_routes(version="0.34.0"), "vLLM 0.34.0, outside the supported range 0.26 to 0.33"),
        (_routes(logprobs_mode="raw_logprobs"), "returns raw_logprobs"),
    ],
)
def test_check_server_names_the_problem_and_the_fix(serve, routes, message):
    with pytest.raises(RuntimeError, match=message) as error:
        vllm_utils.check_server(serve(routes).url, "my/model")
    if "range" not in message:
        assert "vllm serve my/model" in str(error.value)  # the exact command to restart it


@pytest.mark.parametrize("version", ["0.26.0", "0.26.1", "0.27.1", "0.28.0", "0.30.2", "0.33.0", "0.33.1.dev7+g1a2b"])
def test_any_server_version_in_the_tested_range_is_accepted_whatever_the_trainer_has(serve, version):
    """The trainer (0.26.0 here) used to demand the server's exact version; 0.26.1 or 0.33 must now be accepted."""
    assert vllm_utils.check_server(serve(_routes(version=version)).url, "m")["version"] == version


@pytest.mark.parametrize(
    "version, ok", [("0.26.0", True), ("0.33.9", True), ("0.25.9", False), ("0.34.0", False), ("1.0.0", False)]
)
def test_vllm_version_refuses_outside_the_range_and_names_it(version, ok):
    if ok:
        assert vllm_utils.vllm_version(version, who="the trainer") == tuple(int(x) for x in version.split(".")[:2])
    else:
        with pytest.raises(
            RuntimeError, match=f"the trainer runs vLLM {version}, outside the supported range 0.26 to 0.33"
        ):
            vllm_utils.vllm_version(version, who="the trainer")


def test_a_server_left_paused_by_a_dead_trainer_is_resumed(serve):
    server = serve({**_routes(), "/is_paused": (200, {"is_paused": True}), "/resume": (200, {"status": "resumed"})})
    vllm_utils.check_server(server.url, "m")
    assert server.paths()[-4:] == ["/resume", "/is_sleeping", "/v1/models", "/get_world_size"]


def test_an_engine_stuck_behind_a_healthy_api_is_reported_within_seconds(serve):
    """/health answers, but the engine is blocked (in an NCCL receive whose trainer died): the probe says so at once
    instead of the next call waiting out a long read timeout."""
    server = serve({**_routes(), "/is_paused": lambda body: time.sleep(20) or (200, {"is_paused": False})})
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="answers /health but its engine not /is_paused within 1 s") as error:
        vllm_utils.probe_server(server.url, "my/model", timeout=1)
    assert time.perf_counter() - t0 < 5 and "vllm serve my/model" in str(error.value)


def test_unreachable_server_error_prints_the_serve_command():
    with pytest.raises(ConnectionError) as error:
        vllm_utils.wait_for_server("http://127.0.0.1:9", timeout=0, model="Qwen/Qwen2.5-0.5B-Instruct")
    message = str(error.value)
    assert "--vllm-server-timeout" in message
    assert (
        "VLLM_SERVER_DEV_MODE=1 vllm serve Qwen/Qwen2.5-0.5B-Instruct --host 127.0.0.1 --port 9 "
        '--weight-transfer-config \'{"backend": "nccl"}\' --logprobs-mode processed_logprobs --max-logprobs -1 '
        "--api-server-count 4"
    ) in message


def test_weight_endpoint_failure_is_raised_not_retried(serve):
    server = serve({"/update_weights": (500, {"error": "bad metadata"})})
    with pytest.raises(RuntimeError, match="500.*bad metadata"):
        vllm_utils._post(server.url, "/update_weights", 5, json={})
    assert server.paths() == ["/update_weights"]


class FakeLLM:
    """Records the calls a colocated engine gets (and whether `model` still held gradients when vLLM woke up);
    generates one token per prompt and sample."""

    def __init__(self, model=None):
        self.calls, self.model = [], model

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags):
        holds_grads = any(p.grad is not None for p in self.model.parameters())
        self.calls.append(("wake_up", tuple(tags), "with gradients" if holds_grads else "without gradients"))

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append((method, len(list(kwargs["weights_iterator"])), kwargs["is_checkpoint_format"]))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def generate(self, prompts, params, use_tqdm=False):
        self.calls.append(("generate", len(prompts)))
        from vllm.logprobs import Logprob, create_sample_logprobs

        logprobs = create_sample_logprobs(params.flat_logprobs)  # as vLLM's engine builds them
        logprobs.append({7: Logprob(logprob=-0.5, rank=1, decoded_token=None)})
        sample = SimpleNamespace(token_ids=[7], logprobs=logprobs)
        return [SimpleNamespace(outputs=[sample] * params.n) for _ in prompts]


def _tiny_llama(**overrides):
    config = dict(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return LlamaForCausalLM(LlamaConfig(**{**config, **overrides}))


def test_colocate_sleep_mode_order(monkeypatch):
    """generate -> sleep (training) -> sync: drop gradients, empty the allocator cache, wake weights, reload all through
    vLLM's reload path (post-load processing included), reset cache -> generate: empty the cache, wake the KV cache."""
    model = _tiny_llama()
    llm = FakeLLM(model)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: llm.calls.append(("empty_cache",)))
    engine = {
        "mode": "colocate",
        "sleep": True,
        "llm": llm,
        "tp_group": None,
        "n": 2,
        "fields": {
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "max_tokens": 4,
        },
    }
    ids, lps = vllm_utils.generate(engine, [[1, 2], [3]])
    assert ids == [[7]] * 4 and lps == [[-0.5]] * 4
    vllm_utils.sleep(engine)
    vllm_utils.sleep(engine)  # a second call is a no-op
    with pytest.raises(RuntimeError, match="call sync_weights first"):  # level 2 discarded the weights
        vllm_utils.generate(engine, [[1]])
    model(torch.tensor([[1, 2]]), labels=torch.tensor([[1, 2]])).loss.backward()  # the training step's gradients
    vllm_utils.sync_weights(engine, model)
    vllm_utils.generate(engine, [[1]])
    n_params = len(list(model.parameters()))
    assert llm.calls == [
        ("generate", 2),
        ("sleep", 2),
        ("empty_cache",),
        ("wake_up", ("weights",), "without gradients"),
        ("reload_weights", n_params, True),
        ("reset_prefix_cache",),
        ("empty_cache",),
        ("wake_up", ("kv_cache",), "without gradients"),
        ("generate", 1),
    ]


def test_colocate_without_sleep_mode_reloads_and_keeps_gradients():
    model = _tiny_llama()
    llm = FakeLLM(model)
    model(torch.tensor([[1, 2]]), labels=torch.tensor([[1, 2]])).loss.backward()
    vllm_utils.sync_weights({"mode": "colocate", "sleep": False, "llm": llm, "tp_group": None}, model)
    assert llm.calls == [("reload_weights", len(list(model.parameters())), True), ("reset_prefix_cache",)]
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("nvls, tp, fused", [("0", 2, False), ("0", 1, True), (None, 2, True)])
def test_colocate_engine_keeps_multicast_off_where_the_host_turned_it_off(monkeypatch, nvls, tp, fused):
    """A tensor-parallel engine on a host with NCCL_NVLS_ENABLE=0 must not build FlashInfer's multicast all-reduce."""
    import vllm

    seen = {}
    monkeypatch.setattr(vllm, "LLM", lambda **kwargs: seen.update(kwargs))
    for key in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WORLD_SIZE", str(tp))
    if nvls is None:
        monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    else:
        monkeypatch.setenv("NCCL_NVLS_ENABLE", nvls)
    vllm_utils.colocate_engine("model", tensor_parallel_size=tp)
    assert seen["distributed_executor_backend"] == "external_launcher" and seen["tensor_parallel_size"] == tp
    assert ("compilation_config" not in seen) == fused
    if not fused:
        assert seen["compilation_config"] == {"pass_config": {"fuse_allreduce_rms": False}}


def test_every_rank_generates_through_the_server_and_only_rank_0_joins_the_weight_sync(monkeypatch):
    """Under torchrun, ranks other than 0 skip the NCCL group but must still know where to send their prompts. The group
    is formed at the first sync_weights (after the model check), on a free port unless --vllm-group-port is given."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(vllm_utils, "wait_for_server", lambda *a, **k: None)
    server = {"model_id": "served-model", "max_model_len": 2048, "version": "0.26.0", "model_config": {}}
    server["backend"] = "nccl"
    monkeypatch.setattr(vllm_utils, "check_server", lambda *a: server)
    monkeypatch.setattr(vllm_utils, "check_transport", lambda *a: None)
    monkeypatch.setattr(vllm_utils, "check_same_model", lambda *a: None)
    joined, synced, sent = [], [], []
    monkeypatch.setattr(vllm_utils, "server_init_weight_sync", lambda *a, **k: joined.append((a, k)) or "group")
    monkeypatch.setattr(vllm_utils, "server_sync_weights", lambda *a, **k: synced.append((a, k)))
    monkeypatch.setattr(
        vllm_utils,
        "server_generate",
        lambda url, model_id, prompts, n, fields, chunk, timeout, lost, images: (
            sent.append((url, chunk, timeout)) or ([[1]], [[-0.1]])
        ),
    )
    args = _args(
        model_name_or_path="m",
        vllm_mode="server",
        vllm_server_host="10.0.0.7",
        vllm_server_port=8001,
        vllm_server_timeout=1,
        num_generations=1,
        max_completion_length=8,
        vllm_generation_chunk_size=3,
    )
    model = _tiny_llama()
    for rank in (1, 0):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setattr("vllm.utils.network_utils.get_ip", lambda: "10.0.0.1")
        engine = vllm_utils.start(args, "m", max_prompt_length=10)
        assert vllm_utils.generate(engine, [[5, 6]]) == ([[1]], [[-0.1]])
        vllm_utils.sync_weights(engine, model)
        vllm_utils.sync_weights(engine, model)
        assert ("group" in engine) == (rank == 0)
    assert sent == [(["http://10.0.0.7:8001"], 3, 1800.0)] * 2  # chunk size and timeout from Args
    assert len(joined) == 1 and joined[0][0] == ("http://10.0.0.7:8001", None, "10.0.0.1")  # once, rank 0, free port
    assert joined[0][1] == {"version": "0.26.0", "timeout": 300.0, "buffer_bytes": 1 << 30, "name": "m"}
    assert len(synced) == 2 and synced[0][0] == ("http://10.0.0.7:8001", "group", model)


def test_a_resumed_run_tells_to_serve_its_base_model_not_its_checkpoint():
    """A full-model resume loads runs/.../checkpoint-N, but the server is told to serve --model-name-or-path: the
    checkpoint may be deleted by --save-total-limit, and the server gets the run's weights at once anyway."""
    args = _args(model_name_or_path="base/model", vllm_mode="server", vllm_server_host="127.0.0.1")
    args.__dict__.update(vllm_server_port=vllm_utils.free_port(), vllm_server_timeout=0.1, max_completion_length=8)
    with pytest.raises(ConnectionError) as error:
        vllm_utils.start(args, "runs/grpo__1__1/checkpoint-3", max_prompt_length=10)
    assert "vllm serve base/model " in str(error.value) and "checkpoint-3" not in str(error.value)


def _sleep_then(seconds, result=None, error=None):
    def work():
        time.sleep(seconds)
        if error:
            raise error
        return result

    return work


@pytest.mark.parametrize(
    "nccl, http, expected, within",
    [
        (_sleep_then(0.1, result="group"), _sleep_then(0.2), "group", 5),  # both succeed: the NCCL side's result
        (_sleep_then(0, error=OSError("port 51216 in use")), _sleep_then(30), OSError, 5),  # NCCL fails: raised at once
        (
            _sleep_then(0, error=OSError("port 51216 in use")),
            _sleep_then(0.1, error=TimeoutError("read timed out")),
            OSError,
            5,
        ),
        (
            _sleep_then(30),
            _sleep_then(0, error=RuntimeError("POST /update_weights failed")),
            RuntimeError,
            5,
        ),  # HTTP fails
        (_sleep_then(30), _sleep_then(0), TimeoutError, 5),  # the server finished, the trainer's side never does
    ],
)
def test_run_beside_raises_the_first_failure_and_prefers_the_nccl_cause(nccl, http, expected, within):
    t0 = time.perf_counter()
    if isinstance(expected, str):
        assert vllm_utils._run_beside(nccl, http, timeout=0.5) == expected
    else:
        with pytest.raises(expected):
            vllm_utils._run_beside(nccl, http, timeout=0.5)
    assert time.perf_counter() - t0 < within


# ------------------------------------------------------------------------------------------------------------------
# The weight-transfer messages of each vLLM version

INIT = {"master_address": "10.0.0.1", "master_port": 40000, "rank_offset": 1, "world_size": 3}
META = {"names": ["a.weight"], "dtype_names": ["bfloat16"], "shapes": [[4, 2]]}
PACKED = {"packed": True, "packed_buffer_size_bytes": 1 << 20, "packed_num_buffers": 2}


def test_the_installed_vllm_026_parses_the_messages_sent_to_a_026_server():
    """vLLM 0.26's own parsers (WeightTransferEngine.parse_init_info / parse_update_info) take the messages, with the
    packed geometry the trainer broadcasts with; 0.28's format would be rejected by them."""
    import vllm
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    assert vllm.__version__.startswith("0.26."), "this test reads the installed vLLM, pinned to 0.26 (requirements.txt)"
    parser = SimpleNamespace(
        init_info_cls=NCCLWeightTransferEngine.init_info_cls, update_info_cls=NCCLWeightTransferEngine.update_info_cls
    )
    init, update = vllm_utils.weight_sync_messages("0.26.0", INIT, META, 1 << 20)
    init = NCCLWeightTransferEngine.parse_init_info(parser, init)
    update = NCCLWeightTransferEngine.parse_update_info(parser, update)
    assert (init.master_address, init.master_port, init.rank_offset, init.world_size) == ("10.0.0.1", 40000, 1, 3)
    assert (update.names, update.shapes, update.packed, update.packed_buffer_size_bytes, update.packed_num_buffers) == (
        ["a.weight"],
        [[4, 2]],
        True,
        1 << 20,
        vllm_utils.PACKED_NUM_BUFFERS,
    )
    with pytest.raises(ValueError, match="Invalid init_info"):  # what a 0.28-style message gets from a 0.26 server
        NCCLWeightTransferEngine.parse_init_info(parser, vllm_utils.weight_sync_messages("0.28.0", INIT, META)[0])


# Fields of the message dataclasses in each vLLM wheel (pip download --no-deps vllm==X, read with unzip):
#   init:   vllm/distributed/weight_transfer/nccl_common.py, class NCCLWeightTransferInitInfo
#   update: vllm/distributed/weight_transfer/nccl_engine.py, class NCCLWeightTransferUpdateInfo
# as (fields without a default, fields with one). 0.29 to 0.32 have 0.28's update fields, and 0.28's (0.29) or
# 0.33's (0.30 to 0.32) init fields.
WHEEL_FIELDS = {
    "0.27.1": {
        "init": ({"master_address", "master_port", "rank_offset", "world_size"}, set()),
        "update": ({"names", "dtype_names", "shapes"}, set(PACKED)),
    },
    "0.28.0": {
        "init": ({"master_address", "master_port", "rank_offset", "world_size"}, set(PACKED)),
        "update": ({"names", "dtype_names", "shapes"}, set()),
    },
    # 0.33.0's init is kw_only; its __post_init__ wants master_address + master_port or nccl_unique_id_b64
    "0.33.0": {
        "init": ({"rank_offset", "world_size"}, {"master_address", "master_port", "nccl_unique_id_b64", *PACKED}),
        "update": (set(), {"names", "dtype_names", "shapes"}),
    },
}


@pytest.mark.parametrize("version", WHEEL_FIELDS)
def test_messages_have_exactly_the_fields_of_that_versions_classes(version):
    """Field by field against the wheel's classes: nothing they lack (an unknown key is "Invalid init_info/update_info",
    raised after /start_weight_update for the update), nothing required missing, and the packed geometry where that
    version reads it (a 0.28+ worker whose init lacks it would receive unpacked while the trainer sends packed)."""
    messages = dict(zip(("init", "update"), vllm_utils.weight_sync_messages(version, INIT, META, 1 << 20)))
    for kind, message in messages.items():
        required, optional = WHEEL_FIELDS[version][kind]
        assert required <= message.keys() <= required | optional, (version, kind, sorted(message))
    packed_in = "init" if version >= "0.28" else "update"
    assert {key: messages[packed_in][key] for key in PACKED} == PACKED
    assert messages["init"]["master_address"] and messages["init"]["master_port"]  # 0.33: the TCP rendezvous


def test_server_init_joins_on_a_free_port_unless_one_is_given(serve, monkeypatch):
    """Two runs on one host each get a port of their own (the old fixed 51216 collided); the init message follows the
    server's version."""
    from vllm.distributed.weight_transfer import nccl_common

    trainer_sides = []
    monkeypatch.setattr(nccl_common, "trainer_init", lambda info: trainer_sides.append(info) or "group")
    server = serve({"/get_world_size": (200, {"world_size": 2}), "/init_weight_transfer_engine": (200, {})})
    for port, version in ((None, "0.26.0"), (None, "0.28.0"), (51216, "0.26.0")):
        assert vllm_utils.server_init_weight_sync(server.url, port, "127.0.0.1", version, 1 << 20, timeout=5) == "group"
    sent = [body["init_info"] for path, _, body in server.calls if path == "/init_weight_transfer_engine"]
    assert sent == trainer_sides and [info["world_size"] for info in sent] == [3, 3, 3]
    assert all(isinstance(info["master_port"], int) for info in sent) and sent[2]["master_port"] == 51216
    assert "packed" not in sent[0] and sent[1]["packed"] is True


# ------------------------------------------------------------------------------------------------------------------
# A weight update against a server: order, pause, failures


def _sync_routes(**overrides):
    ok = (200, {})
    routes = {
        "/is_paused": (200, {"is_paused": False}),
        "/pause": ok,
        "/resume": ok,
        "/start_weight_update": ok,
        "/update_weights": ok,
        "/finish_weight_update": ok,
        "/reset_prefix_cache": (200, {"success": True}),
    }
    return {**routes, **overrides}


@pytest.fixture
def no_nccl(monkeypatch):
    """The trainer's NCCL side of an update, replaced by a record of its calls."""
    from vllm.distributed.weight_transfer import packed_tensor

    sent = []
    producer = lambda weights, group, src, post_iter, size, buffers: sent.append(
        (len(list(weights)), group, size, buffers)
    )  # noqa: E731
    monkeypatch.setattr(packed_tensor, "packed_nccl_broadcast_producer", producer)
    return sent


@pytest.mark.parametrize("version, packed_in_update", [("0.26.0", True), ("0.27.1", True), ("0.33.0", False)])
def test_an_update_pauses_the_server_waiting_for_running_requests_and_resumes_it(
    serve, no_nccl, version, packed_in_update
):
    server = serve(_sync_routes())
    vllm_utils.server_sync_weights(server.url, "group", _tiny_llama(), version, 1 << 20, timeout=5)
    assert server.paths() == [
        "/is_paused",
        "/pause",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/reset_prefix_cache",
        "/resume",
    ]
    assert server.calls[1][1] == "mode=wait"  # never abort: running requests finish on the old weights
    update_info = server.calls[3][2]["update_info"]
    assert ("packed" in update_info) == packed_in_update
    assert no_nccl == [(len(update_info["names"]), "group", 1 << 20, vllm_utils.PACKED_NUM_BUFFERS)]  # every weight


def _vllm_error(message):
    # what vLLM's API server answers when a worker raised (entrypoints/serve/utils/server_utils.py, exception_handler)
    return 500, {
        "error": {"message": f"Call to update_weights method failed: {message}", "type": "InternalServerError"}
    }


@pytest.mark.parametrize(
    "finish_answers, restore_calls",
    [
        # vLLM ended the update itself when /update_weights raised: a new start keeps the waiting layers, finish restores
        (
            [_vllm_error("finish_weight_update called without a matching start_weight_update."), (200, {})],
            ["/finish_weight_update", "/start_weight_update", "/finish_weight_update"],
        ),
        ([(200, {})], ["/finish_weight_update"]),  # the update was still open: finishing it restores
    ],
)
def test_a_failed_update_restores_the_server_and_resumes_it(serve, no_nccl, finish_answers, restore_calls):
    """/update_weights fails (here: a message the server rejects) after /start_weight_update moved the layers to the
    meta device; the trainer finishes the update so that they get their weights back, resumes, then raises."""
    server = serve(
        _sync_routes(
            **{
                "/update_weights": _vllm_error("Invalid update_info for NCCLWeightTransferEngine"),
                "/finish_weight_update": finish_answers,
            }
        )
    )
    with pytest.raises(RuntimeError, match="(?s)Invalid update_info.*The server at .* was restored"):
        vllm_utils.server_sync_weights(
            server.url, "group", _tiny_llama(), "0.26.0", 1 << 20, timeout=5, name="my/model"
        )
    paths = server.paths()
    assert paths[:4] == ["/is_paused", "/pause", "/start_weight_update", "/update_weights"]
    assert paths[4:] == [*restore_calls, "/resume"]


def test_a_server_that_cannot_be_restored_is_reported_with_the_restart_command(serve, no_nccl):
    broken = _vllm_error("CUDA error")
    server = serve(
        _sync_routes(
            **{"/update_weights": broken, "/finish_weight_update": broken, "/start_weight_update": [(200, {}), broken]}
        )
    )
    with pytest.raises(RuntimeError, match="could not be restored") as error:
        vllm_utils.server_sync_weights(
            server.url, "group", _tiny_llama(), "0.26.0", 1 << 20, timeout=5, name="my/model"
        )
    assert "vllm serve my/model" in str(error.value) and server.paths()[-1] == "/resume"


_ACTIVE = _vllm_error(
    "start_weight_update called while a weight update is already active. Call finish_weight_update first."
)


@pytest.mark.parametrize("backend", ["nccl", "ipc"])
def test_an_update_left_active_by_a_dead_trainer_is_finished_and_the_push_goes_on(serve, no_nccl, monkeypatch, backend):
    """A trainer killed between /start_weight_update and its end leaves the update active. Where the server's engine
    still answers, the next trainer finishes that update (every layer gets its weights back), starts its own and
    pushes, instead of refusing."""
    ipc, model = FakeIPC(monkeypatch), _tiny_llama()
    update = ipc.update_weights if backend == "ipc" else (200, {})
    server = serve(_sync_routes(**{"/start_weight_update": [_ACTIVE, (200, {})], "/update_weights": update}))
    if backend == "nccl":
        vllm_utils.server_sync_weights(server.url, "group", model, "0.26.0", 1 << 20, timeout=5, name="my/m")
        assert len(no_nccl) == 1  # the broadcast ran
    else:
        vllm_utils.server_sync_weights_ipc(server.url, model, "0.26.0", 1 << 20, timeout=5, name="my/m")
        assert ipc.received.keys() == dict(vllm_utils.named_weights(model)).keys()  # every weight arrived
    paths, repaired = server.paths(), ["/start_weight_update", "/finish_weight_update", "/start_weight_update"]
    assert paths[:5] == ["/is_paused", "/pause", *repaired]  # the dead trainer's update finished before this one
    assert "/update_weights" in paths[5:] and paths[-3:] == ["/finish_weight_update", "/reset_prefix_cache", "/resume"]


@pytest.mark.parametrize("backend", ["nccl", "ipc"])
def test_an_update_that_stays_active_is_explained(serve, no_nccl, backend):
    """The repair fails (the update is still active after /finish_weight_update): the trainer is told why and how to
    recover instead of a bare 500, and nothing is sent. The restart command is the one of this server: its port and
    its weight transfer (the first GPU run printed port 8000 and NCCL for an IPC server on port 8041)."""
    server = serve(_sync_routes(**{"/start_weight_update": _ACTIVE}))
    with pytest.raises(RuntimeError, match="a previous trainer died inside a weight update") as error:
        if backend == "nccl":
            vllm_utils.server_sync_weights(
                server.url, "group", _tiny_llama(), "0.26.0", 1 << 20, timeout=5, name="my/model"
            )
        else:  # nothing is exported before the start fails: no GPU needed
            vllm_utils.server_sync_weights_ipc(server.url, _tiny_llama(), "0.26.0", 1 << 20, timeout=5, name="my/model")
    port = server.url.rsplit(":", 1)[1]
    assert f"vllm serve my/model --host 127.0.0.1 --port {port} " in str(error.value)
    assert f'{{"backend": "{backend}"}}' in str(error.value)
    tried = ["/start_weight_update", "/finish_weight_update", "/start_weight_update"]  # one repair, then the refusal
    assert server.paths() == ["/is_paused", "/pause", *tried, "/resume"] and no_nccl == []


def test_a_stuck_server_is_reported_before_anything_is_sent(serve, no_nccl, monkeypatch):
    monkeypatch.setattr(vllm_utils.probe_server, "__defaults__", (1.0, "nccl"))
    server = serve(_sync_routes(**{"/is_paused": lambda body: time.sleep(20) or (200, {"is_paused": False})}))
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="answers /health but its engine not /is_paused"):
        vllm_utils.server_sync_weights(server.url, "group", _tiny_llama(), "0.26.0", 1 << 20, timeout=300)
    assert time.perf_counter() - t0 < 5 and server.paths() == ["/is_paused"] and no_nccl == []


def test_a_server_serving_another_model_is_refused_before_any_nccl(serve, monkeypatch, tmp_path):
    """The served model's config (read from /server_info's model path) describes other parameter shapes: the first
    sync names both models and the first parameter that differs, and neither joins NCCL nor starts an update."""
    _tiny_llama(hidden_size=32).config.save_pretrained(tmp_path / "served")
    _tiny_llama().config.save_pretrained(tmp_path / "same")
    joined = []
    monkeypatch.setattr(vllm_utils, "server_init_weight_sync", lambda *a, **k: joined.append(a) or "group")
    monkeypatch.setattr(vllm_utils, "server_sync_weights", lambda *a, **k: joined.append(a))
    for served, fails in (("served", True), ("same", False), ("not-on-this-machine", False)):
        server = serve(_routes(model=str(tmp_path / served)))
        engine = {
            "mode": "server",
            "base_url": server.url,
            "server": vllm_utils.check_server(server.url, "trainer/model"),
            "model": "trainer/model",
            "master_address": "127.0.0.1",
            **vllm_utils.SERVER_OPTIONS,
        }
        if fails:
            with pytest.raises(RuntimeError) as error:
                vllm_utils.sync_weights(engine, _tiny_llama())
            message = str(error.value)
            assert str(tmp_path / "served") in message and "trainer/model" in message
            assert "model.embed_tokens.weight is [64, 16] in the trainer, [64, 32] on the server" in message
            assert f"--port {server.url.rsplit(':', 1)[1]} " in message  # this server's port, not the default
            assert joined == [] and "/start_weight_update" not in server.paths()
        else:  # the same model, or one whose config cannot be read here (the check is skipped, with a message)
            joined.clear()
            vllm_utils.sync_weights(engine, _tiny_llama())
            assert len(joined) == 2  # NCCL group, then the update


def test_untrusted_server_info(serve, tmp_path):
    """/server_info is whatever answers on the server's port: one naming a model directory whose config maps to its
    own Python code (auto_map), and saying trust_remote_code, must not make the trainer import that code. Only the
    trainer's own --trust-remote-code runs it."""
    ran, model_dir = tmp_path / "ran", tmp_path / "evil"
    model_dir.mkdir()
    config = {"model_type": "evil", "auto_map": {"AutoConfig": "configuration_evil.EvilConfig"}}
    (model_dir / "config.json").write_text(json.dumps(config))
    (model_dir / "configuration_evil.py").write_text(
        f"open({str(ran)!r}, 'w').close()  # what any imported code may do\n"
        "from transformers import PretrainedConfig\n\n\nclass EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n"
    )
    routes = _routes(model=str(model_dir))
    routes["/server_info"][1]["vllm_config"]["model_config"]["trust_remote_code"] = True
    server = vllm_utils.check_server(serve(routes).url, "trainer/model")
    vllm_utils.check_same_model(server, _tiny_llama(), "trainer/model")  # the trainer's default: not trusted
    assert not ran.exists()
    vllm_utils.check_same_model(server, _tiny_llama(), "trainer/model", trust_remote_code=True)
    assert ran.exists()  # the trainer's flag, and it alone, runs the model's code


# ------------------------------------------------------------------------------------------------------------------
# Generation against a server


def _echo_completions(concurrency, delays):
    """/v1/completions that answers each prompt with its own first token, n times, after the next of `delays`;
    concurrency["max"] is the most requests it held at once."""
    lock = threading.Lock()

    def answer(body):
        with lock:
            concurrency["now"] = concurrency.get("now", 0) + 1
            concurrency["max"] = max(concurrency.get("max", 0), concurrency["now"])
            delay = delays.pop(0) if delays else 0
        time.sleep(delay)
        with lock:
            concurrency["now"] -= 1
        return 200, _response([([prompt[0]], [-0.5], "length") for prompt in body["prompt"] for _ in range(body["n"])])

    return answer


def test_server_generation_splits_a_round_into_concurrent_chunks_and_keeps_prompt_order(serve):
    """No response holds a whole round: 10 prompts x n=2 go out as requests of 3 prompts, all at once, and the rows come
    back in prompt order even though the later requests answer first."""
    concurrency = {}
    server = serve({"/v1/completions": _echo_completions(concurrency, delays=[0.6, 0.4, 0.2, 0.0])})
    prompts = [[100 + i, 1] for i in range(10)]
    ids, lps = vllm_utils.server_generate(server.url, "m", prompts, 2, {"max_tokens": 1}, chunk_size=3, timeout=10)
    assert ids == [[100 + i] for i in range(10) for _ in range(2)] and lps == [[-0.5]] * 20
    assert sorted(len(body["prompt"]) for _, _, body in server.calls) == [1, 3, 3, 3]
    assert concurrency["max"] > 1  # concurrent, not one after the other


def test_server_generation_waits_out_a_paused_server(serve):
    """vLLM 0.33 answers 503 to new requests while a weight update has it paused: the request is sent again."""
    server = serve({"/v1/completions": [(503, {"error": "paused"}), (200, _response([([5], [-0.1], "length")]))]})
    assert vllm_utils.server_generate(server.url, "m", [[1]], 1, {}, timeout=10) == ([[5]], [[-0.1]])
    assert server.paths() == ["/v1/completions"] * 2


# ------------------------------------------------------------------------------------------------------------------
# The options each script exposes


@pytest.mark.parametrize("script", ["grpo.py", "rloo.py", "online_dpo.py"])
def test_every_script_has_the_server_options_with_the_same_defaults_and_docs(script):
    """vllm_utils reads these Args fields (with these defaults for older Args); each script must offer them, documented
    alike, and docs/vllm.md must explain each (the README leaves the options to `--help`)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    args = next(
        node for node in ast.walk(ast.parse((root / script).read_text())) if getattr(node, "name", "") == "Args"
    )
    body = args.body
    fields = {
        node.target.id: (ast.literal_eval(node.value), body[i + 1].value.value)
        for i, node in enumerate(body)
        if isinstance(node, ast.AnnAssign) and node.target.id in vllm_utils.SERVER_OPTIONS
    }
    assert {name: default for name, (default, _) in fields.items()} == vllm_utils.SERVER_OPTIONS
    grpo_args = next(n for n in ast.walk(ast.parse((root / "grpo.py").read_text())) if getattr(n, "name", "") == "Args")
    grpo_docs = {
        node.target.id: grpo_args.body[i + 1].value.value
        for i, node in enumerate(grpo_args.body)
        if isinstance(node, ast.AnnAssign)
    }
    docs = (root / "docs" / "vllm.md").read_text()
    for name, (_, doc) in fields.items():
        assert doc == grpo_docs[name]
        assert f"`--{name.replace('_', '-')}`" in docs


def test_a_failed_sync_forms_a_new_nccl_group_on_the_next_one(monkeypatch):
    """A failed update can leave a broadcast pending in the group (NCCL has no timeout): a caller that retries must not
    reuse it, or the server would receive the stale broadcast."""
    joined, outcomes = [], [RuntimeError("the weight update failed"), None]
    monkeypatch.setattr(
        vllm_utils, "server_init_weight_sync", lambda *a, **k: joined.append(a) or f"group{len(joined)}"
    )

    def sync(url, group, model, **options):
        if outcome := outcomes.pop(0):
            raise outcome

    monkeypatch.setattr(vllm_utils, "server_sync_weights", sync)
    monkeypatch.setattr(vllm_utils, "_answers", lambda url: True)  # it still answers: a failure, not a lost server
    engine = {
        "mode": "server",
        "base_url": "http://s",
        "model_checked": True,
        "model": "m",
        "master_address": "h",
        "server": {"version": "0.26.0", "backend": "nccl"},
        **vllm_utils.SERVER_OPTIONS,
    }
    with pytest.raises(RuntimeError, match="the weight update failed"):
        vllm_utils.sync_weights(engine, _tiny_llama())
    vllm_utils.sync_weights(engine, _tiny_llama())
    assert len(joined) == 2 and engine["group"] == "group2"


def test_a_refused_prefix_cache_reset_is_an_error_raised_at_once_and_the_server_resumed(serve, no_nccl):
    """While paused (mode wait) no request holds blocks, so a refused reset is an error, not something to retry."""
    server = serve(_sync_routes(**{"/reset_prefix_cache": (200, {"success": False})}))
    with pytest.raises(RuntimeError, match="prefix cache could not be reset"):
        vllm_utils.server_sync_weights(server.url, "group", _tiny_llama(), "0.26.0", 1 << 20, timeout=5)
    assert server.paths()[-2:] == ["/reset_prefix_cache", "/resume"]


def test_generate_takes_n_and_temperature_per_call(monkeypatch):
    """Evaluation asks for other settings than training's (greedy, k samples): n and temperature per call, in both
    modes, while the engine's own settings, which the training rounds use, stay as they were."""
    llm, seen = FakeLLM(_tiny_llama()), []

    def generate(prompts, params, use_tqdm=False):  # the fake engine, recording what it was asked for
        seen.append((params.n, params.temperature))
        return FakeLLM.generate(llm, prompts, params)

    monkeypatch.setattr(llm, "generate", generate)
    fields = {"temperature": 0.7, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "max_tokens": 4}
    engine = {"mode": "colocate", "sleep": False, "llm": llm, "tp_group": None, "n": 4, "fields": fields}
    assert len(vllm_utils.generate(engine, [[1], [2]], n=1, temperature=0.0)[0]) == 2  # greedy, one each
    assert len(vllm_utils.generate(engine, [[1], [2]])[0]) == 8
    assert seen == [(1, 0.0), (4, 0.7)] and engine["fields"]["temperature"] == 0.7
    sent = []  # server mode: what goes into the /v1/completions requests
    monkeypatch.setattr(
        vllm_utils,
        "server_generate",
        lambda url, model_id, prompt_ids, n, fields, *chunking: sent.append((n, fields["temperature"])) or ([], []),
    )
    server = {
        "mode": "server",
        "base_url": "http://x",
        "server": {"model_id": "m"},
        "n": 4,
        "fields": fields,
        "vllm_generation_chunk_size": 8,
        "vllm_generation_timeout": 1.0,
    }
    vllm_utils.generate(server, [[1]], 3, 0.5)
    vllm_utils.generate(server, [[1]])
    assert sent == [(3, 0.5), (4, 0.7)] and fields["temperature"] == 0.7


def test_colocate_generation_asks_for_token_ids_and_logprobs_without_text():
    """The in-process engine detokenizes between decoding steps when asked to (vLLM's default): nothing here reads the
    text, so colocate_generate turns it off, and asks for vLLM's flat log-probs (no dict and object per token); rows
    come back prompt-major with each sampled token's log-prob."""
    from vllm.logprobs import FlatLogprobs, Logprob

    seen = {}

    def sample(ids):
        logprobs = FlatLogprobs()  # what the engine builds for flat_logprobs=True: one position per token
        for t in ids:
            logprobs.append({t: Logprob(logprob=-0.5 * t, rank=1, decoded_token=None)})
        return SimpleNamespace(token_ids=ids, logprobs=logprobs)

    def generate(prompts, params, use_tqdm):
        seen.update(params=params, prompts=prompts)
        return [SimpleNamespace(outputs=[sample([p["prompt_token_ids"][0], 7]), sample([8])]) for p in prompts]

    ids, logprobs = vllm_utils.colocate_generate(
        SimpleNamespace(generate=generate), [[1, 2], [3]], 2, {"temperature": 0.7, "max_tokens": 4}
    )
    params = seen["params"]
    assert params.detokenize is False and params.flat_logprobs and params.n == 2 and params.logprobs == 0
    assert params.temperature == 0.7 and seen["prompts"] == [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}]
    assert ids == [[1, 7], [8], [3, 7], [8]] and logprobs == [[-0.5, -3.5], [-4.0], [-1.5, -3.5], [-4.0]]


@pytest.mark.parametrize("arch", ["deepseek_v2", "qwen3_moe", "gpt_oss", "mixtral"])
def test_moe_experts_are_sent_under_the_names_and_values_save_pretrained_writes(arch, tmp_path):
    """transformers 5 fuses each MoE layer's experts into mlp.experts.gate_up_proj [E, 2I, H] / down_proj [E, H, I];
    vLLM 0.26's DeepseekV2 loader knows only the checkpoint's per-expert tensors (on the GPU the fused names failed
    with KeyError 'layers.1.mlp.experts.gate_up_proj'). What the trainer sends must be what save_pretrained writes,
    for every layout (GPT-OSS's checkpoint keeps a fused [E, H, 2I] tensor, Mixtral's has w1 / w2 / w3): the same
    names, shapes and values, and weight_metadata must announce exactly that."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, DeepseekV2Config, GptOssConfig, MixtralConfig, Qwen3MoeConfig

    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2)
    common.update(intermediate_size=48, moe_intermediate_size=8, num_experts_per_tok=2, tie_word_embeddings=False)
    if arch == "deepseek_v2":
        config = DeepseekV2Config(**common, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1)
        config.update(dict(q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8))
    elif arch == "qwen3_moe":
        config = Qwen3MoeConfig(**common, head_dim=16, num_experts=4, decoder_sparse_step=1, mlp_only_layers=[])
    else:
        config = (GptOssConfig if arch == "gpt_oss" else MixtralConfig)(**common, num_local_experts=4, head_dim=16)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    assert any(name.endswith("experts.gate_up_proj") for name, _ in model.named_parameters())  # fused here
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    sent = dict(vllm_utils.named_weights(model))
    assert sorted(sent) == sorted(saved)
    per_expert = {"gpt_oss": ".mlp.experts.gate_up_proj", "mixtral": ".experts.3.w3.weight"}
    assert any(per_expert.get(arch, ".mlp.experts.3.up_proj.weight") in name for name in sent)
    for name, tensor in saved.items():
        assert torch.equal(sent[name], tensor), name
    meta = vllm_utils.weight_metadata(model)
    assert meta["names"] == list(sent) and meta["shapes"] == [list(t.shape) for t in sent.values()]


# ------------------------------------------------------------------------------------------------------------------
# CUDA IPC weight transfer (a server on the trainer's GPU): the messages, the chunks, the request sequence, the layouts


# 0.27.0 and 0.33.0 wheels, vllm/distributed/weight_transfer/ipc_engine.py: IPCWeightTransferInitInfo has `packed`
# (default False); IPCWeightTransferUpdateInfo has names, dtype_names, shapes (required) and ipc_handles,
# ipc_handles_pickled, tensor_sizes (optional), and no `packed` (0.26.0's has it: the installed vLLM parses that one).
IPC_UPDATE_FIELDS_027_033 = ({"names", "dtype_names", "shapes"}, {"ipc_handles", "ipc_handles_pickled", "tensor_sizes"})


class FakeIPC:
    """Plays CUDA IPC on the CPU: ipc_handle() keeps the exported tensor itself under a key, shared memory as a real
    export is; the stand-in /update_weights reads it when the request arrives and rebuilds the tensors from the
    message's tensor_sizes, as vLLM's packed_ipc_consumer does: a trainer that refilled its buffer before the server
    answered would be caught sending the wrong bytes."""

    def __init__(self, monkeypatch):
        self.chunks, self.received, self.updates = {}, {}, []
        monkeypatch.setattr(vllm_utils, "ipc_handle", self.handle)

    def handle(self, buffer):
        key = len(self.chunks)
        self.chunks[key] = buffer
        return {"GPU-0": ("fake", key)}

    def update_weights(self, body):
        import base64
        import pickle

        info = body["update_info"]
        self.updates.append(info)
        key = pickle.loads(base64.b64decode(info["ipc_handles_pickled"]))["GPU-0"][1]
        data = self.chunks[key]
        assert sum(info["tensor_sizes"]) == data.numel()
        for name, dtype, shape, part in zip(
            info["names"], info["dtype_names"], info["shapes"], data.split(info["tensor_sizes"])
        ):
            self.received[name] = part.view(getattr(torch, dtype)).view(shape).clone()
        return 200, {}


@pytest.mark.parametrize("version", ["0.26.0", "0.27.1", "0.33.0"])
def test_an_ipc_push_sends_every_weight_in_bounded_chunks_paused_and_resumed(serve, monkeypatch, version):
    """The exact request sequence (0.27+: the init with `packed` first); every bf16 weight arrives intact, in chunks
    that fit the buffer, one handle each; the update messages have exactly the fields of that version's class (0.26:
    parsed by the installed vLLM's own IPCWeightTransferUpdateInfo)."""
    ipc = FakeIPC(monkeypatch)
    server = serve(_sync_routes(**{"/update_weights": ipc.update_weights, "/init_weight_transfer_engine": (200, {})}))
    model = _tiny_llama()
    buffer_bytes = 4096  # the embedding (64 x 16 bf16 = 2048 bytes) fits; several chunks in all
    vllm_utils.server_sync_weights_ipc(server.url, model, version, buffer_bytes, timeout=5, name="m")
    chunks = len(ipc.updates)
    init = ["/init_weight_transfer_engine"] if version >= "0.27" else []
    assert server.paths() == [
        *init,
        "/is_paused",
        "/pause",
        "/start_weight_update",
        *["/update_weights"] * chunks,
        "/finish_weight_update",
        "/reset_prefix_cache",
        "/resume",
    ]
    assert chunks > 1 and all(sum(update["tensor_sizes"]) <= buffer_bytes for update in ipc.updates)
    sent = dict(vllm_utils.named_weights(model))
    assert ipc.received.keys() == sent.keys()
    assert all(
        torch.equal(ipc.received[name], tensor) and tensor.dtype == torch.bfloat16 for name, tensor in sent.items()
    )
    if version >= "0.27":
        assert server.calls[0][2] == {"init_info": {"packed": True}}
        required, optional = IPC_UPDATE_FIELDS_027_033
        assert all(required <= update.keys() <= required | optional for update in ipc.updates)
    else:
        monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo

        for update in ipc.updates:
            parsed = IPCWeightTransferUpdateInfo(**update)
            assert parsed.packed is True and parsed.ipc_handles["GPU-0"][0] == "fake"


def test_a_tensor_larger_than_the_buffer_goes_alone_as_a_copy():
    """A tensor above the buffer is a chunk of its own, a copy: exporting a parameter's own storage would pin a CUDA
    IPC record to it at every sync."""
    big = torch.arange(64.0).bfloat16()
    weights = [("a", torch.ones(4, dtype=torch.bfloat16)), ("big", big), ("c", torch.ones(2))]
    chunks = []
    for data, meta in vllm_utils.packed_chunks(iter(weights), 16):
        chunks.append((data.clone(), meta, data.data_ptr()))
    assert [meta["names"] for _, meta, _ in chunks] == [["a"], ["big"], ["c"]]
    assert chunks[1][0].numel() == 128 and chunks[2][1]["dtype_names"] == ["float32"]
    assert torch.equal(chunks[1][0].view(torch.bfloat16), big) and chunks[1][2] != big.data_ptr()


def test_a_failed_ipc_update_restores_the_server_and_names_the_fix(serve, monkeypatch):
    """The server's answers to a wrong layout become the one-line fix; the server is restored and resumed. A server on
    another GPU (no GPU discovery at start-up: this answer tells) gets both layouts that work, each command in full."""
    FakeIPC(monkeypatch)
    _layout(monkeypatch)
    answers = {
        "IPC handle not found for GPU UUID 1234. Available UUIDs: ['abcd']": "not on trainer rank 0's GPU GPU-abcd",
        "Refusing to deserialize `ipc_handles_pickled` without VLLM_ALLOW_INSECURE_SERIALIZATION=1": "started without",
    }
    for answer, fix in answers.items():
        server = serve(_sync_routes(**{"/update_weights": _vllm_error(answer)}))
        with pytest.raises(RuntimeError, match="The server at .* was restored") as error:
            vllm_utils.server_sync_weights_ipc(server.url, _tiny_llama(), "0.26.0", 1 << 20, timeout=5, name="my/m")
        assert fix in str(error.value) and "VLLM_ALLOW_INSECURE_SERIALIZATION=1 vllm serve my/m" in str(error.value)
        assert "CUDA_VISIBLE_DEVICES=3 " in str(error.value)  # the IPC command puts the server on the trainer's GPU
        assert ('{"backend": "nccl"}' in str(error.value)) == ("GPU UUID" in answer)  # or NCCL, on other GPUs
        assert server.paths()[-2:] == ["/finish_weight_update", "/resume"]


def _layout(monkeypatch, host="127.0.0.1", env=None):
    """check_transport's view: trainer on GPU-abcd (CUDA_VISIBLE_DEVICES=3), the server at `host`:8001."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: SimpleNamespace(uuid="abcd"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    return f"http://{host}:8001"


@pytest.mark.parametrize(
    "host, workers, env, message, command",
    [
        ("10.1.2.3", 1, None, "runs on 10.1.2.3", "CUDA_VISIBLE_DEVICES=1 VLLM_SERVER_DEV_MODE=1 vllm"),
        ("127.0.0.1", 2, None, "with 2 workers", '{"backend": "nccl"}'),
        (
            "localhost",
            1,
            {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
            "cannot be exported as a CUDA IPC handle",
            "Unset it",
        ),
        (
            "localhost",
            1,
            {"PYTORCH_ALLOC_CONF": "expandable_segments:True"},  # torch 2.11's name for the same setting
            "cannot be exported as a CUDA IPC handle",
            "Unset it",
        ),
    ],
)
def test_a_layout_ipc_cannot_serve_is_refused_with_the_command_that_works(
    monkeypatch, host, workers, env, message, command
):
    url = _layout(monkeypatch, host, env)
    with pytest.raises(RuntimeError, match=message) as error:
        vllm_utils.check_transport(url, {"backend": "ipc", "workers": workers}, "my/m")
    assert command in str(error.value)


@pytest.mark.parametrize(
    "backend, host, workers", [("ipc", "127.0.0.1", 1), ("nccl", "127.0.0.1", 1), ("nccl", "h", 2)]
)
def test_layouts_each_transport_serves_pass(monkeypatch, backend, host, workers):
    """IPC with one worker on this host (which GPU, its first answer tells); NCCL on any host and any number of workers
    (two ranks on one GPU: NCCL's refusal at the first push tells)."""
    vllm_utils.check_transport(_layout(monkeypatch, host), {"backend": backend, "workers": workers}, "my/m")


def test_an_nccl_server_on_the_trainers_gpu_is_named_at_the_first_push_with_both_commands(serve, monkeypatch):
    """No GPU discovery: NCCL refuses two ranks on one GPU with "invalid usage" (vLLM's pynccl raises it in the
    trainer's group init), which the trainer turns into one line naming the likely cause, with the IPC command for this
    GPU and the NCCL one for other GPUs."""
    from vllm.distributed.weight_transfer import nccl_common

    def refused(info):
        raise RuntimeError("NCCL error: invalid usage (run with NCCL_DEBUG=WARN for details)")

    monkeypatch.setattr(nccl_common, "trainer_init", refused)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # the trainer's GPU, which the IPC command names
    server = serve({"/get_world_size": (200, {"world_size": 1}), "/init_weight_transfer_engine": (200, {})})
    with pytest.raises(RuntimeError, match="likely runs on the trainer's GPU: NCCL refused the group") as error:
        vllm_utils.server_init_weight_sync(server.url, None, version="0.26.0", timeout=5, name="my/m")
    said, port = str(error.value), server.url.rsplit(":", 1)[1]
    assert f"the server at {server.url} " in said and "invalid usage" in said and f"--port {port} " in said
    assert '{"backend": "ipc"}' in said and '{"backend": "nccl"}' in said and "CUDA_VISIBLE_DEVICES=3 " in said


def test_an_ipc_server_that_also_answers_beyond_loopback_is_warned_about(monkeypatch, capsys):
    """vLLM binds every interface without --host, and an IPC server unpickles what it is sent: the trainer warns when
    the server's port also answers on one of this host's other addresses, and not for one bound to 127.0.0.1."""
    import socket

    import psutil

    nics = [a.address for nic in psutil.net_if_addrs().values() for a in nic if a.family == socket.AF_INET]
    if all(address.startswith("127.") for address in nics):
        pytest.skip("this machine has no IPv4 address but loopback")
    for host, warned in (("127.0.0.1", False), ("0.0.0.0", True)):
        with socket.create_server((host, 0)) as listener:  # a port that answers: the kernel accepts for it
            url = _layout(monkeypatch).replace(":8001", f":{listener.getsockname()[1]}")
            vllm_utils.check_transport(url, {"backend": "ipc", "workers": 1}, "my/m")
        out = capsys.readouterr().out
        assert ("warning: " in out and "also answers on" in out and "--host 127.0.0.1" in out) == warned, out


def test_a_sleeping_server_is_refused_at_start_up(serve):
    server = serve({**_routes(weight_transfer="ipc"), "/is_sleeping": (200, {"is_sleeping": True})})
    with pytest.raises(RuntimeError, match="is asleep"):
        vllm_utils.check_server(server.url, "m")


def test_check_server_reports_the_backend_and_refuses_an_unknown_one(serve):
    assert vllm_utils.check_server(serve(_routes(weight_transfer="ipc")).url, "m")["backend"] == "ipc"
    with pytest.raises(RuntimeError, match="transfers weights by sparse_nccl"):
        vllm_utils.check_server(serve(_routes(weight_transfer="sparse_nccl")).url, "m")


def test_sync_weights_takes_the_transport_the_server_reports(monkeypatch):
    """An IPC server gets server_sync_weights_ipc and no NCCL group; a NCCL one the group and the broadcast."""
    calls = []
    monkeypatch.setattr(vllm_utils, "server_sync_weights_ipc", lambda *a, **k: calls.append("ipc"))
    monkeypatch.setattr(vllm_utils, "server_init_weight_sync", lambda *a, **k: calls.append("init") or "group")
    monkeypatch.setattr(vllm_utils, "server_sync_weights", lambda *a, **k: calls.append("nccl"))
    for backend in ("ipc", "nccl"):
        engine = {"mode": "server", "base_url": "u", "model": "m", "model_checked": True, "master_address": "a"}
        engine["server"] = {"version": "0.26.0", "backend": backend}
        vllm_utils.sync_weights({**engine, **vllm_utils.SERVER_OPTIONS}, _tiny_llama())
    assert calls == ["ipc", "init", "nccl"]


# ----------------------------------------------------------------------------------------------------------------
# start-up: the vLLM flags' checks and warnings (all three scripts ask before any model loads), the first weight push


def test_check_args_names_each_vllm_flag_and_fits_every_script(monkeypatch, capsys):
    import grpo
    import online_dpo

    monkeypatch.setattr(vllm_utils, "setup_problems", lambda: ["--use-vllm needs a CUDA GPU"])
    bad = dict(vllm_gpu_memory_utilization=1.5, vllm_server_port=[8000, 0], async_generation=True)
    problems = vllm_utils.check_args(grpo.Args(use_vllm=True, vllm_importance_sampling_clip_min=4.0, **bad))
    assert problems[0] == "--use-vllm needs a CUDA GPU"
    for text in ("--vllm-gpu-memory-utilization must be in (0, 1]", "--vllm-server-port must be TCP ports"):
        assert any(p.startswith(text) for p in problems), (text, problems)
    for ports, ok in (([8000, 8000], False), ([8000, 8001], True), ([], False), (8001, True), (70000, False)):
        said = vllm_utils.check_args(SimpleNamespace(**{**vars(grpo.Args()), "vllm_server_port": ports}))
        assert (said == []) == ok, (ports, said)
    assert any(p.startswith("--vllm-importance-sampling-clip-max must be >") for p in problems)
    assert any("--async-generation needs --use-vllm --vllm-mode server" in p for p in problems)
    # online_dpo.py has no importance-sampling flags: its checks skip them
    assert vllm_utils.check_args(online_dpo.Args(use_vllm=False)) == []
    assert vllm_utils.check_args(grpo.Args()) == [] and capsys.readouterr().out == ""
    # truncated sampling with the importance-sampling correction: a warning, not a refusal
    monkeypatch.setattr(vllm_utils, "setup_problems", lambda: [])
    assert vllm_utils.check_args(grpo.Args(use_vllm=True, top_p=0.9)) == []
    assert "warning: with top_p / top_k / min_p / repetition_penalty" in capsys.readouterr().out
    assert vllm_utils.check_args(online_dpo.Args(use_vllm=True, top_p=0.9)) == []  # no correction: no warning
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_start_with_weights_pushes_the_trainers_weights_to_a_server_at_once(monkeypatch, mode):
    pushed = []
    monkeypatch.setattr(vllm_utils, "start", lambda args, path, longest, images: {"mode": args.vllm_mode, "path": path})
    monkeypatch.setattr(vllm_utils, "sync_weights", lambda engine, model: pushed.append((engine["path"], model)))
    engine = vllm_utils.start_with_weights(SimpleNamespace(vllm_mode=mode, use_peft=False), "MODEL", "m", 10)
    assert engine == {"mode": mode, "path": "m"}
    assert pushed == ([("m", "MODEL")] if mode == "server" else [])  # a colocated engine loads the checkpoint itself


@pytest.mark.parametrize(
    "failing", ["/start_weight_update", "/update_weights", "/finish_weight_update", "/reset_prefix_cache"]
)
def test_an_ipc_push_that_fails_at_any_step_leaves_the_server_resumed(serve, monkeypatch, failing):
    """Whichever request of the push fails, the error is raised and the server ends resumed (not paused forever); a
    failure after /start_weight_update also finishes the update first, so that the layers get their weights back."""
    FakeIPC(monkeypatch)
    server = serve(_sync_routes(**{failing: _vllm_error("boom")}))
    with pytest.raises(RuntimeError, match="boom"):
        vllm_utils.server_sync_weights_ipc(server.url, _tiny_llama(), "0.26.0", 1 << 20, timeout=5, name="m")
    paths = server.paths()
    assert paths[-1] == "/resume" and paths.count("/pause") == 1
    if failing in ("/update_weights", "/finish_weight_update"):
        assert "/finish_weight_update" in paths[paths.index(failing) + 1 :]  # restored before resuming


def test_an_ipc_init_that_fails_pauses_nothing(serve, monkeypatch):
    """0.27+: /init_weight_transfer_engine comes before /pause, so a server that refuses it is left serving."""
    FakeIPC(monkeypatch)
    server = serve(_sync_routes(**{"/init_weight_transfer_engine": _vllm_error("boom")}))
    with pytest.raises(RuntimeError, match="boom"):
        vllm_utils.server_sync_weights_ipc(server.url, _tiny_llama(), "0.33.0", 1 << 20, timeout=5, name="m")
    assert server.paths() == ["/init_weight_transfer_engine"]


def test_ipc_exports_are_collected_after_the_server_finished_the_update(serve, monkeypatch):
    """A 0.28+ server releases its mapping of the last chunk in /finish_weight_update: the trainer's
    torch.cuda.ipc_collect() must come after it (before, the last buffer would sit in torch's IPC limbo until the next
    sync), on success and on failure."""
    FakeIPC(monkeypatch)
    for answers in ({}, {"/reset_prefix_cache": _vllm_error("boom")}):
        server = serve(_sync_routes(**answers, **{"/init_weight_transfer_engine": (200, {})}))
        collected = []
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: collected.append(list(server.paths())))
        with contextlib.suppress(RuntimeError):
            vllm_utils.server_sync_weights_ipc(server.url, _tiny_llama(), "0.33.0", 1 << 20, timeout=5, name="m")
        assert len(collected) == 1 and "/finish_weight_update" in collected[0], collected


# ----------------------------------------------------------------------------------------------------------------
# Several servers of one run on the trainer's GPU (--vllm-server-port 8000 8001): one EngineCore's CPU bounds a round
# with log-probs, two share it (benchmarks/results/README.md, commit 358bc54: 1.87 s a round against 3.10 s for one)


def test_a_round_is_shared_by_several_servers_and_comes_back_in_prompt_order(serve, monkeypatch):
    """32 prompts in chunks of 8 go to two servers in turn (16 prompts each, all requests at once); the rows come back
    prompt-major, whichever server answered them; a torchrun rank starts at its own server."""
    servers = [serve({"/v1/completions": _echo_completions({}, delays=[0.3, 0.0])}) for _ in range(2)]
    prompts = [[100 + i, 1] for i in range(32)]
    ids, lps = vllm_utils.server_generate([s.url for s in servers], "m", prompts, 2, {}, chunk_size=8, timeout=10)
    assert ids == [[100 + i] for i in range(32) for _ in range(2)] and lps == [[-0.5]] * 64
    firsts = [[body["prompt"][0][0] for _, _, body in s.calls] for s in servers]
    assert sorted(firsts[0]) == [100, 116] and sorted(firsts[1]) == [108, 124]  # chunks 0, 2 and 1, 3
    monkeypatch.setenv("RANK", "1")
    vllm_utils.server_generate([s.url for s in servers], "m", prompts[:8], 2, {}, chunk_size=8, timeout=10)
    assert len(servers[1].calls) == 3 and len(servers[0].calls) == 2


def test_a_lost_server_gets_no_chunk_until_it_has_the_weights_again(serve):
    """A server in `lost` (it stopped answering; it may be back, holding its start-up weights) is not asked, even by
    the chunks that another server's failure moves on: one that answers is taken back only by push_live."""
    down, up = (serve({"/v1/completions": _echo_completions({}, delays=[0.0])}) for _ in range(2))
    dead = "http://127.0.0.1:9"  # nothing listens there: a connection refused, as from a killed server
    lost = {down.url: 0.0}
    ids, _ = vllm_utils.server_generate(
        [down.url, dead, up.url], "m", [[100 + i] for i in range(6)], 1, {}, chunk_size=1, timeout=10, lost=lost
    )
    assert ids == [[100 + i] for i in range(6)] and down.calls == [] and len(up.calls) == 6
    assert set(lost) == {down.url, dead}  # the refused one is lost now too


def _timeline_routes(timeline, tag, **overrides):
    """_sync_routes whose every answer is also written to the shared `timeline` as (tag, path)."""

    def logged(path, answer):
        return lambda body: timeline.append((tag, path)) or (answer(body) if callable(answer) else answer)

    return {path: logged(path, answer) for path, answer in _sync_routes(**overrides).items()}


def test_an_ipc_push_to_several_servers_packs_each_chunk_once_and_pauses_them_all(serve, monkeypatch):
    """Each chunk is packed once and sent to both servers at once (a fresh export each) while both are paused inside
    a started update; the servers' pauses (and the rest of their sequences) run at once, not one after the other,
    and every weight reaches both intact."""
    ipc, timeline, lock = FakeIPC(monkeypatch), [], threading.Lock()
    busy = {path: {"now": 0, "max": 0} for path in ("/pause", "/update_weights", "/resume")}

    def slow(path, answer):  # slow enough that a sequential push would never have both servers in it at once
        def call(body):
            with lock:
                busy[path]["now"] += 1
                busy[path]["max"] = max(busy[path]["max"], busy[path]["now"])
            time.sleep(0.05)
            result = answer(body) if callable(answer) else answer
            with lock:
                busy[path]["now"] -= 1
            return result

        return call

    slowed = {"/pause": slow("/pause", (200, {})), "/resume": slow("/resume", (200, {}))}
    slowed["/update_weights"] = slow("/update_weights", ipc.update_weights)
    servers = [serve(_timeline_routes(timeline, k, **slowed)) for k in (0, 1)]
    model = _tiny_llama()
    vllm_utils.server_sync_weights_ipc([s.url for s in servers], model, "0.26.0", 4096, timeout=5, name="m")
    chunks = len(ipc.updates) // 2
    begin = ["/is_paused", "/pause", "/start_weight_update"]
    end = ["/finish_weight_update", "/reset_prefix_cache", "/resume"]
    for k in (0, 1):  # each server's own sequence
        assert [p for t, p in timeline if t == k] == [*begin, *["/update_weights"] * chunks, *end], timeline
    paths = [p for _, p in timeline]
    updates = [i for i, p in enumerate(paths) if p == "/update_weights"]
    last_start = max(i for i, p in enumerate(paths) if p == "/start_weight_update")
    assert last_start < updates[0] and updates[-1] < paths.index("/finish_weight_update")  # all started, all sent
    sent_to = [t for t, p in timeline if p == "/update_weights"]
    assert all(sorted(sent_to[2 * c : 2 * c + 2]) == [0, 1] for c in range(chunks))  # chunk by chunk, to both
    assert chunks > 1 and all(b["max"] == 2 for b in busy.values()), busy  # both paused, copying, resumed at once
    assert len(ipc.chunks) == 2 * chunks  # one export per server and chunk
    names = [tuple(update["names"]) for update in ipc.updates]
    assert sorted(names[0::2]) == sorted(names[1::2])  # the same chunks to both
    sent = dict(vllm_utils.named_weights(model))
    assert ipc.received.keys() == sent.keys() and all(torch.equal(ipc.received[k], v) for k, v in sent.items())


@pytest.mark.parametrize("failing", [0, 1])
@pytest.mark.parametrize("path", ["/start_weight_update", "/update_weights"])
def test_a_failed_push_to_either_server_leaves_both_restored_and_resumed(serve, monkeypatch, failing, path):
    """Whichever server fails, both end resumed, each update that started is finished (its layers get their weights
    back), and the error says the cause once and names each restored server."""
    FakeIPC(monkeypatch)
    servers = [serve(_sync_routes(**({path: _vllm_error("boom")} if k == failing else {}))) for k in (0, 1)]
    with pytest.raises(RuntimeError, match="boom") as error:
        vllm_utils.server_sync_weights_ipc([s.url for s in servers], _tiny_llama(), "0.26.0", 1 << 20, 5, name="m")
    said = str(error.value)
    assert said.count("the weight update failed") <= 1 and said.count("boom") == 1, said
    for k, server in enumerate(servers):  # all are paused at once; no chunk goes out before all are started
        paths, started = server.paths(), k != failing or path == "/update_weights"
        assert paths.count("/pause") == 1 and paths[-1] == "/resume", (k, paths)
        assert ("/finish_weight_update" in paths) == started, paths
        assert (f"The server at {server.url} was restored" in said) == started, said
        if path == "/start_weight_update":
            assert "/update_weights" not in paths, paths


def test_a_server_too_slow_to_start_its_update_is_named_and_both_end_resumed(serve, monkeypatch):
    """Its /start_weight_update does not answer within the timeout: the error names it, nothing is sent, both updates
    are finished (the slow one may have started after the trainer gave up) and both servers end resumed."""
    FakeIPC(monkeypatch)
    slow_start = lambda body: time.sleep(1.5) or (200, {})  # noqa: E731 - answers, but after the timeout
    servers = [serve(_sync_routes()), serve(_sync_routes(**{"/start_weight_update": slow_start}))]
    with pytest.raises(RuntimeError) as error:
        vllm_utils.server_sync_weights_ipc([s.url for s in servers], _tiny_llama(), "0.26.0", 1 << 20, 0.5, name="m")
    first, *rest = str(error.value).split("\n")
    assert first.startswith("the weight update failed: ") and "timed out" in first, first
    assert f"port={servers[1].url.rsplit(':', 1)[1]}" in first, first  # the slow one
    for server in servers:
        deadline = time.time() + 10
        while server.paths()[-1:] != ["/resume"] and time.time() < deadline:  # (the slow start answers late)
            time.sleep(0.05)
        paths = server.paths()
        assert "/update_weights" not in paths and paths.count("/pause") == 1 and paths[-1] == "/resume", paths
        assert "/finish_weight_update" in paths, paths
        assert any(f"The server at {server.url} was restored" in line for line in rest), str(error.value)


def test_a_stuck_server_among_several_is_reported_before_any_is_paused(serve, monkeypatch):
    """Every server is probed first: one whose engine does not answer /is_paused stops the push before any /pause."""
    FakeIPC(monkeypatch)
    monkeypatch.setattr(vllm_utils.probe_server, "__defaults__", (1.0, "nccl"))
    stuck = lambda body: time.sleep(20) or (200, {"is_paused": False})  # noqa: E731
    servers = [serve(_sync_routes()), serve(_sync_routes(**{"/is_paused": stuck}))]
    with pytest.raises(RuntimeError, match="answers /health but its engine not /is_paused"):
        vllm_utils.server_sync_weights_ipc([s.url for s in servers], _tiny_llama(), "0.26.0", 1 << 20, 5, name="m")
    assert [server.paths() for server in servers] == [["/is_paused"], ["/is_paused"]]


def test_a_server_failing_after_the_send_leaves_the_others_updated(serve, monkeypatch):
    """Every server got the weights; the third's /finish_weight_update fails. The others finish, reset their prefix
    caches and resume as after a good push, and the error names the third only."""
    FakeIPC(monkeypatch)
    servers = [serve(_sync_routes()) for _ in range(2)]
    servers.append(serve(_sync_routes(**{"/finish_weight_update": _vllm_error("boom")})))
    with pytest.raises(RuntimeError, match="boom") as error:
        vllm_utils.server_sync_weights_ipc([s.url for s in servers], _tiny_llama(), "0.26.0", 1 << 30, 5, name="m")
    for server in servers[:2]:
        assert server.paths()[-3:] == ["/finish_weight_update", "/reset_prefix_cache", "/resume"], server.paths()
        assert server.url not in str(error.value), str(error.value)
    assert f"The server at {servers[2].url} could not be restored" in str(error.value), str(error.value)
    assert servers[2].paths()[-1] == "/resume" and "/reset_prefix_cache" not in servers[2].paths()


def test_a_failed_push_restores_its_servers_at_once(serve):
    """The send fails with both servers paused inside the update: both are restored (finish) at the same time, each
    waiting here for the other's call, so that neither keeps the healthy one paused; both then resume."""
    both = threading.Barrier(2, timeout=5)
    finish = lambda body: both.wait() and None or (200, {})  # noqa: E731 - returns once both servers are inside
    servers = [serve(_sync_routes(**{"/finish_weight_update": finish})) for _ in range(2)]

    def send():
        raise RuntimeError("the send broke")

    with pytest.raises(RuntimeError, match="the send broke") as error:
        vllm_utils.paused_update([s.url for s in servers], send, "m", "ipc", timeout=10)
    for server in servers:
        assert f"The server at {server.url} was restored" in str(error.value), str(error.value)
        assert server.paths()[-2:] == ["/finish_weight_update", "/resume"], server.paths()


def test_a_pause_that_times_out_is_undone(serve):
    """A /pause that does not answer within the timeout: the error says so and the server is asked to resume (it was
    left paused, serving nothing, until another trainer's check resumed it)."""
    slow_pause = lambda body: time.sleep(1.0) or (200, {})  # noqa: E731
    server = serve(_sync_routes(**{"/pause": slow_pause}))
    with pytest.raises(requests.RequestException, match="timed out"):
        vllm_utils.paused_update(server.url, lambda: None, "m", "ipc", timeout=0.3)
    deadline = time.time() + 10
    while "/resume" not in server.paths() and time.time() < deadline:  # (the stand-in answers one call at a time)
        time.sleep(0.05)
    assert server.paths()[-2:] == ["/pause", "/resume"], server.paths()


def _several(monkeypatch, servers, **extra):
    """start() against stand-ins for the servers' facts: `servers`, one dict of overrides per port; `extra`: Args."""
    monkeypatch.setattr(vllm_utils, "wait_for_server", lambda *a, **k: None)
    facts = {f"http://127.0.0.1:{8000 + i}": s for i, s in enumerate(servers)}
    base = {"model_id": "served", "max_model_len": 2048, "version": "0.26.0", "model_config": {}, "backend": "ipc"}
    monkeypatch.setattr(vllm_utils, "check_server", lambda url, model: {**base, "url": url, **facts[url]})
    checked = []
    monkeypatch.setattr(vllm_utils, "check_transport", lambda url, server, model: checked.append(url))
    monkeypatch.setattr("vllm.utils.network_utils.get_ip", lambda: "10.0.0.1")
    args = _args(model_name_or_path="my/m", vllm_mode="server", vllm_server_host="127.0.0.1", vllm_server_timeout=1)
    args.__dict__.update(vllm_server_port=[8000 + i for i in range(len(servers))], max_completion_length=8, **extra)
    return (lambda: vllm_utils.start(args, "my/m", max_prompt_length=10)), checked


def test_several_ports_start_one_engine_over_all_the_servers_each_checked(monkeypatch):
    start, checked = _several(monkeypatch, [{}, {}])
    engine = start()
    assert engine["base_urls"] == ["http://127.0.0.1:8000", "http://127.0.0.1:8001"] and checked == engine["base_urls"]
    sent, pushed = [], []
    monkeypatch.setattr(vllm_utils, "server_generate", lambda urls, *a: sent.append(urls) or ([[1]], [[-0.1]]))
    monkeypatch.setattr(vllm_utils, "server_sync_weights_ipc", lambda urls, *a, **k: pushed.append(urls))
    monkeypatch.setattr(vllm_utils, "check_same_model", lambda server, *a: pushed.append(server["url"]))
    vllm_utils.generate(engine, [[5]])
    vllm_utils.sync_weights(engine, _tiny_llama())
    assert sent == [engine["base_urls"]] and pushed == [*engine["base_urls"], engine["base_urls"]]  # each compared


@pytest.mark.parametrize(
    "second, said",
    [
        ({"backend": "nccl"}, "need servers on this GPU with CUDA IPC weight transfer"),
        ({"version": "0.27.1"}, "must run one vLLM and serve one model"),
        ({"model_id": "other"}, "must run one vLLM and serve one model"),
        ({"max_model_len": 12}, "exceeds http://127.0.0.1:8001's --max-model-len 12"),
    ],
)
def test_several_servers_that_cannot_share_a_run_are_refused_at_start_up(monkeypatch, second, said):
    start, _ = _several(monkeypatch, [{}, second])
    with pytest.raises((RuntimeError, ValueError), match=said) as error:
        start()
    if "CUDA IPC" in said:  # the commands that work: one per port, each with half the memory share
        assert str(error.value).count("--gpu-memory-utilization 0.17") == 2 and "--port 8001 " in str(error.value)


def test_the_commands_for_several_servers_split_the_memory_share(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    assert "--gpu-memory-utilization 0.35 " in vllm_utils.serve_command("m", backend="ipc")
    assert "--gpu-memory-utilization 0.17 " in vllm_utils.serve_command("m", backend="ipc", servers=2)
    with pytest.raises(ConnectionError, match="--gpu-memory-utilization 0.17 ") as error:
        vllm_utils.wait_for_server(f"http://127.0.0.1:{vllm_utils.free_port()}", 0.01, "m", servers=2)
    assert "CUDA_VISIBLE_DEVICES=2 " in str(error.value)


def test_the_serve_commands_bind_loopback_and_carry_trust_remote_code_only_when_asked(monkeypatch):
    """Dev mode's endpoints have no authentication and an IPC server unpickles what it is sent: every command the
    trainer prints binds 127.0.0.1. --trust-remote-code only where asked: by the argument, else by the trainer's flag,
    which start() also hands to the served model's comparison."""
    for backend in ("nccl", "ipc"):
        command = vllm_utils.serve_command("m", backend=backend)
        assert " --host 127.0.0.1 " in command and "--trust-remote-code" not in command
        trusted = vllm_utils.serve_command("m", backend=backend, trust_remote_code=True)
        assert "vllm serve m --trust-remote-code --host 127.0.0.1 " in trusted
    monkeypatch.setattr(vllm_utils, "TRUST_REMOTE_CODE", False)  # restored after the test: start() sets it
    compared = []
    monkeypatch.setattr(vllm_utils, "check_same_model", lambda server, model, path, trust: compared.append(trust))
    monkeypatch.setattr(vllm_utils, "server_sync_weights_ipc", lambda *a, **k: None)
    for trust in (True, False):
        start, _ = _several(monkeypatch, [{}], trust_remote_code=trust)
        vllm_utils.sync_weights(start(), _tiny_llama())
        assert compared[-1] is trust and ("--trust-remote-code" in vllm_utils._restart("my/m", "ipc")) == trust


@pytest.mark.parametrize("fails", [False, True])
def test_push_live_on_several_ranks_sends_what_the_other_ranks_gather(monkeypatch, fails):
    """Under torchrun every rank takes part in each weight's FSDP2 gather, the changed weights once a push went: rank
    0 must not push a server that came back every weight nor push again after a failure, or the ranks' gathers part
    ways and the run hangs. It takes the server back with the changed weights. One process: test_server_lost."""
    pushes = []

    def server_push(engine, model, urls, changed_only=False):
        pushes.append((list(urls), changed_only))
        if fails:
            raise requests.ConnectionError("the server went away mid-push")

    monkeypatch.setattr(vllm_utils, "server_push", server_push)
    monkeypatch.setattr(vllm_utils, "check_server", lambda url, model: {})
    monkeypatch.setattr(vllm_utils, "check_same_model", lambda *a: None)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    urls = ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    engine = {"base_urls": urls, "base_url": urls[0], "lost": {urls[1]: 0.0}, "pushed": True, "model": "m"}
    monkeypatch.setattr(vllm_utils, "_answers", lambda url, timeout=5.0: True)  # both answer: 8002 came back
    with pytest.raises(requests.ConnectionError) if fails else contextlib.nullcontext():
        vllm_utils.push_live(engine, None)
    assert pushes == [(urls, True)]  # once, the changed weights, to both (8002 back)
    assert (urls[1] in engine["lost"]) == fails


def test_named_weights_of_a_vlm_renames_without_transformers_reverse_after_the_first_push(monkeypatch, tmp_path):
    """transformers 5 loads a Qwen2.5-VL checkpoint under new names (model.language_model.* for model.*): every weight
    of the push goes through revert_weight_conversion (~0.3 ms each: ~0.3 s a push on the 3B shape). A reverse that
    hands back the same tensor under another name is learned at the first push; later pushes rename alone, and send
    the names and tensors the reverse of the whole state gives."""
    import sys

    from transformers import AutoModelForImageTextToText

    from grpo_cli import ROOT, STORIES

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import make_vlm_bench

    make_vlm_bench.make_model(STORIES, tmp_path / "tiny", "tiny")
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "tiny", dtype=torch.float32)
    calls, reverse = [], vllm_utils.revert_weight_conversion
    monkeypatch.setattr(vllm_utils, "revert_weight_conversion", lambda m, d: calls.append(len(d)) or reverse(m, d))
    expected = reverse(model, {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()})
    for push in (1, 2):
        calls.clear()
        sent = dict(vllm_utils.named_weights(model))
        assert sent.keys() == expected.keys() and all(torch.equal(sent[n], expected[n]) for n in sent)
        assert len([c for c in calls if c == 1]) == (len(sent) if push == 1 else 0)  # per weight: the first push only
