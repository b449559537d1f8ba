"""per_token_logprobs and hf_generate on a tiny random Llama, against naive per-row references."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import grpo

PAD = 0
TEMPERATURE = 0.7


def tiny_llama(seed=0, tie=False):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        pad_token_id=PAD,
    )
    return LlamaForCausalLM(config).eval()


def batch(seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(1, 300, (n,), generator=gen).tolist()  # noqa: E731
    # prompts of different lengths (left padding) and completions of different lengths (right padding), one empty
    prompts = [ids(3), ids(7), ids(1), ids(5)]
    completions = [ids(6), ids(2), ids(4), []]
    return prompts, completions


def naive_logprobs(model, prompts, completions, temperature):
    """Each row on its own, unpadded: logits of the positions before each completion token, at `temperature`."""
    rows, entropies = [], []
    for p, c in zip(prompts, completions):
        if not c:
            rows.append(torch.zeros(0))
            entropies.append(torch.zeros(0))
            continue
        logits = model(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1 : -1] / temperature
        logp = logits.log_softmax(-1)
        rows.append(logp.gather(-1, torch.tensor(c)[:, None]).squeeze(-1))
        entropies.append(-(logp.exp() * logp).sum(-1).detach())
    return rows, entropies


@pytest.mark.parametrize("tie", [False, True])
def test_per_token_logprobs_matches_naive(tie):
    model = tiny_llama(tie=tie)
    prompts, completions = batch()
    ids, attn, pos, cmask, P = grpo.collate(prompts, completions, "cpu", PAD)
    assert P == 7 and ids.shape == (4, 7 + 6) and cmask.sum(-1).tolist() == [6, 2, 4, 0]
    assert ids[2, :6].tolist() == [PAD] * 6 and pos[1].tolist() == list(range(9)) + [8] * 4  # left-padded prompts
    weights = torch.randn(4, 6, generator=torch.Generator().manual_seed(2))

    logprobs, entropy = grpo.per_token_logprobs(
        model, ids, attn, pos, cmask, P, TEMPERATURE, chunk_tokens=3, with_entropy=True
    )
    assert logprobs.shape == (4, 6)
    (logprobs * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    reference, ref_entropy = naive_logprobs(model, prompts, completions, TEMPERATURE)
    sum(((r * weights[i, : len(r)]).sum() for i, r in enumerate(reference)), torch.tensor(0.0)).backward()
    for i, (r, e) in enumerate(zip(reference, ref_entropy)):
        n = len(r)
        torch.testing.assert_close(logprobs[i, :n].detach(), r.detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(entropy[i, :n], e, atol=1e-5, rtol=0)
        assert (logprobs[i, n:] == 0).all() and (entropy[i, n:] == 0).all()  # padding
    assert (logprobs < 0).sum() == 12  # every real token got a (negative) log-prob
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, atol=1e-5, rtol=1e-4, msg=f"gradient of {name}")
    assert grads["model.embed_tokens.weight"].abs().sum() > 0


def test_per_token_logprobs_chunk_size_and_no_grad_agree():
    model = tiny_llama()
    prompts, completions = batch(seed=3)
    args = grpo.collate(prompts, completions, "cpu", PAD)
    with torch.no_grad():
        a = grpo.per_token_logprobs(model, *args, temperature=1.0, chunk_tokens=1)
        b = grpo.per_token_logprobs(model, *args, temperature=1.0, chunk_tokens=1024)
    c = grpo.per_token_logprobs(model, *args, temperature=1.0, chunk_tokens=5)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    torch.testing.assert_close(a, c.detach(), atol=1e-6, rtol=0)
    # the same rows in a different padding layout (alone in the batch) give the same log-probs
    alone = grpo.collate(prompts[:1], completions[:1], "cpu", PAD)
    with torch.no_grad():
        d = grpo.per_token_logprobs(model, *alone, temperature=1.0)
    torch.testing.assert_close(d[0], a[0, : d.shape[1]], atol=1e-5, rtol=0)


def test_hf_generate_samples_the_full_softmax_and_cuts_at_eos():
    model = tiny_llama()
    with torch.no_grad():  # logits all within ~1e-3 of each other (distinct, or top-k would keep every tie):
        model.lm_head.weight.mul_(1e-3)  # the sampling distribution is almost uniform over the 300 tokens
    args = grpo.Args(num_generations=400, max_completion_length=1, temperature=TEMPERATURE, top_k=0, bf16=False)
    completions, sampling_logprobs = grpo.hf_generate(model, [[5, 6, 7]], args, eos_ids=[2], pad_id=PAD)
    assert sampling_logprobs is None and len(completions) == 400 and all(len(c) == 1 for c in completions)
    # --top-k 0 means no top-k: 400 uniform draws over 300 tokens hit ~220 distinct tokens (top-50 would cap it at 50)
    assert len({c[0] for c in completions}) > 150

    # EOS: with a third of the vocabulary as stop tokens, most completions stop early; each is cut after its first EOS
    eos = list(range(100))
    args = grpo.Args(num_generations=64, max_completion_length=8, top_k=0, bf16=False)
    completions, _ = grpo.hf_generate(model, [[5, 6, 7], [9]], args, eos_ids=eos, pad_id=PAD)
    assert len(completions) == 128
    assert sum(len(c) < 8 for c in completions) > 64
    for c in completions:
        assert 1 <= len(c) <= 8
        assert not any(token in eos for token in c[:-1])
        assert c[-1] in eos or len(c) == 8
