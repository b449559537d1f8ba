"""grpo.py's loss and advantage functions against values worked out by hand from the papers' formulas."""

import math

import pytest
import torch

import grpo
import rewards


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def clip(x, lo, hi):
    return min(max(x, lo), hi)


# ----------------------------------------------------------------------------------------------------------------
# policy_loss: token level (PPO clip, GRPO eq. 3)

# 2 sequences x 3 tokens; log-ratios chosen so that every branch of the clipped objective is hit.
LOGP = [[-1.0, -2.0, -0.5], [-1.5, -0.3, -2.0]]
LOG_RATIO = [[0.5, -0.5, 0.0], [0.4, -0.4, 0.1]]  # r = e^0.5 = 1.65 (above 1.2), e^-0.5 = 0.61 (below 0.8), 1, ...
OLD = [[lp - d for lp, d in zip(row_lp, row_d)] for row_lp, row_d in zip(LOGP, LOG_RATIO)]
ADV = [1.5, -2.0]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]


def hand_ppo(r, a, eps_low, eps_high, delta=None):
    unclipped = (min(r, delta) if delta is not None else r) * a
    return -min(unclipped, clip(r, 1 - eps_low, 1 + eps_high) * a)


def test_policy_loss_token_level_both_clip_branches():
    loss, ratio = grpo.policy_loss(t(LOGP), t(OLD), t(ADV), t(MASK), epsilon_low=0.2, epsilon_high=0.28)
    assert loss.shape == (2, 3) and ratio.shape == (2, 3)
    # A = +1.5: r = e^0.5 = 1.6487 > 1.28 is clipped to 1.28; r = e^-0.5 = 0.6065 keeps the unclipped (smaller) r*A
    # A = -2.0: r = e^0.4 = 1.4918 keeps r*A (more negative); r = e^-0.4 = 0.6703 is clipped to 0.8
    expected = [
        [-1.28 * 1.5, -math.exp(-0.5) * 1.5, -1.0 * 1.5],
        [-math.exp(0.4) * -2.0, -0.8 * -2.0, -math.exp(0.1) * -2.0],
    ]
    for i in range(2):
        for j in range(3):
            r = math.exp(LOG_RATIO[i][j])
            assert ratio[i, j].item() == pytest.approx(r, rel=1e-6)
            assert loss[i, j].item() == pytest.approx(expected[i][j], rel=1e-6)
            assert loss[i, j].item() == pytest.approx(hand_ppo(r, ADV[i], 0.2, 0.28), rel=1e-6)


def test_policy_loss_on_policy_gradient_is_minus_advantage():
    # at ratio 1 the clipped objective's gradient w.r.t. log pi is -A per token
    logp = t(LOGP).requires_grad_()
    loss, _ = grpo.policy_loss(logp, logp.detach(), t(ADV), t(MASK))
    loss.sum().backward()
    assert logp.grad.tolist() == [[-1.5] * 3, [2.0] * 3]


