"""The scripts' LM-head log-probs on CUDA under bf16 autocast (their training path): the LM head's weight gradient is
summed over the token chunks in float32 (torch.addmm with out_dtype, CUDA only), so splitting the tokens into chunks
changes it only by float32 rounding; a bf16-rounded product per chunk would change it ~1000 x more. And the
torch.compile'd softmax kernels (script.fused) compute what their eager versions do."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import grpo
import online_dpo
import rloo


@pytest.mark.parametrize("script", [grpo, rloo, online_dpo], ids=lambda m: m.__name__)
def test_chunked_weight_gradient_is_summed_in_float32(script):
    torch.manual_seed(0)
    sizes = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4)
    model = LlamaForCausalLM(LlamaConfig(**sizes, num_key_value_heads=2, tie_word_embeddings=False))
    model.lm_head.bias = torch.nn.Parameter(torch.randn(4096) * 0.1)  # an LM head with a bias (GPT-J, Phi-2)
    reference_model, model = copy.deepcopy(model).double(), model.cuda()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 4096, (8,), generator=gen).tolist() for _ in range(8)]
    completions = [torch.randint(1, 4096, (200,), generator=gen).tolist() for _ in range(8)]

    def gradients(model, device, chunk_tokens, autocast):
        model.zero_grad(set_to_none=True)
        batch = grpo.collate(prompts, completions, device, 0)
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            logprobs = script.per_token_logprobs(model, *batch, 0.7, chunk_tokens)
        (logprobs * torch.linspace(-1, 1, logprobs.shape[1], device=device)).sum().backward()
        params = model.lm_head.weight, model.lm_head.bias, model.model.embed_tokens.weight  # the last via grad_hidden
        return [p.grad.clone().double().cpu() for p in params]

    # 1600 tokens: one chunk, or 123 of 13 tokens and a 1-token remainder
    whole, chunked = gradients(model, "cuda", 4096, True), gradients(model, "cuda", 13, True)
    assert model.lm_head.weight.grad.dtype == torch.float32
    error = ((chunked[0] - whole[0]).abs().max() / whole[0].abs().max()).item()
    assert error < 1e-5, f"chunked LM-head weight gradient differs by {error:.2g} (relative): rounded per chunk?"
    reference = gradients(reference_model, "cpu", 64, False)  # float64 on the CPU
    for ours, exact in zip(chunked, reference):  # bf16 logits: ~1e-2; a wrong formula: ~1
        assert (ours - exact).abs().max() < 3e-2 * exact.abs().max()


@pytest.mark.parametrize("script", [grpo, rloo, online_dpo], ids=lambda m: m.__name__)
def test_compiled_softmax_kernels_equal_eager(script):
    """On CUDA the LM head's elementwise work runs torch.compile'd (script.fused): same numbers as the eager functions
    the CPU tests check, for a bf16 chunk of odd length at a temperature other than 1."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(37, 4099, device="cuda", generator=gen) * 8).bfloat16()
    targets = torch.randint(0, 4099, (37,), device="cuda", generator=gen)
    stats, compiled_stats = script.softmax_stats(logits, targets, 0.7), script.fused(script.softmax_stats, logits)
    for eager, fused in zip(stats, compiled_stats(logits, targets, 0.7)):
        torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)
    grad_logprobs = torch.randn(37, device="cuda", generator=gen)
    eager = script.softmax_grad(logits, stats[0], grad_logprobs, targets, 0.7)
    fused = script.fused(script.softmax_grad, logits)(logits, stats[0], grad_logprobs, targets, 0.7)
    assert fused.dtype == eager.dtype == torch.bfloat16
    torch.testing.assert_close(fused.float(), eager.float(), rtol=1e-2, atol=1e-3)
