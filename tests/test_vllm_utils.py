"""CPU tests of vllm_utils.py: the request sent to /v1/completions, how its response is read back, the weight
metadata, and the errors a misconfigured server gets. A small HTTP server on 127.0.0.1 plays `vllm serve`."""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import vllm_utils


def test_completions_request_sends_every_sampling_field():
    args = SimpleNamespace(temperature=0.7, top_p=0.9, top_k=0, min_p=0.05, repetition_penalty=1.1, max_completion_length=64)
    fields = vllm_utils.sampling_fields(args)
    body = vllm_utils.completions_request("m", [[1, 2, 3], [4, 5]], 4, fields)
    assert body["prompt"] == [[1, 2, 3], [4, 5]] and body["n"] == 4 and body["model"] == "m"
    # a server fills any missing field from the model's generation_config.json, so none may be missing
    assert {k: body[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")} == {
        "temperature": 0.7, "top_p": 0.9, "top_k": -1, "min_p": 0.05, "repetition_penalty": 1.1, "max_tokens": 64}
    assert body["logprobs"] == 0 and body["return_token_ids"] is True
    assert json.loads(json.dumps(body)) == body  # JSON-serialisable as is


def _response(choices):
    return {"choices": [{"index": i, "token_ids": ids, "logprobs": {"token_logprobs": lps}, "finish_reason": fr}
                        for i, (ids, lps, fr) in enumerate(choices)]}


def test_parse_completions_prompt_major_eos_last_and_alignment():
    eos = 2
    # 2 prompts x n=2; choice k belongs to prompt k // 2; a stop on EOS keeps the EOS as the last token
    response = _response([([5, 6, eos], [-0.1, -0.2, -0.3], "stop"), ([7], [-1.0], "length"),
                          ([8, eos], [-0.5, None], "stop"), ([9, 9, 9], [-0.1, -0.1, -0.1], "length")])
    response["choices"] = response["choices"][::-1]  # order on the wire does not matter: `index` does
    ids, lps = vllm_utils.parse_completions(response, num_prompts=2, n=2)
    assert ids == [[5, 6, eos], [7], [8, eos], [9, 9, 9]]
    assert lps[0] == [-0.1, -0.2, -0.3] and lps[2] == [-0.5, None]
    assert all(len(i) == len(l) for i, l in zip(ids, lps))


def test_parse_completions_rejects_wrong_count_and_misaligned_logprobs():
    with pytest.raises(RuntimeError, match="3 completions for 2 prompts x 2"):
        vllm_utils.parse_completions(_response([([1], [-1.0], "stop")] * 3), 2, 2)
    with pytest.raises(RuntimeError, match="1 log-probs for 2 tokens"):
        vllm_utils.parse_completions(_response([([1, 2], [-1.0], "stop")]), 1, 1)


def test_weight_metadata_describes_exactly_the_streamed_tensors():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    meta = vllm_utils.weight_metadata(model, torch.bfloat16)  # known before any tensor is gathered
    weights = list(vllm_utils.named_weights(model, torch.bfloat16))
    params = list(model.named_parameters())
    assert meta["names"] == [n for n, _ in params]  # every parameter, in order, HF checkpoint names
    assert "lm_head.weight" not in meta["names"]  # tied: the shared tensor is sent once, as embed_tokens
    assert meta["shapes"] == [list(p.shape) for _, p in params]
    assert meta["dtype_names"] == ["bfloat16"] * len(params)
    for (name, tensor), dtype_name, shape in zip(weights, meta["dtype_names"], meta["shapes"]):
        assert getattr(torch, dtype_name) == tensor.dtype and list(tensor.shape) == shape
    assert torch.equal(weights[0][1], params[0][1].detach().to(torch.bfloat16))
    # packed sizes the receiver derives from the metadata equal the bytes the sender packs
    sent = sum(t.numel() * t.element_size() for _, t in weights)
    derived = sum(torch.Size(s).numel() * getattr(torch, d).itemsize for s, d in zip(meta["shapes"], meta["dtype_names"]))
    assert sent == derived


class FakeServer:
    """Answers GET/POST paths from a dict {path: (status, json body)}."""

    def __init__(self, routes):
        routes_ = routes

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                status, body = routes_.get(self.path.split("?")[0], (404, {"detail": "Not Found"}))
                data = json.dumps(body).encode()
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
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


def _routes(weight_transfer={"backend": "nccl"}, version=None, logprobs_mode="processed_logprobs"):
    import vllm

    return {"/health": (200, {}), "/version": (200, {"version": version or vllm.__version__}),
            "/v1/models": (200, {"data": [{"id": "served-model", "max_model_len": 2048}]}),
            "/server_info": (200, {"vllm_config": {"weight_transfer_config": weight_transfer,
                                                   "model_config": {"logprobs_mode": logprobs_mode}}})}


def test_check_server_accepts_a_correct_server():
    server = FakeServer(_routes())
    try:
        assert vllm_utils.check_server(server.url, "m") == ("served-model", 2048)
    finally:
        server.close()


@pytest.mark.parametrize("routes, message", [
    ({**_routes(), "/server_info": (404, {})}, "VLLM_SERVER_DEV_MODE=1"),
    (_routes(weight_transfer=None), "--weight-transfer-config"),
    (_routes(version="0.1.0"), "vLLM 0.1.0 but the trainer has vLLM"),
    (_routes(logprobs_mode="raw_logprobs"), "returns raw_logprobs log-probs, which leave out the temperature"),
])
def test_check_server_names_the_problem_and_the_fix(routes, message):
    server = FakeServer(routes)
    try:
        with pytest.raises(RuntimeError, match=message) as error:
            vllm_utils.check_server(server.url, "my/model")
        if "0.1.0" not in message:
            assert "vllm serve my/model" in str(error.value)  # the exact command to restart it
    finally:
        server.close()


def test_unreachable_server_error_prints_the_serve_command():
    with pytest.raises(ConnectionError) as error:
        vllm_utils.wait_for_server("http://127.0.0.1:9", timeout=0, model="Qwen/Qwen2.5-0.5B-Instruct")
    message = str(error.value)
    assert "--vllm-server-timeout" in message
    assert ("VLLM_SERVER_DEV_MODE=1 vllm serve Qwen/Qwen2.5-0.5B-Instruct --host 0.0.0.0 --port 9 "
            "--weight-transfer-config '{\"backend\": \"nccl\"}' --logprobs-mode processed_logprobs --max-logprobs -1") in message


def test_weight_endpoint_failure_is_raised_not_retried():
    calls = []
    server = FakeServer({"/update_weights": (500, {"error": "bad metadata"})})
    original = server.httpd.RequestHandlerClass.do_POST

    def counting(handler):
        calls.append(handler.path)
        original(handler)

    server.httpd.RequestHandlerClass.do_POST = counting
    try:
        with pytest.raises(RuntimeError, match="500.*bad metadata"):
            vllm_utils._post(server.url, "/update_weights", 5, json={})
        assert calls == ["/update_weights"]
    finally:
        server.close()


class FakeLLM:
    """Records the calls a colocated engine gets; generates one token per prompt and sample."""

    def __init__(self):
        self.calls = []
        model = SimpleNamespace(load_weights=lambda weights: self.calls.append(("load", len(list(weights)))))
        worker = SimpleNamespace(model_runner=SimpleNamespace(model=model))
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=worker))

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def generate(self, prompts, params, use_tqdm=False):
        self.calls.append(("generate", len(prompts)))
        sample = SimpleNamespace(token_ids=[7], logprobs=[{7: SimpleNamespace(logprob=-0.5)}])
        return [SimpleNamespace(outputs=[sample] * params.n) for _ in prompts]