def test_policy_loss_delta_two_sided_clipping():
    # INTELLECT-2: the unclipped branch is min(r, delta) * A. Only matters for A < 0 and r > delta.
    log_ratio = [[1.0, 0.1, -1.0], [1.0, 0.1, -1.0]]  # r = 2.718, 1.105, 0.368
    logp = [[-1.0, -1.0, -1.0]] * 2
    old = [[lp - d for lp, d in zip(a, b)] for a, b in zip(logp, log_ratio)]
    adv = [2.0, -3.0]
    delta = 2.0
    loss, _ = grpo.policy_loss(t(logp), t(old), t(adv), t(MASK), 0.2, 0.2, delta=delta)
    expected = [
        # A = 2: min(min(r, 2) * 2, clip(r) * 2): r=e -> min(4, 2.4) = 2.4; r=1.105 -> min(2.21, 2.21); r=.368 -> .736
        [-2.4, -math.exp(0.1) * 2, -math.exp(-1.0) * 2],
        # A = -3: r=e -> min(2 * -3, 1.2 * -3) = -6 (without delta it would be e * -3 = -8.15); r=.368 -> clip .8*-3
        [6.0, math.exp(0.1) * 3, 0.8 * 3],
    ]
    for i in range(2):
        for j in range(3):
            assert loss[i, j].item() == pytest.approx(expected[i][j], rel=1e-6)
            assert loss[i, j].item() == pytest.approx(
                hand_ppo(math.exp(log_ratio[i][j]), adv[i], 0.2, 0.2, delta), rel=1e-6
            )
    no_delta, _ = grpo.policy_loss(t(logp), t(old), t(adv), t(MASK), 0.2, 0.2)
    assert no_delta[1, 0].item() == pytest.approx(math.e * 3, rel=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# policy_loss: sequence level (GSPO eq. 7)


def test_policy_loss_sequence_level_geometric_mean_ratio():
    loss, ratio = grpo.policy_loss(t(LOGP), t(OLD), t(ADV), t(MASK), 0.2, 0.2, importance_sampling_level="sequence")
    # s_i = exp(mean of the log-ratios over the real tokens): the padded 3rd token of row 1 (log-ratio 0.1) is ignored
    s0 = math.exp((0.5 - 0.5 + 0.0) / 3)  # = 1
    s1 = math.exp((0.4 - 0.4) / 2)  # = 1; with the padded token it would be exp(0.1 / 3)
    assert ratio[0].tolist() == pytest.approx([s0] * 3, rel=1e-6)
    assert ratio[1].tolist() == pytest.approx([s1] * 3, rel=1e-6)
    assert loss.expand(2, 3)[0].tolist() == pytest.approx([-s0 * 1.5] * 3, rel=1e-6)
    # a ratio that is not 1: row 0 log-ratios 0.3, 0.6, -0.3 -> s = exp(0.2) = 1.2214 > 1.2, clipped for A > 0;
    # row 1 (mask 1, 1, 0) log-ratios -0.6, -0.4 (and 5.0 on the padded token) -> s = exp(-0.5) = 0.6065 < 0.8
    log_ratio = [[0.3, 0.6, -0.3], [-0.6, -0.4, 5.0]]
    old = [[lp - d for lp, d in zip(a, b)] for a, b in zip(LOGP, log_ratio)]
    adv = [2.0, -1.0]
    loss, ratio = grpo.policy_loss(t(LOGP), t(old), t(adv), t(MASK), 0.2, 0.2, importance_sampling_level="sequence")
    s0, s1 = math.exp(0.2), math.exp(-0.5)
    assert ratio[:, 0].tolist() == pytest.approx([s0, s1], rel=1e-6)
    assert loss.expand(2, 3)[0].tolist() == pytest.approx([-min(s0 * 2, 1.2 * 2)] * 3, rel=1e-6)  # -2.4
    assert loss.expand(2, 3)[1].tolist() == pytest.approx([-min(s1 * -1, 0.8 * -1)] * 3, rel=1e-6)  # 0.8


def test_policy_loss_sequence_level_gradient_is_length_normalised():
    # d/d logp_t of -s * A with s = exp(mean_t logp_t - old_t) is -A * s / |o| on each real token, 0 on padding
    logp = t(LOGP).requires_grad_()
    old = t([[-1.0, -2.0, -0.5], [-1.5, -0.3, -2.0]])  # ratio 1 everywhere
    loss, _ = grpo.policy_loss(logp, old, t(ADV), t(MASK), importance_sampling_level="sequence")
    (loss.expand(2, 3) * t(MASK)).sum().backward()
    # row 0: 3 tokens each carrying loss -s*A -> summed over 3 tokens: grad = 3 * (-1.5 / 3) = -1.5 per token
    # row 1: 2 real tokens -> grad = 2 * (2.0 / 2) = 2.0 on the real tokens, 0 on the padded one
    assert logp.grad.tolist() == [pytest.approx([-1.5] * 3), pytest.approx([2.0, 2.0, 0.0])]


def test_gspo_recipe_is_the_paper_objective():
    # GSPO (arXiv 2507.18071 eq. 5-7): J = 1/G sum_i min(s_i A_i, clip(s_i, 1 - eps, 1 + eps) A_i), with
    # s_i = exp(1/|y_i| sum_t log r_it); --importance-sampling-level sequence --loss-type grpo must give -J.
    # Completions of 1 and 4 tokens (padding's log-ratio 3.0 is ignored), A = +1 and -1, eps = 0.2.
    mask = t([[1, 0, 0, 0], [1, 1, 1, 1]])
    log_ratio = [[0.1, 3.0, 3.0, 3.0], [-0.1, -0.5, -0.2, -0.4]]  # s = e^0.1 = 1.105 (inside); e^-0.3 = 0.741 (< 0.8)
    logp = t([[-1.0, -2.0, -0.5, -1.0], [-1.5, -0.3, -2.0, -0.7]]).requires_grad_()
    old = logp.detach() - t(log_ratio)
    adv = t([1.0, -1.0])
    per_token, _ = grpo.policy_loss(logp, old, adv, mask, 0.2, 0.2, importance_sampling_level="sequence")
    loss = (per_token * grpo.policy_loss_weights(mask, "grpo", max_completion_length=4)).sum()
    s0, s1 = math.exp(0.1), math.exp(-0.3)
    paper = -(min(s0 * 1, clip(s0, 0.8, 1.2) * 1) + min(s1 * -1, clip(s1, 0.8, 1.2) * -1)) / 2  # -(1.105 - 0.8) / 2
    assert loss.item() == pytest.approx(paper, rel=1e-6)
    # gradient: only the unclipped completion's tokens, d(-s0 A0 / 2)/d logp_0 = -s0 / 2 (its one token)
    loss.backward()
    assert logp.grad.tolist() == [pytest.approx([-s0 / 2, 0, 0, 0], rel=1e-6), pytest.approx([0] * 4)]
    # the default --loss-type dapo weighs each completion by its length instead: (1 * -1.105 + 4 * 0.8) / 5
    dapo = (per_token * grpo.policy_loss_weights(mask, "dapo", 4, total_tokens=mask.sum().item())).sum().item()
    assert dapo == pytest.approx((-s0 + 4 * 0.8) / 5, rel=1e-6) and abs(dapo - paper) > 0.5


# ----------------------------------------------------------------------------------------------------------------
# policy_loss_weights: loss aggregation of each loss_type

LOSSES = [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 0.0, 0.0], [7.0, 0.0, 0.0, 0.0], [-1.0, -2.0, -3.0, 0.0]]
LMASK = [[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]]
MAX_LEN = 6


