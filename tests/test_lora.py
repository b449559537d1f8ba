"""LoRA (--use-peft, peft) on the CPU: the weights vLLM gets are the merged W + (alpha / r) B A in the dtype sent,
through every path (colocate's reload, NCCL, IPC) and with the stored base unchanged; the reference model is the base
itself (the adapters disabled: no copy, the base model's log-probs exactly); set_up trains the adapters alone, over a
frozen bf16 base; a resume from an adapter checkpoint is bit-identical to the run without the interruption; the
scripts learn with LoRA; 2 ranks end with the adapter 1 rank ends with."""

import json
import os
import signal
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from test_vllm_utils import FakeIPC, _sync_routes, serve  # noqa: F401 - serve: the stand-in server's fixture
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

import grpo
import online_dpo
import rloo
import vllm_utils
from grpo_cli import ASSETS, SMALL, STORIES, check, read_metrics, run_grpo

LORA = grpo.Args(use_peft=True, lora_r=4, lora_alpha=12)  # alpha / r = 3
LORA_LEARNING_RATE = 1e-3  # the quickstart task's with --use-peft (the full model's 2e-4 learns too slowly)


def tiny_qwen2():
    """A random Qwen2 (untied LM head, q/k/v biases) in bf16."""
    torch.manual_seed(0)
    config = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
    return Qwen2ForCausalLM(Qwen2Config(**config, num_key_value_heads=1)).to(torch.bfloat16)


def trained_lora(base, dtype=torch.float32):
    """grpo's LoRA model over `base` with B moved off its zero start (as training moves it)."""
    model = grpo.add_lora(LORA, base, dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.2)
    return model


def merged_expectation(model, plain_names, dtype=torch.bfloat16):
    """{base model's name: W + 3 B A in float32, rounded once to dtype} computed here from the LoRA layers."""
    expected = {}
    for name, module in model.get_base_model().named_modules():
        if hasattr(module, "base_layer") and "default" in getattr(module, "lora_A", {}):
            W, A, B = module.base_layer.weight, module.lora_A["default"].weight, module.lora_B["default"].weight
            expected[f"{name}.weight"] = (W.float() + 3.0 * (B.float() @ A.float())).to(dtype)
    assert expected and set(expected) <= set(plain_names)
    return expected


def check_pushed(pushed, model, plain):
    """pushed ({name: tensor}) holds every base weight under the plain model's names: the adapted ones merged, the
    others as they are, all bf16; no LoRA matrix is sent."""
    plain_names = [n for n, _ in plain.named_parameters()]
    assert list(pushed) == plain_names
    expected = merged_expectation(model, plain_names)
    stored = {n.replace(".base_layer.", "."): p for n, p in model.get_base_model().named_parameters()}
    for name, tensor in pushed.items():
        assert tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor, expected.get(name, stored[name].to(torch.bfloat16))), name
    assert all(not torch.equal(pushed[name], stored[name]) for name in expected)  # B A moved every adapted weight


class RecordingLLM:
    """A colocated engine that keeps the tensors its reload path receives."""

    def __init__(self):
        self.loads = []

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.loads.append({name: tensor.clone() for name, tensor in kwargs["weights_iterator"]})

    def reset_prefix_cache(self):
        pass