def test_colocate_sleep_mode_order():
    # generate -> sleep (training) -> sync: wake weights, load all, reset cache -> generate: wake KV cache first
    llm = FakeLLM()
    engine = {"mode": "colocate", "sleep": True, "llm": llm, "tp_group": None, "n": 2,
              "fields": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "max_tokens": 4}}
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    ids, lps = vllm_utils.generate(engine, [[1, 2], [3]])
    assert ids == [[7]] * 4 and lps == [[-0.5]] * 4
    vllm_utils.sleep(engine)
    vllm_utils.sleep(engine)  # a second call is a no-op
    with pytest.raises(RuntimeError, match="call sync_weights first"):  # level 2 discarded the weights
        vllm_utils.generate(engine, [[1]])
    vllm_utils.sync_weights(engine, model)
    vllm_utils.generate(engine, [[1]])
    n_params = len(list(model.parameters()))
    assert llm.calls == [("generate", 2), ("sleep", 2), ("wake_up", ("weights",)), ("load", n_params),
                         ("reset_prefix_cache",), ("wake_up", ("kv_cache",)), ("generate", 1)]


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
    """Under torchrun, ranks other than 0 skip the NCCL group but must still know where to send their prompts."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(vllm_utils, "wait_for_server", lambda *a: None)
    monkeypatch.setattr(vllm_utils, "check_server", lambda *a: ("served-model", 2048))
    monkeypatch.setattr(vllm_utils, "check_gpu_not_shared", lambda *a: None)
    joined, sent = [], []
    monkeypatch.setattr(vllm_utils, "server_init_weight_sync", lambda *a: joined.append(a) or "group")
    monkeypatch.setattr(vllm_utils, "server_generate", lambda url, model_id, prompts, n, fields: sent.append(url) or ([[1]], [[-0.1]]))
    args = SimpleNamespace(vllm_mode="server", vllm_server_host="10.0.0.7", vllm_server_port=8001, vllm_server_timeout=1,
                           vllm_group_port=51216, num_generations=1, max_completion_length=8, temperature=1.0, top_p=1.0,
                           top_k=0, min_p=0.0, repetition_penalty=1.0)
    for rank in (1, 0):
        monkeypatch.setattr(vllm_utils, "_rank", lambda: rank)
        monkeypatch.setattr("vllm.utils.network_utils.get_ip", lambda: "10.0.0.1")
        engine = vllm_utils.start(args, "m", max_prompt_length=10)
        assert vllm_utils.generate(engine, [[5, 6]]) == ([[1]], [[-0.1]])
        assert ("group" in engine) == (rank == 0)
    assert sent == ["http://10.0.0.7:8001"] * 2
    assert len(joined) == 1 and joined[0][2] == "10.0.0.1"  # rank 0 alone, advertising its routable address


def _sleep_then(seconds, result=None, error=None):
    def work():
        time.sleep(seconds)
        if error:
            raise error
        return result
    return work


@pytest.mark.parametrize("nccl, http, expected, within", [
    (_sleep_then(0.1, result="group"), _sleep_then(0.2), "group", 5),  # both succeed: the NCCL side's result
    (_sleep_then(0, error=OSError("port 51216 in use")), _sleep_then(30), OSError, 5),  # NCCL fails: raised at once
    (_sleep_then(0, error=OSError("port 51216 in use")), _sleep_then(0.1, error=TimeoutError("read timed out")), OSError, 5),
    (_sleep_then(30), _sleep_then(0, error=RuntimeError("POST /update_weights failed")), RuntimeError, 5),  # HTTP fails
    (_sleep_then(30), _sleep_then(0), TimeoutError, 5),  # the server finished, the trainer's side never does
])
def test_run_beside_raises_the_first_failure_and_prefers_the_nccl_cause(nccl, http, expected, within):
    t0 = time.perf_counter()
    if isinstance(expected, str):
        assert vllm_utils._run_beside(nccl, http, timeout=0.5) == expected
    else:
        with pytest.raises(expected):
            vllm_utils._run_beside(nccl, http, timeout=0.5)
    assert time.perf_counter() - t0 < within
