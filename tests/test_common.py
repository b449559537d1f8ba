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


def _load(script, checkpoint_dir, model, optimizer, scheduler):
    """The scripts' (one, shared) resume of the optimizer, schedule and RNG state from checkpoint_dir/trainer_state.pt."""
    run = dict(model=model, optimizer=optimizer, scheduler=scheduler, device=torch.device("cpu"), rank=0, world_size=1)
    return script.load_checkpoint(type("Run", (), run), checkpoint_dir)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda m: m.__name__)
def test_checkpointed_optimizer_state_round_trips_and_saving_never_steps(script, tmp_path, monkeypatch):
    """full_state before any optimizer step leaves the optimizer as it was (torch's state-dict API would fill the
    empty AdamW state with a step at lr 0, and the first real update would then be bias-corrected as the second).
    After a step in which one parameter got no gradient (a multimodal model's unused tower), the state resumes into a
    fresh optimizer: as one rank writes it (by index, loaded directly: no throw-away AdamW state, which would cost 2x
    the weights' memory) and as several ranks write it (by parameter name, not strict: that parameter has no state)."""
    import torch.distributed.checkpoint.state_dict as dcp

    throwaway_states, init = [], dcp._init_optim_state
    monkeypatch.setattr(dcp, "_init_optim_state", lambda optim: throwaway_states.append(optim) or init(optim))
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(4, 3), "unused": torch.nn.Linear(4, 3)})
    make = lambda: torch.optim.AdamW(model.parameters(), lr=1e-2)  # noqa: E731

    def on_several_ranks(*args):  # full_state's path for several ranks (by parameter name), in a process group of 1
        store = tmp_path / f"store{len(list(tmp_path.iterdir()))}"
        torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        try:
            return script.full_state(*args)
        finally:
            torch.distributed.destroy_process_group()

    optimizer = make()
    for saved in (script.full_state(model, optimizer)[1], on_several_ranks(model, optimizer)[1]):
        assert not optimizer.state and saved["state"] == {}
    model["used"](torch.randn(5, 4)).square().sum().backward()
    optimizer.step()
    by_index, by_name = script.full_state(model, optimizer)[1], on_several_ranks(model, optimizer)[1]
    for saved, throwaway in ((by_index, 0), (by_name, 1)):
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        state = {"optimizer": saved, "scheduler": scheduler.state_dict(), "torch_rng": [torch.get_rng_state()]}
        state |= {"cuda_rng": None, "global_step": 1, "prompts_consumed": 4, "skipped_steps": 0}
        torch.save(state, tmp_path / "trainer_state.pt")
        resumed, throwaway_states[:] = make(), []
        counters = _load(script, tmp_path, model, resumed, torch.optim.lr_scheduler.LambdaLR(resumed, lambda s: 1.0))
        assert counters == {"global_step": 1, "prompts_consumed": 4, "skipped_steps": 0}
        assert len(throwaway_states) == throwaway
        for param in model["used"].parameters():
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(resumed.state[param][key], optimizer.state[param][key]), key
        assert all(param not in resumed.state for param in model["unused"].parameters())


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda m: m.__name__)
def test_one_rank_checkpoints_hand_over_the_tensors_without_a_host_copy(script):
    """On one rank full_state returns the model's and the optimizer's own tensors (torch.save then copies GPU tensors
    one at a time); a CPU copy of the whole state first (cpu_offload, which several ranks need to gather onto rank 0)
    would hold about 3x the model's size in host memory at each checkpoint."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()
    model_state, optimizer_state = script.full_state(model, optimizer)
    assert model_state["weight"].data_ptr() == model.weight.data_ptr()
    assert optimizer_state["state"][0]["exp_avg"].data_ptr() == optimizer.state[model.weight]["exp_avg"].data_ptr()


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda m: m.__name__)
def test_decoder_layers_finds_the_blocks_of_models_without_base_model_layers(script):
    # FSDP2 (shard_model, unsharded) and --torch-compile act on these; GPT-2 keeps its blocks in transformer.h, where
    # `model.base_model.layers` raised AttributeError
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=100, bos_token_id=0, eos_token_id=0))
    assert script.decoder_layers(gpt2) == list(gpt2.transformer.h)
    llama = AutoModelForCausalLM.from_pretrained(STORIES)
    assert script.decoder_layers(llama) == list(llama.model.layers) and len(llama.model.layers) > 1
