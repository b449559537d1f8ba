"""The trainer's log-probs apply the model's own final-logit transform (Gemma 2 soft-capping, Granite logits_scaling,
Cohere logit_scale), and the start-up check (check_logprobs) fails loudly on a transform it does not know."""

import pytest
import torch
from transformers import (
    CohereConfig,
    CohereForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)

import grpo
import online_dpo
import rloo

SCRIPTS = [grpo, rloo, online_dpo]
PAD = 0
TEMPERATURE = 0.7
SIZES = dict(
    vocab_size=300,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=PAD,
    tie_word_embeddings=False,
)
ARCHS = {
    "gemma2": lambda: Gemma2ForCausalLM(Gemma2Config(**SIZES, head_dim=8, final_logit_softcapping=30.0)),
    "granite": lambda: GraniteForCausalLM(GraniteConfig(**SIZES, logits_scaling=8.0)),
    "cohere": lambda: CohereForCausalLM(CohereConfig(**SIZES, logit_scale=0.0625)),
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SIZES)),
}


def tiny(arch):
    torch.manual_seed(0)
    model = ARCHS[arch]().eval()
    with (
        torch.no_grad()
    ):  # raw logits of up to 100: the soft cap (30) bites, and scaling them changes the log-probs a lot
        hidden = model(input_ids=torch.arange(1, 20)[None], output_hidden_states=True).hidden_states[-1]
        model.lm_head.weight.mul_(100 / model.lm_head(hidden).abs().max())
    return model


def batch():
    gen = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(1, 300, (n,), generator=gen).tolist()  # noqa: E731
    return grpo.collate([ids(3), ids(7), ids(1)], [ids(6), ids(2), ids(4)], "cpu", PAD)


def model_logprobs(model, ids, attn, pos, cmask, P):
    """log_softmax(model(...).logits / T) of the completion tokens: what generate samples from."""
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, P - 1 : -1]
    logprobs = (logits.float() / TEMPERATURE).log_softmax(-1).gather(-1, ids[:, P:, None]).squeeze(-1)
    return torch.where(cmask.bool(), logprobs, 0.0)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda m: m.__name__)
def test_per_token_logprobs_equal_the_model_logits(script, arch, monkeypatch):
    model, args = tiny(arch), batch()
    if arch == "gemma2":  # the cap bites: raw logits go well past it
        with torch.no_grad():
            assert model.lm_head(model(input_ids=args[0], output_hidden_states=True).hidden_states[-1]).abs().max() > 60
    reference = model_logprobs(model, *args)
    with torch.no_grad():
        ours = script.per_token_logprobs(model, *args, temperature=TEMPERATURE, chunk_tokens=5)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=0)
    # ...and the transform matters here: without it the log-probs are far off (Llama has none)
    monkeypatch.setattr(script, "final_logits", lambda logits, config: logits)
    with torch.no_grad():
        raw = script.per_token_logprobs(model, *args, temperature=TEMPERATURE, chunk_tokens=5)
    assert ((raw - reference).abs().max() > 0.5) == (arch != "llama")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda m: m.__name__)
def test_check_logprobs_passes_for_known_transforms(script, arch):
    script.check_logprobs(tiny(arch), list(range(5, 25)), "cpu", world_size=1)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda m: m.__name__)
def test_check_logprobs_raises_for_an_unknown_transform(script, monkeypatch):
    # a forward that transforms its logits after the LM head in a way final_logits does not know
    model = tiny("llama")
    forward = model.forward

    def scaled_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits = out.logits * 0.5
        return out

    monkeypatch.setattr(model, "forward", scaled_forward)
    with pytest.raises(ValueError, match="LlamaForCausalLM.*would not match the sampler"):
        script.check_logprobs(model, list(range(5, 25)), "cpu", world_size=1)
    # the same for a known architecture whose transform the trainer would skip (the bug this check guards against)
    monkeypatch.setattr(script, "final_logits", lambda logits, config: logits)
    with pytest.raises(ValueError, match="Gemma2ForCausalLM"):
        script.check_logprobs(tiny("gemma2"), list(range(5, 25)), "cpu", world_size=1)