def hand_loss(loss_type):
    # per-sequence sums of the real tokens' losses: 10, 11, 7, -6 over 4, 2, 1, 3 tokens (10 in all), N = 4
    if loss_type == "grpo":  # mean over sequences of each sequence's token mean
        return (10 / 4 + 11 / 2 + 7 / 1 + -6 / 3) / 4
    if loss_type == "bnpo":  # token mean
        return (10 + 11 + 7 - 6) / (4 + 2 + 1 + 3)
    if loss_type == "dr_grpo":  # sum / (N * max_completion_length)
        return (10 + 11 + 7 - 6) / (4 * MAX_LEN)
    if loss_type == "dapo":  # sum / total_tokens of the generated batch (passed in as 20)
        return (10 + 11 + 7 - 6) / 20


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_policy_loss_weights(loss_type):
    weights = grpo.policy_loss_weights(t(LMASK), loss_type, MAX_LEN, total_tokens=20)
    total = (t(LOSSES) * weights).sum().item()
    assert total == pytest.approx(hand_loss(loss_type), rel=1e-6)
    expected = {"grpo": 3.25, "bnpo": 2.2, "dr_grpo": 22 / 24, "dapo": 1.1}[loss_type]
    assert total == pytest.approx(expected, rel=1e-6)
    # padding never carries weight
    assert (weights[t(LMASK) == 0] == 0).all()


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("split", [[[0, 1], [2, 3]], [[0], [1, 2, 3]], [[3, 1], [0], [2]]])
def test_policy_loss_weights_micro_batch_invariance(loss_type, split):
    # The trainer computes the weights once for the optimizer step's rows, then each micro-batch sums its rows'
    # share: the summed micro-batch losses must equal the loss of the whole batch, however the rows are split.
    weights = grpo.policy_loss_weights(t(LMASK), loss_type, MAX_LEN, total_tokens=20)
    losses = t(LOSSES)
    summed = 0.0
    for rows in split:
        # a micro-batch is cut to its own longest completion, as in the trainer
        width = max(sum(LMASK[i]) for i in rows)
        summed += (losses[rows, :width] * weights[rows, :width]).sum().item()
    assert summed == pytest.approx(hand_loss(loss_type), rel=1e-6)


