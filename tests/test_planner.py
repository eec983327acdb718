"""Latency model, expert estimator, calibration and the verification-length planner (pure policy; CPU, fast)."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
import torch

from scheduler.calibration import AcceptanceCalibrator
from scheduler.latency_model import (ExpertEstimator, LatencyCoefs, LatencyModel, PlanCost, StepComposition,
                                     TokenCostTable, footprint_from_routing)
from scheduler.planner import (Plan, budget_plan, expected_goodput, fixed_lengths, plan_host, plan_with_experts,
                               survival_from_acceptance)
from scheduler.planner_torch import (budget_plan_device, calibrate_device, distinct_by_tokens_device,
                                     footprint_touch_probs, plan_device,
                                     plan_with_experts_device, survival_device)

# ---------------------------------------------------------------------------------------------------------
# helpers


def zipf_probs(num_experts: int, s: float = 1.0) -> list[float]:
    w = [1.0 / (e + 1) ** s for e in range(num_experts)]
    z = sum(w)
    return [x / z for x in w]


def route(rng: random.Random, log_w: list[float], top_k: int) -> list[int]:
    """One token's top-k experts: Gumbel-top-k = sampling without replacement proportional to the weights."""
    keys = [lw - math.log(-math.log(rng.random() or 1e-300)) for lw in log_w]
    return sorted(range(len(keys)), key=keys.__getitem__, reverse=True)[:top_k]


def random_survival(rng: random.Random, b: int, k: int) -> list[list[float]]:
    return survival_from_acceptance([[rng.random() ** 0.4 for _ in range(k)] for _ in range(b)])


def random_composition(rng: random.Random, layers: int) -> StepComposition:
    b = rng.randint(1, 64)
    toks = [rng.randint(1, 17) for _ in range(b)]
    ctx = [rng.randint(16, 4096) for _ in range(b)]
    experts = [rng.randint(8, 200) for _ in range(layers)]
    return StepComposition(toks, ctx, num_moe_layers=layers, distinct_experts_per_layer=experts)


TRUE = LatencyCoefs(const_ms=1.5, ms_per_token=0.004, ms_per_expert=0.0015, ms_per_request=0.02,
                    ms_per_context_token=2e-5)


def true_ms(comp: StepComposition, coefs: LatencyCoefs = TRUE) -> float:
    return (coefs.const_ms + coefs.ms_per_token * comp.num_tokens + coefs.ms_per_expert * comp.experts_total()
            + coefs.ms_per_request * comp.num_requests + coefs.ms_per_context_token * comp.context_tokens)


# ---------------------------------------------------------------------------------------------------------
# latency model


def test_latency_model_fit_recovers_coefficients_and_reports_error():
    rng = random.Random(0)
    train = [(c, true_ms(c) * (1 + rng.gauss(0, 0.01))) for c in (random_composition(rng, 10) for _ in range(400))]
    held = [(c, true_ms(c) * (1 + rng.gauss(0, 0.01))) for c in (random_composition(rng, 10) for _ in range(100))]
    model = LatencyModel()
    coefs = model.fit(train)
    for got, want in zip(coefs.as_list(), TRUE.as_list()):
        assert got == pytest.approx(want, rel=0.08)
    stats = model.evaluate(held)
    assert stats.n == 100 and stats.mean_abs_pct < 1.5 and stats.p90_abs_pct < 3.0

    # online: starts empty, fits itself after min_samples, reports prequential error, tracks a change
    online = LatencyModel(refit_every=8)
    for comp, ms in train[:200]:
        online.observe(comp, ms)
    assert online.fitted and online.error_stats().n == 200 - online.min_samples
    # the worst samples are kept, largest error first, with their observe index and features
    glitch = train[200][0]
    online.observe(glitch, 0.01 * true_ms(glitch))  # a measurement 100x too small
    assert online.observed == 201 and len(online.worst) == LatencyModel.WORST
    assert online.worst[0][1] == 201 and online.worst[0][0] > 5000 and online.worst[0][3] == 0.01 * true_ms(glitch)
    assert [w[0] for w in online.worst] == sorted((w[0] for w in online.worst), reverse=True)
    assert online.worst[0][0] == pytest.approx(online.error_stats().max_abs_pct)
    slower = LatencyCoefs(**{**TRUE.__dict__, "ms_per_expert": 3 * TRUE.ms_per_expert})
    for comp in (random_composition(rng, 10) for _ in range(600)):
        online.observe(comp, true_ms(comp, slower))
    assert online.coefs.ms_per_expert == pytest.approx(slower.ms_per_expert, rel=0.05)
    assert online.evaluate((c, true_ms(c, slower)) for c, _ in held).mean_abs_pct < 1.0


def test_latency_model_leaves_out_what_the_profile_holds_fixed():
    """A start-up profile at one batch size holds the request count and each request's context fixed (here 8
    tokens, one request): those features cannot be told from the constant, get no weight, and serving's longer
    contexts are predicted from the constant (before, the fit's minimum-norm split put part of the constant on
    the context, and c=1 steps at 30x the profile's context were predicted at ~12x their time). At several batch
    sizes the profile's context is a multiple of the request count: the context still gets no weight."""
    for sizes in ([1], [1, 4, 16]):
        model = LatencyModel()
        for b in sizes:
            for t in (1, 2, 4, 8, 12, 17):
                comp = StepComposition([t] * b, [8] * b, num_moe_layers=10, distinct_experts_per_layer=[4 * t] * 10)
                model.anchor(comp, true_ms(comp))
        coefs = model.fit()
        assert coefs.ms_per_context_token == 0.0 and (coefs.ms_per_request == 0.0) == (sizes == [1])
        for b in sizes:
            serving = StepComposition([16] * b, [286] * b, num_moe_layers=10, distinct_experts_per_layer=[64] * 10)
            assert model.predict(serving) == pytest.approx(true_ms(serving), rel=0.05)
    # online samples that vary the context identify its coefficient
    rng = random.Random(1)
    for _ in range(64):
        comp = random_composition(rng, 10)
        model.observe(comp, true_ms(comp))
    assert model.coefs.ms_per_context_token == pytest.approx(TRUE.ms_per_context_token, rel=0.05)


def test_identifiable_columns_edge_cases():
    """identifiable_columns keeps const first, drops a column the earlier ones explain, handles fewer rows than
    columns (least squares on the kept ones) and keeps the constant alone when nothing varies; the fit ignores a
    sample with a non-finite feature or time."""
    import numpy as np

    from scheduler.latency_model import identifiable_columns

    ones = np.ones(6)
    x = np.c_[ones, np.arange(6.0), 2 * np.arange(6.0) + 3, ones * 5]  # [6, 4]: col 2 = 3 const + 2 col 1, col 3 const
    assert identifiable_columns(x, ones) == [0, 1]
    assert identifiable_columns(x[:2], ones[:2]) == [0, 1]  # two rows: at most two columns
    assert identifiable_columns(np.c_[ones, ones * 7], ones) == [0]
    assert identifiable_columns(np.zeros((3, 2)), np.ones(3)) == [0]  # nothing at all: the constant
    model = LatencyModel()
    rng = random.Random(2)
    for _ in range(40):
        comp = random_composition(rng, 10)
        model.anchor(comp, true_ms(comp))
    model.anchors.append(([1.0, float("nan"), 1.0, 1.0, 1.0], 3.0))
    model.anchors.append(([1.0, 1.0, 1.0, 1.0, 1.0], float("inf")))
    coefs = model.fit()
    assert all(math.isfinite(c) for c in coefs.as_list())
    assert coefs.ms_per_expert == pytest.approx(TRUE.ms_per_expert, rel=0.05)


def test_latency_model_nonnegative_and_estimated_experts():
    rng = random.Random(1)
    no_ctx = LatencyCoefs(const_ms=1.0, ms_per_token=0.01, ms_per_expert=0.002, ms_per_request=0.0)
    data = [(c, true_ms(c, no_ctx) + rng.gauss(0, 0.01)) for c in (random_composition(rng, 4) for _ in range(200))]
    coefs = LatencyModel(relative=False).fit(data)
    assert all(v >= 0 for v in coefs.as_list())
    assert coefs.ms_per_request < 1e-3 and coefs.ms_per_context_token < 1e-6
    # before routing, the expert feature comes from the estimator
    est = ExpertEstimator(num_layers=4, num_experts=64, top_k=4)
    model = LatencyModel(coefs=no_ctx, estimator=est)
    comp = StepComposition([1, 1], [10, 20], num_moe_layers=4)
    assert model.predict(comp) == pytest.approx(1.0 + 0.02 + 0.002 * est.expected_distinct_total(2))
    with pytest.raises(ValueError):
        LatencyModel(coefs=no_ctx).predict(comp)


def test_token_cost_table():
    table = TokenCostTable.fit([(1, 2.0), (1, 2.2), (4, 2.0), (8, 3.0), (16, 5.0)])
    assert table.cost_ms(1) == pytest.approx(6.2 / 3)  # (1) and (4) pooled, by sample count, to stay monotone
    assert table.cost_ms(4) == pytest.approx(6.2 / 3)
    assert table.cost_ms(12) == pytest.approx(4.0)
    assert table.cost_ms(32) > table.cost_ms(16)
    table.observe(32, 9.0)
    assert table.cost_ms(32) == pytest.approx(9.0)
    assert table.dense_ms(3)[0] == table.cost_ms(0)


# ---------------------------------------------------------------------------------------------------------
# expert estimator


