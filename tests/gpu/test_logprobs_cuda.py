"""The scripts' LM-head log-probs on CUDA under bf16 autocast (their training path): the LM head's weight gradient is
summed over the token chunks in float32 (torch.addmm with out_dtype, CUDA only), so splitting the tokens into chunks
changes it only by float32 rounding; a bf16-rounded product per chunk would change it ~1000 x more."""

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
    model = LlamaForCausalLM(LlamaConfig(**sizes, num_key_value_heads=2, tie_word_embeddings=False)).cuda()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 4096, (8,), generator=gen).tolist() for _ in range(8)]
    completions = [torch.randint(1, 4096, (200,), generator=gen).tolist() for _ in range(8)]
    batch = grpo.collate(prompts, completions, "cuda", 0)

    def weight_gradient(chunk_tokens):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.bfloat16):
            logprobs = script.per_token_logprobs(model, *batch, 1.0, chunk_tokens)
        (logprobs * torch.linspace(-1, 1, logprobs.shape[1], device="cuda")).sum().backward()
        assert model.lm_head.weight.grad.dtype == torch.float32
        return model.lm_head.weight.grad.clone()

    whole, chunked = weight_gradient(4096), weight_gradient(16)  # 1600 tokens: one chunk, or 100
    error = ((chunked - whole).abs().max() / whole.abs().max()).item()
    assert error < 1e-5, f"chunked LM-head weight gradient differs by {error:.2g} (relative): rounded per chunk?"