@pytest.mark.parametrize("architecture", ["stories260K (llama, tied)", "qwen2 (untied, biases)"])
def test_every_push_sends_the_merged_weights_and_leaves_the_base_as_it_was(serve, monkeypatch, architecture):  # noqa: F811
    from vllm.distributed.weight_transfer import packed_tensor

    if architecture.startswith("stories"):
        plain, base = (AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.bfloat16) for _ in range(2))
    else:
        plain, base = tiny_qwen2(), tiny_qwen2()
    model = trained_lora(base)
    before = {name: param.clone() for name, param in model.named_parameters()}
    # the announced metadata is the plain model's: a server of the base model takes it (check_same_model's test)
    meta, plain_meta = vllm_utils.weight_metadata(model), vllm_utils.weight_metadata(plain)
    assert meta == plain_meta

    llm = RecordingLLM()  # colocate: vLLM's reload path
    vllm_utils.sync_weights({"mode": "colocate", "sleep": False, "llm": llm, "tp_group": None}, model)
    check_pushed(llm.loads[0], model, plain)

    broadcast = {}  # server over NCCL: what the packed producer gets
    producer = lambda weights, *rest: broadcast.update({n: t.clone() for n, t in weights})  # noqa: E731
    monkeypatch.setattr(packed_tensor, "packed_nccl_broadcast_producer", producer)
    server = serve(_sync_routes())
    vllm_utils.server_sync_weights(server.url, "group", model, "0.26.0", 1 << 20, timeout=5)
    check_pushed(broadcast, model, plain)
    assert server.calls[3][2]["update_info"]["names"] == list(broadcast)

    ipc = FakeIPC(monkeypatch)  # server over CUDA IPC: what the stand-in rebuilds from the chunks
    server = serve(_sync_routes(**{"/update_weights": ipc.update_weights, "/init_weight_transfer_engine": (200, {})}))
    vllm_utils.server_sync_weights_ipc(server.url, model, "0.33.0", 4096, timeout=5, name="m")
    check_pushed(ipc.received, model, plain)

    for name, param in model.named_parameters():  # never merged into the stored base
        assert torch.equal(param, before[name]) and param.dtype == before[name].dtype, name


def test_a_colocated_engine_gets_the_merged_weights_before_its_first_round(monkeypatch):
    """It starts from the base model (a checkpoint holds only the adapter): with LoRA it is pushed at once, also at a
    resume."""
    pushed = []
    monkeypatch.setattr(vllm_utils, "start", lambda args, path, longest, images: {"mode": args.vllm_mode, "path": path})
    monkeypatch.setattr(vllm_utils, "sync_weights", lambda engine, model: pushed.append(engine["path"]))
    vllm_utils.start_with_weights(SimpleNamespace(vllm_mode="colocate", use_peft=True), "MODEL", "base", 10)
    assert pushed == ["base"]


def test_the_reference_is_the_base_with_the_adapters_off():
    """The same log-probs, exactly, as the base model loaded on its own in the same dtype; the policy's differ, and
    the adapters are still trained after the reference pass."""
    alone = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.bfloat16)
    model = trained_lora(AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.bfloat16))
    batch = grpo.collate([[1, 403, 412], [1, 50]], [[60, 70, 80, 90], [100, 2]], torch.device("cpu"), 0)
    with torch.no_grad():
        reference = grpo.per_token_logprobs(grpo.WithoutAdapters(model), *batch)
        assert torch.equal(reference, grpo.per_token_logprobs(alone, *batch))
        assert not torch.allclose(grpo.per_token_logprobs(model, *batch), reference, atol=1e-3)
    trained = [name for name, param in model.named_parameters() if param.requires_grad]
    assert trained and all(".lora_" in name for name in trained)


def test_under_autocast_the_adapters_save_no_copy_of_their_input():
    """Under bf16 autocast (CUDA's default), peft's cast of a LoRA layer's input to the fp32 adapters' dtype is
    switched off: autocast casts it back to the same bf16 values, but each copy is a new tensor that autograd saves, so
    q, k and v would save their shared input three times and gate/up twice (the 7B shape's first training forward ran
    out of memory). Logits and gradients are bit-identical either way (bf16 -> fp32 -> bf16 is lossless; dropout 0)."""
    config = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))

    def forward_backward(autocast):
        torch.manual_seed(0)
        base = Qwen2ForCausalLM(Qwen2Config(**config, num_key_value_heads=2)).to(torch.bfloat16)
        model = grpo.add_lora(LORA, base, torch.float32, autocast=autocast)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.2)
        weights = {param.untyped_storage().data_ptr() for param in model.parameters()}
        saved = {}  # storage -> bytes: a tensor saved by several operations counts once

        def pack(tensor):
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            with torch.autocast("cpu", torch.bfloat16, cache_enabled=False):
                logits = model(input_ids=ids).logits
        logits.float().square().mean().backward()
        grads = [param.grad for param in model.parameters() if param.requires_grad]
        return logits, grads, sum(n for ptr, n in saved.items() if ptr not in weights)

    logits, grads, saved = forward_backward(autocast=True)
    peft_logits, peft_grads, peft_saved = forward_backward(autocast=False)  # peft's own casting
    assert torch.equal(logits, peft_logits) and all(map(torch.equal, grads, peft_grads))
    hidden_copies = 3 * ids.numel() * config["hidden_size"] * 2  # per layer: 2 of q/k/v's, 1 of gate/up's, bf16
    assert peft_saved - saved >= config["num_hidden_layers"] * hidden_copies, (peft_saved, saved)