def test_policy_loss_weights_unknown_type():
    with pytest.raises(ValueError, match="unknown loss_type"):
        grpo.policy_loss_weights(t(LMASK), "nope", MAX_LEN)


# ----------------------------------------------------------------------------------------------------------------
# k3 KL


def test_k3_kl():
    logp = [[-1.0, -2.0, -0.5], [-0.1, -3.0, -1.0]]
    ref = [[-1.5, -1.0, -0.5], [-2.0, -2.5, -0.2]]
    kl = grpo.k3_kl(t(logp), t(ref))
    for i in range(2):
        for j in range(3):
            d = ref[i][j] - logp[i][j]
            assert kl[i, j].item() == pytest.approx(math.exp(d) - d - 1, rel=1e-5, abs=1e-7)
            assert kl[i, j].item() >= 0
    assert kl[0, 2].item() == 0.0  # identical log-probs
    assert kl[0, 0].item() == pytest.approx(math.exp(-0.5) + 0.5 - 1, rel=1e-5)  # 0.10653


# ----------------------------------------------------------------------------------------------------------------
# group_advantages (DeepSeekMath sec. 4.1.2; Dr. GRPO for scale_rewards none)


def mean(xs):
    return sum(xs) / len(xs)


def std(xs):  # unbiased
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


REWARDS = [1.0, 0.0, 0.0, 1.0, 2.0, 0.5, 0.5, 0.5]  # 2 groups of 4


def test_group_advantages_group_scaling():
    adv = grpo.group_advantages(t(REWARDS), 4, "group").tolist()
    # group 0: mean 0.5, std sqrt((.25 * 4) / 3) = 0.57735; group 1: mean 0.875, std sqrt((1.265625 + 3*.140625)/3)
    m0, s0 = 0.5, math.sqrt(1 / 3)
    m1, s1 = 0.875, math.sqrt((1.125**2 + 3 * 0.375**2) / 3)
    expected = [(r - m0) / (s0 + 1e-4) for r in REWARDS[:4]] + [(r - m1) / (s1 + 1e-4) for r in REWARDS[4:]]
    assert adv == pytest.approx(expected, rel=1e-5)
    assert adv[0] == pytest.approx(0.5 / (0.5773503 + 1e-4), rel=1e-5)
    assert adv == pytest.approx(
        [(r - mean(g)) / (std(g) + 1e-4) for g in (REWARDS[:4], REWARDS[4:]) for r in g], rel=1e-5
    )


def test_group_advantages_batch_scaling():
    adv = grpo.group_advantages(t(REWARDS), 4, "batch").tolist()
    s = std(REWARDS)  # unbiased std of all 8 rewards
    expected = [(r - 0.5) / (s + 1e-4) for r in REWARDS[:4]] + [(r - 0.875) / (s + 1e-4) for r in REWARDS[4:]]
    assert adv == pytest.approx(expected, rel=1e-5)


def test_group_advantages_no_scaling():
    adv = grpo.group_advantages(t(REWARDS), 4, "none").tolist()
    assert adv == pytest.approx([0.5, -0.5, -0.5, 0.5, 1.125, -0.375, -0.375, -0.375], rel=1e-6)


def test_group_advantages_nan_is_left_out_and_gets_zero():
    rewards = [1.0, float("nan"), 0.0, 0.0, 3.0, 3.0, 3.0, 3.0]
    adv = grpo.group_advantages(t(rewards), 4, "group").tolist()
    valid = [1.0, 0.0, 0.0]  # group 0 without the NaN: mean 1/3, unbiased std sqrt((4/9 + 1/9 + 1/9) / 2)
    m, s = 1 / 3, math.sqrt((4 / 9 + 2 / 9) / 2)
    assert s == pytest.approx(std(valid))
    assert adv[:4] == pytest.approx([(1 - m) / (s + 1e-4), 0.0, (0 - m) / (s + 1e-4), (0 - m) / (s + 1e-4)], rel=1e-5)
    # group 1: all rewards equal -> no signal, every advantage 0 (not NaN, not huge)
    assert adv[4:] == [0.0, 0.0, 0.0, 0.0]
    assert all(math.isfinite(a) for a in adv)
    # batch scaling also leaves the NaN out: std over the 7 valid rewards
    adv_b = grpo.group_advantages(t(rewards), 4, "batch").tolist()
    sb = std([1.0, 0.0, 0.0, 3.0, 3.0, 3.0, 3.0])
    assert adv_b[:4] == pytest.approx([(1 - m) / (sb + 1e-4), 0.0, -m / (sb + 1e-4), -m / (sb + 1e-4)], rel=1e-5)
    assert adv_b[4:] == [0.0] * 4


