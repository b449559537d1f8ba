"""online_dpo.py's functions: losses against hand-computed values, pairing, temperature-scaled sequence log-probs,
reward-model scoring, the missing-EOS penalty and the beta schedule."""

import math

import pytest
import torch
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
)

import online_dpo
from grpo_cli import STORIES

NAN = float("nan")

# ----------------------------------------------------------------------------------------------------------------
# losses: 2 pairs with given sequence log-probs
#   pair 1: z = (-10 - -14) - (-11 - -12) = 4 - 1 = 3     (the policy prefers the chosen completion more than ref)
#   pair 2: z = (-5 - -3) - (-4 - -4)     = -2 - 0 = -2   (the policy prefers the rejected one)
CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED = [-10.0, -5.0], [-14.0, -3.0], [-11.0, -4.0], [-12.0, -4.0]
Z = [3.0, -2.0]


def t(values, grad=False):
    return torch.tensor(values, dtype=torch.float32, requires_grad=grad)


def test_sigmoid_loss_by_hand():
    beta = 0.1
    chosen = t(CHOSEN, grad=True)
    losses = online_dpo.dpo_loss(chosen, t(REJECTED), t(REF_CHOSEN), t(REF_REJECTED), beta, "sigmoid")
    # DPO eq. 7: -log sigmoid(beta z) = log(1 + exp(-beta z))
    assert losses.tolist() == pytest.approx([math.log(1 + math.exp(-0.3)), math.log(1 + math.exp(0.2))], rel=1e-6)
    assert losses.tolist() == pytest.approx([0.554355, 0.798139], abs=1e-6)
    # d loss / d log pi(chosen) = -beta * sigmoid(-beta z): the pair the policy gets wrong pulls harder
    losses.sum().backward()
    expected = [-beta / (1 + math.exp(beta * z)) for z in Z]
    assert chosen.grad.tolist() == pytest.approx(expected, rel=1e-5)
    assert abs(chosen.grad[1]) > abs(chosen.grad[0])


def test_ipo_loss_by_hand():
    beta = 0.25  # tau = beta: the target margin is 1 / (2 beta) = 2
    losses = online_dpo.dpo_loss(t(CHOSEN), t(REJECTED), t(REF_CHOSEN), t(REF_REJECTED), beta, "ipo")
    # IPO eq. 17: (z - 1 / (2 tau))^2
    assert losses.tolist() == pytest.approx([(3.0 - 2.0) ** 2, (-2.0 - 2.0) ** 2], rel=1e-6)
    assert losses.tolist() == pytest.approx([1.0, 16.0], rel=1e-6)
    # at the target margin the loss is 0, and it rises on both sides (unlike sigmoid, which keeps pushing)
    assert online_dpo.dpo_loss(t([0.0]), t([-2.0]), t([0.0]), t([0.0]), beta, "ipo").item() == 0.0
    assert online_dpo.dpo_loss(t([0.0]), t([-5.0]), t([0.0]), t([0.0]), beta, "ipo").item() == pytest.approx(9.0)
    with pytest.raises(ValueError, match="unknown loss_type"):
        online_dpo.dpo_loss(t(CHOSEN), t(REJECTED), t(REF_CHOSEN), t(REF_REJECTED), beta, "hinge")


def test_loss_is_log2_when_policy_equals_reference():
    assert online_dpo.dpo_loss(t(CHOSEN), t(REJECTED), t(CHOSEN), t(REJECTED), 0.1).tolist() == pytest.approx(
        [math.log(2)] * 2
    )


# ----------------------------------------------------------------------------------------------------------------
# pairing


def test_select_pairs_best_vs_worst_g4():
    rewards = t(
        [
            0.2,
            0.9,
            NAN,
            -1.0,  # prompt 0: best 1, worst 3
            NAN,
            0.5,
            0.3,
            0.4,  # prompt 1: the NaN is ignored: best 5, worst 6
            1.0,
            1.0,
            1.0,
            1.0,  # prompt 2: all tie
            NAN,
            2.0,
            NAN,
            2.0,  # prompt 3: two scorable, tied
            NAN,
            NAN,
            NAN,
            7.0,  # prompt 4: one scorable sample: no pair
            3.0,
            0.0,
            3.0,
            0.0,  # prompt 5: equal best / worst: the first of each
        ]
    )
    chosen, rejected, num_tied, num_unscorable = online_dpo.select_pairs(rewards, 4)
    assert chosen == [1, 5, 20] and rejected == [3, 6, 21]
    assert num_tied == 2 and num_unscorable == 1


