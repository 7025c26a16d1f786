"""rapo_ray.algos against hand-computed values. The arithmetic is written out next to each expectation."""

from __future__ import annotations

import math

import pytest
import torch

from rapo_ray.algos.advantages import grpo_outcome_advantage
from rapo_ray.algos.arpo import (
    BranchBudget,
    EntropyBrancher,
    branch_probability,
    normalized_segment_entropy,
    should_branch,
)
from rapo_ray.algos.entropy import step_entropies, token_entropy_from_logits
from rapo_ray.algos.loss import AGG_MODES, PolicyLossConfig, aggregation_denominator, policy_loss, target_logprobs
from rapo_ray.algos.rapo import (
    RetrievalRewardSwitches,
    importance_shaping_factor,
    rapo_advantage,
    retrieval_advantage,
    retrieval_reward_single,
    retrieved_token_fraction,
    trajectory_retrieval_reward,
)


def _logp(values):
    return torch.log(torch.tensor(values, dtype=torch.float64))


def _random_batch(B=6, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    old = logp.detach() + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.3).to(torch.float64)
    mask[0] = 0  # a sequence with no loss tokens
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    shaping = 1 + 0.05 * torch.rand(B, generator=g, dtype=torch.float64)
    return logp, old, adv, mask, shaping


def test_grpo_advantage_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0])
    groups = ["a", "a", "a", "a", "b"]
    adv = grpo_outcome_advantage(rewards, groups)
    # group a: mean 0.5; unbiased std = sqrt(4 * 0.25 / 3) = 0.5773503; 0.5 / (0.5773503 + 1e-6)
    expected_a = 0.5 / (math.sqrt(1.0 / 3.0) + 1e-6)
    assert adv.tolist() == pytest.approx([expected_a, -expected_a, -expected_a, expected_a, 0.0], abs=1e-6)
    # group b has one member: no baseline, advantage 0.
    assert adv[4].item() == 0.0


def test_grpo_dr_grpo_and_constant_group():
    adv = grpo_outcome_advantage(torch.tensor([3.0, 1.0, 5.0, 5.0]), torch.tensor([0, 0, 1, 1]), norm_by_std=False)
    # group 0: mean 2 -> [+1, -1]; group 1 constant -> 0
    assert adv.tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0])


def test_grpo_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="group_ids"):
        grpo_outcome_advantage(torch.tensor([1.0, 2.0]), [0])


def test_token_entropy_uniform_and_peaked():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]])
    h = token_entropy_from_logits(logits)
    # uniform over 4: log 4 = 1.3862944; a one-hot is ~0
    assert h[0].item() == pytest.approx(math.log(4), abs=1e-6)
    assert h[1].item() == pytest.approx(0.0, abs=1e-6)


def test_step_entropies_exclude_tool_and_retrieved():
    ent = torch.tensor([0.1, 0.2, 9.0, 9.0, 0.5, 0.6, 7.0, 0.9])
    segs = [("generated", 0, 2), ("tool_result", 2, 4), ("generated", 4, 6), ("retrieved", 6, 7), ("generated", 7, 8)]
    # (0.1+0.2)/2 = 0.15, (0.5+0.6)/2 = 0.55, 0.9
    assert step_entropies(ent, segs) == pytest.approx([0.15, 0.55, 0.9])


def test_step_entropies_bad_segments():
    with pytest.raises(ValueError, match="unknown segment kind"):
        step_entropies(torch.zeros(3), [("bogus", 0, 1)])
    with pytest.raises(ValueError, match="outside"):
        step_entropies(torch.zeros(3), [("generated", 2, 5)])