def test_group_advantages_all_nan_group():
    adv = grpo.group_advantages(t([float("nan")] * 2 + [1.0, 0.0]), 2, "group").tolist()
    assert adv[:2] == [0.0, 0.0]
    assert adv[2:] == pytest.approx([0.5 / (math.sqrt(0.5) + 1e-4), -0.5 / (math.sqrt(0.5) + 1e-4)], rel=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# vllm_importance_ratio (truncated / masked importance sampling)

# trainer ("old") and vLLM ("sampling") log-probs; row 1 has a padded 3rd token (garbage values there)
TRAIN_LP = [[-1.0, -2.0, -0.5], [-0.2, -1.0, -7.0]]
VLLM_LP = [[-1.5, -1.0, -0.5], [-0.1, -0.1, 3.0]]
IS_MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
# per-token log ratios: [0.5, -1.0, 0.0], [-0.1, -0.9, (pad)]; ratios e^0.5 = 1.649, e^-1 = 0.368, 1, 0.905, 0.407


def test_vllm_importance_ratio_token_truncate():
    w, diff = grpo.vllm_importance_ratio(
        t(TRAIN_LP), t(VLLM_LP), t(IS_MASK), "token_truncate", clip_min=0.5, clip_max=1.5
    )
    expected = [[1.5, 0.5, 1.0], [math.exp(-0.1), 0.5, 1.0]]  # pad: log ratio 0 -> 1
    assert w.tolist()[0] == pytest.approx(expected[0], rel=1e-6)
    assert w.tolist()[1][:2] == pytest.approx(expected[1][:2], rel=1e-6)
    assert diff.tolist() == [pytest.approx([0.5, 1.0, 0.0]), pytest.approx([0.1, 0.9, 0.0])]
    assert not w.requires_grad


def test_vllm_importance_ratio_token_mask():
    w, _ = grpo.vllm_importance_ratio(t(TRAIN_LP), t(VLLM_LP), t(IS_MASK), "token_mask", clip_min=0.5, clip_max=1.5)
    # outside [0.5, 1.5] -> 0; inside -> the ratio itself
    assert w.tolist()[0] == pytest.approx([0.0, 0.0, 1.0])
    assert w.tolist()[1][:2] == pytest.approx([math.exp(-0.1), 0.0], rel=1e-6)
    # default bounds: no lower bound, upper 3
    w, _ = grpo.vllm_importance_ratio(t(TRAIN_LP), t(VLLM_LP), t(IS_MASK), "token_mask")
    assert w.tolist()[0] == pytest.approx([math.exp(0.5), math.exp(-1.0), 1.0], rel=1e-6)


def test_vllm_importance_ratio_sequence_truncate():
    # one ratio per sequence: exp(sum of the real tokens' log ratios)
    s0, s1 = math.exp(0.5 - 1.0 + 0.0), math.exp(-0.1 - 0.9)  # 0.6065, 0.3679
    w, _ = grpo.vllm_importance_ratio(
        t(TRAIN_LP), t(VLLM_LP), t(IS_MASK), "sequence_truncate", clip_min=0.5, clip_max=3.0
    )
    assert w.tolist() == [pytest.approx([s0] * 3, rel=1e-6), pytest.approx([0.5] * 3, rel=1e-6)]
    w, _ = grpo.vllm_importance_ratio(
        t(TRAIN_LP), t(VLLM_LP), t(IS_MASK), "sequence_truncate", clip_min=None, clip_max=0.5
    )
    assert w.tolist() == [pytest.approx([0.5] * 3, rel=1e-6), pytest.approx([s1] * 3, rel=1e-6)]


def test_vllm_importance_ratio_sequence_mask():
    s0 = math.exp(-0.5)
    w, _ = grpo.vllm_importance_ratio(t(TRAIN_LP), t(VLLM_LP), t(IS_MASK), "sequence_mask", clip_min=0.5, clip_max=3.0)
    assert w.tolist() == [pytest.approx([s0] * 3, rel=1e-6), [0.0, 0.0, 0.0]]  # s1 = 0.368 < 0.5: masked


def test_vllm_importance_ratio_nan_sampling_logprobs_count_as_one():
    nan = float("nan")
    vllm_lp = [[nan, nan, nan], [-0.1, nan, 3.0]]
    for mode in ("token_truncate", "token_mask"):
        w, diff = grpo.vllm_importance_ratio(t(TRAIN_LP), t(vllm_lp), t(IS_MASK), mode, clip_min=0.1, clip_max=3.0)
        assert w.tolist()[0] == [1.0, 1.0, 1.0]
        assert w.tolist()[1][:2] == pytest.approx([math.exp(-0.1), 1.0], rel=1e-6)
        assert not diff.isnan().any()
    for mode in ("sequence_truncate", "sequence_mask"):
        w, _ = grpo.vllm_importance_ratio(t(TRAIN_LP), t(vllm_lp), t(IS_MASK), mode, clip_min=0.1, clip_max=3.0)
        assert w.tolist() == [[1.0] * 3, pytest.approx([math.exp(-0.1)] * 3, rel=1e-6)]


# ----------------------------------------------------------------------------------------------------------------
# token_budget_batches


@pytest.mark.parametrize("budget", [1, 30, 64, 100, 250, 10_000])
def test_token_budget_batches(budget):
    gen = torch.Generator().manual_seed(0)
    prompt_lengths = torch.randint(3, 20, (37,), generator=gen).tolist()
    completion_lengths = torch.randint(0, 40, (37,), generator=gen).tolist()
    rows = list(range(37))
    batches = grpo.token_budget_batches(rows, prompt_lengths, completion_lengths, budget)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == rows  # every row exactly once
    assert all(batches)
    for b in batches:
        size = len(b) * (max(prompt_lengths[i] for i in b) + max(completion_lengths[i] for i in b))
        assert size <= budget or len(b) == 1  # a single over-budget row goes alone
    if budget == 10_000:
        assert len(batches) == 1
    if budget == 1:
        assert len(batches) == 37


def test_token_budget_batches_subset_of_rows():
    # the trainer passes the rows of one optimizer step, which need not start at 0
    prompt_lengths = [5] * 10
    completion_lengths = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    batches = grpo.token_budget_batches(range(4, 10), prompt_lengths, completion_lengths, 30)
    assert sorted(i for b in batches for i in b) == [4, 5, 6, 7, 8, 9]
    # sorted by length: rows 4 (len 10) and 5 (len 11) fit in 2 x 11 = 22 <= 30; 3 rows would need 3 x 12 = 36
    assert batches == [[4, 5], [6, 7], [8, 9]]


# ----------------------------------------------------------------------------------------------------------------
# rewards.score (the reward functions called with the dataset columns)


def test_score_completions_names_a_failing_reward():
    def broken_reward(completions, **kwargs):
        raise KeyError("no such thing")

    def ok_reward(completions, **kwargs):
        return [1.0 for _ in completions]

    with pytest.raises(RuntimeError, match="broken_reward") as info:
        rewards.score([ok_reward, broken_reward], ["a", "b"], {"answer": ["1", "2"]})
    assert "KeyError" in str(info.value) and "answer" in str(info.value)


def test_score_completions_none_is_nan_and_length_checked():
    def partial(completions, **kwargs):
        return [1.0, None, 0.5]

    def short(completions, **kwargs):
        return [1.0]

    scores = rewards.score([partial], ["a", "b", "c"], {})
    assert scores.shape == (3, 1)
    assert scores[0, 0].item() == 1.0 and math.isnan(scores[1, 0].item()) and scores[2, 0].item() == 0.5
    with pytest.raises(ValueError, match="short"):
        rewards.score([short], ["a", "b", "c"], {})