def test_select_pairs_g2_and_all_tied():
    rewards = t([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, NAN, 1.0, NAN, NAN])
    chosen, rejected, num_tied, num_unscorable = online_dpo.select_pairs(rewards, 2)
    assert chosen == [0, 3] and rejected == [1, 2] and num_tied == 1 and num_unscorable == 2
    # a step whose prompts all tie gives no pair at all (the trainer then skips the update)
    chosen, rejected, num_tied, num_unscorable = online_dpo.select_pairs(torch.zeros(8), 4)
    assert chosen == [] and rejected == [] and num_tied == 2 and num_unscorable == 0


# ----------------------------------------------------------------------------------------------------------------
# sequence log-probs at the sampling temperature


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config).eval()


def test_sequence_logprobs_use_the_sampling_temperature():
    model = tiny_llama()
    with torch.no_grad():  # a random init has near-uniform logits, on which the temperature hardly shows
        model.lm_head.weight.mul_(30)
    gen = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(1, 300, (n,), generator=gen).tolist()  # noqa: E731
    prompts = [ids(3), ids(7), ids(1), ids(5)]  # left padding
    completions = [ids(6), ids(2), ids(4), ids(1)]  # right padding
    T = 0.7
    logps = online_dpo.sequence_logprobs(model, prompts, completions, T, "cpu", pad_id=0)
    assert logps.shape == (4,)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        with torch.no_grad():  # naive: the row alone, unpadded, log_softmax(logits / T) summed over the completion
            logits = model(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1 : -1]
        naive_t = (logits / T).log_softmax(-1).gather(-1, torch.tensor(c)[:, None]).sum()
        naive_1 = logits.log_softmax(-1).gather(-1, torch.tensor(c)[:, None]).sum()
        assert logps[i].item() == pytest.approx(naive_t.item(), abs=1e-4)
        assert abs(logps[i].item() - naive_1.item()) > 0.1  # temperature 1 would give something else
    # the gradient path (chunked, activation-checkpointed) gives the same values as the no-grad one
    with torch.no_grad():
        no_grad = online_dpo.sequence_logprobs(model, prompts, completions, T, "cpu", pad_id=0)
    torch.testing.assert_close(logps.detach(), no_grad, atol=1e-5, rtol=0)
    logps.sum().backward()
    assert model.model.embed_tokens.weight.grad.abs().sum() > 0


# ----------------------------------------------------------------------------------------------------------------
# reward model


@pytest.fixture
def reward_model_dir(tmp_path):
    """A tiny random LlamaForSequenceClassification (num_labels 1, no pad token in its config, like many reward
    models) with the stories260K tokenizer, given a chat template."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        num_labels=1,
        pad_token_id=None,
    )
    LlamaForSequenceClassification(config).save_pretrained(tmp_path / "rm")
    tokenizer = AutoTokenizer.from_pretrained(STORIES)
    tokenizer.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    tokenizer.save_pretrained(tmp_path / "rm")
    return tmp_path / "rm"


def alone(model, ids):
    """Score of one sequence, unpadded (batch of 1: the model reads the last token)."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, 0].item()