def test_retrieval_reward_single_hand_computed():
    # H_before 1.0, H_after 0.5: H_delta = -(0.5-1)/1 = 0.5; g = tanh(1) = 0.7615942; Z = g * 1.0
    assert retrieval_reward_single(1.0, 0.5) == pytest.approx(math.tanh(1.0))
    # H_before 2, H_after 3: H_delta = -(3-2)/2 = -0.5; g = tanh(-1); Z = 2 * tanh(-1) = -1.5231884
    assert retrieval_reward_single(2.0, 3.0) == pytest.approx(2 * math.tanh(-1.0))
    # ablations
    assert retrieval_reward_single(2.0, 3.0, RetrievalRewardSwitches(use_quality=False)) == pytest.approx(2.0)
    assert retrieval_reward_single(2.0, 3.0, RetrievalRewardSwitches(use_timing=False)) == pytest.approx(
        math.tanh(-1.0)
    )
    assert retrieval_reward_single(2.0, 3.0, RetrievalRewardSwitches(invert_delta=True)) == pytest.approx(
        2 * math.tanh(1.0)
    )
    assert retrieval_reward_single(2.0, 3.0, RetrievalRewardSwitches(invert_timing=True)) == pytest.approx(
        0.5 * math.tanh(-1.0)
    )
    # H_before = 0: the division is guarded (eps), no inf/nan
    z = retrieval_reward_single(0.0, 0.3)
    assert math.isfinite(z) and z == pytest.approx(0.0)


def test_trajectory_retrieval_reward_mean_and_skips():
    ent = [1.0, 0.5, 2.0, 3.0]
    # retrieval between steps 0 and 1 -> tanh(1); between 2 and 3 -> 2 tanh(-1); the last has no follower
    z = trajectory_retrieval_reward(ent, [(0, 1), (2, 3), (3, None)])
    assert z == pytest.approx((math.tanh(1.0) + 2 * math.tanh(-1.0)) / 2)
    assert trajectory_retrieval_reward(ent, []) == 0.0
    assert trajectory_retrieval_reward(ent, [(3, None)]) == 0.0


def test_retrieval_advantage_and_rapo_advantage():
    z = torch.tensor([0.0, 0.0, 0.6, -0.2])
    a_ret = retrieval_advantage(z, [0, 0, 0, 0])
    # mean 0.1; deviations -0.1 -0.1 0.5 -0.3; unbiased var = (0.01+0.01+0.25+0.09)/3 = 0.12
    std = math.sqrt(0.12)
    exp_ret = [-0.1 / (std + 1e-6), -0.1 / (std + 1e-6), 0.5 / (std + 1e-6), -0.3 / (std + 1e-6)]
    assert a_ret.tolist() == pytest.approx(exp_ret, abs=1e-6)
    a_acc = torch.tensor([1.0, -1.0, 1.0, -1.0])
    a = rapo_advantage(a_acc, a_ret, advantage_weight=0.2)
    assert a.tolist() == pytest.approx([(1 + 0.2 * r) * s for r, s in zip(exp_ret, [1, -1, 1, -1])], abs=1e-6)
    # the optional clamp keeps (1 + a A_ret) >= 0
    clamped = rapo_advantage(torch.tensor([1.0]), torch.tensor([-10.0]), 0.2, clamp_factor_at_zero=True)
    assert clamped.item() == 0.0
    assert rapo_advantage(torch.tensor([1.0]), torch.tensor([-10.0]), 0.2).item() == pytest.approx(-1.0)


def test_importance_shaping():
    # more retrieved tokens than response tokens is impossible: an error, not a silent fraction > 1
    with pytest.raises(ValueError):
        retrieved_token_fraction(torch.tensor([5]), torch.tensor([0]))
    # 0/100 = 0; 30/120 = 0.25; an empty response (0/0) is 0
    f = retrieved_token_fraction(torch.tensor([0, 30, 0]), torch.tensor([100, 120, 0]))
    assert f.tolist() == pytest.approx([0.0, 0.25, 0.0])
    f = f[:2]
    assert importance_shaping_factor(f, 0.05).tolist() == pytest.approx([1.0, 1.0125])