def test_expert_estimator_converges_on_zipf_routing():
    rng = random.Random(2)
    E, K, LAYERS = 64, 4, 2
    log_w = [math.log(p) for p in zipf_probs(E)]
    est = ExpertEstimator(num_layers=LAYERS, num_experts=E, top_k=K)
    assert est.expected_distinct_total(1) == pytest.approx(K * LAYERS)
    uniform_16 = est.expected_distinct_total(16)
    for _ in range(150):  # 150 steps of 16 tokens
        est.observe_routing([[e for _ in range(16) for e in route(rng, log_w, K)] for _ in range(LAYERS)])
    for n in (1, 4, 16, 64):
        trials = [sum(len({e for _ in range(n) for e in route(rng, log_w, K)}) for _ in range(LAYERS))
                  for _ in range(max(20, 600 // n))]
        truth = sum(trials) / len(trials)
        assert est.expected_distinct_total(n) == pytest.approx(truth, rel=0.04), n
        est.observe_distinct(n, [trials[0] // LAYERS] * LAYERS)
    assert uniform_16 > 1.3 * est.expected_distinct_total(16)  # it learned the skew
    assert est.error_stats().n == 4


def test_expert_estimator_learns_locality_and_footprint_cost():
    rng = random.Random(3)
    E, K = 32, 4
    log_w = [math.log(p) for p in zipf_probs(E)]
    est = ExpertEstimator(num_layers=1, num_experts=E, top_k=K)
    for _ in range(50):
        est.observe_routing([[e for _ in range(16) for e in route(rng, log_w, K)]])
    true_locality = 0.6
    for _ in range(400):
        fp_experts = rng.sample(range(E), 8)
        fp = footprint_from_routing([fp_experts])
        ids = []
        for _ in range(4):
            ids += rng.sample(fp_experts, K) if rng.random() < true_locality else route(rng, log_w, K)
        est.observe_request(fp, [ids])
    assert est.locality == pytest.approx(true_locality, abs=0.08)
    # a request whose footprint is the batch's popular experts costs less than one on rare experts
    popular, rare = footprint_from_routing([[0, 1, 2, 3]]), footprint_from_routing([[28, 29, 30, 31]])
    inc, _ = est.batch_increments([None] * 6 + [popular, rare], [1] * 8, 4)
    assert inc[6][0] < 0.6 * inc[7][0]
    assert all(row[j + 1] <= row[j] + 1e-12 for row in inc for j in range(3))  # sublinear


# ---------------------------------------------------------------------------------------------------------
# planner: optimality


def brute_force(survival, caps, cost, inc):
    return max((expected_goodput(survival, list(L), cost, inc) for L in
                itertools.product(*[range(c + 1) for c in caps])), key=lambda p: p.goodput_tokens_per_ms)


def random_instance(rng: random.Random, b: int, k: int):
    survival = random_survival(rng, b, k)
    caps = [rng.randint(0, k) for _ in range(b)]
    # expert increments: sublinear (decreasing) for most rows, so costs fall with j and pooling is exercised
    inc = [sorted((rng.random() * 8 for _ in range(k)), reverse=rng.random() < 0.8) for _ in range(b)]
    cost = PlanCost(base_ms=rng.uniform(1, 10), ms_per_token=rng.uniform(0.01, 1.0), ms_per_expert=rng.uniform(0, 0.5))
    return survival, caps, cost, inc


def test_planner_equals_brute_force():
    rng = random.Random(4)
    for _ in range(300):
        survival, caps, cost, inc = random_instance(rng, rng.randint(1, 4), rng.randint(1, 4))
        plan = plan_host(survival, caps, cost, inc)
        best = brute_force(survival, caps, cost, inc)
        assert plan.goodput_tokens_per_ms == pytest.approx(best.goodput_tokens_per_ms, rel=1e-12)
        assert all(0 <= L <= c for L, c in zip(plan.lengths, caps))
        again = expected_goodput(survival, plan.lengths, cost, inc)
        assert again.expected_tokens == pytest.approx(plan.expected_tokens)
        assert again.step_ms == pytest.approx(plan.step_ms)


def test_planner_chooses_zero_when_drafts_are_worthless_and_cap_when_free():
    cost = PlanCost(base_ms=5.0, ms_per_token=0.05, ms_per_expert=0.01)
    worthless = [[1e-4 * 0.5 ** j for j in range(8)] for _ in range(6)]
    assert plan_host(worthless, [8] * 6, cost, [[8.0] * 8] * 6).lengths == [0] * 6
    assert plan_device(torch.tensor(worthless, dtype=torch.float64), torch.full((6,), 8), 5.0, 0.05, 0.01,
                       torch.full((6, 8), 8.0)).tolist() == [0] * 6
    sure = [[1.0] * 8 for _ in range(6)]
    assert plan_host(sure, [8, 3, 0, 8, 8, 1], cost).lengths == [8, 3, 0, 8, 8, 1]
    # mixed: the worthless request decodes plainly while the others speculate
    mixed = [[0.95 ** (j + 1) for j in range(8)], [0.01 ** (j + 1) for j in range(8)]]
    L = plan_host(mixed, [8, 8], cost).lengths
    assert L[0] > 0 and L[1] == 0


# ---------------------------------------------------------------------------------------------------------
# planner vs fixed K and budget where experts dominate the step

E_W, TOPK_W, LAYERS_W, K_W = 64, 4, 2, 6
# experts dominate: a step of B decodes touching ~50-90 distinct experts spends 5-9 ms on them, 0.2 ms on the rest
WORLD = LatencyCoefs(const_ms=0.2, ms_per_token=0.005, ms_per_expert=0.1)


def world_estimator() -> ExpertEstimator:
    est = ExpertEstimator(LAYERS_W, E_W, TOPK_W, locality=0.7)
    zp = zipf_probs(E_W)
    est.observe_counts([[4000 * TOPK_W * p for p in zp] for _ in range(LAYERS_W)])
    return est


def world_goodput(est, survival, footprints, lengths) -> float:
    """Ground truth of the synthetic world: the full coverage model (distinct experts of the union of every
    request's tokens, with their footprints), not the planner's linearization."""
    _, experts = est.batch_increments(footprints, [1] * len(survival), 0, lengths)
    ms = WORLD.const_ms + WORLD.ms_per_token * (len(survival) + sum(lengths)) + WORLD.ms_per_expert * experts
    return (len(survival) + sum(sum(r[:L]) for r, L in zip(survival, lengths))) / ms


def world_table(est) -> TokenCostTable:
    """budget's start-up profile: cost by token count, measured with globally routed tokens (exact for them)."""
    return TokenCostTable.fit((t, WORLD.const_ms + WORLD.ms_per_token * t + WORLD.ms_per_expert *
                               est.expected_distinct_total(t)) for t in range(1, 16 * (K_W + 1) + 1))


def footprint(rng: random.Random, popular: bool):
    """A request whose recent tokens used the 8 most popular experts, or 16 of the rarely used half."""
    return footprint_from_routing([rng.sample(range(8), 8) if popular else rng.sample(range(E_W // 2, E_W), 16)
                                   for _ in range(LAYERS_W)])


def world_batches(rng: random.Random):
    for b in (1, 2, 4, 8, 16) * 3:
        footprints = [footprint(rng, rng.random() < 0.5) for _ in range(b)]
        survival = [[a ** (j + 1) for j in range(K_W)] for a in (rng.choice([0.3, 0.6, 0.8, 0.9, 0.95])
                                                                  for _ in range(b))]
        yield survival, footprints


def hybridspec(est, survival, footprints):
    base = StepComposition([1] * len(survival), [0] * len(survival), num_moe_layers=LAYERS_W)
    return plan_with_experts(survival, [K_W] * len(survival), WORLD, base, est, footprints).lengths


def _moe_config(num_experts: int = 64, top_k: int = 8):
    """A two-layer MoE config for the policy tests."""
    from workers.config import ModelConfig

    return ModelConfig.from_dict({"model_type": "qwen3_next", "hidden_size": 64, "num_hidden_layers": 2,
                                  "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                                  "vocab_size": 64, "num_experts": num_experts, "num_experts_per_tok": top_k})


def compare(est, table, survival, fps) -> tuple[float, float]:
    """(hybridspec / budget, hybridspec / best fixed K) expected goodput in the synthetic world."""
    caps = [K_W] * len(survival)
    ours = world_goodput(est, survival, fps, hybridspec(est, survival, fps))
    best_fixed = max(world_goodput(est, survival, fps, fixed_lengths(caps, k)) for k in range(K_W + 1))
    budget = world_goodput(est, survival, fps, budget_plan(survival, caps, table, len(survival)).lengths)
    return ours / budget, ours / best_fixed


def test_planner_beats_every_fixed_k_and_budget_when_experts_dominate():
    est = world_estimator()
    table = world_table(est)
    rng = random.Random(5)
    for survival, fps in world_batches(rng):
        vs_budget, vs_fixed = compare(est, table, survival, fps)
        assert vs_budget >= 1 - 1e-9 and vs_fixed >= 1 - 1e-9, (len(survival), vs_budget, vs_fixed)
    # footprints differ, survival does not: budget and fixed K cannot tell cheap drafts (experts the batch
    # touches anyway) from costly ones; the planner verifies more of the cheap ones
    for b in (2, 4, 8):
        for a in (0.6, 0.7):
            fps = [footprint(rng, i % 2 == 0) for i in range(b)]
            survival = [[a ** (j + 1) for j in range(K_W)] for _ in range(b)]
            vs_budget, vs_fixed = compare(est, table, survival, fps)
            assert vs_budget > 1.02 and vs_fixed > 1.02, (b, a, vs_budget, vs_fixed)


# ---------------------------------------------------------------------------------------------------------
# calibration


def test_calibration_maps_overconfident_drafter_down():
    rng = random.Random(6)
    cal = AcceptanceCalibrator(num_bins=10, max_positions=4)
    for _ in range(6000):
        conf = rng.uniform(0.6, 1.0)
        pos = rng.randrange(4)
        cal.observe("ngram", pos, conf, rng.random() < 0.5 * conf)  # says 0.9, is accepted 45% of the time
        good = rng.random()
        cal.observe("mtp", pos, good, rng.random() < good)  # calibrated already
    for pos in range(4):
        assert cal.calibrate("ngram", pos, 0.9) == pytest.approx(0.45, abs=0.06)
        assert cal.calibrate("mtp", pos, 0.3) == pytest.approx(0.3, abs=0.06)
    vals = cal.table("ngram")[0]
    assert all(a <= b + 1e-12 for a, b in zip(vals, vals[1:]))
    st = cal.stats("ngram")
    assert st.ece_raw > 0.35 and st.ece_calibrated < 0.06 and st.n == 6000
    assert cal.stats("mtp").ece_calibrated < 0.06


def test_calibration_observes_only_up_to_first_rejection():
    cal = AcceptanceCalibrator(max_positions=8, prior_weight=0.0)
    for _ in range(10):
        cal.observe_verification("d", [0.95] * 6, num_verified=6, num_accepted=2)
    assert cal.calibrate("d", 0, 0.95) == pytest.approx(1.0)  # a bin centre: no interpolation
    assert cal.calibrate("d", 2, 0.95) == pytest.approx(0.0, abs=1e-6)
    assert cal.stats("d").n == 30  # positions 0, 1 accepted, 2 rejected; 3..5 unobserved


def test_calibration_prior_pooled_over_positions():
    """A position with few or no observations is shrunk towards the drafter's map over all positions (the
    default prior), not towards the raw confidence: a drafter that says 0.9 and is right half the time at
    positions 0-2 calibrates to ~0.5 at position 10 too (the identity prior says 0.9 there). With no data at all
    both priors trust the raw confidence; a bad prior name is refused, naming the field."""
    rng = random.Random(11)
    pooled, identity = AcceptanceCalibrator(max_positions=16), AcceptanceCalibrator(max_positions=16,
                                                                                  prior="identity")
    assert pooled.calibrate("d", 10, 0.9) == pytest.approx(0.9) == identity.calibrate("d", 10, 0.9)
    for _ in range(600):
        obs = [(pos, 0.9, rng.random() < 0.5) for pos in range(3)]
        pooled.observe_many("d", obs)
        identity.observe_many("d", obs)
    for pos in range(3):
        assert pooled.calibrate("d", pos, 0.9) == pytest.approx(0.5, abs=0.05)
        assert identity.calibrate("d", pos, 0.9) == pytest.approx(0.5, abs=0.05)
    assert pooled.calibrate("d", 10, 0.9) == pytest.approx(0.5, abs=0.05)
    assert identity.calibrate("d", 10, 0.9) == pytest.approx(0.9)
    vals = pooled.table("d")[10]
    assert all(a <= b + 1e-12 for a, b in zip(vals, vals[1:]))
    with pytest.raises(ValueError, match="prior must be one of"):
        AcceptanceCalibrator(prior="flat")


def test_policy_calibration_prior_from_env(monkeypatch):
    """The serving policies' calibrator takes the pooled prior unless HYBRIDSPEC_CALIBRATION_PRIOR says identity
    (A/B measurement); a bad value is refused naming the variable."""
    from workers.policy import LengthPolicy

    cfg = _moe_config(num_experts=8, top_k=2)
    assert LengthPolicy("hybridspec", cfg).calibrator.prior == "pooled"
    monkeypatch.setenv("HYBRIDSPEC_CALIBRATION_PRIOR", "identity")
    assert LengthPolicy("budget", cfg).calibrator.prior == "identity"
    monkeypatch.setenv("HYBRIDSPEC_CALIBRATION_PRIOR", "flat")
    with pytest.raises(ValueError, match="HYBRIDSPEC_CALIBRATION_PRIOR must be one of"):
        LengthPolicy("hybridspec", cfg)


def test_calibration_prior_bench_pooled_is_less_biased():
    """bench/calibration_prior.py's point, over its 12 seeds (one seed's realization moves its bias by +-5%): with
    e2e's replay drafter (noise confidences) at acceptance 0.95 and with an over-confident drafter at 0.85, the
    pooled prior estimates a 16-draft plan's expected tokens with less bias than the identity prior (there
    +0.2% / +1.8% against -4.0% / +10.6%)."""
    from bench.calibration_prior import run

    for kind, p in (("noise", 0.95), ("overconf", 0.85)):
        bias = {prior: sum(run(kind, p, prior, seed, steps=190)[0] for seed in range(12)) / 12
                for prior in ("pooled", "identity")}
        assert abs(bias["pooled"]) < 0.02 < abs(bias["identity"]) - 0.01, (kind, bias)


# ---------------------------------------------------------------------------------------------------------
# device implementations agree with the host


def test_device_plan_equals_host_plan():
    rng = random.Random(7)
    for _ in range(150):
        b, k = rng.randint(1, 32), rng.randint(1, 16)
        survival, caps, cost, inc = random_instance(rng, b, k)
        host = plan_host(survival, caps, cost, inc)
        dev = plan_device(torch.tensor(survival, dtype=torch.float64), torch.tensor(caps), cost.base_ms,
                          cost.ms_per_token, cost.ms_per_expert, torch.tensor(inc, dtype=torch.float64))
        assert dev.tolist() == host.lengths
        table = TokenCostTable.fit([(t, 2.0 + 0.3 * t ** 0.8) for t in range(1, b * (k + 1) + 1, 3)])
        hb = budget_plan(survival, caps, table, b, draft_ms=0.5)
        db = budget_plan_device(torch.tensor(survival, dtype=torch.float64), torch.tensor(caps),
                                torch.tensor(table.dense_ms(b * (k + 1)), dtype=torch.float64), b, draft_ms=0.5)
        assert db.tolist() == hb.lengths
    acc = torch.rand(5, 7, dtype=torch.float64)
    want = torch.tensor(survival_from_acceptance(acc.tolist()), dtype=torch.float64)
    assert torch.allclose(survival_device(acc), want, rtol=1e-12, atol=0)


def test_device_plan_with_experts_and_calibration_equal_host():
    est = world_estimator()
    rng = random.Random(8)
    table = torch.tensor(est.touch_prob_table(), dtype=torch.float64)
    for survival, fps in list(world_batches(rng))[:10]:
        b = len(survival)
        host = hybridspec(est, survival, fps)
        counts = torch.zeros(b, LAYERS_W, E_W, dtype=torch.float64)
        for i, fp in enumerate(fps):
            for layer, d in enumerate(fp):
                for e, c in d.items():
                    counts[i, layer, e] = c
        dev = plan_with_experts_device(torch.tensor(survival, dtype=torch.float64), torch.full((b,), K_W),
                                       WORLD.const_ms + WORLD.ms_per_token * b, WORLD.ms_per_token,
                                       WORLD.ms_per_expert, table, torch.ones(b, dtype=torch.long),
                                       footprint_touch_probs(counts, TOPK_W), est.locality)
        assert dev.tolist() == host
    cal = AcceptanceCalibrator(max_positions=3)
    for _ in range(500):
        c = rng.random()
        cal.observe("d", rng.randrange(5), c, rng.random() < c * c)
    conf = torch.rand(4, 5, dtype=torch.float64)
    got = calibrate_device(conf, torch.tensor(cal.table("d"), dtype=torch.float64))
    want = [cal.calibrate_row("d", row) for row in conf.tolist()]
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)


def test_model_token_cost_plan_is_exact_for_globally_routed_batches():
    """hybridspec's serving plan (workers/policy.py): with every request routed by global popularity the latency
    model's cost depends on the step's token count only (LatencyModel.token_cost), and budget_plan's search over
    it is the exact optimum (brute force over every length vector), >= the linearized footprint planner, every
    fixed K and budget with a measured table."""
    est = world_estimator()
    distinct = distinct_by_tokens_device(torch.tensor(est.touch_prob_table(), dtype=torch.float64), 40).tolist()
    assert all(abs(distinct[n] - est.expected_distinct_total(n)) < 1e-9 for n in range(41))
    model = LatencyModel(LatencyCoefs(const_ms=0.3, ms_per_token=0.01, ms_per_expert=0.05, ms_per_request=0.02,
                                      ms_per_context_token=1e-4), estimator=est)
    rng = random.Random(21)
    table = world_table(est)
    for _ in range(25):
        b, k = rng.randint(1, 3), rng.randint(1, 4)
        survival = random_survival(rng, b, k)
        caps = [rng.randint(0, k) for _ in range(b)]
        base = StepComposition([1] * b, [rng.randint(1, 300) for _ in range(b)], num_moe_layers=LAYERS_W)
        cost = model.token_cost(base, distinct)

        def goodput(lengths):
            return (b + sum(sum(r[:L]) for r, L in zip(survival, lengths))) / cost.cost_ms(b + sum(lengths))

        got = budget_plan(survival, caps, cost, b).lengths
        best = max(goodput(list(ls)) for ls in itertools.product(*[range(c + 1) for c in caps]))
        assert goodput(got) >= best * (1 - 1e-12), (goodput(got), best)
        linear = plan_with_experts(survival, caps, model.coefs, base, est).lengths
        assert goodput(got) >= goodput(linear) * (1 - 1e-12)
        assert goodput(got) >= max(goodput(fixed_lengths(caps, j)) for j in range(k + 1)) * (1 - 1e-12)
        assert goodput(got) >= goodput(budget_plan(survival, caps, table, b).lengths) * (1 - 1e-12)
    with pytest.raises(ValueError, match="num_tokens must be in"):
        cost.cost_ms(len(distinct))


def test_profile_samples_stay_in_every_fit():
    """The start-up profile's samples (several shapes) are anchors: after the online window has filled with
    steps of one shape only, the fit still has the token slope the profile measured."""
    est = ExpertEstimator(1, 8, 2)
    model = LatencyModel(estimator=est, window=32, refit_every=4)
    true = LatencyCoefs(const_ms=2.0, ms_per_token=0.15)
    for b, t in itertools.product((1, 4, 16), (1, 4, 17)):
        comp = StepComposition([t] * b, [8] * b, 0, estimated_experts_total=0.0)
        model.anchor(comp, true_ms(comp, true))
    model.fit()
    for _ in range(200):  # one shape only, slightly slower than the model says
        comp = StepComposition([9], [300], 0, estimated_experts_total=0.0)
        model.observe(comp, 1.02 * true_ms(comp, true))
    assert len(model.samples) == 32 and len(model.anchors) == 9
    assert abs(model.coefs.ms_per_token - 0.15) < 0.02, model.coefs


def test_speculation_gate_follows_measured_goodput_and_probes():
    from workers.policy import SpeculationGate

    gate = SpeculationGate()
    decisions = []
    for step in range(200):
        draft = gate.should_draft(12)
        decisions.append(draft)
        # a world where speculation yields 1.5 tokens per request per step for 2x the step time: plain wins
        gate.observe(12, draft, 18 if draft else 12, 20.0 if draft else 10.0)
    tail = decisions[20:]
    assert decisions[:6] == [True] * 3 + [False] * 3  # each side measured first, speculation first
    # only the probes draft, and rarely: speculation's rate is 0.75x plain's, a clear loser
    assert 0 < sum(tail) <= len(tail) / (SpeculationGate.PROBE * SpeculationGate.MAX_SPACING) + 1, sum(tail)
    assert gate.bucket(12) == 16 and gate.bucket(1) == 1 and gate.bucket(16) == 16
    gate = SpeculationGate()
    for _ in range(200):
        draft = gate.should_draft(3)
        gate.observe(3, draft, 12 if draft else 3, 12.0 if draft else 10.0)  # speculation wins
    assert gate.speculative_share() > 0.9
    # an optimistic plain-rate hint that speculation beats clearly: plain decoding is never explored, only probed
    gate = SpeculationGate()
    first = []
    for _ in range(20):
        draft = gate.should_draft(3, plain_hint=0.25)
        first.append(draft)
        gate.observe(3, draft, 12 if draft else 3, 12.0 if draft else 10.0)  # 1/3 token/ms/request > 1.2 x 0.25
    assert all(first), first
    gate = SpeculationGate()  # a hint that speculation does not beat by the margin: plain is measured
    decisions = []
    for _ in range(8):
        draft = gate.should_draft(3, plain_hint=0.3)
        decisions.append(draft)
        gate.observe(3, draft, 12 if draft else 3, 12.0 if draft else 10.0)
    assert decisions[3:6] == [False] * 3, decisions
    # a bucket met for the first time starts from its nearest measured neighbour's verdict (no exploration) and
    # keeps the neighbour's ratio at its own scale after its first sample
    gate = SpeculationGate()
    for _ in range(40):
        draft = gate.should_draft(16)
        gate.observe(16, draft, 24 if draft else 16, 20.0 if draft else 10.0)  # plain wins at 16
    first = [gate.should_draft(32) for _ in range(4)]  # a larger batch takes plain decoding's lead
    assert first == [False] * 4 and 32 in gate.inherited
    gate.observe(32, False, 32, 16.0)  # its own plain rate: 0.0625 per request (the neighbour's: 0.1)
    assert 32 not in gate.inherited
    assert gate.rate[(32, False)] == pytest.approx(0.0625) and gate.rate[(32, True)] == pytest.approx(0.046875)
    # a smaller batch (a closed batch's tail) takes speculation's lead at least: here the sides tie, it drafts
    assert [gate.should_draft(8) for _ in range(3)] == [True] * 3 and 8 in gate.inherited
    gate.observe(8, True, 12, 10.0)  # its own speculative rate: 0.15 per request; plain's rescaled to the tie
    assert 8 not in gate.inherited
    assert gate.rate[(8, True)] == pytest.approx(0.15) and gate.rate[(8, False)] == pytest.approx(0.15)
    gate.observe(8, False, 8, 4.0)  # then plain decoding measured faster (0.25 per request): it takes over
    assert not gate.should_draft(8)
    # only from an adjacent bucket: batch size 1 measures its own sides (speculation first)
    assert [gate.should_draft(1) for _ in range(3)] == [True] * 3 and 1 not in gate.inherited


def test_speculation_gate_peeks_its_next_verdict_without_counting_it():
    """would_draft (the runner's draft-cap hint) answers what should_draft will, and counts nothing: over a run
    with probes, sampled and unsampled steps, and both sides winning in turn, every peek matches the decision."""
    import random

    from workers.policy import SpeculationGate

    rng = random.Random(0)
    gate = SpeculationGate()
    assert gate.would_draft(4) and not gate.samples  # an unmet bucket: drafts (and nothing was counted)
    hints = []  # the plain hint is a function, called only where a verdict needs it

    def hint() -> float:
        hints.append(1)
        return 0.25
    matched = drafted = 0
    won = {True: 0, False: 0}  # steps decided by each side's measured lead (not probes)
    for step in range(600):
        spec_ms = 12.0 if (step // 150) % 2 else 40.0  # plain wins (0.075 vs 0.1 a ms), then speculation, ...
        sampled = rng.random() < 0.5
        state = (dict(gate.asked), list(gate.decisions), dict(gate.samples))
        peek = gate.would_draft(4, plain_hint=hint, sampled=sampled)
        assert state == (dict(gate.asked), list(gate.decisions), dict(gate.samples))
        asked = gate.asked.get(4, 0)
        draft = gate.should_draft(4, plain_hint=hint, sampled=sampled)
        matched += peek == draft
        drafted += draft
        if gate.asked.get(4, 0) == asked + 1:  # not a probe
            won[draft] += 1
        gate.observe(4, draft, 12 if draft else 4, spec_ms if draft else 10.0)
    assert matched == 600 and 0 < drafted < 600
    assert won[True] > 100 and won[False] > 100  # both sides led for long stretches, with the other's probes
    # the hint only where a verdict needs it: not where plain decoding leads (170 of 1200 calls here)
    assert 0 < len(hints) < 2 * won[True] + 2 * (600 - won[True] - won[False]) + 20


def test_speculation_gate_decides_a_peeked_step_once(monkeypatch):
    """should_draft of the step would_draft peeked at (same batch size and sampling, nothing learned in between)
    counts the peeked verdict without deciding again; a sample in between, another batch size or sampling, or
    no peek at all make it decide afresh, and the decisions are the same either way."""
    from workers.policy import SpeculationGate

    gate = SpeculationGate()
    for drafted, ms in ((True, 40.0), (False, 10.0)) * SpeculationGate.MIN_SAMPLES:
        gate.observe(4, drafted, 12 if drafted else 4, ms)  # plain decoding leads bucket 4
    calls = []
    verdict = gate._verdict
    monkeypatch.setattr(gate, "_verdict", lambda *a: calls.append(a) or verdict(*a))

    def decided(peek: dict, step: dict, between=None) -> int:
        calls.clear()
        peeked = gate.would_draft(**peek)
        if between is not None:
            between()
        asked = gate.asked.get(4, 0)
        assert gate.should_draft(**step) == peeked or between is not None
        assert gate.asked.get(4, 0) in (0, asked + 1)  # counted (a probe resets the clock)
        return len(calls)

    assert decided({"batch_size": 4, "sampled": True}, {"batch_size": 4, "sampled": True}) == 1
    assert decided({"batch_size": 4, "sampled": False}, {"batch_size": 4, "sampled": False}) == 1
    assert decided({"batch_size": 4, "sampled": False}, {"batch_size": 4, "sampled": True}) == 2
    assert decided({"batch_size": 4, "sampled": True}, {"batch_size": 3, "sampled": True}) == 2
    assert decided({"batch_size": 4, "sampled": True}, {"batch_size": 4, "sampled": True},
                   between=lambda: gate.observe(4, False, 4, 10.0)) == 2
    calls.clear()
    gate.should_draft(4, sampled=True)  # no peek before it
    gate.should_draft(4, sampled=True)  # (the last step's peek was used once)
    assert len(calls) == 2


def test_served_steps_reuse_only_verdicts_a_fresh_decision_would_give(monkeypatch):
    """Over a served hybridspec run (the runner's own call order: next_step at a step's end, should_draft at the
    next one's start, prefill chunks between), every kept verdict that should_draft counts equals the verdict the
    gate would reach afresh on that step's own contexts; and a kept verdict that read the plain hint is not
    reused for a step of other contexts."""
    from workers.policy import SpeculationGate

    checked = {"reused": 0, "fresh": 0, "mismatch": 0}
    should_draft = SpeculationGate.should_draft

    def checking(gate, batch_size, plain_hint=None, sampled=True, only_plain=False):
        peek = gate._peek
        if peek is not None and peek[0] == batch_size and peek[1] == sampled:
            checked["reused"] += 1
            unexplored = dict(gate.plain_unexplored)
            checked["mismatch"] += gate._verdict(gate.bucket(batch_size), plain_hint, sampled) != peek[2]
            gate.plain_unexplored = unexplored
        else:
            checked["fresh"] += 1
        return should_draft(gate, batch_size, plain_hint, sampled, only_plain)
    monkeypatch.setattr(SpeculationGate, "should_draft", checking)
    model, runner, prompts, greedy, page_size, num_pages, serve, drafter_model = _tiny_served(40, conc=4)
    _replay_with_cost(model, runner, prompts, greedy, page_size, num_pages, drafter_model, 0.6)
    assert serve(runner, prompts, 40, 8, page_size, num_pages, "hybridspec").tokens == greedy
    # how many steps reuse a kept verdict depends on the measured step times (9 to 14 seen on different machines):
    # the check is that reuse happens and never disagrees with a fresh decision
    assert checked["reused"] >= 3 and checked["mismatch"] == 0, checked
    # a verdict kept on the hint of other contexts (a step of the same size with other requests) is not reused
    policy = runner.policy
    gate = policy.gate
    gate.samples[(4, True)], gate.rate[(4, True)] = gate.MIN_SAMPLES, 1.0  # bucket 4: speculation measured ...
    gate.samples.pop((4, False), None)  # ... plain decoding not: the verdict reads the plain hint
    sample, drafts = policy.next_step(4, lambda: [100, 101, 102, 103])
    assert policy._peek_contexts == [100, 101, 102, 103] and gate._peek is not None
    reused = checked["reused"]
    policy.should_draft([200, 201, 202, 203], sampled=gate._peek[1])
    assert checked["reused"] == reused and gate._peek is None


def test_a_step_without_a_peek_drops_the_kept_verdict():
    """LengthPolicy.wants_cycle (the runner's end of a step with a prefill chunk, which peeks at no next verdict)
    drops a verdict kept from an earlier peek: the next decode step decides on its own contexts."""
    from workers.bench_model import qwen36_35b_a3b_config
    from workers.policy import LengthPolicy

    policy = LengthPolicy("hybridspec", qwen36_35b_a3b_config(num_layers=2))
    gate = policy.gate
    for drafted, ms in ((True, 40.0), (False, 10.0)) * gate.MIN_SAMPLES:
        gate.observe(4, drafted, 12 if drafted else 4, ms)
    gate.would_draft(4, sampled=True)
    assert gate._peek is not None
    policy.wants_cycle(4)
    assert gate._peek is None


def test_speculation_gate_margin_gives_near_ties_to_plain_decoding(monkeypatch):
    """SPEC_MARGIN: speculation must beat plain decoding's rate by that fraction to win a measured bucket."""
    from workers.policy import SpeculationGate

    def share(margin: float) -> float:
        monkeypatch.setattr(SpeculationGate, "SPEC_MARGIN", margin)
        gate = SpeculationGate()
        for _ in range(300):
            draft = gate.should_draft(8)
            gate.observe(8, draft, 8 * 1.55 if draft else 8, 15.0 if draft else 10.0)  # speculation 3% ahead
        return gate.speculative_share()

    assert share(0.0) > 0.9 and share(0.06) < 0.1


def test_speculation_gate_rates_are_tokens_over_time_and_probes_spread_with_the_gap():
    """A side's rate is a ratio of EWMAs, tokens over ms: steps of 10 and 30 ms with one token each give 1/20 token
    per ms after many alternations (an EWMA of the rates would say (1/10 + 1/30) / 2 = 1/15), and steps of (1
    token, 10 ms) and (3 tokens, 20 ms) 4/30 (the rates' mean: 1/8). The losing side
    is probed PROBE steps apart at a gap of GAP_UNIT or less, farther apart as the gap grows, up to MAX_SPACING x
    PROBE (and at once where speculation is ahead of the optimistic plain hint); PROBE until the bucket has measured
    both sides itself."""
    from workers.policy import SpeculationGate

    gate = SpeculationGate()
    gate.ALPHA = 0.02  # a long memory: the EWMAs' values are about their samples' means
    for i in range(2000):
        gate.observe(1, True, 1.0, 10.0 if i % 2 else 30.0)
    assert gate.rate[(1, True)] == pytest.approx(1 / 20, rel=0.02)
    assert gate.pooled[(1, True)] == pytest.approx([2000.0, 40000.0])
    for i in range(2000):  # (1 token, 10 ms) and (3 tokens, 20 ms): 4 tokens in 30 ms (the rates' mean: 0.125)
        gate.observe(2, True, 2.0 if i % 2 else 6.0, 10.0 if i % 2 else 20.0)  # (per request of 2)
    assert gate.rate[(2, True)] == pytest.approx(4 / 30, rel=0.02)
    gate.observe(2, True, 0.0, 10.0)  # no tokens: no sample (no decode step yields none)
    assert gate.samples[(2, True)] == 2000
    gate = SpeculationGate()
    P = SpeculationGate.PROBE
    assert gate.probe_spacing(4, 1.0, 0.5, False) == P  # neither side measured in the bucket itself
    gate.own[(4, True)] = gate.own[(4, False)] = 1
    assert gate.probe_spacing(4, 1.0, 0.97, False) == P
    assert gate.probe_spacing(4, 1.0, 0.9, False) == 2 * P
    assert gate.probe_spacing(4, 0.85, 1.0, False) == 3 * P
    assert gate.probe_spacing(4, 1.0, 0.5, False) == SpeculationGate.MAX_SPACING * P
    assert gate.probe_spacing(4, 1.0, 0.97, True) == SpeculationGate.MAX_SPACING * P
    # through should_draft with noisy cycles (small enough that a probe never turns the verdict): every probe comes
    # probe_spacing steps after the last one (a modulus of a spacing that moves with the rates gave gaps from 1 to
    # ~6x the spacing)
    import random
    rnd = random.Random(0)
    for loser in (0.9, 0.8):
        gate = SpeculationGate()
        decisions = []
        for _ in range(3000):
            draft = gate.should_draft(8)
            decisions.append(draft)
            ms = 10.0 * (1 + 0.03 * rnd.uniform(-1, 1))  # plain: 0.1 token per ms per request, +-3%
            gate.observe(8, draft, 8 * 0.1 * loser * ms if draft else 8.0, ms * (1 + 0.03 * rnd.uniform(-1, 1)))
        probes = [i for i, d in enumerate(decisions) if d and i >= 6]  # speculation loses: its steps are probes
        gaps = [b - a for a, b in zip(probes, probes[1:])]
        assert len(gaps) > 20 and min(gaps) >= P and max(gaps) <= SpeculationGate.MAX_SPACING * P, (loser, gaps)
        nominal = P * min(SpeculationGate.MAX_SPACING, (1 - loser) / SpeculationGate.GAP_UNIT)  # 32, 64
        assert sum(gaps) / len(gaps) == pytest.approx(nominal, rel=0.15), (loser, gaps)


def test_speculation_gate_switches_sides_as_their_rates_cross():
    """A bucket on plain decoding goes back to speculation once speculation's measured rate (fed by its probes)
    is ahead, even by 5% (a 10% margin was measured and removed); one on speculation keeps it while its rate is
    at least plain's and leaves it once plain is faster; a bucket met for the first time follows its neighbour's
    rates."""
    from workers.policy import SpeculationGate

    def run(gate: SpeculationGate, spec_rate: float, steps: int) -> list[bool]:
        out = []
        for _ in range(steps):
            draft = gate.should_draft(12)
            out.append(draft)
            gate.observe(12, draft, 12 * spec_rate * 10.0 if draft else 12.0, 10.0)  # plain: 0.1 per request
        return out

    gate = SpeculationGate()
    tail = run(gate, 0.09, 60)[20:]  # speculation slower: plain decoding (probes aside)
    assert sum(tail) <= len(tail) / SpeculationGate.PROBE + 1, sum(tail)
    tail = run(gate, 0.105, 140)[100:]  # 5% ahead now: speculation again once its probes have measured it
    assert sum(tail) >= len(tail) - len(tail) / SpeculationGate.PROBE - 1, sum(tail)
    assert sum(run(gate, 0.102, 60)[10:]) >= 50 - 50 / SpeculationGate.PROBE - 1  # kept while at least plain's
    assert sum(run(gate, 0.09, 60)[20:]) <= 40 / SpeculationGate.PROBE + 1  # left once plain is faster
    gate.rate[(16, True)] = 0.105  # bucket 8, met now, starts from bucket 16's rates: speculation ahead
    assert [gate.should_draft(6) for _ in range(5)] == [True] * 5 and 8 in gate.inherited


def test_step_ends_charge_each_step_its_queued_device_work():
    """The gate's sample of a decode step is its whole cycle: from where the step before it returned (after its
    learning) to the end of everything it launched. On CUDA a drafted step's commit runs after the host has
    returned, so the step is charged up to its end event, read at a later step's end once the device has passed
    it (never waited for: an unread cycle is tried again, at most MAX_PENDING kept); a step's learning (a
    routing-statistics fold) is in no cycle; a step started long after the last one returned (the engine idled)
    gives no sample."""
    from workers.runner import _StepEnds

    device = {"now": 0.0}  # ms on the device's clock

    class FakeEvent:  # an event of the fake device: done once the device's clock reaches its time
        def __init__(self, done_at: float):
            self.done_at = done_at

        def query(self) -> bool:
            return self.done_at <= device["now"]

        def elapsed_time(self, other: "FakeEvent") -> float:
            return other.done_at - self.done_at

    host = {"now": 0.0}  # seconds on the host's clock
    ends = _StepEnds(torch.device("cpu"), clock=lambda: host["now"])
    ends.cuda = True
    marks = []  # device times at which the next marks are passed
    ends.mark = lambda: FakeEvent(marks.pop(0))

    def step(start_s: float, end_ms: float, returned_s: float, resume_ms: float, device_now_ms: float, sample):
        """A step begun at start_s (host) whose launches end at end_ms (device); its learning returns at
        returned_s (host), the device passes that point at resume_ms; the device's clock then: device_now_ms."""
        marks.extend([end_ms, resume_ms])
        end = ends.mark()
        host["now"], device["now"] = returned_s, device_now_ms
        got = ends.step_ended(start_s, returned_s, end, sample)
        ends.resumed()
        return got

    assert step(0.000, 10.0, 0.010, 10.0, 10.0, None) == []  # a prefill step: no sample, the next cycle starts
    # a drafted step returns at 20 ms on the host, its commit runs until 23 ms on the device, then its learning
    # (a routing-statistics fold) keeps the host until 27 ms with the device idle
    assert step(0.0102, 23.0, 0.027, 27.0, 20.0, (4, True, 8.0)) == []  # its commit is still running
    # the next (plain) step's acceptance has synchronized past the commit: the drafted cycle is 23 - 10 ms
    assert step(0.0272, 35.0, 0.034, 35.0, 33.0, (4, False, 4.0)) == [(4, True, 8.0, 13.0)]
    # the plain step's cycle is 35 - 27 ms: the fold is in neither cycle (and not 33 - 20 on the host)
    assert step(0.0342, 47.0, 0.046, 47.0, 45.0, (4, False, 4.0)) == [(4, False, 4.0, 8.0)]
    # a step whose predecessor's end is not passed yet when it ends: that cycle waits, and is read later
    assert step(0.0462, 60.0, 0.050, 60.0, 46.0, (4, False, 4.0)) == []
    assert step(0.0502, 70.0, 0.072, 70.0, 72.0, None) == [(4, False, 4.0, 12.0), (4, False, 4.0, 13.0)]
    # an idle engine: a step starting 1 s after the last one returned gives no sample
    assert step(1.072, 1080.0, 1.080, 1080.0, 1080.0, (4, True, 8.0)) == [] and ends.pending == []
    # cycles never passed are kept up to MAX_PENDING, the newest
    for i in range(6):
        step(1.0802 + i * 0.01, 1e9, 1.09 + i * 0.01, 1e9, 1090.0, (4, False, float(i)))
    assert [p[2][2] for p in ends.pending] == [2.0, 3.0, 4.0, 5.0][-_StepEnds.MAX_PENDING:]

    # CPU: every step's work is done when it returns, its cycle is known at once
    host["now"] = 0.010
    cpu = _StepEnds(torch.device("cpu"), clock=lambda: host["now"])
    assert cpu.step_ended(0.0, 0.010, cpu.mark(), (2, True, 5.0)) == []  # no step before it: no cycle
    cpu.resumed()
    host["now"] = 0.030
    end = cpu.mark()
    host["now"] = 0.034  # its learning: not in the cycle
    assert cpu.step_ended(0.0105, 0.030, end, (2, True, 5.0)) == [(2, True, 5.0, pytest.approx(20.0))]


def test_step_ends_time_plain_cycles_on_the_host_clock_where_the_device_idles():
    """On CUDA a cycle that starts after a step which queued nothing behind its read-back, of a step the runner
    announced as plain, is timed on the host clock: no event at its start or its end (each cost ~0.03 ms of host
    time on the step's critical path). A step that launched work after its read-back ends on an event, and a cycle
    on two clocks is never timed; a resume without `host` records an event as before."""
    from workers.runner import _StepEnds

    host = {"now": 0.0}
    recorded = []

    class Ev:
        def record(self):
            recorded.append(self)
            self.t = host["now"] * 1e3

        def query(self) -> bool:
            return True

        def elapsed_time(self, other) -> float:
            return other.t - self.t

    ends = _StepEnds(torch.device("cpu"), clock=lambda: host["now"], new_event=Ev)  # events: as on CUDA
    ends.resumed(True, host=True)
    assert recorded == [] and ends.sampling
    host["now"] = 0.003
    end = ends.end_mark(False)
    assert recorded == [] and end == 0.003
    assert ends.step_ended(0.0001, 0.003, end, (1, False, 1.0)) == [(1, False, 1.0, pytest.approx(3.0))]
    ends.resumed(True, host=True)
    host["now"] = 0.010
    end = ends.end_mark(True)  # it launched after its read-back: an event, and no cycle from the host-clock start
    assert recorded == [end]
    assert ends.step_ended(0.0031, 0.010, end, (1, True, 2.0)) == [] and ends.pending == []
    ends.resumed(True)
    host["now"] = 0.014
    end = ends.end_mark(False)
    assert len(recorded) == 3
    assert ends.step_ended(0.0101, 0.014, end, (1, False, 1.0)) == [(1, False, 1.0, pytest.approx(4.0))]
    ends.resumed(False, host=True)  # an untimed next step: no start at all (thinned on CUDA)
    assert ends.resume is None and not ends.sampling


def test_step_ends_ring_never_misreads_a_re_recorded_event():
    """On CUDA the markers are a ring of RING events re-recorded in turn: a cycle still unread when one of its
    events is recorded again (a step whose end the device has not passed while later steps marked on) is dropped
    and counted, never read with the new time; the cycles after it are read as usual."""
    from workers.runner import _StepEnds

    device = {"now": 0.0}
    times: list[float] = []  # device times at which the next recorded events are passed

    class RingEvent:
        def record(self):
            self.done_at = times.pop(0)

        def query(self) -> bool:
            return self.done_at <= device["now"]

        def elapsed_time(self, other) -> float:
            return other.done_at - self.done_at

    host = {"now": 0.0}
    ends = _StepEnds(torch.device("cpu"), clock=lambda: host["now"], new_event=RingEvent)
    ends.RING = 6
    got = []

    def step(end_ms: float, device_now: float, sample=(4, False, 4.0)):
        times.extend([end_ms, end_ms])  # its end, then where it returned
        host["now"] += 0.001
        end = ends.mark()
        device["now"] = device_now
        got.extend(ends.step_ended(host["now"] - 0.0005, host["now"], end, sample))
        ends.resumed()

    step(10.0, 10.0, None)
    for k in range(7):  # the device stalls behind the host: no step's end is passed while the ring turns over
        step(20.0 + 10 * k, 15.0)
    # a cycle is dropped once a later mark re-records one of its events (RING = 6: three steps of marks); the
    # newest stay pending
    assert got == [] and ends.dropped == 5 and len(ends.pending) == 2
    # the device catches up: this step's end mark re-records the oldest pending cycle's first event (dropped), the
    # other and this step's own are read, 10 ms each
    step(90.0, 1000.0)
    assert got == [(4, False, 4.0, pytest.approx(10.0))] * 2 and ends.dropped == 6 and len(ends.ring) == 6
    assert ends.take_dropped() == 6 and ends.take_dropped() == 0  # the runner adds them to policy.gate_dropped


def test_policy_gate_learns_cycles_with_the_plans_expected_tokens():
    """observe_outcome hands back what the gate counts for a step (a drafted step: its plan's expected tokens;
    nothing before the policy is warm or without a gate), and the gate learns it with the cycle's time."""
    from workers.policy import LengthPolicy

    cfg = _moe_config(num_experts=8, top_k=2)
    policy = LengthPolicy("hybridspec", cfg)
    assert policy.observe_outcome(4, False, 4, step_ms=5.0) is None  # not warm yet: the gate learns nothing
    policy.profiled, policy.latency.coefs = True, object()
    assert policy.warm()
    policy.expected_tokens = 9.5
    assert policy.observe_outcome(4, True, 6, step_ms=10.0) == 9.5  # the plan's expectation, not the realized 6
    assert policy.observe_outcome(4, False, 4, step_ms=5.0) == 4.0
    policy.observe_cycle(4, True, 9.5, 19.0)
    assert policy.gate.rate[(4, True)] == pytest.approx(9.5 / 19.0 / 4)
    assert LengthPolicy("budget", cfg).observe_outcome(4, True, 6, step_ms=10.0) is None  # no gate


def _replay_with_cost(model, runner, prompts, greedy, page_size, num_pages, drafter_model, acceptance: float):
    """_tiny_served's runner drafts with a replay drafter at `acceptance` over the greedy continuations, with a
    2-layer draft model's forward as its cost (as bench/e2e.py's DFlash-shaped drafter)."""
    import torch

    from workers.drafters import DraftModelDrafter, ReplayDrafter

    cfg = model.config
    cost = DraftModelDrafter(drafter_model(cfg, 2, torch.float32, "cpu"), num_pages, page_size, len(prompts))
    replay = ReplayDrafter(acceptance, cfg.vocab_size, seed=3, cost_model=cost)
    for p, cont in zip(prompts, greedy):
        replay.set_reference(p, cont + [0] * 20)
    runner.drafter = replay


def _tiny_served(new: int, conc: int = 2, page_size: int = 16):
    """The tiny bench model (fp32, CPU) behind the engine's scheduler + a ModelRunner (bench/e2e.py's `serve`),
    `conc` prompts of 16 tokens and their greedy continuations of `new` tokens. -> (model, runner, prompts,
    greedy, page_size, num_pages, serve, drafter_model)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from e2e import drafter_model, serve, tiny_config

    from workers.bench_model import build_bench_model
    from workers.cache import ModelCache
    from workers.runner import ModelRunner

    torch.manual_seed(0)
    model = build_bench_model(config=tiny_config(), dtype=torch.float32, device="cpu", decisive=True)
    num_pages = conc * -(-(16 + new + 20) // page_size)
    runner = ModelRunner(model, ModelCache(model.config, num_pages + 1, page_size, conc + 1, torch.float32, "cpu"))
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, model.config.vocab_size, (16,), generator=gen).tolist() for _ in range(conc)]
    greedy = serve(runner, prompts, new, 0, page_size, num_pages, "ar").tokens
    return model, runner, prompts, greedy, page_size, num_pages, serve, drafter_model


def _served_with_wrong_drafts(new: int, monkeypatch=None):
    """_tiny_served's runner serving hybridspec with a replay drafter whose drafts are always wrong and whose
    forward costs time (e2e's DFlash-shaped one); its output checked against the greedy output. With
    `monkeypatch`, the gate's cycles are pinned (drafted 30 ms, plain 10 ms) where the runner hands them over: on a
    busy CI machine one slow plain step on the real clock could put the gate on speculation for a probe spacing.
    -> (runner, prompts, greedy, page_size, num_pages, serve, the run's result)."""
    from workers.drafters import DraftModelDrafter, ReplayDrafter
    from workers.policy import LengthPolicy

    if monkeypatch is not None:
        real = LengthPolicy.observe_cycle
        monkeypatch.setattr(LengthPolicy, "observe_cycle", lambda self, b, drafted, tokens, ms:
                            real(self, b, drafted, tokens, 30.0 if drafted else 10.0))

    model, runner, prompts, greedy, page_size, num_pages, serve, drafter_model = _tiny_served(new)
    cfg, conc = model.config, len(prompts)
    cost = DraftModelDrafter(drafter_model(cfg, 2, torch.float32, "cpu"), num_pages, page_size, conc)
    replay = ReplayDrafter(0.0, cfg.vocab_size, seed=3, cost_model=cost)
    for p, cont in zip(prompts, greedy):
        replay.set_reference(p, cont + [0] * 20)
    runner.drafter = replay
    res = serve(runner, prompts, new, 8, page_size, num_pages, "hybridspec")
    assert res.tokens == greedy
    return runner, prompts, greedy, page_size, num_pages, serve, res


def test_hybridspec_stops_drafting_where_drafts_are_never_accepted(monkeypatch):
    """End to end on CPU (tiny bench model, the engine's scheduler + runner): with a drafter whose drafts are
    always wrong (and whose forward costs time, as e2e's DFlash-shaped one: a free drafter with plans of length 0
    makes a drafted step cost what a plain one does, and the gate's two sides tie), hybridspec's gate measures
    plain decoding faster and stops drafting except for probes; the output stays the greedy output. (The cycles'
    ms are pinned, a drafted one 3x a plain one: the tokens each side counts are the runner's own.)"""
    runner, prompts, greedy, page_size, num_pages, serve, res = _served_with_wrong_drafts(80, monkeypatch)
    gate = runner.policy.gate
    assert gate.decisions[0] > 2 * gate.decisions[1], gate.decisions  # mostly plain decode steps
    assert gate.own.get((2, True), 0) >= 1 and gate.own.get((2, False), 0) >= 1  # the runner fed it both sides
    # what the gate's speculative side counted against what those steps output: a drafted step whose drafts are
    # all rejected outputs one token a request, and the plan expects at least that
    out, expected = runner.policy.gate_tokens[2]
    assert expected >= out > 0
    # a step in which anything captured a CUDA graph (here: every step, as counted by captures_total) is no sample
    # of its kind: the gate learns nothing from it
    before = dict(gate.samples)
    calls = iter(range(10**6))
    runner.captures_total = lambda: next(calls)
    res = serve(runner, prompts, 16, 8, page_size, num_pages, "hybridspec", keep_policy=True)
    assert res.tokens == [t[:16] for t in greedy] and gate.samples == before
    # each decode step reports hybridspec's own cap on drafts at its batch size to the scheduler, and the scheduler
    # reserves no more for the next step; a step with a prefill reports nothing. Recent plans of 3 at this bucket:
    # a cap of 3 + DRAFT_MARGIN, under max_verify_len. (The gate's peek is held at "drafts" here: where it says the
    # next step decodes plainly the hint is 0, tests/test_speculative.py checks that.)
    from collections import deque

    from workers.policy import DRAFT_MARGIN, DRAFT_WINDOW

    runner.policy.planned_max[2] = deque([3] * DRAFT_WINDOW, maxlen=DRAFT_WINDOW)
    assert runner.policy.draft_cap(2) == 3 + DRAFT_MARGIN < runner.policy.max_verify_len
    steps, real = [], runner.execute

    def execute(work):
        result = real(work)
        # the policy's cap as the step left it, and whether the gate's peek said the next step decodes plainly
        steps.append((work, result, runner.policy.draft_cap(len(work)), runner._hinted_plain))
        return result

    runner.execute = execute
    next_step = runner.policy.next_step
    runner.policy.next_step = lambda b, contexts, thin=True: (next_step(b, contexts, thin)[0], True)  # drafts next
    serve(runner, prompts, 12, 8, page_size, num_pages, "hybridspec", keep_policy=True)
    del runner.execute, runner.policy.next_step
    decodes = []
    for work, result, cap, plain in steps:
        if all(len(w.tokens) == 1 and w.context_len > 0 for w in work):
            assert not plain and result.draft_cap_hint == (runner.policy.max_verify_len if cap is None else cap)
            decodes.append((work, result.draft_cap_hint))
        else:
            assert result.draft_cap_hint is None
    assert len(decodes) >= 3 and decodes[0][1] == 3 + DRAFT_MARGIN
    for (_, hint), (work, _) in zip(decodes, decodes[1:]):  # the next step's caps within the last hint
        assert max(w.draft_cap for w in work) <= hint
    assert max(w.draft_cap for w in decodes[0][0]) == 8  # a new scheduler: max_draft (serve's 8)
    assert max(w.draft_cap for w in decodes[1][0]) == 3 + DRAFT_MARGIN  # then the worker's hint
    ends = runner._ends
    runner.use_policy(runner.policy)  # a policy (kept or new): its gate's cycles start afresh
    assert runner._ends is not ends and runner._ends.resume is None and runner._ends.pending == []


def test_gate_thinning_times_only_sampled_steps_and_keeps_its_probes(monkeypatch):
    """SpeculationGate.SAMPLE_EVERY > 1: on a measured bucket the winning side's cycles are timed every
    SAMPLE_EVERY-th step and every probe is timed (an untimed step never probes); unmeasured buckets always. End to
    end (the runner's _StepEnds thinned on the host clock): an untimed step makes no mark, the output stays the
    greedy output, and the gate learns from about a quarter of the steps where plain decoding wins."""
    from workers.policy import SpeculationGate
    from workers.runner import _StepEnds

    monkeypatch.setattr(SpeculationGate, "SAMPLE_EVERY", 4)
    gate = SpeculationGate()
    for draft in (True,) * 3 + (False,) * 3:  # both sides measured, plain 2x faster
        assert gate.wants_sample(8) and gate.should_draft(8) == draft
        gate.observe(8, draft, 8.0, 20.0 if draft else 10.0)
    timed, probes = [], []
    for _ in range(400):
        t = gate.wants_sample(8)
        d = gate.should_draft(8, sampled=t)
        timed.append(t)
        probes.append(d)
        if t:
            gate.observe(8, d, 8.0, 20.0 if d else 10.0)
    assert not any(d and not t for d, t in zip(probes, timed))  # every probe timed
    gaps = [b - a for a, b in zip([i for i, d in enumerate(probes) if d], [i for i, d in enumerate(probes) if d][1:])]
    assert gaps and set(gaps) == {SpeculationGate.MAX_SPACING * SpeculationGate.PROBE}  # the spacing kept
    assert 400 / 4 <= sum(timed) <= 400 / 4 + sum(probes) + 2

    monkeypatch.setattr(_StepEnds, "THIN", True)
    marks = []
    real_mark = _StepEnds.mark
    monkeypatch.setattr(_StepEnds, "mark", lambda self: marks.append(1) or real_mark(self))
    hosts = []  # resumed's `host`: the next cycle on the host clock (a plain step after one that queued nothing)
    real_resumed = _StepEnds.resumed
    monkeypatch.setattr(_StepEnds, "resumed", lambda self, sample_next=True, host=False:
                        hosts.append(host) or real_resumed(self, sample_next, host))
    runner, prompts, greedy, page_size, num_pages, serve, res = _served_with_wrong_drafts(80, monkeypatch)  # plain wins
    g = runner.policy.gate
    learned = sum(g.own.values())
    assert g.own.get((2, False), 0) >= 1 and learned < 0.6 * res.steps, (learned, res.steps)
    assert len(marks) < 1.2 * res.steps  # (two marks a timed step, none on the others)
    assert any(hosts) and not all(hosts)  # plain stretches on the host clock, drafted steps' successors not


def test_gate_thins_a_bucket_whose_plain_side_speculation_leaves_unexplored(monkeypatch):
    """Where plain decoding is never explored (speculation ahead of the optimistic plain hint, e.g. c=1 at high
    acceptance) its drafted cycles are timed every SAMPLE_EVERY-th step, not every step; once the hint catches
    up, the next timed step explores plain decoding and every step is timed until plain is measured. An untimed
    step never explores (its sample would be lost). Without SAMPLE_EVERY > 1 every step is timed."""
    from workers.policy import SpeculationGate

    monkeypatch.setattr(SpeculationGate, "SAMPLE_EVERY", 4)
    gate = SpeculationGate()
    for _ in range(3):  # the speculative side measured: 1 token per ms per request
        assert gate.wants_sample(1) and gate.should_draft(1)
        gate.observe(1, True, 5.0, 5.0)
    hint = {"plain": 0.5}  # plain's optimistic rate: far behind speculation
    timed = []
    for _ in range(40):
        t = gate.wants_sample(1)
        assert gate.should_draft(1, lambda: hint["plain"], sampled=t)  # never explores plain
        timed.append(t)
        if t:
            gate.observe(1, True, 5.0, 5.0)
    assert sum(timed) == 40 // 4 and gate.own.get((1, False), 0) == 0
    hint["plain"] = 2.0  # now plain looks faster: the next untimed step still drafts, a timed one explores
    while gate.wants_sample(1) is False:
        assert gate.should_draft(1, lambda: hint["plain"], sampled=False)
    assert not gate.should_draft(1, lambda: hint["plain"], sampled=True)
    gate.observe(1, False, 1.0, 0.5)
    assert all(gate.wants_sample(1) for _ in range(8))  # until plain has its MIN_SAMPLES
    forced = SpeculationGate()  # the force_plain ablation after a thinned stretch: every plain step timed
    for _ in range(3):
        forced.observe(1, True, 5.0, 5.0)
    forced.should_draft(1, 0.5)
    assert forced.plain_unexplored[1] and sum(forced.wants_sample(1) for _ in range(8)) == 2
    forced.force_plain = True
    assert not forced.should_draft(1, 0.5) and all(forced.wants_sample(1) for _ in range(8))
    monkeypatch.setattr(SpeculationGate, "SAMPLE_EVERY", 1)
    other = SpeculationGate()
    for _ in range(3):
        other.observe(2, True, 5.0, 5.0)
    other.should_draft(2, 0.5)
    assert all(other.wants_sample(2) for _ in range(8))


def test_deferred_learning_lands_after_the_next_forward_and_changes_no_token():
    """On CUDA a step's learning (policy.observe) waits for the next step's forward launch, so the host learns
    while the device runs it (runner.defer_learning; forced on here on CPU): step j's observation is learned
    inside step j + 1 after its forward, the last one when serve() flushes; the tokens are the greedy ones, and
    the policy learns every step once, as undeferred."""
    from workers.drafters import DraftModelDrafter, ReplayDrafter

    model, runner, prompts, greedy, page_size, num_pages, serve, drafter_model = _tiny_served(24)
    cfg, conc, new = model.config, len(prompts), 24
    assert runner.defer_learning is False  # CPU default: the forward is synchronous, nothing to overlap
    cost = DraftModelDrafter(drafter_model(cfg, 1, torch.float32, "cpu"), num_pages, page_size, conc)
    forwards = {"n": 0}
    model_forward = model.forward

    def counted_forward(*args, **kwargs):
        forwards["n"] += 1
        return model_forward(*args, **kwargs)
    model.forward = counted_forward
    for defer in (False, True):
        replay = ReplayDrafter(0.7, cfg.vocab_size, seed=3, cost_model=cost)
        for p, cont in zip(prompts, greedy):
            replay.set_reference(p, cont + [0] * 20)
        runner.drafter = replay
        runner.set_policy("hybridspec", 8)
        runner.defer_learning = defer
        policy, execute, learned, steps = runner.policy, runner.execute, [], {"n": 0}
        observe = policy.observe

        def spy_observe(drafter, obs, counts, fold=True):
            learned.append((steps["n"], forwards["n"]))  # (steps started, target forwards run) when learned
            observe(drafter, obs, counts, fold)

        reports = []  # steps whose result carries the policy's error report

        def spy_execute(requests):
            steps["n"] += 1
            out = execute(requests)
            if out.policy_stats:
                reports.append(steps["n"])
            return out
        runner._steps = 0
        policy.observe, runner.execute = spy_observe, spy_execute
        forwards["n"] = 0
        res = serve(runner, prompts, new, 8, page_size, num_pages, "hybridspec", keep_policy=True)
        del runner.execute
        assert res.tokens == greedy
        n = steps["n"]
        assert len(learned) == n and policy.steps == n  # every step learned once
        from workers.runner import POLICY_STATS_EVERY as every
        if defer:  # step j's learning inside step j + 1, after that step's forward; the last one at the flush
            assert [s for s, _ in learned] == list(range(2, n + 1)) + [n]
            assert all(f == s for s, f in learned)  # after the forward of the step it ran in
            # the error report of steps 1, 17, ... is made inside the next step (off the critical path)
            assert reports == list(range(2, n + 1, every))
        else:
            assert [s for s, _ in learned] == list(range(1, n + 1))
            assert reports == list(range(1, n + 1, every))
        assert runner._learning is None
    # a policy replaced while a step's learning is pending: the learning goes to the policy that ran the step
    from workers.policy import StepObservation

    old = runner.policy
    before = old.steps
    runner._learning = (old, "replay", StepObservation([1], [40], 3.0, None), None)  # as a deferred step leaves it
    runner.set_policy("budget", 8)
    assert old.steps == before + 1 and runner.policy.steps == 0 and runner._learning is None


def test_speculation_gate_is_off_under_expert_parallelism():
    """Under EP a rank's whole step includes waiting for the other ranks at the exchanges, so the gate could not
    see a plain-decoding win and ranks would decide apart: the EP wiring turns it and ExtraGate off (and keeps them off after a
    new policy is set, as it re-wraps the policy). The learning is never deferred there (it all-reduces): one
    left pending by a step before EP is learned first, locally."""
    from types import SimpleNamespace

    from workers.expert_parallel import _observe_slowest
    from workers.policy import LengthPolicy

    cfg = _moe_config(num_experts=8, top_k=2)
    flushed = []
    runner = SimpleNamespace(policy=LengthPolicy("hybridspec", cfg), device=torch.device("cpu"), defer_learning=True,
                             flush_learning=lambda: flushed.append(runner.policy.observe))
    assert runner.policy.gate is not None and runner.policy.extra_gate is not None
    observe = runner.policy.observe
    _observe_slowest(runner)
    assert runner.policy.gate is None and runner.policy.should_draft([3, 4])
    assert runner.policy.extra_gate is None  # (its rates are whole steps as well)
    assert flushed == [observe] and runner.defer_learning is False  # flushed once, before the observe was wrapped
    _observe_slowest(runner)
    assert len(flushed) == 1


def test_hybridspec_plans_for_the_whole_step_with_its_measured_overhead():
    """hybridspec maximizes the goodput of the whole step: a drafted step's measured time beyond the forward
    (drafting, planning, acceptance) is paid whatever the lengths, so a larger overhead makes longer blocks
    worth it; the overhead is learned per batch-size bucket from whole steps and forwards. Both objectives: each
    step's own ratio (the default) at once, and the goodput its recent plans expect (the rate variant) once its
    rate has settled (every step alike here, so both land on the best fixed length)."""
    from workers.policy import LengthPolicy

    cfg = _moe_config(num_experts=8, top_k=2)
    survival = [[0.6 ** (j + 1) for j in range(8)]]

    def rate(lengths, overhead):
        return (1 + sum(survival[0][:lengths[0]])) / (overhead + 4.0 + 0.3 * (1 + lengths[0]))

    for ratio in (True, False):
        policy = LengthPolicy("hybridspec", cfg, max_verify_len=8)
        if not ratio:
            policy.ablate("rate")
        policy.latency.coefs = LatencyCoefs(const_ms=4.0, ms_per_token=0.3)
        for _ in range(1 if ratio else 200):  # (the rate: plans at the goodput of the plans before them)
            short = policy._plan_hybridspec(survival, [8], [1], [100])
        assert rate(short, 0.0) >= max(rate([k], 0.0) for k in range(9)) * (1 - 1e-9)
        assert policy.step_overhead_ms(1) == 0.0
        for _ in range(40):
            policy.observe_outcome(1, True, 3, step_ms=12.0, forward_ms=5.0)  # 7 ms beyond the forward
            policy.observe_outcome(1, False, 1, step_ms=5.0, forward_ms=4.5)  # plain steps teach nothing here
        assert policy.step_overhead_ms(1) == pytest.approx(7.0, rel=0.02)
        policy.observe_outcome(16, True, 40, step_ms=30.0, forward_ms=20.0)  # bucket 16: 10 ms beyond the forward
        assert policy.step_overhead_ms(2) == policy.step_overhead_ms(1)  # the nearest bucket measured
        assert policy.step_overhead_ms(12) == pytest.approx(10.0)
        for _ in range(1 if ratio else 200):
            long = policy._plan_hybridspec(survival, [8], [1], [100])
        assert long[0] > short[0], (ratio, short, long)
        assert rate(long, 7.0) >= max(rate([k], 7.0) for k in range(9)) * (1 - 1e-9)
        assert (policy.plan_rate.get(1) is None) == ratio


def test_hybridspec_plans_at_its_goodput_not_each_steps_ratio():
    """Steps whose drafts look strong or weak alternate: at the goodput its plans reach, hybridspec verifies
    longer in the strong steps and shorter in the weak ones than each step's own ratio would, and its expected
    tokens per ms over the stream beat the ratio's (and every fixed length's); the default (the ratio) plans as
    budget_plan does without a rate."""
    from scheduler.latency_model import TokenCostTable
    from workers.policy import LengthPolicy

    cfg = _moe_config(num_experts=8, top_k=2)
    strong = [[0.9 ** (j + 1) for j in range(16)]]
    weak = [[0.9 * 0.6 ** j for j in range(16)]]
    # a c=1 step: 4 ms fixed once drafting (1 ms of it the overhead), 0.3 ms a verified token
    table = TokenCostTable(list(range(1, 18)), [3.0 + 0.3 * (n - 1) for n in range(1, 18)])

    def serve(ratio: bool) -> tuple[float, dict]:
        policy = LengthPolicy("hybridspec", cfg, max_verify_len=16)
        if not ratio:
            policy.ablate("rate")
        policy.step_cost = lambda tokens, contexts, max_tokens: table
        policy.step_overhead_ms = lambda batch_size: 1.0
        tokens = ms = 0.0
        lengths = {}
        for step in range(400):
            surv = strong if step % 2 else weak
            L = policy._plan_hybridspec(surv, [16], [1], [100])[0]
            if step >= 200:  # (settled)
                tokens += 1 + sum(surv[0][:L])
                ms += 1.0 + table.step_ms[L]
                lengths["strong" if step % 2 else "weak"] = L
        return tokens / ms, lengths

    at_rate, rate_lengths = serve(False)
    at_ratio, ratio_lengths = serve(True)
    assert rate_lengths["strong"] > ratio_lengths["strong"] and rate_lengths["weak"] < ratio_lengths["weak"], \
        (rate_lengths, ratio_lengths)
    assert at_rate > at_ratio * 1.005, (at_rate, at_ratio)
    fixed = max((2 + sum(strong[0][:k]) + sum(weak[0][:k])) / (2 * (1.0 + table.step_ms[k])) for k in range(17))
    assert at_rate > fixed
    plain = budget_plan(weak, [16], table, 1, draft_ms=1.0)
    policy = LengthPolicy("hybridspec", cfg, max_verify_len=16)  # (the default: the ratio)
    policy.step_cost = lambda tokens, contexts, max_tokens: table
    policy.step_overhead_ms = lambda batch_size: 1.0
    assert policy._plan_hybridspec(weak, [16], [1], [100]) == plain.lengths
    with pytest.raises(ValueError, match="rate must be a finite goodput > 0"):
        budget_plan(weak, [16], table, 1, rate=0.0)


def test_the_plans_whole_step_prediction_error_is_reported():
    """Each drafted step's planned ms against its measured ms (signed and absolute, in the policy's stats); a plain
    step after a plan (the gate said no) leaves no sample and clears the prediction."""
    from workers.policy import LengthPolicy

    cfg = _moe_config(num_experts=8, top_k=2)
    policy = LengthPolicy("hybridspec", cfg, max_verify_len=8)
    policy.latency.coefs = LatencyCoefs(const_ms=4.0, ms_per_token=0.3)
    assert "plan_step_bias_pct" not in policy.stats()
    policy._plan_hybridspec([[0.6 ** (j + 1) for j in range(8)]], [8], [1], [100])
    predicted = policy._predicted_ms
    assert predicted > 4.0
    policy.observe_outcome(1, True, 3, step_ms=2 * predicted, forward_ms=predicted)  # twice as long as planned
    stats = policy.stats()
    assert stats["plan_step_bias_pct"] == pytest.approx(-50.0) and stats["plan_step_abs_pct"] == pytest.approx(50.0)
    policy._plan_hybridspec([[0.6 ** (j + 1) for j in range(8)]], [8], [1], [100])
    policy.observe_outcome(1, False, 1, step_ms=5.0)  # not drafted: no sample
    assert len(policy.plan_errors) == 1 and policy._predicted_ms is None


def test_routing_counts_are_sampled_from_the_steps_that_carry_them():
    """Every COUNTS_SAMPLE_EVERY-th step with routing counts is summed; COUNTS_FOLD_EVERY samples fold into the
    estimator. Steps without counts (plain graphs, prefill) neither sample nor shift the sampling."""
    import torch

    from workers.policy import COUNTS_FOLD_EVERY, COUNTS_SAMPLE_EVERY, LengthPolicy, StepObservation

    cfg = _moe_config(num_experts=8, top_k=2)
    policy = LengthPolicy("hybridspec", cfg, max_verify_len=8)
    layers = policy.num_moe_layers
    hot = [torch.tensor([4.0, 0, 0, 0, 0, 0, 0, 0])] * layers  # every slot on expert 0
    obs = StepObservation([2, 2], [10, 10], None, None)
    before = policy.estimator.touch_prob_table()[0][0]
    for _ in range(COUNTS_SAMPLE_EVERY * (COUNTS_FOLD_EVERY - 1)):  # the first of every COUNTS_SAMPLE_EVERY
        policy.observe(None, obs, hot)
        policy.observe(None, obs, [])  # a plain step in between: no counts, no sample
    assert policy.estimator.counts[0][0] == 0.0  # one sample short of a fold
    assert policy._pending_steps == COUNTS_FOLD_EVERY - 1
    kept = policy.keep_counts(hot)  # as the runner keeps them at the step (the COUNTS_SAMPLE_EVERY-th: a copy)
    assert kept is not None and kept.shape == (layers, 8)
    policy.observe(None, obs, kept, fold=False)  # a deferred learning: the due fold waits for fold_counts()
    assert policy.estimator.counts[0][0] == 0.0 and policy._pending_steps == COUNTS_FOLD_EVERY
    policy.fold_counts()
    assert policy.estimator.counts[0][0] == 4.0 * COUNTS_FOLD_EVERY and policy._pending_counts is None
    assert policy.estimator.touch_prob_table()[0][0] > before
    assert policy.keep_counts(hot) is None and policy.keep_counts([]) is None  # not a sampled step; no counts
    # on CUDA the fold's copy to the host is async: a fold not yet arrived is applied by a later call, once, while
    # the next counts pile up apart
    import workers.policy as policy_mod
    arrived = {"now": False}
    real_ready = policy_mod.DeviceReadback.ready
    policy_mod.DeviceReadback.ready = lambda self: arrived["now"]
    try:
        folded = policy.estimator.counts[0][0]
        for _ in range(COUNTS_FOLD_EVERY * COUNTS_SAMPLE_EVERY):
            policy.observe(None, obs, hot)
        assert policy._folding is not None and policy.estimator.counts[0][0] == folded  # on its way
        for _ in range(COUNTS_SAMPLE_EVERY):
            policy.observe(None, obs, hot)  # more counts meanwhile: pending again, not lost
        assert policy._pending_steps == 1 and policy.estimator.counts[0][0] == folded
        arrived["now"] = True
        policy.fold_counts()
        assert policy.estimator.counts[0][0] == folded + 4.0 * COUNTS_FOLD_EVERY and policy._folding is None
        policy.fold_counts()  # applied once
        assert policy.estimator.counts[0][0] == folded + 4.0 * COUNTS_FOLD_EVERY
    finally:
        policy_mod.DeviceReadback.ready = real_ready


def test_hybridspec_prices_a_step_by_what_it_measured_at_that_batch_size():
    """hybridspec's step cost: the forward ms it measured by token count at the batch's size bucket once it has
    two token counts there (the linear model misses graph-bucket steps), the latency model before and at batch
    sizes it has not run."""
    from scheduler.latency_model import ModelTokenCost
    from workers.policy import LengthPolicy, SlopeFloor, StepObservation

    cfg = _moe_config(num_experts=8, top_k=2)
    policy = LengthPolicy("hybridspec", cfg, max_verify_len=8)
    policy.latency.coefs = LatencyCoefs(const_ms=4.0, ms_per_token=0.1)
    assert isinstance(policy.step_cost([1, 1], [10, 10], 20), ModelTokenCost)
    for t, ms in ((2, 5.0), (10, 9.0), (18, 9.5)):  # a step function of the token count at 2 requests
        policy.observe_profile(StepObservation([t // 2] * 2, [10, 10], ms, None), None)
    cost = policy.step_cost([1, 1], [10, 10], 20)
    assert isinstance(cost, SlopeFloor) and cost.cost_ms(10) == pytest.approx(9.0)
    # flatter than the model's ms_per_token (0.1) between 10 and 18 tokens: the floor holds the slope
    assert cost.cost_ms(18) == pytest.approx(9.8) and cost.costs_ms(2, 18)[-1] == pytest.approx(9.8)
    # a model slope above the table's own: the floor is at most SLOPE_FLOOR_CHORD (0.5) of the table's mean rise
    # (4.5 ms over 16 tokens), here 0.14 ms a token, and at least SLOPE_FLOOR_MIN (0.25) of the model's: 0.25
    policy.latency.coefs = LatencyCoefs(const_ms=4.0, ms_per_token=1.0)
    assert policy.step_cost([1, 1], [10, 10], 20).cost_ms(18) == pytest.approx(9.0 + 8 * 0.25)
    policy.latency.coefs = LatencyCoefs(const_ms=4.0, ms_per_token=0.2)  # 0.5 x 0.28 = 0.14 < 0.2
    assert policy.step_cost([1, 1], [10, 10], 20).cost_ms(18) == pytest.approx(9.0 + 8 * 0.140625)
    flat = LengthPolicy("hybridspec", cfg, max_verify_len=8)  # a flat, then falling table keeps a floor
    flat.latency.coefs = LatencyCoefs(const_ms=4.0, ms_per_token=0.1)
    for t, ms in ((2, 9.0), (10, 9.0), (18, 8.9)):
        flat.observe_profile(StepObservation([t // 2] * 2, [10, 10], ms, None), None)
    cost = flat.step_cost([1, 1], [10, 10], 20)  # (the table pools the falling points to one level)
    assert cost.cost_ms(18) == pytest.approx(cost.cost_ms(2) + 16 * 0.025)
    policy.latency.coefs = LatencyCoefs(const_ms=4.0, ms_per_token=0.1)
    assert isinstance(policy.step_cost([1] * 4, [10] * 4, 40), ModelTokenCost)  # bucket 4: nothing measured
    # a prefill chunk (no context yet, or longer than a verification block) is no sample of a verification step
    policy.observe(None, StepObservation([600, 1], [0, 30], 40.0, None), None)
    policy.observe(None, StepObservation([300, 1], [300, 30], 30.0, None), None)
    assert policy.cost_table(2).tokens == [2, 10, 18] and not policy.bucket_costs
    policy.observe(None, StepObservation([5, 1], [300, 30], 7.0, None), None)  # a verification step is
    assert policy.cost_table(2).tokens == [2, 6, 10, 18] and policy.bucket_costs[2].tokens == [6]
    assert policy.profile_scale[2] == pytest.approx(1.0)  # the profile said 7.0 ms at 6 tokens too
    budget = LengthPolicy("budget", cfg, max_verify_len=8)
    budget.observe_profile(StepObservation([1, 1], [10, 10], 5.0, None), None)
    assert not budget.bucket_costs and not budget.profile_costs  # only hybridspec keeps them


def test_hybridspec_cost_table_is_rebuilt_by_the_learning_not_by_the_plan(monkeypatch):
    """A served sample rebuilds its bucket's cost table where it is learned (on CUDA while the next forward is on
    the device), so the next plan reads it without rebuilding; the table equals a fresh build of what was
    measured (the plans see the same costs as when the plan rebuilt it)."""
    from workers.policy import LengthPolicy, SlopeFloor, StepObservation

    cfg = _moe_config(num_experts=8, top_k=2)
    policy = LengthPolicy("hybridspec", cfg, max_verify_len=8)
    policy.latency.coefs = LatencyCoefs(const_ms=4.0, ms_per_token=0.1)
    for t, ms in ((2, 5.0), (10, 9.0), (18, 9.5)):
        policy.observe_profile(StepObservation([t // 2] * 2, [10, 10], ms, None), None)
    for ms in (7.0, 7.4, 6.8):  # served verification steps of 6 tokens at 2 requests
        policy.observe(None, StepObservation([5, 1], [300, 30], ms, None), None)
        built, fresh = policy._cost_tables[2], policy._build_cost_table(2)
        assert (built.tokens, built.step_ms, built._counts) == (fresh.tokens, fresh.step_ms, fresh._counts)
    assert policy._cost_tables[2].tokens == [2, 6, 10, 18]
    monkeypatch.setattr(policy, "_build_cost_table", lambda b: pytest.fail("the plan rebuilt the cost table"))
    cost = policy.step_cost([1, 1], [10, 10], 20)
    assert isinstance(cost, SlopeFloor) and cost.table is built


def test_the_learning_primes_the_next_plans_costs_and_the_plans_stay_the_same(monkeypatch):
    """After a served sample the learning computes the bucket's measured cost of every decode token count
    (prime_step_cost: inside the next forward on CUDA): the plan's step_cost is that same object while table and
    floor stay, its costs_ms reads a slice (no table walk), bit for bit equal to a fresh SlopeFloor's, shorter ranges
    included, a copy the caller may change; a rebuilt table or another floor gives a new one. The plans equal
    those of a policy that never primed."""
    import copy

    import numpy as np

    from workers.policy import LengthPolicy, SlopeFloor, StepObservation

    cfg = _moe_config(num_experts=8, top_k=2)
    policies = [LengthPolicy("hybridspec", cfg, max_verify_len=8) for _ in range(2)]
    for policy in policies:
        policy.latency.coefs = LatencyCoefs(const_ms=4.0, ms_per_token=0.1)
        for t, ms in ((2, 5.0), (10, 9.0), (18, 9.5)):
            policy.observe_profile(StepObservation([t // 2] * 2, [10, 10], ms, None), None)
    primed, plain = policies
    monkeypatch.setattr(plain, "prime_step_cost", lambda batch_size: None)
    survival = [[0.9 ** (j + 1) for j in range(8)], [0.6 ** (j + 1) for j in range(8)]]
    for ms in (7.0, 7.4, 6.8, 8.1):
        for policy in policies:
            policy.observe(None, StepObservation([5, 1], [300, 30], ms, None), None)
        cost = primed.step_cost([1, 1], [300, 30], 20)
        assert isinstance(cost, SlopeFloor) and 2 in cost._memo and cost._memo[2].shape[0] == 2 * (8 + 2) - 1
        assert cost is primed.step_cost([1, 1], [300, 30], 20)  # the same object while nothing changed
        fresh = SlopeFloor(copy.deepcopy(cost.table), cost.floor)  # (its own table: the counter below is cost's)
        calls = {"n": 0}
        real = cost.table.costs_ms
        monkeypatch.setattr(cost.table, "costs_ms", lambda lo, hi: calls.__setitem__("n", calls["n"] + 1) or real(lo, hi))
        for hi in (2, 7, 18, 20):
            got = cost.costs_ms(2, hi)
            assert calls["n"] == 0 and np.array_equal(got, fresh.costs_ms(2, hi)), hi
        got[:] = -1.0  # a copy: the memo is untouched
        assert np.array_equal(cost.costs_ms(2, 20), fresh.costs_ms(2, 20))
        assert np.array_equal(cost.costs_ms(3, 9), fresh.costs_ms(3, 9)) and calls["n"] == 1  # another origin
        assert cost.costs_ms(2, 1).shape == fresh.costs_ms(2, 1).shape == (0,)  # an empty range stays empty
        monkeypatch.undo()
        monkeypatch.setattr(plain, "prime_step_cost", lambda batch_size: None)
        assert primed._plan_hybridspec(survival, [8, 8], [1, 1], [300, 30]) == \
            plain._plan_hybridspec(survival, [8, 8], [1, 1], [300, 30])
        assert primed._predicted_ms == plain._predicted_ms
    before = primed.step_cost([1, 1], [300, 30], 20)
    primed.latency.coefs = LatencyCoefs(const_ms=4.0, ms_per_token=0.001)  # another floor
    assert primed.step_cost([1, 1], [300, 30], 20) is not before


def test_a_sample_settled_by_the_plan_does_not_prime_the_costs_there(monkeypatch):
    """A step time still on its way to the host is learned at the next plan or observation; learned at the plan
    (its critical path) it does not prime the next plan's costs (the plan computes what it needs), learned at an
    observation it does."""
    from workers.policy import DeviceReadback, LengthPolicy, StepObservation

    cfg = _moe_config(num_experts=8, top_k=2)
    policy = LengthPolicy("hybridspec", cfg, max_verify_len=8)
    policy.latency.coefs = LatencyCoefs(const_ms=4.0, ms_per_token=0.1)
    for t, ms in ((2, 5.0), (10, 9.0), (18, 9.5)):
        policy.observe_profile(StepObservation([t // 2] * 2, [10, 10], ms, None), None)
    primed = []
    monkeypatch.setattr(policy, "prime_step_cost", lambda batch_size: primed.append(batch_size))
    on_its_way = lambda ms: StepObservation([5, 1], [300, 30], ms, DeviceReadback(torch.tensor([3, 4])))
    policy.observe(None, on_its_way(7.0), None)
    assert primed == [] and policy._unsettled is not None
    policy.lengths("replay", [2, 2], [[0.9, 0.9], [0.9, 0.9]], [1, 1], [300, 30])  # settled by the plan
    assert policy._unsettled is None and primed == []
    policy.observe(None, on_its_way(7.2), None)
    policy.observe(None, StepObservation([5, 1], [301, 31], 7.1, [3, 4]), None)  # settles the one before, learns
    assert primed == [2, 2]


def test_every_drafting_policy_measures_its_drafting_and_the_rest_of_its_steps():
    """budget and fixed keep the drafter's ms by rows and the rest of a drafted step as hybridspec does (a
    diagnostic: their overheads beyond the forward compare with hybridspec's measured); their plans do not read
    them."""
    from scheduler.latency_model import DraftCost
    from workers.policy import LengthPolicy

    cfg = _moe_config(num_experts=8, top_k=2)
    for name in ("budget", "fixed", "hybridspec"):
        policy = LengthPolicy(name, cfg, max_verify_len=16)
        policy.observe_draft(4, 4 * 17, None)  # not measured (a capture, nothing drafted): no sample
        assert not policy.draft_costs
        policy.observe_draft(4, 4 * 17, 1.5)
        policy.observe_outcome(4, True, 8, step_ms=9.0, forward_ms=7.0)
        assert policy.draft_costs[4].ms(DraftCost.grid(4 * 17)) == pytest.approx(1.5)
        assert policy.rest_overhead_ms[4] == pytest.approx(0.5)
        assert policy.draft_overhead_ms[4] == pytest.approx(2.0)


def test_profile_points_are_rescaled_by_what_served_steps_measure_against_them():
    """The start-up profile's synthetic steps (short contexts, other graph buckets) can sit off the served steps
    by a factor; the token counts the plan has not visited take that factor, so they neither lure the plan nor
    keep it away."""
    from workers.policy import LengthPolicy, StepObservation

    cfg = _moe_config(num_experts=8, top_k=2)
    policy = LengthPolicy("hybridspec", cfg, max_verify_len=8)
    policy.latency.coefs = LatencyCoefs(const_ms=4.0, ms_per_token=0.1)
    for t, ms in ((4, 10.0), (8, 12.0), (16, 16.0), (32, 24.0)):  # 4 requests x 1 / 2 / 4 / 8 tokens
        policy.observe_profile(StepObservation([t // 4] * 4, [8] * 4, ms, None), None)
    for _ in range(40):  # served steps measure 1.5x the profile at 8 tokens
        policy.observe(None, StepObservation([2] * 4, [300] * 4, 18.0, None), None)
    table = policy.cost_table(4)
    assert table.tokens == [4, 8, 16, 32]
    assert policy.profile_scale[4] == pytest.approx(1.5, rel=1e-3)
    assert table.cost_ms(8) == pytest.approx(18.0)  # measured
    assert table.cost_ms(32) == pytest.approx(36.0, rel=1e-3)  # the profile's 24 ms x 1.5
    assert table.cost_ms(4) == pytest.approx(15.0, rel=1e-3)


def test_extra_token_goes_where_the_router_correction_keeps_it_often_enough(monkeypatch):
    """The router correction's extra token is sent while its measured keep rate makes it pay (P(kept) x the
    survival of that draft per marginal ms beats the plan's goodput) and stops where the batch rarely covers its
    experts; without a plan (warm-up) every request below its cap gets one; batches below the EXTRA_FROM bucket
    never get one. (The plan here ends on a graph bucket's top, 48 tokens: the room rule, tested below, is off.)"""
    import workers.policy as policy_module
    from workers.policy import EXTRA_FROM, LengthPolicy

    monkeypatch.setattr(policy_module, "EXTRA_WITHIN_BUCKET", False)

    cfg = _moe_config()
    policy = LengthPolicy("hybridspec", cfg, max_verify_len=8)
    b = EXTRA_FROM
    assert policy.extra_tokens([2] + [8] * (b - 2) + [0], [8] * (b - 1) + [0]) == {0}  # no plan yet: below cap
    assert policy.extra_tokens([2, 8, 0], [8, 8, 0]) == set()  # a small batch: none
    policy.latency.coefs = LatencyCoefs(const_ms=4.0, ms_per_token=0.05, ms_per_expert=0.3)  # experts dominate
    survival = [[0.8 ** (j + 1) for j in range(8)]] * (b // 2) + [[0.3 ** (j + 1) for j in range(8)]] * (b // 2)

    def extras():
        lengths = policy._plan_hybridspec(survival, [8] * b, [1] * b, [50] * b)
        return lengths, policy.extra_tokens(lengths, [8] * b)

    lengths, sent = extras()
    assert lengths[-1] < 8 and b - 1 in sent, (lengths, sent)  # optimistic keep rate: worth a token without experts
    for _ in range(200):
        policy.observe_extra(b, 0, b)  # never kept at this batch size
    lengths, sent = extras()
    assert sent == set(), (lengths, sent)
    assert policy.extra_tokens(lengths, [8] * b) == {i for i in range(b) if lengths[i] < 8}  # a stale plan: unused
    small = LengthPolicy("hybridspec", cfg, max_verify_len=8)
    small.latency.coefs = policy.latency.coefs
    lengths = small._plan_hybridspec(survival[-2:], [8, 8], [1, 1], [50, 50])
    assert lengths[-1] < 8 and small.extra_tokens(lengths, [8, 8]) == set()


def test_extra_tokens_do_not_carry_a_step_past_its_token_bucket(monkeypatch):
    """Costs are step-shaped by the graphs' token buckets. Extra tokens that fit under the bucket's top cost little
    and are sent (best gains first); the ones that would carry the step past it pay the jump together, and are sent
    only where their gains together are worth it (before, each extra was priced alone at the slope where the plan
    ended, and a plan a few tokens under a bucket's top could send enough of them to land in the next bucket)."""
    import workers.policy as policy_module
    from scheduler.latency_model import LatencyCoefs, TokenCostTable
    from scheduler.planner import Plan
    from workers.policy import EXTRA_FROM, LengthPolicy, SlopeFloor

    b = max(EXTRA_FROM, 16)
    policy = LengthPolicy("hybridspec", _moe_config(), max_verify_len=8)
    policy.latency.coefs = LatencyCoefs(const_ms=4.0, ms_per_token=0.002, ms_per_expert=0.0)
    # flat to 64 tokens (the bucket's top), 4 ms more from 65 on
    cost = SlopeFloor(TokenCostTable([16, 64, 65, 96], [10.0, 10.1, 14.1, 14.2]), policy.latency.coefs.ms_per_token)
    lengths = [2] * (b - 4) + [3] * 4  # 16 + 36 = 52 tokens with the b pending ones (b = 16)
    survival = [[0.9 ** (j + 1) for j in range(8)] for _ in range(b)]
    survival[-1] = [0.99 ** (j + 1) for j in range(8)]  # the best extra draft
    base = b
    total = base + sum(lengths)
    assert total < 64
    plan = Plan(lengths, expected_tokens=b * 3.0, step_ms=12.0)

    def extras(keep=(2.0, 2.0)):
        policy.extra_keep[16] = keep
        policy._last_plan = (survival, cost, plan, base)
        policy._predicted_ms = plan.step_ms
        return policy.extra_tokens(lengths, [8] * b)

    sent = extras()
    assert len(sent) == 64 - total == 64 - 52 and b - 1 in sent  # fills the bucket to its top, best gains first
    assert policy._predicted_ms == pytest.approx(12.0 + cost.cost_ms(64) - cost.cost_ms(total))
    # the same plan one token short of the top: one extra, not sixteen past it; the jump's price decides it even
    # without the bucket-room rule
    lengths2 = [3] * (b - 1) + [2]  # 16 + 47 = 63
    for room_rule in (True, False):
        monkeypatch.setattr(policy_module, "EXTRA_WITHIN_BUCKET", room_rule)
        policy.extra_keep[16] = (2.0, 2.0)
        policy._last_plan = (survival, cost, Plan(lengths2, b * 3.0, 12.0), base)
        assert policy.extra_tokens(lengths2, [8] * b) == {b - 1}
    monkeypatch.setattr(policy_module, "EXTRA_WITHIN_BUCKET", True)
    # a cost without a bucket step and good gains: still no more than the bucket's room (EXTRA_WITHIN_BUCKET: the
    # measured forward table missed the whole step's jump, bench/NOTES.md), best gains first
    flat = SlopeFloor(TokenCostTable([16, 96], [10.0, 10.2]), 0.002)
    policy._last_plan = (survival, flat, plan, base)
    sent = policy.extra_tokens(lengths, [8] * b)
    assert len(sent) == 64 - total and b - 1 in sent
    policy._last_plan = (survival, flat, plan, base)
    monkeypatch.setattr(policy_module, "EXTRA_WITHIN_BUCKET", False)  # without the rule: every candidate
    assert policy.extra_tokens(lengths, [8] * b) == set(range(b))
    monkeypatch.setattr(policy_module, "EXTRA_WITHIN_BUCKET", True)
    # gains that never pay for a token: none
    assert extras(keep=(0.0, 100.0)) == set()
    # a plan made at a rate: extras by gain - rate x added ms (a rate no gain beats sends none, a low one fills the
    # bucket), and the rate is used once
    for rate, want in ((1e6, 0), (1e-3, 64 - total)):
        policy._rate_now = rate
        assert len(extras()) == want and policy._rate_now is None


def test_extra_gate_measures_both_verdicts_then_follows_the_faster_and_probes_the_other():
    """ExtraGate: per batch-size bucket, MIN_SAMPLES steps under the rule's verdict (extras) first, then as many
    without, then the side with more output tokens per ms per request decides, and the other side is tried every
    PROBE-th decision; the verdict follows the rates when they cross; buckets are independent; empty samples are
    not learned."""
    from workers.extra_gate import ExtraGate

    g, n, probe = ExtraGate(), ExtraGate.MIN_SAMPLES, ExtraGate.PROBE
    for _ in range(n):
        assert g.sends(16)
        g.observe(16, True, 2.5, 22.0)  # with extras: 0.114 tokens per ms per request
    for _ in range(n):
        assert not g.sends(16)
        g.observe(16, False, 2.7, 22.0)  # without: 0.123
    assert g.rate(16, True) == pytest.approx(2.5 / 22.0) and g.rate(16, False) == pytest.approx(2.7 / 22.0)
    gap = 1.0 - 2.5 / 2.7  # 7.4%: the loser is tried every PROBE x gap / GAP_UNIT decisions (at most MAX_SPACING x)
    spacing = g.spacing(16)
    assert spacing == round(probe * min(ExtraGate.MAX_SPACING, gap / ExtraGate.GAP_UNIT)) > probe
    verdicts = []
    for _ in range(2 * spacing):
        verdicts.append(g.sends(16))
        g.observe(16, verdicts[-1], 2.5 if verdicts[-1] else 2.7, 22.0)  # (the same rates)
    assert verdicts == ([False] * (spacing - 1) + [True]) * 2
    # a due probe stays due until a step under it is measured (a decided step may go unobserved)
    assert [g.sends(16) for _ in range(spacing)] == [False] * (spacing - 1) + [True]
    assert g.sends(16) and g.sends(16)
    g.observe(16, True, 2.5, 22.0)
    assert not g.sends(16)
    assert g.sends(64) and g.rate(64, True) is None  # another bucket explores on its own
    for _ in range(40):  # extras now measured faster
        g.observe(16, True, 3.0, 20.0)
    spacing = g.spacing(16)
    assert [g.sends(16) for _ in range(spacing)] == [True] * (spacing - 1) + [False]
    g.tokens[(16, True)], g.ms[(16, True)] = 2.701, 22.0  # a near tie: probed every PROBE-th decision
    assert g.spacing(16) == probe
    before = dict(g.samples)
    g.observe(16, True, 0.0, 20.0)
    g.observe(16, False, 2.0, 0.0)
    assert g.samples == before
    assert 0.0 < g.share() < 1.0


def test_hybridspec_sends_extra_tokens_only_where_its_steps_with_them_deliver_more():
    """The router correction's rule on trial (LengthPolicy + ExtraGate): a drafted step that ran under the rule
    counts its realized output tokens and ms for the extras side, one under the gate's 'none' verdict for the
    other; where steps without extras measure faster, extra_tokens sends none but at the gate's probes; a plain
    step learns nothing and drops the step's verdict; `hybridspec-ungatedextra` sends them at every step."""
    from scheduler.latency_model import LatencyCoefs, TokenCostTable
    from scheduler.planner import Plan
    from workers.extra_gate import ExtraGate
    from workers.policy import EXTRA_FROM, LengthPolicy, SlopeFloor

    b = max(EXTRA_FROM, 16)
    lengths = [2] * (b - 4) + [1] * 4  # 16 + 28 = 44 tokens: room for 4 extras under the 48-token bucket's top
    survival = [[0.9 ** (j + 1) for j in range(8)] for _ in range(b)]
    plan = Plan(lengths, expected_tokens=b * 3.0, step_ms=12.0)

    def make(variant: str | None = None) -> LengthPolicy:
        policy = LengthPolicy("hybridspec", _moe_config(), max_verify_len=8)
        if variant:
            policy.ablate(variant)
        policy.latency.coefs = LatencyCoefs(const_ms=4.0, ms_per_token=0.002, ms_per_expert=0.0)
        return policy

    def step(policy: LengthPolicy, tokens_per_request: float, ms: float) -> set[int]:
        cost = SlopeFloor(TokenCostTable([16, 64, 96], [10.0, 10.1, 10.2]), policy.latency.coefs.ms_per_token)
        policy._last_plan, policy._predicted_ms = (survival, cost, plan, b), plan.step_ms
        sent = policy.extra_tokens(lengths, [8] * b)
        policy.observe_outcome(b, True, int(round(tokens_per_request * b)), ms)
        return sent

    policy, n = make(), ExtraGate.MIN_SAMPLES
    assert all(step(policy, 2.5, 22.0) for _ in range(n))  # the rule's verdict first: it sends extras
    assert not any(step(policy, 2.75, 22.0) for _ in range(n))  # then none, measured
    eg = policy.extra_gate
    assert eg.samples[(16, True)] == n and eg.samples[(16, False)] == n
    assert eg.rate(16, True) == pytest.approx(2.5 / 22.0) and eg.rate(16, False) == pytest.approx(2.75 / 22.0)
    sent = [bool(step(policy, 2.75, 22.0)) for _ in range(eg.spacing(16))]
    assert sent.count(True) == 1 and sent[-1]  # none, but the probe
    assert policy.stats()["extra_verdict_share"] == pytest.approx(eg.share())
    # a plain step after a verdict: nothing learned, the verdict dropped
    samples = dict(eg.samples)
    policy._last_plan = (survival, SlopeFloor(TokenCostTable([16, 96], [10.0, 10.2]), 0.002), plan, b)
    policy.extra_tokens(lengths, [8] * b)
    assert policy._extra_verdict is not None
    policy.observe_outcome(b, False, b, 10.0)
    assert eg.samples == samples and policy._extra_verdict is None
    ungated = make("ungatedextra")
    assert all(step(ungated, 2.5 if i < n else 2.75, 22.0) for i in range(2 * n + ExtraGate.PROBE))


def test_cost_ranges_equal_pointwise_costs():
    """budget_plan reads a whole range of step costs at once (costs_ms): it equals cost_ms point by point for
    the token table (inside, between and beyond its points) and the model's token cost; the grouped
    distinct-experts table of a large touch table stays within 0.1% of the exact one."""
    table = TokenCostTable.fit([(1, 5.0), (4, 5.5), (17, 7.0), (40, 12.0), (40, 11.0)])
    assert table.costs_ms(0, 60) == pytest.approx([table.cost_ms(n) for n in range(61)], rel=1e-12)
    model = LatencyModel(LatencyCoefs(const_ms=1.0, ms_per_token=0.1, ms_per_expert=0.01))
    cost = model.token_cost(StepComposition([1], [0], 1), [math.sqrt(n) for n in range(50)])
    assert cost.costs_ms(2, 49) == pytest.approx([cost.cost_ms(n) for n in range(2, 50)], rel=1e-12)
    with pytest.raises(ValueError, match="token range must be within"):
        cost.costs_ms(0, 50)
    big = ExpertEstimator(40, 256, 8)
    rng = random.Random(3)
    big.observe_counts([[rng.paretovariate(1.2) for _ in range(256)] for _ in range(40)])
    touch = torch.tensor(big.touch_prob_table(), dtype=torch.float64)
    grouped = distinct_by_tokens_device(touch, 300)
    exact = distinct_by_tokens_device(touch, 300, exact_upto=10**9)
    assert torch.allclose(grouped, exact, rtol=1e-3, atol=1e-9)
    assert abs(exact[37].item() - big.expected_distinct_total(37)) < 1e-6


def test_the_learnings_device_reads_are_queued_before_the_steps_read_back(monkeypatch):
    """A drafted hybridspec step queues what its learning reads of the device (the distinct experts, the sampled
    counts) right after the forward's launch, before acceptance reads the step back (on CUDA the host's time for
    the copies then runs under the forward), and learns the same values: every timed step's observation carries
    the distinct experts read for it. Served on CPU (tiny bench model, replay drafter at acceptance 0.7)."""
    import workers.runner as runner_mod
    from workers.policy import LengthPolicy

    model, runner, prompts, greedy, page_size, num_pages, serve, drafter_model = _tiny_served(24)
    _replay_with_cost(model, runner, prompts, greedy, page_size, num_pages, drafter_model, 0.7)
    events: list[tuple] = []
    read, keep, accept = runner.__class__._read_distinct, LengthPolicy.keep_counts, runner_mod.accept

    def spy(label, f):
        def call(*a, **k):
            out = f(*a, **k)
            events.append((label, out))
            return out
        return call

    monkeypatch.setattr(runner.__class__, "_read_distinct", spy("read", read))
    monkeypatch.setattr(LengthPolicy, "keep_counts", spy("keep", keep))
    monkeypatch.setattr(runner_mod, "accept", spy("accept", accept))
    observed: list[list[int] | None] = []
    real_observe = LengthPolicy.observe

    def observe(self, drafter, obs, *a, **k):
        observed.append(list(obs.distinct_experts) if obs.distinct_experts is not None else None)
        return real_observe(self, drafter, obs, *a, **k)

    monkeypatch.setattr(LengthPolicy, "observe", observe)
    res = serve(runner, prompts, 24, 8, page_size, num_pages, "hybridspec")
    assert res.tokens == greedy and res.accepted_tokens > 0  # lossless, and drafts were verified
    # per step (split at each read of the distinct experts): the read and the counts' keep come before acceptance
    reads = [i for i, (label, _) in enumerate(events) if label == "read"]
    assert len(reads) >= 5
    for i in reads:
        after = [label for label, _ in events[i + 1:]]
        nxt = after.index("read") if "read" in after else len(after)
        assert after[:1] == ["keep"] and "accept" in after[1:nxt], after[:nxt]
    # the values read are the values learned (CPU: the read returns the list itself)
    values = [out for label, out in events if label == "read"]
    assert all(v in observed for v in values)


def test_distinct_experts_on_their_way_to_the_host_are_learned_at_the_next_plan():
    """A served step's distinct experts come back without a sync (DeviceReadback): the policy learns that step's
    latency sample at its next plan or observation (not at the gate or a stats report, which would wait for the
    GPU), with those values, exactly once, and a step observed after it is learned after it."""
    from workers.policy import DeviceReadback, LengthPolicy, StepObservation

    cfg = _moe_config()
    policy = LengthPolicy("hybridspec", cfg, max_verify_len=8)
    learned = []
    policy._learn_step_time = lambda obs, anchor=False, prime=True: learned.append((obs.forward_ms, obs.distinct_experts))
    def step(ms, distinct, turn):
        return StepObservation([3, 3], [40, 40], ms, DeviceReadback(torch.tensor(distinct)))

    policy.observe("replay", step(5.0, [9, 11], 0), None)
    assert learned == [] and policy.steps == 1  # still on its way
    policy.lengths("replay", [2, 2], [[0.9, 0.9], [0.9, 0.9]], [1, 1], [40, 40])
    assert learned == [(5.0, [9, 11])]
    policy.observe("replay", step(6.0, [12, 13], 1), None)
    policy.observe("replay", StepObservation([1, 1], [41, 41], 4.0, [4, 5]), None)  # a synchronous one
    assert learned == [(5.0, [9, 11]), (6.0, [12, 13]), (4.0, [4, 5])]
    policy.observe("replay", step(7.0, [1, 2], 0), None)
    policy.stats()  # reports without waiting for the step on its way
    assert len(learned) == 3
    policy.should_draft([40, 40])  # the gate does not wait for it either
    assert len(learned) == 3
    policy.observe("replay", StepObservation([1, 1], [42, 42], 4.5, [4, 6]), None)
    assert learned[-2:] == [(7.0, [1, 2]), (4.5, [4, 6])]


def test_device_readbacks_reuse_a_buffer_once_it_was_read():
    """DeviceReadback takes its host buffer (and on CUDA its event) from a free list per (dtype, size, device): a
    read one goes back and carries the next read-back of that shape; one not read yet is never handed out again
    (its values stay its own), nor is a buffer of another shape; values() may be called again (the same list)."""
    from workers.policy import DeviceReadback

    DeviceReadback._free.clear()
    a = DeviceReadback(torch.tensor([1, 2, 3]))
    b = DeviceReadback(torch.tensor([4, 5, 6]))  # a not read: its own buffer
    assert a.host is not b.host
    buffer_a = a.host
    assert a.ready() and a.values() == [1, 2, 3] and a.values() == [1, 2, 3]
    c = DeviceReadback(torch.tensor([7, 8, 9]))  # a's buffer, read: reused
    assert c.host is buffer_a
    d = DeviceReadback(torch.tensor([[1, 2], [3, 4]]))  # another size: a buffer of its own
    assert d.host is not buffer_a and d.host is not b.host
    assert b.values() == [4, 5, 6] and c.values() == [7, 8, 9] and d.values() == [1, 2, 3, 4]
    assert a.values() == [1, 2, 3]  # a's list is not overwritten by c's use of its buffer
    e = DeviceReadback(torch.tensor([1.5, 2.5]))  # float: its own key
    assert e.values() == [1, 2]
    for _ in range(3 * DeviceReadback.FREE_MAX):  # the free list stays bounded
        DeviceReadback(torch.tensor([0, 0, 0])).values()
    assert all(len(v) <= DeviceReadback.FREE_MAX for v in DeviceReadback._free.values())
    DeviceReadback._free.clear()


def test_hybridspec_drafts_only_what_its_recent_plans_verify():
    """hybridspec's draft cap at a batch-size bucket is the longest length of its recent plans there (their upper
    quantile) plus a margin (none before a few plans, none for other policies); plans that use the margin widen
    it, a single one does not."""
    from workers.policy import DRAFT_MARGIN, DRAFT_WINDOW, LengthPolicy

    cfg = _moe_config()
    policy = LengthPolicy("hybridspec", cfg, max_verify_len=16)
    policy.latency.coefs = LatencyCoefs(const_ms=4.0, ms_per_token=0.3, ms_per_expert=0.0)  # tokens are dear
    low = [[0.5 ** (j + 1) for j in range(16)]] * 2
    assert policy.draft_cap(2) is None
    for _ in range(DRAFT_WINDOW // 4):
        lengths = policy._plan_hybridspec(low, [16, 16], [1, 1], [50, 50])
    cap = policy.draft_cap(2)
    assert cap == max(lengths) + DRAFT_MARGIN < 16, (cap, lengths)
    assert policy.draft_cap(16) is None  # another bucket has no plans yet
    high = [[0.99 ** (j + 1) for j in range(16)]] * 2  # acceptance rose: the plan takes the whole cap ...
    lengths = policy._plan_hybridspec(high, [cap, cap], [1, 1], [50, 50])
    assert max(lengths) == cap
    assert policy.draft_cap(2) == cap  # one long plan does not widen every request's block ...
    for _ in range(2):
        policy._plan_hybridspec(high, [cap, cap], [1, 1], [50, 50])
    assert policy.draft_cap(2) == min(16, cap + DRAFT_MARGIN)  # ... a quarter of the recent ones do
    assert LengthPolicy("budget", cfg, max_verify_len=16).draft_cap(2) is None


def test_hybridspec_ablations_switch_off_their_part_and_nothing_else():
    from workers.policy import ABLATIONS, LengthPolicy

    cfg = _moe_config()
    from workers.policy import DRAFT_MARGIN

    # (extra, counts, gate, width, plain, extra gate, margin, quiet plain streaks, plans at their goodput: a variant,
    # the floor by padded rows: a variant, the profile's bucket-filling blocks: a variant)
    on = (True, True, True, True, False, True, DRAFT_MARGIN, True, False, False, False)
    expect = {"noextra": (False,) + on[1:], "nocounts": on[:1] + (False,) + on[2:], "lean": (False, False) + on[2:],
              "nogate": on[:2] + (False,) + on[3:], "nowidth": on[:3] + (False,) + on[4:],
              "plain": on[:4] + (True,) + on[5:], "ungatedextra": on[:5] + (False,) + on[6:],
              "margin1": on[:6] + (1,) + on[7:], "noquiet": on[:7] + (False,) + on[8:],
              "nocap": on[:6] + (16,) + on[7:], "rate": on[:8] + (True,) + on[9:], "padfloor": on[:9] + (True, False),
              "bucketprofile": on[:10] + (True,), "padprofile": on[:9] + (True, True)}
    assert set(expect) == set(ABLATIONS)
    for variant, parts in expect.items():
        policy = LengthPolicy("hybridspec", cfg)
        policy.ablate(variant)
        assert (policy.uses_extra_token, policy.collects_routing, policy.gate is not None,
                policy.plans_width, policy.gate is not None and policy.gate.force_plain,
                policy.extra_gate is not None, policy.draft_margin, policy.quiet_plain,
                policy.plans_at_rate, policy.pad_floor, policy.bucket_profile) == parts, variant
    from collections import deque

    from workers.policy import DRAFT_WINDOW
    caps = {}
    for variant in (None, "margin1", "nocap"):  # the margin reaches the cap the scheduler reserves drafts by
        policy = LengthPolicy("hybridspec", cfg)
        if variant:
            policy.ablate(variant)
        policy.planned_max[2] = deque([3] * DRAFT_WINDOW, maxlen=DRAFT_WINDOW)
        caps[variant] = policy.draft_cap(2)
    assert caps == {None: 3 + DRAFT_MARGIN, "margin1": 4, "nocap": 16}  # nocap: every drafted step drafts 16
    gate = LengthPolicy("hybridspec", cfg)
    gate.ablate("plain")
    for draft in (True,) * 3:  # (speculation measured faster: a gate of its own would draft)
        gate.gate.observe(1, draft, 4.0, 2.0)
    assert not gate.gate.should_draft(1) and not gate.gate.would_draft(1)  # plain whatever it measured
    with pytest.raises(ValueError, match="ablation must be one of"):
        LengthPolicy("hybridspec", cfg).ablate("nothing")
    with pytest.raises(ValueError, match="ablation must be one of"):
        LengthPolicy("budget", cfg).ablate("lean")


def test_width_plan_is_budget_plan_for_a_flat_overhead_and_the_best_width_otherwise():
    """width_plan: with the same overhead for every longest length c it is budget_plan; with overheads rising in
    c it is the best of budget_plan over the drafts at j < c, each at its c's overhead (brute force), and its
    lengths stay <= c; with a rate, the best of budget_plan at that rate by gain - rate x ms, the same way."""
    from scheduler.planner import width_plan

    rng = np.random.default_rng(3)
    table = TokenCostTable([1, 64, 128, 256, 512], [5.0, 6.0, 8.0, 12.0, 20.0])
    for _ in range(150):
        B, K = int(rng.integers(1, 24)), int(rng.integers(1, 12))
        survival = survival_from_acceptance(rng.uniform(0.3, 0.99, (B, K)))
        caps = rng.integers(0, K + 1, B).tolist()
        flat = float(rng.uniform(0.0, 3.0))
        ref = budget_plan(survival, caps, table, B, draft_ms=flat)
        plan, c = width_plan(survival, caps, table, B, [0.0] + [flat] * K)
        assert plan.lengths == ref.lengths
        assert plan.step_ms == pytest.approx(ref.step_ms) and plan.expected_tokens == pytest.approx(ref.expected_tokens)
        rising = [0.0, *np.sort(rng.uniform(0.0, 6.0, K))]
        plan, c = width_plan(survival, caps, table, B, rising)
        best = max(budget_plan(survival, [min(x, w) for x in caps], table, B, draft_ms=rising[w]).goodput_tokens_per_ms
                   for w in range(1, K + 1))
        assert plan.goodput_tokens_per_ms == pytest.approx(best)
        assert max(plan.lengths) <= c and plan.step_ms >= rising[c]
        rate = float(rng.uniform(0.1, 3.0))
        plan, c = width_plan(survival, caps, table, B, rising, rate=rate)
        best = max(p.expected_tokens - rate * p.step_ms
                   for p in (budget_plan(survival, [min(x, w) for x in caps], table, B, draft_ms=rising[w], rate=rate)
                             for w in range(1, K + 1)))
        assert plan.expected_tokens - rate * plan.step_ms == pytest.approx(best)
        assert max(plan.lengths) <= c and plan.step_ms >= rising[c]
    ragged = [[0.9, 0.8, 0.5], [0.95], []]
    plan, c = width_plan(ragged, [3, 1, 0], table, 3, [0.0, 1.0, 1.0, 1.0])
    assert plan.lengths == budget_plan(ragged, [3, 1, 0], table, 3, draft_ms=1.0).lengths and c == max(plan.lengths)
    assert width_plan([], [], table, 0, [0.0, 1.0]) == (Plan([], 0.0, 1.0 + table.cost_ms(0)), 1)
    # equal goodput at every c (the drafts are worth nothing): the smallest c and no tokens
    assert width_plan([[0.0] * 4] * 2, [4, 4], table, 2, [0.0] + [2.0] * 4)[1] == 1
    with pytest.raises(ValueError, match="width_ms"):
        width_plan([[0.9]], [1], table, 1, [0.0])
    with pytest.raises(ValueError, match="rate must be a finite goodput > 0"):
        width_plan([[0.9]], [1], table, 1, [0.0, 1.0], rate=float("nan"))


def test_hybridspec_plans_every_branch_at_the_rate_its_decode_plans_learn(monkeypatch):
    """Every plan of hybridspec after its first is made at the goodput of the decode-only plans before it at its
    batch size (width_plan's choices and the plans between them alike), each plan's own expected tokens and ms
    feed it; a step with a prefill chunk plans at the rate but teaches it nothing; another batch size starts from
    the nearest one's rate scaled to its own; the default (the ratio) never passes a rate. Its extra tokens are chosen
    at the plan's rate too."""
    import workers.policy as pol

    calls = []

    def spy(fn):
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            calls.append((fn.__name__, kwargs.get("rate"), out[0] if isinstance(out, tuple) else out))
            return out
        return wrapped

    monkeypatch.setattr(pol, "width_plan", spy(pol.width_plan))
    monkeypatch.setattr(pol, "budget_plan", spy(pol.budget_plan))
    rng = np.random.default_rng(2)
    for ratio in (False, True):
        calls.clear()
        policy = _measured_width_policy()
        if not ratio:
            policy.ablate("rate")
        tok = ms = None
        for step in range(3 * pol.WIDTH_EVERY):
            policy.observe_draft(8, 8 * 17, 6.0)
            survival = [[float(p) ** (j + 1) for j in range(16)] for p in rng.uniform(0.6, 0.98, 8)]
            policy._plan_hybridspec(survival, [16] * 8, [1] * 8, [100] * 8)
            name, rate, plan = calls[-1]
            if ratio or step == 0:
                assert rate is None
            else:
                assert rate == pytest.approx(tok / ms)
            if not ratio:
                tok = plan.expected_tokens if tok is None else tok + pol.RATE_ALPHA * (plan.expected_tokens - tok)
                ms = plan.step_ms if ms is None else ms + pol.RATE_ALPHA * (plan.step_ms - ms)
        assert {name for name, _, _ in calls} == {"width_plan", "budget_plan"}  # both branches were planned
        if ratio:
            assert policy.plan_rate == {}
            continue
        assert policy.plan_rate[8] == pytest.approx([tok, ms])
        policy._plan_hybridspec(survival + [[]], [16] * 8 + [0], [1] * 8 + [64], [100] * 9)  # a prefill chunk too
        assert calls[-1][1] == pytest.approx(tok / ms)  # at batch size 8's rate (its decode rows) ...
        assert policy.plan_rate[8] == pytest.approx([tok, ms]) and 9 not in policy.plan_rate  # ... teaching nothing
        policy.observe_draft(6, 6 * 17, 5.0)
        policy._plan_hybridspec(survival[:6], [16] * 6, [1] * 6, [100] * 6)
        assert calls[-1][1] == pytest.approx(tok * 6 / 8 / ms)  # from batch size 8's, scaled
        assert policy.plan_rate[6] == pytest.approx([calls[-1][2].expected_tokens, calls[-1][2].step_ms])


def test_width_plan_keeps_one_long_length_from_widening_every_request():
    """64 requests alike and one that the drafter is sure of: priced as sunk (budget_plan), the sure one is
    verified 16 long, so every request drafts 16 next step; priced at the block it implies, the plan stops
    where a wider block costs more than the sure request's extra drafts bring."""
    from scheduler.planner import width_plan

    table = TokenCostTable([64, 256, 512, 1088], [10.0, 17.0, 25.0, 42.0])
    survival = [[0.7 ** (j + 1) for j in range(16)]] * 63 + [[0.99 ** (j + 1) for j in range(16)]]
    caps = [16] * 64
    sunk = budget_plan(survival, caps, table, 64, draft_ms=8.0)
    assert max(sunk.lengths) == 16
    width = [0.0] + [4.0 + 0.25 * min(c + 2, 16) for c in range(1, 17)]  # the drafter: 0.25 ms per width step
    plan, c = width_plan(survival, caps, table, 64, width)
    assert c < 16 and max(plan.lengths) == c
    assert plan.goodput_tokens_per_ms > (sunk.expected_tokens / (sunk.step_ms - 8.0 + width[16]))


def test_draft_cost_interpolates_what_it_measured_and_scales_below_it():
    from scheduler.latency_model import DraftCost

    cost = DraftCost()
    assert not cost.measured
    with pytest.raises(RuntimeError, match="draft cost is empty"):
        cost.ms(10)
    cost.observe(1024, 4.0)
    assert cost.ms(1024) == pytest.approx(4.0)
    assert cost.ms(512) == pytest.approx(2.0)  # one point: proportional either way
    assert cost.ms(2048) == pytest.approx(8.0)
    cost.observe(320, 2.0)
    assert cost.ms(672) == pytest.approx(3.0)  # between the points: interpolated
    assert cost.ms(160) == pytest.approx(1.0)  # below the first: proportional to it
    assert cost.ms_array(np.array([160.0, 672.0, 1024.0])).tolist() == pytest.approx([1.0, 3.0, 4.0])
    cost.observe(0, 1.0)  # no rows: not a sample
    assert cost.table.tokens == [320, 1024]
    # row counts are kept on a grid of 8-16 points per octave: 32 batch sizes x 16 blocks make <= 40 points
    assert [DraftCost.grid(r) for r in (1, 7, 17, 136, 1100)] == [1, 7, 16, 128, 1152]
    many = DraftCost()
    for n in range(33, 65):
        for k in range(2, 18):
            many.observe(n * k, 1.0)
    assert len(many.table.tokens) <= 40


def test_hybridspec_prices_its_plans_at_the_drafting_they_imply():
    """With the drafter's cost measured per rows and the rest of the step measured, hybridspec plans its
    longest length with the block it implies: a dear drafter keeps the plans (and the next steps' blocks)
    shorter than pricing the measured overhead as sunk does; the step's prediction has this step's drafting.
    hybridspec-nowidth plans as before."""
    from scheduler.latency_model import DraftCost
    from workers.policy import DRAFT_MARGIN, DRAFT_WINDOW, LengthPolicy

    cfg = _moe_config(num_experts=8, top_k=2)
    survival = [[0.8 ** (j + 1) for j in range(16)]] * 8
    plans = {}
    for variant in ("width", "nowidth"):
        policy = LengthPolicy("hybridspec", cfg, max_verify_len=16)
        if variant == "nowidth":
            policy.ablate("nowidth")
        policy.latency.coefs = LatencyCoefs(const_ms=4.0, ms_per_token=0.05, ms_per_expert=0.0)
        for _ in range(20):  # drafting 8 x 17 rows took 6 ms of a 9 ms overhead
            policy.observe_draft(8, 8 * 17, 6.0)
            policy.observe_outcome(8, True, 20, step_ms=9.0 + 8.0, forward_ms=8.0)
        assert policy.draft_overhead_ms[8] == pytest.approx(9.0)
        policy.observe_draft(8, 8 * 17, 6.0)
        plans[variant] = (policy._plan_hybridspec(survival, [16] * 8, [1] * 8, [100] * 8), policy._predicted_ms)
        if variant == "width":
            assert policy.rest_overhead_ms[8] == pytest.approx(3.0)
            assert policy.draft_costs[8].ms(DraftCost.grid(8 * 17)) == pytest.approx(6.0)
            assert policy.planned_max[8][-1] == max(plans[variant][0])
    (narrow, predicted), (sunk, _) = plans["width"], plans["nowidth"]
    assert max(narrow) < max(sunk), (narrow, sunk)
    tokens = sum(narrow) + 8
    assert predicted == pytest.approx(3.0 + 6.0 + 4.0 + 0.05 * tokens, rel=1e-6)  # this step drafted 17 a request
    policy = LengthPolicy("hybridspec", cfg, max_verify_len=16)  # ... and the next steps draft what it chose
    policy.latency.coefs = LatencyCoefs(const_ms=4.0, ms_per_token=0.05, ms_per_expert=0.0)
    for _ in range(20):
        policy.observe_draft(8, 8 * 17, 6.0)
        policy.observe_outcome(8, True, 20, step_ms=17.0, forward_ms=8.0)
    for _ in range(DRAFT_WINDOW):
        policy.observe_draft(8, 8 * 17, 6.0)
        lengths = policy._plan_hybridspec(survival, [16] * 8, [1] * 8, [100] * 8)
    assert policy.draft_cap(8) == max(lengths) + DRAFT_MARGIN < 16


def _measured_width_policy():
    """hybridspec at batch size 8 that measured its drafting (6 ms for 8 x 17 rows) and the rest of its steps
    (3 ms): its plans choose their longest length with width_plan."""
    from workers.policy import LengthPolicy

    policy = LengthPolicy("hybridspec", _moe_config(num_experts=8, top_k=2), max_verify_len=16)
    policy.latency.coefs = LatencyCoefs(const_ms=4.0, ms_per_token=0.05, ms_per_expert=0.0)
    for _ in range(20):
        policy.observe_draft(8, 8 * 17, 6.0)
        policy.observe_outcome(8, True, 20, step_ms=17.0, forward_ms=8.0)
    return policy


def test_hybridspec_chooses_the_longest_length_every_few_plans_and_plans_within_it():
    """width_plan's choice is made every WIDTH_EVERY plans per bucket; the plans between search within it (even
    where better drafts arrive) at its overhead, and the next choice follows the drafts."""
    from workers.policy import WIDTH_EVERY

    policy = _measured_width_policy()
    low, high = [[0.6 ** (j + 1) for j in range(16)]] * 8, [[0.97 ** (j + 1) for j in range(16)]] * 8
    policy.observe_draft(8, 8 * 17, 6.0)
    first = policy._plan_hybridspec(low, [16] * 8, [1] * 8, [100] * 8)
    c = policy._width_choice[8].c
    assert max(first) == c
    for _ in range(WIDTH_EVERY - 1):
        policy.observe_draft(8, 8 * 17, 6.0)
        within = policy._plan_hybridspec(high, [16] * 8, [1] * 8, [100] * 8)
        assert max(within) == c and policy._predicted_ms is not None
    policy.observe_draft(8, 8 * 17, 6.0)
    again = policy._plan_hybridspec(high, [16] * 8, [1] * 8, [100] * 8)
    assert max(again) > c and policy._width_choice[8].c == max(again)
    assert list(policy.planned_max[8]) == [c] * WIDTH_EVERY + [max(again)]


def test_width_from_reads_its_switch_and_names_the_allowed_values(monkeypatch):
    """HYBRIDSPEC_WIDTH_FROM (A/B measurement): a batch-size bucket, a power of two >= 1; 8 by default."""
    from workers.policy import width_from

    monkeypatch.delenv("HYBRIDSPEC_WIDTH_FROM", raising=False)
    assert width_from() == 8
    for value, expected in (("1", 1), ("16", 16)):
        monkeypatch.setenv("HYBRIDSPEC_WIDTH_FROM", value)
        assert width_from() == expected
    for bad in ("0", "3", "-8", "x", ""):
        monkeypatch.setenv("HYBRIDSPEC_WIDTH_FROM", bad)
        with pytest.raises(ValueError, match="HYBRIDSPEC_WIDTH_FROM must be a power of two >= 1"):
            width_from()


def test_hybridspec_prices_the_drafting_as_sunk_below_the_width_bucket():
    """Below the WIDTH_FROM batch-size bucket (a latency-bound drafter: its ms hardly depend on the block, and the
    width's price was its table's noise) the plans make no width choice: budget_plan on the measured drafting and
    rest of the step as a sunk overhead, as hybridspec-nowidth plans everywhere. The same drafting table that
    makes bucket 8 stop short (drafting 16 costs 2.5x drafting 4) leaves bucket 4's plans at the whole block."""
    from scheduler.planner import budget_plan
    from workers.policy import WIDTH_FROM, LengthPolicy

    assert WIDTH_FROM == 8  # (the default: HYBRIDSPEC_WIDTH_FROM unset in the tests)
    policy = LengthPolicy("hybridspec", _moe_config(num_experts=8, top_k=2), max_verify_len=16)
    policy.latency.coefs = LatencyCoefs(const_ms=4.0, ms_per_token=0.05, ms_per_expert=0.0)
    for b in (4, 8):
        for _ in range(20):
            policy.observe_draft(b, b * 7, 2.0)  # blocks of 6 drafts: 2 ms, blocks of 16: 5 ms
            policy.observe_draft(b, b * 17, 5.0)
            policy.observe_outcome(b, True, 2 * b, step_ms=14.0, forward_ms=8.0)
    survival = [[0.9 ** (j + 1) for j in range(16)]] * 8
    policy.observe_draft(8, 8 * 17, 5.0)
    wide = policy._plan_hybridspec(survival, [16] * 8, [1] * 8, [100] * 8)
    assert 8 in policy._width_choice and max(wide) < 16  # priced: a narrower block pays for its drafting
    policy.observe_draft(4, 4 * 17, 5.0)
    sunk = policy._plan_hybridspec(survival[:4], [16] * 4, [1] * 4, [100] * 4)
    assert 4 not in policy._width_choice
    cost = policy.step_cost([1] * 4, [100] * 4, 4 + 64 + 4)
    expected = budget_plan(survival[:4], [16] * 4, cost, 4, draft_ms=policy.step_overhead_ms(4))
    assert sunk == expected.lengths and max(sunk) > max(wide), (sunk, wide)


def test_hybridspec_chooses_again_at_once_where_its_choice_was_the_drafts_limit():
    """A choice that took every draft there was (c = the longest cap: the drafts' limit, not its own) is made
    again at the next plan that has more drafts (the block grows by the margin a step, not every WIDTH_EVERY
    plans); an interior choice waits its WIDTH_EVERY plans."""
    policy = _measured_width_policy()
    high = [[0.97 ** (j + 1) for j in range(16)]] * 8
    policy.observe_draft(8, 8 * 5, 2.0)
    assert max(policy._plan_hybridspec(high, [4] * 8, [1] * 8, [100] * 8)) == 4  # all 4 drafts: censored
    assert policy._width_choice[8].c == 4 and policy._width_choice[8].censored
    policy.observe_draft(8, 8 * 7, 3.0)
    assert max(policy._plan_hybridspec(high, [6] * 8, [1] * 8, [100] * 8)) == 6  # chosen again at once
    policy.observe_draft(8, 8 * 17, 6.0)
    mid = [[0.8 ** (j + 1) for j in range(16)]] * 8
    lengths = policy._plan_hybridspec(mid, [16] * 8, [1] * 8, [100] * 8)
    c = policy._width_choice[8].c
    assert max(lengths) == c < 16 and not policy._width_choice[8].censored  # an interior choice ...
    policy.observe_draft(8, 8 * 17, 6.0)
    assert max(policy._plan_hybridspec(high, [16] * 8, [1] * 8, [100] * 8)) == c  # ... kept for the next plans
    assert policy._width_choice[8].plans == 2


def test_calibration_serves_its_maps_stale_for_a_few_reads_at_most():
    """max_stale_reads = 2: after new observations the next two reads see the maps as last built, the third the
    rebuilt ones (equal to an exact calibrator's); a position never built is built at its first read (here the
    first observation's scoring, before its counts); a step's calibration of many short rows is one read (every
    row sees the same version); 0 (the default) is always exact."""
    exact, lazy = AcceptanceCalibrator(), AcceptanceCalibrator(max_stale_reads=2)
    conf = [[0.9, 0.8, 0.7]]
    prior = AcceptanceCalibrator().calibrate_array("d", conf).tolist()  # the maps with no data
    last = prior
    for outcome, n in ((3, 20), (0, 200)):  # drafts accepted, then rejected
        for cal in (exact, lazy):
            cal.observe_step("d", [([0.9, 0.8, 0.7], 3, outcome)] * n)
        fresh = exact.calibrate_array("d", conf).tolist()
        assert fresh != last
        assert [lazy.calibrate_array("d", conf).tolist() for _ in range(4)] == [last, last, fresh, fresh]
        last = fresh
    assert last[0][0] < prior[0][0]
    for cal in (exact, lazy):  # accepted again: short rows go through the per-draft loop
        cal.observe_step("d", [([0.9, 0.8, 0.7], 3, 3)] * 200)
    rows = [[0.9, 0.8]] * 6
    fresh = exact.calibrate_rows("d", rows)
    assert fresh != [last[0][:2]] * 6
    assert [lazy.calibrate_rows("d", rows) for _ in range(3)] == [[last[0][:2]] * 6] * 2 + [fresh]
    # a plan's reads (stale_ok) serve the last maps up to STALE_OK_FACTOR x max_stale_reads reads, so that the
    # rebuild falls to the next other read (the observation's scoring); the default calibrator stays exact
    from scheduler.calibration import STALE_OK_FACTOR
    last = exact.calibrate_array("d", conf).tolist()
    assert lazy.calibrate_array("d", conf).tolist() == last  # both up to date
    for cal in (exact, lazy):
        cal.observe_step("d", [([0.9, 0.8, 0.7], 3, 0)] * 200)
    fresh = exact.calibrate_array("d", conf, stale_ok=True).tolist()
    assert fresh != last and exact.calibrate_array("d", conf).tolist() == fresh
    stale_ok_reads = [lazy.calibrate_array("d", conf, stale_ok=True).tolist() for _ in range(2 * STALE_OK_FACTOR)]
    assert stale_ok_reads == [last] * (2 * STALE_OK_FACTOR)  # past max_stale_reads, still the last maps
    assert lazy.calibrate_array("d", conf, stale_ok=True).tolist() == fresh  # the bound: rebuilt
    lazy.observe_step("d", [([0.9, 0.8, 0.7], 3, 3)] * 200)
    exact.observe_step("d", [([0.9, 0.8, 0.7], 3, 3)] * 200)
    newer = exact.calibrate_array("d", conf).tolist()
    assert [lazy.calibrate_array("d", conf, stale_ok=True).tolist() for _ in range(3)] == [fresh] * 3
    assert lazy.calibrate_array("d", conf).tolist() == newer  # an ordinary read past the limit rebuilds
    assert lazy.calibrate_rows("d", rows, stale_ok=True) == exact.calibrate_rows("d", rows)
    with pytest.raises(ValueError, match="max_stale_reads must be >= 0"):
        AcceptanceCalibrator(max_stale_reads=-1)


def test_gate_only_plain_counts_plain_verdicts_and_keeps_a_due_probe():
    """A step that cannot draft (the runner's hint reserved no drafts) asks the gate once with only_plain: a plain
    verdict is counted as any (its probe clock advances); a verdict to draft (a due probe) answers True and counts
    nothing, so the probe stays due for the next step that may draft."""
    from workers.policy import SpeculationGate

    gate = SpeculationGate()
    for draft in (True,) * 3 + (False,) * 3:  # both sides measured, plain 2x faster
        assert gate.should_draft(8) == draft
        gate.observe(8, draft, 8.0, 20.0 if draft else 10.0)
    spacing = gate.probe_spacing(8, gate.rate[(8, True)], gate.rate[(8, False)], False)
    for i in range(spacing - 1):
        assert gate.should_draft(8, only_plain=True) is False and gate.asked[8] == i + 1
    decisions = list(gate.decisions)
    assert gate.should_draft(8, only_plain=True) is True  # the probe is due: a miss, not counted
    assert gate.decisions == decisions and gate.asked[8] == spacing - 1
    assert gate.should_draft(8) is True and gate.asked[8] == 0  # the next step that may draft probes


def test_runner_times_plain_cycles_on_the_host_clock_and_the_rest_on_events(monkeypatch):
    """Served end to end with the gate's CUDA paths (host-timed stand-in events): where plain decoding wins, plain
    steps after plain steps are timed on the host clock at both ends; a drafted step ends on an event, and so
    does the start of the cycle after it (its commit and the drafter's roll-back run after its read-back); no
    timed cycle mixes the two clocks."""
    from gate_clocks import record_cycle_clocks

    seen, _ = record_cycle_clocks(monkeypatch)
    _served_with_wrong_drafts(80, monkeypatch)  # plain wins: long plain stretches, probes
    assert seen
    assert all(begin == end for begin, end, _, _ in seen)  # never two clocks in one cycle
    assert any(begin and not drafted for begin, _, drafted, _ in seen)  # plain cycles on the host clock
    assert all(not end for _, end, drafted, _ in seen if drafted)  # a drafted step ends on an event
    assert all(not begin for begin, _, _, before in seen if before)  # after a drafted step: an event start


def test_a_policy_swap_delivers_the_report_its_last_step_owed():
    """On CUDA the policy's error report is made inside the next step (runner._stats_due); a policy swapped in
    before that step makes the old policy's report at the swap and the next result carries it (not the new
    policy's, and none is lost)."""
    import types

    model, runner, prompts, greedy, page_size, num_pages, serve, _ = _tiny_served(4)
    runner.defer_learning = True
    old = runner.policy
    made = []
    real_stats = type(old).stats

    def stats(self, drafter=None):
        made.append(self)
        return real_stats(self, drafter)
    old.stats = types.MethodType(stats, old)
    runner._stats_due = True  # as step 1, 17, ... leaves it
    runner.set_policy("budget", 8)
    assert made == [old] and not runner._stats_due
    owed = runner._owed_stats
    assert owed is not None and "latency_samples" in owed
    reports, execute = [], runner.execute

    def spy(requests):
        out = execute(requests)
        reports.append(out.policy_stats)
        return out
    runner.execute = spy
    res = serve(runner, prompts, 2, 8, page_size, num_pages, "budget", keep_policy=True)
    del runner.execute
    assert res.tokens == [t[:2] for t in greedy] and runner._owed_stats is None
    assert reports[0] is owed and made == [old]  # the first step's result, the old policy's report


def test_a_step_that_reads_nothing_back_starts_the_next_cycle_on_an_event(monkeypatch):
    """A prefill chunk with nothing to sample leaves its forward running on the device (no read-back): even after
    a plain hint, the next gate cycle starts on an event, not the host clock; a plain decode after a plain hint
    (it read its token back, queued nothing after) starts it on the host clock."""
    import types

    from gate_clocks import record_cycle_clocks

    from scheduler.types import SamplingParams, StepRequest

    _, starts = record_cycle_clocks(monkeypatch)
    model, runner, prompts, greedy, page_size, num_pages, serve, _ = _tiny_served(4)
    runner.set_policy("hybridspec", 8)  # (a fresh _StepEnds of the stand-in kind)
    runner.drafter = types.SimpleNamespace(name="none", release=lambda ids: None)  # (never asked to draft here)
    monkeypatch.setattr(runner.policy, "wants_cycle", lambda b: True)  # (after a prefill chunk)
    monkeypatch.setattr(runner.policy, "next_step", lambda b, contexts, thin=True: (True, False))  # the hint: plain
    chunk = StepRequest("p", [3, 4, 5, 6], 0, [0], 0, False, SamplingParams(), 0, [])
    runner._hinted_plain = True
    runner.execute([chunk])
    decode = StepRequest("p", [7], 4, [0], 0, True, SamplingParams(), 0, [3, 4, 5, 6, 7])
    runner._hinted_plain = True
    runner.execute([decode])
    assert starts[-2:] == [False, True]


def _gate_steps(quiet_on: bool, steps: int, seed: int) -> tuple[list, dict, int]:
    """The runner's call order around hybridspec's gate on the CUDA path (cycles thinned), with quiet plain streaks
    (SpeculationGate.quiet_streak / quiet_step) or without, on a stream of pinned cycle times: plain and speculation
    lead in turn, the batch size moves between two buckets now and then. -> (per step (batch size, drafted, timed),
    the gate's counters, quiet steps)."""
    import random

    from workers.policy import SpeculationGate

    rng = random.Random(seed)
    gate = SpeculationGate()
    quiet, hinted_plain, sampling, quiet_steps = None, False, True, 0
    trace = []
    for t in range(steps):
        size = 4 if (t // 97) % 3 else rng.choice((3, 4, 8))
        q = quiet is not None and quiet[0] == size and hinted_plain and not sampling
        if not q:
            quiet = None
        if q:
            gate.quiet_step(size, start=True)
            drafted = False
            quiet_steps += 1
        elif hinted_plain:
            gate.should_draft(size, sampled=sampling, only_plain=True)
            drafted = False
        else:
            drafted = gate.should_draft(size, sampled=sampling)
        trace.append((size, drafted, sampling))
        if sampling:
            spec_ms = 40.0 if (t // 300) % 2 == 0 else 12.0  # plain leads, then speculation, ...
            gate.observe(size, drafted, 3.0 * size if drafted else float(size), spec_ms if drafted else 10.0)
        if q and quiet[1] > 1:
            gate.quiet_step(size, start=False)
            quiet, sampling = (size, quiet[1] - 1), False
        else:
            sampling = gate.wants_sample(size)
            hinted_plain = not gate.would_draft(size, sampled=sampling)
            n = gate.quiet_streak(size) if quiet_on and hinted_plain and not sampling else -1
            quiet = (size, n + 1) if n >= 0 else None
    counters = {"asked": gate.asked, "ticks": gate.ticks, "decisions": gate.decisions, "samples": gate.samples,
                "rate": gate.rate}
    return trace, counters, quiet_steps


def test_quiet_plain_streaks_decide_every_step_as_asking_the_gate_would(monkeypatch):
    """A quiet plain step counts the verdict its streak knew (plain, untimed, no probe) instead of asking the gate:
    over long runs in the runner's call order (plain and speculation leading in turn, probes, timed steps every
    SAMPLE_EVERY-th, batch sizes moving between buckets) every step drafts, is timed and probes exactly as when the
    gate is asked at every step, and the gate's counters end the same; most plain steps are quiet."""
    from workers.policy import SpeculationGate

    monkeypatch.setattr(SpeculationGate, "SAMPLE_EVERY", 4)
    for seed in range(3):
        asked, counted, _ = _gate_steps(False, 1500, seed)
        quiet, counted_quiet, n = _gate_steps(True, 1500, seed)
        assert quiet == asked and counted_quiet == counted
        plain = sum(1 for _, drafted, _ in asked if not drafted)
        assert 0.4 * plain < n < plain, (n, plain)  # quiet: many plain steps, never the timed ones
        assert any(d for _, d, _ in asked) and any(not d for _, d, _ in asked)
    # no streak where its verdicts depend on more than the counters
    gate = SpeculationGate()
    assert gate.quiet_streak(4) == -1  # unmeasured
    for drafted, ms in ((True, 12.0), (False, 10.0)) * SpeculationGate.MIN_SAMPLES:
        gate.observe(4, drafted, 12.0 if drafted else 4.0, ms)
    assert gate.quiet_streak(4) == -1  # speculation leads
    gate.force_plain = True
    assert gate.quiet_streak(4) == -1


def test_served_quiet_plain_steps_keep_the_output_and_the_gate_s_decisions(monkeypatch):
    """Served end to end on the gate's CUDA path (cycles thinned; pinned cycle times, plain decoding 3x faster):
    with quiet plain streaks the output is the greedy output and the gate's decisions and counters are those of the
    same run asking the gate at every step; most plain steps were quiet, and every quiet step's verdict is the one
    the gate would give afresh (plain, no probe) with the untimed step after it not due for timing."""
    import copy

    from workers.policy import LengthPolicy, SpeculationGate
    from workers.runner import _StepEnds

    monkeypatch.setattr(_StepEnds, "THIN", True)
    monkeypatch.setattr(_StepEnds, "GAP_MS", 1e9)  # (a slow machine's pause between steps drops no sample)
    checked = {"start": 0, "end": 0}
    real = SpeculationGate.quiet_step

    def checking(gate, batch_size, start):
        b = gate.bucket(batch_size)
        if start:
            assert gate._verdict(b, None, False) == (False, True, False)
            checked["start"] += 1
        else:
            assert not copy.deepcopy(gate).wants_sample(batch_size)
            checked["end"] += 1
        return real(gate, batch_size, start)
    monkeypatch.setattr(SpeculationGate, "quiet_step", checking)
    runs = {}
    streak = LengthPolicy.quiet_streak
    for on in (False, True):  # (off: what the noquiet ablation does)
        monkeypatch.setattr(LengthPolicy, "quiet_streak", streak if on else lambda self, batch_size: -1)
        runner, _, _, _, _, _, res = _served_with_wrong_drafts(80, monkeypatch)  # (checks the greedy output)
        g = runner.policy.gate
        runs[on] = (list(g.decisions), dict(g.asked), dict(g.ticks), dict(g.samples), res.steps)
        if not on:
            assert checked == {"start": 0, "end": 0}
    assert runs[True] == runs[False]
    assert checked["start"] > 0.5 * runs[True][0][0] and checked["end"] > 0, (checked, runs[True][0])


def test_a_quiet_streak_ends_where_the_policy_loses_its_gate(monkeypatch):
    """A live policy whose gate is switched off mid-streak (as expert parallelism's slowest-rank observation does)
    serves on without the gate: the next step decodes as any gateless step (review of 0e26e18)."""
    from workers.runner import ModelRunner, _StepEnds

    monkeypatch.setattr(_StepEnds, "THIN", True)
    monkeypatch.setattr(_StepEnds, "GAP_MS", 1e9)
    real = ModelRunner.execute
    cut = []

    def execute(self, requests):
        if not cut and self._quiet is not None and self._quiet[1] > 1:
            cut.append(self._quiet)
            self.policy.gate = None
        return real(self, requests)
    monkeypatch.setattr(ModelRunner, "execute", execute)
    _served_with_wrong_drafts(80, monkeypatch)  # (checks the greedy output)
    assert cut  # a streak was running when the gate went


def test_padfloor_counts_padded_rows_and_fills_the_bucket_the_plain_floor_tips_away_from():
    """hybridspec-padfloor: the measured cost's floor a token counts the rows a graph step pads to. On run 39's c=64
    tables (H200, bench/NOTES.md 2026-12-07 17:59 item 3: the forward's cost table, the drafter's ms by rows, the
    rest of the step) the plain floor raises the flat 257-384 stretch and the width search keeps 3 drafts a request;
    counted by padded rows it fills the 384-row bucket (5 drafts), as the table's own points say it should."""
    from scheduler.latency_model import TokenCostTable
    from scheduler.planner import width_plan
    from workers.policy import PAD_ROWS, LengthPolicy, SlopeFloor

    table = TokenCostTable([64, 128, 192, 256, 273, 320, 384, 386, 512, 768, 1088],
                           [12.09, 12.09, 13.70, 15.62, 17.47, 17.67, 18.04, 19.80, 20.83, 26.31, 33.44])
    floor = 0.011665  # the latency model's ms_per_token that run
    plain, padded = SlopeFloor(table, floor), SlopeFloor(table, floor, PAD_ROWS)
    # inside the 384 bucket the padded floor adds nothing (the table's own points), across buckets a row's floor each
    assert padded.cost_ms(384) == pytest.approx(18.04) and plain.cost_ms(384) == pytest.approx(17.47 + 111 * floor)
    assert padded.cost_ms(300) == pytest.approx(table.cost_ms(300))
    assert plain.cost_ms(300) == pytest.approx(17.47 + 27 * floor)
    assert plain.cost_ms(300) > table.cost_ms(300) + 0.1
    assert padded.cost_ms(257) >= 15.62 + 128 * floor - 1e-9  # 257 tokens run the 384-row graph: 128 rows more
    np.testing.assert_allclose(padded.costs_ms(64, 600)[-1], padded.cost_ms(600))
    draft_rows = [256, 320, 384, 448, 512, 576, 640, 1024]
    draft_ms = [2.61, 2.69, 2.69, 2.92, 3.04, 3.54, 3.48, 5.36]
    B, K, rest = 64, 16, 2.35
    blocks = np.minimum(np.arange(1, K + 1) + 2, 16) + 1.0  # drafting c + DRAFT_MARGIN (+ the pending token)
    width = [0.0] + [rest + float(np.interp(B * x, draft_rows, draft_ms)) for x in blocks]
    survival = [[0.7 ** j for j in range(1, K + 1)] for _ in range(B)]
    plan, c = width_plan(survival, [K] * B, plain, B, width)
    assert c == 3 and set(plan.lengths) == {3}
    plan, c = width_plan(survival, [K] * B, padded, B, width)
    assert c == 5 and set(plan.lengths) == {5}
    # the policy's variant: its measured cost carries the rows; plain hybridspec's does not
    for variant, rows in ((None, None), ("padfloor", PAD_ROWS)):
        policy = LengthPolicy("hybridspec", _moe_config(), max_verify_len=8)
        if variant:
            policy.ablate(variant)
        policy.bucket_costs[16] = TokenCostTable([16, 64, 96], [10.0, 10.1, 10.2])
        assert policy._slope_floor(16).rows == rows


def test_a_profile_point_at_a_buckets_top_keeps_the_plan_off_the_next_graph():
    """At 4 requests the start-up profile measures 4 x {1, 2, 4, 8, 12, 17} tokens: a line from 48 to 68 tokens
    prices 64 (the 64-row graph, 16-token block) nearly as dear as 68 (the 68-row graph, 17-token block), and the
    plan verifies 16 drafts a request where 15 pay more (H100, 3f8805f: hybridspec's 66-token steps at 13.8 ms,
    budget's 64-token steps at 12.8; bench/NOTES.md 2026-12-07 22:06 item 8). With the point at 64 that
    hybridspec-bucketprofile's profile adds (the blocks that fill a token bucket), the plan stays at 64 tokens."""
    from scheduler.latency_model import LatencyCoefs
    from workers.policy import LengthPolicy, StepObservation

    ms = {4: 9.0, 8: 9.3, 16: 9.8, 32: 11.0, 48: 12.3, 64: 12.8, 68: 13.9}  # by tokens at 4 requests
    survival = [[0.95 ** (j + 1) for j in range(16)] for _ in range(4)]
    chosen = {}
    for blocks in ((1, 2, 4, 8, 12, 17), (1, 2, 4, 8, 12, 16, 17)):  # the profile's, and bucketprofile's
        policy = LengthPolicy("hybridspec", _moe_config(), max_verify_len=16)
        policy.latency.coefs = LatencyCoefs(const_ms=8.0, ms_per_token=0.02)
        for t in blocks:
            policy.observe_profile(StepObservation([t] * 4, [50] * 4, ms[4 * t], None), None)
        chosen[16 in blocks] = sum(policy._plan_hybridspec(survival, [16] * 4, [1] * 4, [50] * 4))
    # the ratios on these costs: 15 drafts each (64 tokens) 44.79 / 12.8 = 3.50 tokens a ms, 16 each 46.55 / 13.9 = 3.35
    assert chosen == {False: 64, True: 60}