def test_hf_generate_ignores_the_generation_config_of_the_model_under_the_adapters():
    """As tests/test_common.py's test for a plain model: the checkpoint's generation_config.json (here suppressing
    every token but one) does not reach generate through the peft wrapper either."""
    base = AutoModelForCausalLM.from_pretrained(STORIES)
    kept = 100
    base.generation_config.suppress_tokens = [t for t in range(base.config.vocab_size) if t != kept]
    model = trained_lora(base)
    args = grpo.Args(num_generations=8, max_completion_length=4, temperature=1.0, top_k=0, bf16=False)
    torch.manual_seed(0)
    completions, _ = grpo.hf_generate(model, [[1, 403, 412]], args, eos_ids=[2], pad_id=0)
    tokens = [t for c in completions for t in c]
    assert len(tokens) > 8 and sum(t != kept for t in tokens) > len(tokens) // 2, tokens
    assert base.generation_config.suppress_tokens  # restored


@pytest.mark.parametrize("script", [grpo, rloo, online_dpo], ids=lambda m: m.__name__)
def test_set_up_trains_the_adapters_alone_over_a_frozen_bf16_base(monkeypatch, tmp_path, script):
    """One model is loaded (the reference is the policy with its adapters off); the base is bf16 and frozen, the
    adapters are in --param-dtype and are all the optimizer holds."""
    loads, load = [], AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: loads.append(a) or load(*a, **k))
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    data = str(ASSETS / "stories_prompts.jsonl")
    args = script.Args(
        model_name_or_path=STORIES, dataset_name=data, prompt_column="prompt", answer_column="",
        reward_funcs=["keyword_reward"], use_chat_template=False, bf16=False, output_dir=str(tmp_path / "run"),
        use_peft=True, beta=[0.1] if script is online_dpo else 0.1, max_steps=1, prompts_per_step=2, num_generations=2, max_completion_length=8,
    )  # fmt: skip
    try:
        run = script.set_up(args, script.RULES, reference_model=True)
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
    os.close(run.lock)
    assert len(loads) == 1 and isinstance(run.ref_model, script.WithoutAdapters) and run.ref_model.model is run.model
    optimized = {id(p) for group in run.optimizer.param_groups for p in group["params"]}
    for name, param in run.model.named_parameters():
        adapter = ".lora_" in name
        assert (id(param) in optimized) == adapter == param.requires_grad, name
        assert param.dtype == (torch.float32 if adapter else torch.bfloat16), name