def test_reward_model_scores_equal_unpadded_scores(reward_model_dir):
    model, tokenizer = online_dpo.load_reward_model(reward_model_dir, "cpu")
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert model.config.pad_token_id == tokenizer.eos_token_id == 2
    prompts = ["Once upon a time, there was a little girl named", "The cat was sad.", "One day,"]
    completions = [" Lily. She liked to play.", " It wanted to play with the big dog in the park all day long.", ""]
    inputs = online_dpo.reward_model_inputs(tokenizer, prompts, completions)
    assert inputs[0] == tokenizer(prompts[0] + completions[0])["input_ids"]  # plain text: concatenated, with BOS
    lengths = [len(ids) for ids in inputs]
    assert len(set(lengths)) == 3
    # a budget of 2 x the longest row: the rows share micro-batches, so the shorter ones are padded
    scores = online_dpo.reward_model_scores(model, inputs, micro_batch_tokens=2 * max(lengths), device="cpu")
    reference = AutoModelForSequenceClassification.from_pretrained(reward_model_dir).eval()
    for i, ids in enumerate(inputs):
        assert scores[i].item() == pytest.approx(alone(reference, ids), abs=1e-5)
    # one micro-batch for everything, or one row each: the same scores
    for budget in (10**6, 1):
        torch.testing.assert_close(
            online_dpo.reward_model_scores(model, inputs, budget, "cpu"), scores, atol=1e-5, rtol=0
        )

    # the check can fail: padding with a token other than config.pad_token_id makes the model read the padding
    L = max(lengths)
    wrong = torch.tensor([ids + [7] * (L - len(ids)) for ids in inputs])
    with torch.no_grad():
        leaked = model(
            input_ids=wrong, attention_mask=(torch.arange(L)[None] < torch.tensor(lengths)[:, None]).long()
        ).logits[:, 0]
    assert (leaked - scores).abs().max() > 1e-3


def test_reward_model_inputs_chat_template(reward_model_dir):
    _, tokenizer = online_dpo.load_reward_model(reward_model_dir, "cpu")
    messages = [{"role": "system", "content": "Tell a story."}, {"role": "user", "content": "The cat was sad."}]
    (ids,) = online_dpo.reward_model_inputs(tokenizer, [messages], ["It cried."])
    text = "<s>system: Tell a story.\nuser: The cat was sad.\nassistant: It cried.\n"
    assert tokenizer.decode(ids) == text
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"] and ids.count(tokenizer.bos_token_id) == 1
    # a reward tokenizer without a template: message contents and the completion, joined by blank lines
    tokenizer.chat_template = None
    (ids,) = online_dpo.reward_model_inputs(tokenizer, [messages], ["It cried."])
    assert ids == tokenizer("Tell a story.\n\nThe cat was sad.\n\nIt cried.")["input_ids"]


def test_reward_model_must_have_one_label(tmp_path):
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_labels=2,
    )
    LlamaForSequenceClassification(config).save_pretrained(tmp_path / "rm2")
    AutoTokenizer.from_pretrained(STORIES).save_pretrained(tmp_path / "rm2")
    with pytest.raises(ValueError, match="has 2 labels; a reward model has 1"):
        online_dpo.load_reward_model(tmp_path / "rm2", "cpu")


# ----------------------------------------------------------------------------------------------------------------
# missing-EOS penalty and beta schedule


def test_missing_eos_penalty():
    eos = [2, 3]
    rewards = t([1.0, 0.5, NAN, 0.0, 2.0])
    completions = [[5, 2], [5, 6], [7], [9, 9, 3], [2, 8]]  # EOS last / cut at the length limit / ... / EOS not last
    out = online_dpo.apply_missing_eos_penalty(rewards, completions, eos, 0.75)
    assert out[[0, 1, 3, 4]].tolist() == [1.0, -0.25, 0.0, 1.25] and out[2].isnan()


def test_beta_schedule_per_epoch():
    betas = [0.1, 0.05, 0.01]
    assert [online_dpo.beta_for_epoch(betas, epoch) for epoch in range(6)] == [0.1, 0.05, 0.01, 0.01, 0.01, 0.01]
    assert [online_dpo.beta_for_epoch([0.2], epoch) for epoch in range(3)] == [0.2, 0.2, 0.2]
    # the trainer's epoch is prompts consumed // number of prompts: 10 prompts, 4 per step
    epochs = [consumed // 10 for consumed in range(0, 40, 4)]
    assert [online_dpo.beta_for_epoch(betas, e) for e in epochs] == [0.1] * 3 + [0.05] * 2 + [0.01] * 5