def test_policy_loss_clip_hand_computed():
    logp = _logp([[1.5, 0.5, 1.0]])  # ratios 1.5, 0.5, 1.0 against old = 0
    old = torch.zeros(1, 3, dtype=torch.float64)
    mask = torch.ones(1, 3)
    # A = +1: max(-r, -clip(r, .72, 1.28)) = [-1.28, -0.5, -1.0] -> token-mean -2.78/3
    loss, m = policy_loss(logp, old, torch.tensor([1.0]), mask)
    assert loss.item() == pytest.approx(-2.78 / 3)
    assert m["clip_frac"] == pytest.approx(1 / 3)  # only token 0 is clipped (-1.28 > -1.5)
    # A = -1: max(r, clip(r)) = [1.5, 0.72, 1.0]
    loss, _ = policy_loss(logp, old, torch.tensor([-1.0]), mask)
    assert loss.item() == pytest.approx((1.5 + 0.72 + 1.0) / 3)
    # dual clip c = 1.2 caps a negative-advantage token's loss at 1.2: [1.2, 0.72, 1.0]
    loss, m = policy_loss(logp, old, torch.tensor([-1.0]), mask, PolicyLossConfig(dual_clip=1.2))
    assert loss.item() == pytest.approx((1.2 + 0.72 + 1.0) / 3)
    assert m["dual_clip_frac"] == pytest.approx(1 / 3)
    # asymmetric clip [0.8, 1.28], A = +1 -> [-1.28, -0.5, -1.0] (low side is not active for A > 0)
    loss, _ = policy_loss(logp, old, torch.tensor([1.0]), mask, PolicyLossConfig(clip_low=0.2, clip_high=0.28))
    assert loss.item() == pytest.approx(-2.78 / 3)
    # mask out the last token: (-1.28 - 0.5) / 2
    loss, _ = policy_loss(logp, old, torch.tensor([1.0]), torch.tensor([[1, 1, 0]]))
    assert loss.item() == pytest.approx(-1.78 / 2)


def test_policy_loss_shaping_is_clipped_after_scaling():
    old = torch.zeros(1, 2, dtype=torch.float64)
    logp = _logp([[1.0, 1.2]])
    # shaped ratios 1.1 * [1.0, 1.2] = [1.1, 1.32]; A = +1 -> [-1.1, -1.28]
    loss, m = policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 2), shaping=torch.tensor([1.1]))
    assert loss.item() == pytest.approx((-1.1 - 1.28) / 2)
    assert m["ratio_max"] == pytest.approx(1.32)