def test_resume_from_an_adapter_checkpoint_is_bit_identical(tmp_path):
    """Checkpoints hold the adapter (peft's files) and its optimizer state, not the base; a crash after step 2's
    checkpoint and a resume end with the very adapter, and the very metrics, of the run without the crash. The KL to
    the reference (the base) is exactly 0 at step 1."""
    out = tmp_path / "run"
    data = ASSETS / "stories_prompts.jsonl"
    common = [*SMALL, "--dataset-name", data, "--output-dir", out, "--max-steps", 4, "--save-steps", 2, "--seed", 5]
    common += ["--use-peft", "--beta", 0.04, "--save-merged-model"]
    check(run_grpo(*common))
    metrics = read_metrics(out)
    assert metrics[0]["kl/k3_token_mean"] == 0.0 and metrics[-1]["kl/k3_token_mean"] > 0
    names = set(p.name for p in (out / "checkpoint-2").iterdir())
    assert {"adapter_config.json", "adapter_model.safetensors", "trainer_state.pt"} <= names
    assert not names & {"model.safetensors", "config.json"}  # no base weights in a checkpoint
    final = load_file(out / "adapter_model.safetensors")
    assert any(name.endswith("lora_B.weight") and tensor.abs().max() > 0 for name, tensor in final.items())
    merged = AutoModelForCausalLM.from_pretrained(out / "merged")  # the merged model loads as a plain model
    assert merged.dtype == torch.bfloat16

    (out / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics[:2]))
    result = check(run_grpo(*common, "--resume-from-checkpoint", out / "checkpoint-2"))
    assert "at step 2" in result.stdout
    resumed = load_file(out / "adapter_model.safetensors")
    assert resumed.keys() == final.keys()
    for name in final:
        assert torch.equal(resumed[name], final[name]), name
    again = read_metrics(out)
    untimed = lambda m: {k: v for k, v in m.items() if not k.startswith(("timing/", "step_time"))}  # noqa: E731
    assert [untimed(m) for m in again] == [untimed(m) for m in metrics]


def test_lora_learns_the_quickstart_task(lora_learning_run):
    """The quickstart task (tests/test_learning.py's, the same bars) with --use-peft: the reward rises."""
    out = lora_learning_run(LORA_LEARNING_RATE)
    assert (out / "adapter_model.safetensors").exists() and not (out / "model.safetensors").exists()
    reward = [m["reward"] for m in read_metrics(out)]
    assert len(reward) == 30
    first, last = sum(reward[:5]) / 5, sum(reward[-5:]) / 5
    assert reward[0] < 0.5, reward
    assert last >= 0.8 and last - first >= 0.35, f"first 5 steps {first:.3f}, last 5 steps {last:.3f}: {reward}"


def test_two_ranks_end_with_the_adapter_of_one(lora_same_steps_run):
    """test_distributed's 1-vs-2-ranks runs (grpo.py, the same global batch) with --use-peft: the same adapter."""
    tmp_path, one, two = lora_same_steps_run.result()
    assert one.returncode == 0, one.stderr[-4000:]
    assert two.returncode == 0, two.stderr[-4000:]
    a1, a2 = (load_file(tmp_path / run / "adapter_model.safetensors") for run in ("one", "two"))
    assert a1.keys() == a2.keys() and any(n.endswith("lora_B.weight") and a1[n].abs().max() > 5e-3 for n in a1)
    for name in a1:
        assert torch.allclose(a1[name], a2[name], atol=1e-5, rtol=1e-5), (name, (a1[name] - a2[name]).abs().max())


@pytest.mark.parametrize("script", [grpo, rloo, online_dpo], ids=lambda m: m.__name__)
def test_torch_compile_is_off_with_lora_and_a_line_says_so(capsys, script):
    vllm_utils.check_args(script.Args(use_vllm=True, use_peft=True))
    assert "--torch-compile is off with --use-peft" in capsys.readouterr().out
    vllm_utils.check_args(script.Args(use_vllm=True, use_peft=True, torch_compile=False))
    vllm_utils.check_args(script.Args(use_vllm=True))
    assert "--torch-compile" not in capsys.readouterr().out


