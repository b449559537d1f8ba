"""Code that grpo.py, rloo.py and online_dpo.py each carry a copy of (hf_generate, clip_gradients): every copy tested."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import grpo
import online_dpo
import rloo
from grpo_cli import STORIES

SCRIPTS = [grpo, rloo, online_dpo]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda m: m.__name__)
def test_hf_generate_ignores_the_model_generation_config(script):
    # generate fills the fields its config leaves None from model.generation_config (generation_config.json):
    # suppressing every token but one there would make every sampled token that one
    model = AutoModelForCausalLM.from_pretrained(STORIES)
    kept = 100
    model.generation_config.suppress_tokens = [t for t in range(model.config.vocab_size) if t != kept]
    saved = model.generation_config
    args = script.Args(num_generations=8, max_completion_length=4, temperature=1.0, top_k=0, bf16=False)
    torch.manual_seed(0)
    completions, _ = script.hf_generate(model, [[1, 403, 412]], args, eos_ids=[2], pad_id=0)
    tokens = [t for c in completions for t in c]
    assert len(tokens) > 8 and sum(t != kept for t in tokens) > len(tokens) // 2, tokens
    assert model.generation_config is saved  # restored


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda m: m.__name__)
def test_clip_gradients(script):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    model(torch.randn(5, 4)).square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    norm = torch.cat([g.flatten() for g in grads]).norm()
    # <= 0: no clipping, and the norm is still returned
    for max_norm in (0.0, -1.0):
        torch.testing.assert_close(script.clip_gradients(model, max_norm), norm)
        for p, g in zip(model.parameters(), grads):
            torch.testing.assert_close(p.grad, g)
    # > 0: the gradient is scaled to max_norm (the returned norm is the one before clipping)
    torch.testing.assert_close(script.clip_gradients(model, norm.item() / 4), norm)
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g / 4, rtol=1e-4, atol=1e-6)
