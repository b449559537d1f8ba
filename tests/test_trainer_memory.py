"""The trainer's memory-saving paths in grpo.py, rloo.py and online_dpo.py: the LM head's gradient goes straight into
the weight's .grad from the second micro-batch on, gradients are freed right after the optimizer step (before the
weight sync and the next round's generation)."""

import functools

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import grpo
import online_dpo
import rewards
import rloo
from grpo_cli import STORIES_TASK
from test_logits import SIZES

SCRIPTS = [grpo, rloo, online_dpo]


def tiny_llama(tie_word_embeddings=False):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**SIZES, "tie_word_embeddings": tie_word_embeddings}))


def micro_batches():
    gen = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(1, 300, (n,), generator=gen).tolist()  # noqa: E731
    return [grpo.collate([ids(3), ids(7)], [ids(6), ids(2)], "cpu", 0), grpo.collate([ids(5)], [ids(9)], "cpu", 0)]


class CountShape(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the new tensors of one shape that operations allocate (not views or in-place results of their inputs)."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.count = shape, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = torch.utils._pytree.tree_leaves((args, kwargs))
        storages = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
        if isinstance(out, torch.Tensor) and tuple(out.shape) == self.shape:
            self.count += out.untyped_storage().data_ptr() not in storages
        return out


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda m: m.__name__)
def test_lm_head_gradient_goes_into_grad_without_a_second_buffer(script, tied):
    """into_grad=True (the training loops' loss.backward()): the second micro-batch adds the LM head's gradient to the
    weight's .grad directly, so fewer vocabulary x hidden tensors are created (the embedding's own gradient is the one
    left), and every gradient is the same as when autograd sums a separate buffer into .grad."""
    grads, created = {}, {}
    for into_grad in (False, True):
        model = tiny_llama(tie_word_embeddings=tied)  # tied: the embedding's gradient lands in the same .grad
        shape = tuple(model.lm_head.weight.shape)
        for i, (ids, attn, pos, cmask, P) in enumerate(micro_batches()):
            logprobs = script.per_token_logprobs(
                model, ids, attn, pos, cmask, P, 0.7, chunk_tokens=4, into_grad=into_grad
            )
            with CountShape(shape) as counter:
                (logprobs * torch.linspace(-1, 1, logprobs.numel()).view_as(logprobs)).sum().backward()
            created[into_grad, i] = counter.count
        grads[into_grad] = {name: p.grad.clone() for name, p in model.named_parameters()}
    # the LM-head buffer and the embedding's gradient (tied: also their sum, which autograd adds before .grad += it)
    assert created[False, 1] == (3 if tied else 2) and created[True, 1] == 1
    assert created[True, 0] == created[False, 0]  # no .grad yet: the buffer becomes it
    assert tied == (model.lm_head.weight is model.model.embed_tokens.weight)
    for name, expected in grads[False].items():
        assert torch.allclose(grads[True][name], expected, rtol=1e-5, atol=1e-7), name


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda m: m.__name__)
def test_into_grad_is_off_for_autograd_grad(script):
    """By default (torch.autograd.grad callers) the LM head's gradient is returned, never written into .grad."""
    model, (ids, attn, pos, cmask, P) = tiny_llama(), micro_batches()[0]
    model.lm_head.weight.grad = torch.ones_like(model.lm_head.weight)
    logprobs = script.per_token_logprobs(model, ids, attn, pos, cmask, P, 0.7, chunk_tokens=4)
    (grad,) = torch.autograd.grad(logprobs.sum(), model.lm_head.weight)
    assert grad.abs().sum() > 0 and torch.equal(model.lm_head.weight.grad, torch.ones_like(grad))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda m: m.__name__)
def test_the_loop_frees_gradients_after_each_step_and_sends_the_lm_head_gradient_into_grad(
    script, tmp_path, monkeypatch
):
    """The script itself, 6 steps on the CPU: when the next round's completions are scored (after generation), no
    parameter holds a gradient: they are freed right after each optimizer step, not before the next one. And every
    log-prob pass with a gradient asks TokenLogprobs for into_grad (its last argument)."""
    models, holds_gradients, into_grad = [], [], []
    clip = script.clip_gradients
    monkeypatch.setattr(script, "clip_gradients", lambda model, norm: models.append(model) or clip(model, norm))
    apply = script.TokenLogprobs.apply
    record = lambda *args: (into_grad.append(args[-1]) if torch.is_grad_enabled() else None) or apply(*args)
    monkeypatch.setattr(script.TokenLogprobs, "apply", record)

    @functools.wraps(rewards.keyword_reward)
    def keyword_reward(*args, **kwargs):
        if models:
            holds_gradients.append(any(p.grad is not None for p in models[-1].parameters()))
        return rewards.keyword_reward.__wrapped__(*args, **kwargs)

    keyword_reward.__wrapped__ = rewards.keyword_reward
    monkeypatch.setattr(rewards, "keyword_reward", keyword_reward)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    sizes = ["--max-completion-length", "8", "--prompts-per-step", "4", "--num-generations", "4", "--max-steps", "6"]
    argv = [*map(str, STORIES_TASK), *sizes, "--learning-rate", "1e-3", "--output-dir", str(tmp_path / "run")]
    script.train(script.parse_args(argv))
    assert len(models) >= 2 and holds_gradients and not any(holds_gradients), holds_gradients
    assert into_grad and all(into_grad), into_grad