@pytest.mark.parametrize("temperature", [TEMPERATURE, 1.0])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda m: m.__name__)
def test_per_token_logprobs_gradients_equal_autograd_of_the_model_logits(script, arch, temperature):
    """TokenLogprobs writes its own backward (onehot - softmax, chained through the model's transform): every
    parameter's gradient, the LM head's and the layers' below it, equals autograd's through the model's own logits."""
    model, (ids, attn, pos, cmask, P) = tiny(arch), batch()
    if arch == "llama":  # an LM head with a bias (GPT-J, Phi-2 have one): its gradient too
        model.lm_head.bias = torch.nn.Parameter(torch.randn(model.lm_head.out_features))
    weights = torch.randn(cmask.shape, generator=torch.Generator().manual_seed(2)) * cmask

    def gradients(logprobs):
        model.zero_grad()
        (logprobs * weights).sum().backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, P - 1 : -1].float() / temperature
    expected = gradients(logits.log_softmax(-1).gather(-1, ids[:, P:, None]).squeeze(-1))
    ours = gradients(script.per_token_logprobs(model, ids, attn, pos, cmask, P, temperature, chunk_tokens=5))
    assert expected.keys() == ours.keys() and "lm_head.weight" in ours
    for name in expected:  # to float32 rounding, relative to the largest entry (the logits reach 100 here)
        assert (ours[name] - expected[name]).abs().max() <= 1e-5 * expected[name].abs().max(), name


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda m: m.__name__)
def test_per_token_logprobs_under_bfloat16_autocast(script):
    """The GPU path: fp32 weights, the forward under bf16 autocast (the scripts' --bf16 on CUDA; CPU autocast here).
    TokenLogprobs computes the LM head in bf16 as the model would, and hands back fp32 gradients to fp32 weights."""
    model, (ids, attn, pos, cmask, P) = tiny("llama"), batch()
    with torch.no_grad():
        reference = script.per_token_logprobs(model, ids, attn, pos, cmask, P, TEMPERATURE)
    with torch.autocast("cpu", torch.bfloat16):
        logprobs = script.per_token_logprobs(model, ids, attn, pos, cmask, P, TEMPERATURE, chunk_tokens=5)
    logprobs.sum().backward()
    assert logprobs.dtype == torch.float32 and model.lm_head.weight.grad.dtype == torch.float32
    difference = (logprobs - reference).abs()[cmask.bool()]  # bf16 rounding of logits that reach 100 here
    assert 0 < difference.mean() < 0.25 and reference.abs()[cmask.bool()].mean() > 10 * difference.mean()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters() if p.requires_grad)


class ShapeDtypes(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the dtype of every tensor of one shape that an operation returns."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.dtypes = shape, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and tuple(out.shape) == self.shape:
            self.dtypes.append(out.dtype)
        return out


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda m: m.__name__)
def test_bfloat16_weights_get_no_float32_copy_of_the_lm_head(script):
    """With bf16 weights (--param-dtype bfloat16, FSDP2 mixed precision) the LM head's gradient is summed in bf16, as
    the weight is: a float32 vocabulary x hidden buffer would add 6 bytes per LM-head weight at the backward's start."""
    model, (ids, attn, pos, cmask, P) = tiny("llama").to(torch.bfloat16), batch()
    logprobs = script.per_token_logprobs(model, ids, attn, pos, cmask, P, TEMPERATURE, chunk_tokens=5)
    with ShapeDtypes(tuple(model.lm_head.weight.shape)) as created:
        logprobs.sum().backward()
    assert created.dtypes and torch.float32 not in created.dtypes, created.dtypes
    assert model.lm_head.weight.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda m: m.__name__)
def test_a_frozen_lm_head_gets_no_gradient_buffer(script):
    """A frozen LM head (--use-peft's base) gets no vocabulary x hidden gradient buffer in the backward (at 7B: a
    1 GB tensor zeroed and dropped each micro-batch); the layers below still get autograd's gradients."""
    model, (ids, attn, pos, cmask, P) = tiny("llama"), batch()
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, P - 1 : -1].float() / TEMPERATURE
    (logits.log_softmax(-1).gather(-1, ids[:, P:, None]).squeeze(-1) * cmask).sum().backward()
    frozen = ("lm_head.weight", "model.embed_tokens.weight")  # as peft's (the embedding: the head's shape here)
    expected = {name: p.grad.clone() for name, p in model.named_parameters() if name not in frozen}
    model.zero_grad(set_to_none=True)
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    logprobs = script.per_token_logprobs(model, ids, attn, pos, cmask, P, TEMPERATURE, chunk_tokens=5)
    with ShapeDtypes(tuple(model.lm_head.weight.shape)) as created:
        (logprobs * cmask).sum().backward()
    assert created.dtypes == [] and model.lm_head.weight.grad is None
    for name, grad in expected.items():
        got = dict(model.named_parameters())[name].grad
        assert (got - grad).abs().max() <= 1e-5 * grad.abs().max(), name