def test_policy_loss_aggregations_hand_computed():
    old = torch.zeros(2, 3, dtype=torch.float64)
    logp = torch.zeros(2, 3, dtype=torch.float64)  # ratio 1 -> per-token loss = -A
    adv = torch.tensor([1.0, 2.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # per-token losses: seq0 [-1, -1], seq1 [-2]
    tm, _ = policy_loss(logp, old, adv, mask, PolicyLossConfig(agg_mode="token-mean"))
    assert tm.item() == pytest.approx(-4 / 3)
    smtm, _ = policy_loss(logp, old, adv, mask, PolicyLossConfig(agg_mode="seq-mean-token-mean"))
    assert smtm.item() == pytest.approx((-1 + -2) / 2)
    smts, _ = policy_loss(logp, old, adv, mask, PolicyLossConfig(agg_mode="seq-mean-token-sum"))
    assert smts.item() == pytest.approx((-2 + -2) / 2)


def test_policy_loss_kl_terms():
    logp = torch.log(torch.tensor([[0.5]], dtype=torch.float64))
    ref = torch.log(torch.tensor([[0.25]], dtype=torch.float64))
    old = logp.clone()
    # A = 0 so only the KL remains. k1 = log(0.5/0.25) = log 2; k3 = e^{-log 2} + log 2 - 1 = 0.5 + 0.693147 - 1
    loss, m = policy_loss(
        logp, old, torch.tensor([0.0]), torch.ones(1, 1), PolicyLossConfig(kl_coef=0.1, kl_type="k1"), ref_logp=ref
    )
    assert loss.item() == pytest.approx(0.1 * math.log(2))
    loss, _ = policy_loss(
        logp, old, torch.tensor([0.0]), torch.ones(1, 1), PolicyLossConfig(kl_coef=0.1, kl_type="k3"), ref_logp=ref
    )
    assert loss.item() == pytest.approx(0.1 * (0.5 + math.log(2) - 1))
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, old, torch.tensor([0.0]), torch.ones(1, 1), PolicyLossConfig(kl_coef=0.1))


def test_policy_loss_behaviour_correction_hand_computed():
    """Decoupled objective: old_logp is the proximal policy, behaviour_logp the engine that sampled each token.
    Tokens: ratio r = exp(logp - old) = [1, 1, 1.5]; behaviour weight w = exp(old - behaviour) = [0.5, 3, 1]."""
    old = torch.zeros(1, 3, dtype=torch.float64)
    logp = _logp([[1.0, 1.0, 1.5]])
    behaviour = -torch.log(torch.tensor([[0.5, 3.0, 1.0]], dtype=torch.float64))
    mask, adv = torch.ones(1, 3), torch.tensor([1.0])
    # A = +1, clipped surrogate per token [-1, -1, -1.28]
    plain, _ = policy_loss(logp, old, adv, mask)
    assert plain.item() == pytest.approx((-1 - 1 - 1.28) / 3)
    # none: the same loss, to the bit, whatever behaviour_logp says
    none, _ = policy_loss(logp, old, adv, mask, behaviour_logp=behaviour)
    assert none.item() == plain.item()
    # truncate at 2: w = [0.5, 2, 1] -> (-0.5 - 2 - 1.28) / 3
    cfg = PolicyLossConfig(behaviour_correction="truncate", behaviour_cap=2.0)
    loss, m = policy_loss(logp, old, adv, mask, cfg, behaviour_logp=behaviour)
    assert loss.item() == pytest.approx((-0.5 - 2.0 - 1.28) / 3)
    assert m["behaviour_weight_mean"] == pytest.approx((0.5 + 2 + 1) / 3)
    assert m["behaviour_capped_frac"] == pytest.approx(1 / 3)
    # mask at 2: w = [0.5, 0, 1]; the dropped token still counts in the denominator -> (-0.5 - 1.28) / 3
    cfg = PolicyLossConfig(behaviour_correction="mask", behaviour_cap=2.0)
    loss, m = policy_loss(logp, old, adv, mask, cfg, behaviour_logp=behaviour)
    assert loss.item() == pytest.approx((-0.5 - 1.28) / 3)
    # the weight carries no gradient: d loss / d logp = w * d surrogate (token 2 is clipped: 0)
    logp2 = logp.detach().clone().requires_grad_(True)
    policy_loss(logp2, old, adv, mask, cfg, behaviour_logp=behaviour)[0].backward()
    assert logp2.grad[0].tolist() == pytest.approx([-0.5 / 3, 0.0, 0.0])
    with pytest.raises(ValueError, match="needs behaviour_logp"):
        policy_loss(logp, old, adv, mask, cfg)


def test_policy_loss_config_errors():
    with pytest.raises(ValueError, match="agg_mode"):
        PolicyLossConfig(agg_mode="mean")
    with pytest.raises(ValueError, match="dual_clip"):
        PolicyLossConfig(dual_clip=0.5)
    with pytest.raises(ValueError, match="behaviour_correction"):
        PolicyLossConfig(behaviour_correction="clip")
    with pytest.raises(ValueError, match="behaviour_cap"):
        PolicyLossConfig(behaviour_correction="truncate", behaviour_cap=1.0)


def test_masked_tokens_get_zero_gradient():
    logp, old, adv, mask, shaping = _random_batch()
    # garbage in masked positions must not leak (e.g. padding log-probs of -1e9)
    old = torch.where(mask > 0, old, torch.full_like(old, -1e9))
    for mode in AGG_MODES:
        logp.grad = None
        loss, _ = policy_loss(logp, old, adv, mask, PolicyLossConfig(agg_mode=mode, dual_clip=3.0), shaping=shaping)
        loss.backward()
        assert torch.all(logp.grad[mask == 0] == 0)
        assert torch.isfinite(logp.grad).all()
        assert logp.grad[mask > 0].abs().sum() > 0


@pytest.mark.parametrize("mode", AGG_MODES)
def test_data_parallel_shards_reproduce_full_batch(mode):
    logp, old, adv, mask, shaping = _random_batch(B=8, T=5, seed=1)
    cfg = PolicyLossConfig(agg_mode=mode)
    full, _ = policy_loss(logp, old, adv, mask, cfg, shaping=shaping)
    (full_grad,) = torch.autograd.grad(full, logp)
    shards = [slice(0, 3), slice(3, 8)]
    denominator = sum(aggregation_denominator(mask[s], mode) for s in shards)
    total = 0.0
    grad = torch.zeros_like(logp)
    for s in shards:
        part = logp.detach()[s].clone().requires_grad_(True)
        shard_loss, _ = policy_loss(part, old[s], adv[s], mask[s], cfg, shaping=shaping[s], denominator=denominator)
        shard_loss.backward()
        total += shard_loss.item()
        grad[s] = part.grad  # all-reduce(sum) of per-rank gradients
    assert total == pytest.approx(full.item(), abs=1e-12)
    assert torch.allclose(grad, full_grad, atol=1e-12)


def test_policy_loss_gradcheck():
    logp, old, adv, mask, shaping = _random_batch(B=3, T=4, seed=2)
    ref = old - 0.1
    for mode in AGG_MODES:
        cfg = PolicyLossConfig(agg_mode=mode, dual_clip=3.0, kl_coef=0.01, kl_type="k3")
        fn = lambda lp: policy_loss(lp, old, adv, mask, cfg, shaping=shaping, ref_logp=ref)[0]  # noqa: E731
        assert torch.autograd.gradcheck(fn, (logp.detach().clone().requires_grad_(True),), eps=1e-6, atol=1e-5)


def test_on_policy_batch_rapo_equals_grpo():
    """With no retrieval, Z_ret = 0 -> A_ret = 0 and F_ret = 0 -> shaping 1: RAPO reduces to GRPO exactly."""
    logp, old, _, mask, _ = _random_batch(B=8, T=6, seed=3)
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    groups = [0, 0, 0, 0, 1, 1, 1, 1]
    a_acc = grpo_outcome_advantage(rewards, groups)
    z = torch.tensor([trajectory_retrieval_reward([0.5, 0.7], []) for _ in range(8)])
    a_rapo = rapo_advantage(a_acc, retrieval_advantage(z, groups), 0.2)
    assert torch.equal(a_rapo, a_acc)
    shaping = importance_shaping_factor(retrieved_token_fraction(torch.zeros(8), mask.sum(-1)), 0.05)
    assert torch.equal(shaping, torch.ones(8))
    grpo_loss, _ = policy_loss(logp, old, a_acc.double(), mask)
    rapo_loss, _ = policy_loss(logp, old, a_rapo.double(), mask, shaping=shaping)
    assert rapo_loss.item() == grpo_loss.item()


def test_arpo_branch_probability_and_decision():
    assert branch_probability(0.5, tau=0.5, beta=0.2) == pytest.approx(0.6)  # 0.5 + 0.2 * 0.5
    assert branch_probability(10.0) == 1.0 and branch_probability(-10.0) == 0.0
    # u - beta dH = 0.59 - 0.1 = 0.49 <= 0.5 -> branch; 0.61 - 0.1 = 0.51 > 0.5 -> no
    assert should_branch(0.5, 0.59) is True
    assert should_branch(0.5, 0.61) is False


def test_arpo_segment_entropy_normalisation():
    # ARPO sums the first k token entropies and divides by log |V|
    assert normalized_segment_entropy([1.0, 2.0, 3.0], first_k=2, vocab_size=100) == pytest.approx(3.0 / math.log(100))
    assert normalized_segment_entropy([], first_k=20) == 0.0


def test_arpo_budget_bookkeeping():
    budget = BranchBudget(total=4, initial=2, beam_size=2)
    assert budget.remaining == 2
    # every candidate wants to branch; one branch per source per round (beam 2), capped by the budget
    assert budget.allocate([0, 1, 2], decide=lambda i: True) == [0, 1]
    assert budget.remaining == 0
    b2 = BranchBudget(total=5, initial=2, beam_size=3)
    assert b2.allocate([7], decide=lambda i: True) == [7, 7]  # beam 3 -> up to 2 branches from one source
    assert b2.fill_with_full_samples() == 1 and b2.remaining == 0
    with pytest.raises(ValueError):
        BranchBudget(total=2, initial=3)


def test_entropy_brancher_uses_initial_entropy():
    import random

    br = EntropyBrancher(tau=0.5, beta=1.0, rng=random.Random(0))
    br.set_initial("r0", 1.0)
    br.set_initial("r0", 5.0)  # only the first value counts
    assert br.initial["r0"] == 1.0
    # dH = +10 -> probability 1
    assert all(br.decide("r0", 11.0) for _ in range(20))
    # dH = -10 -> probability 0
    assert not any(br.decide("r0", -9.0) for _ in range(20))


def test_group_advantages_rapo_by_hand_and_per_group_equals_whole_batch():
    from rapo_ray.algos.registry import get_algorithm
    from rapo_ray.config import load_config

    algo = load_config().algo  # rapo, a = 0.2, m = 0.05
    batch = {
        "row": [0, 1, 2, 3],
        "group_id": ["g", "g", "h", "h"],
        "reward": [1.0, 0.0, 1.0, 1.0],
        # row 1 retrieved after step 0 (H 2.0) and the step after it has H 1.0
        "step_entropies": [[1.0, 1.0], [2.0, 1.0], [0.5], [0.5]],
        "retrieval_before": [[], [0], [], []],
        "retrieval_after": [[], [1], [], []],
        "num_retrieved_tokens": [0, 5, 0, 0],
        "num_response_tokens": [10, 20, 10, 10],
    }
    out = get_algorithm(algo.name).advantages(batch, algo)
    # group g: rewards (1, 0): mean 0.5, unbiased std 0.7071 -> A_acc = +-0.7071; group h: constant -> 0
    a_acc = 0.5 / (0.5**0.5 + 1e-6)
    # Z of row 1 (Eq. 5-7): delta = (H_before - H_after) / H_before = (2 - 1) / 2 = 0.5, quality tanh(2 * 0.5),
    # timing H_before = 2 -> Z = 2 tanh(1); row 0 has Z 0. The group z-score of (0, Z) is (-0.7071, +0.7071)
    # whatever Z is, so the factors are (1 - 0.2 * 0.7071, 1 + 0.2 * 0.7071)
    z = 2 * math.tanh(1.0)
    z_adv = (z / 2) / (z / 2**0.5 + 1e-6)
    assert out["retrieval_reward"] == pytest.approx([0.0, z, 0.0, 0.0])
    assert out["advantage"] == pytest.approx(
        [a_acc * (1 - 0.2 * z_adv), -a_acc * (1 + 0.2 * z_adv), 0.0, 0.0], abs=1e-5
    )
    # Eq. 8 shaping: 1 + m F_ret with F_ret = 5 / 20
    assert out["shaping"] == pytest.approx([1.0, 1.0 + 0.05 * 0.25, 1.0, 1.0], abs=1e-6)
    # per group == whole batch (what lets Ray Data's map_groups compute it)
    parts = [
        get_algorithm(algo.name).advantages({k: [v[i] for i in idx] for k, v in batch.items()}, algo)
        for idx in ([0, 1], [2, 3])
    ]
    assert [x for p in parts for x in p["advantage"]] == pytest.approx(out["advantage"])


def test_target_logprobs_by_hand():
    """Vocabulary of 2, logits (0, ln 3) at both positions: p = (1/4, 3/4); targets are ids[:, 1:] = (1, 0)."""
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
    got = target_logprobs(logits, torch.tensor([[0, 1, 0]]))
    assert got[0].tolist() == pytest.approx([math.log(0.75), math.log(0.25)])