@pytest.mark.parametrize("script", ["rloo.py", "online_dpo.py"])
def test_rloo_and_online_dpo_train_an_adapter_whose_reference_is_the_base(tmp_path, script):
    """Through the scripts: the KL to the reference (the base, adapters off) is exactly 0 at step 1, later not; the
    output is the adapter."""
    from grpo_cli import STORIES_TASK, run_script

    out = tmp_path / "run"
    args = [*STORIES_TASK, "--max-completion-length", 12, "--prompts-per-step", 8, "--max-steps", 3, "--seed", 1]
    args += ["--use-peft", "--learning-rate", 1e-2, "--output-dir", out]
    args += ["--num-generations", 4, "--beta", 0.05] if script == "rloo.py" else ["--num-generations", 2]
    check(run_script(script, *args))
    kl = [m["kl/k1_token_mean" if script == "rloo.py" else "kl/k1_sequence_sum"] for m in read_metrics(out)]
    assert kl[0] == 0.0 and any(value != 0 for value in kl[1:]), kl
    assert (out / "adapter_model.safetensors").exists() and not (out / "model.safetensors").exists()


def test_a_moe_model_with_its_3d_experts_adapted_is_refused_and_one_with_attention_lora_pushed(tmp_path):
    """Qwen3-MoE in transformers 5 keeps each layer's experts as 3-D tensors, not Linear layers, yet peft 0.21's
    all-linear adapts them (target_parameters): the push, which merges Linear layers only, refuses that with the fix.
    With the attention layers named, it sends what save_pretrained writes (per-expert tensors), the experts as they
    were and the attention merged."""
    from transformers import Qwen3MoeConfig

    config = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2)
    config.update(intermediate_size=48, moe_intermediate_size=8, num_experts_per_tok=2, tie_word_embeddings=False)
    config = Qwen3MoeConfig(**config, head_dim=16, num_experts=4, decoder_sparse_step=1, mlp_only_layers=[])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    model = trained_lora(AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16))
    assert any("experts" in name for name, _ in model.named_parameters() if ".lora_" in name)  # peft's choice
    with pytest.raises(NotImplementedError, match="mlp.experts.*name Linear layers in --lora-target-modules"):
        list(vllm_utils.named_weights(model))
    attention = grpo.Args(use_peft=True, lora_r=4, lora_alpha=12, lora_target_modules=["q_proj", "k_proj", "v_proj"])
    model = grpo.add_lora(
        attention, AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16), torch.float32
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.2)
    sent = dict(vllm_utils.named_weights(model))
    assert sorted(sent) == sorted(saved) and vllm_utils.weight_metadata(model)["names"] == list(sent)
    for name, tensor in saved.items():
        assert torch.equal(sent[name], tensor) != any(f".{p}." in name for p in ("q_proj", "k_proj", "v_proj")), name


def test_lora_under_torchrun_checkpoints_and_resumes(tmp_path):
    """FSDP2 on 2 ranks: the adapter checkpoint (gathered by parameter name) resumes on 2 ranks, to the same adapter
    as the run that was not interrupted."""
    from grpo_cli import launch

    out = tmp_path / "run"
    data = ASSETS / "stories_prompts.jsonl"
    common = [*SMALL, "--dataset-name", data, "--output-dir", out, "--prompts-per-step", 4, "--save-steps", 1]
    common += ["--use-peft", "--beta", 0.04, "--max-steps", 3]
    result = launch("grpo.py", *common, nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    final, metrics = load_file(out / "adapter_model.safetensors"), read_metrics(out)
    (out / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics[:2]))
    resumed = launch("grpo.py", *common, "--resume-from-checkpoint", out / "checkpoint-2", nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = load_file(out / "adapter_model.safetensors")
    assert again.keys() == final.keys() and metrics[0]["kl/k3_token_mean"] == 0.0
    for name in final:
        torch.testing.assert_close(again[name], final[name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("script", [grpo, rloo, online_dpo])
def test_the_micro_batch_default_is_halved_for_lora(script):
    """--micro-batch-tokens left unset: 16384 tokens, 8192 with --use-peft (a 7B shape ran out of memory at 16384 on
    one H200); a value given is kept."""
    for flags, expected in (({}, 16384), (dict(use_peft=True), 8192), (dict(use_peft=True, micro_batch_tokens=99), 99)):
        args = script.Args(model_name_or_path=STORIES, **flags)  # (a hub name not cached here is one HEAD request)
        script.check_args(args, world_size=1)
        assert args.micro_batch_tokens == expected
