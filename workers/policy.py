"""Verification-length policies, run by the worker each step (DESIGN.md steps 3-4).

- `ar`: never verify drafts.   - `fixed`: verify min(K, cap_i) drafts.
- `budget`: vLLM-style adaptive verification: one batch-wide token budget from survival scores and a cost table
  indexed by token count only.
- `hybridspec`: lengths chosen jointly under the batch latency model (tokens, distinct experts, requests,
  context), plus one extra token per request up to the first MoE router, kept only where its experts are
  already covered (router correction, workers/model.py MoEContext).
Survival comes from the drafter's confidences through the online calibrator. Until the latency model has
seen enough steps it explores with `fixed` lengths (an online start-up profile).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from scheduler.calibration import AcceptanceCalibrator
from scheduler.latency_model import ExpertEstimator, LatencyModel, StepComposition, TokenCostTable
from scheduler.planner import budget_plan, fixed_lengths, survival_from_acceptance
from scheduler.planner_torch import plan_with_experts_device
from workers.config import ModelConfig

POLICIES = ("ar", "fixed", "budget", "hybridspec")
WARMUP_STEPS = 8  # steps of `fixed` exploration before the learned policies take over


@dataclass
class StepObservation:
    tokens_per_request: list[int]
    context_lens: list[int]
    forward_ms: float | None  # None: not a measurement (the step captured a CUDA graph first)
    distinct_experts: list[int] | None  # per MoE layer (None: not observed; the estimator stands in)
    verified: list[tuple[list[float], int, int]] = field(default_factory=list)  # (confidences, verified, accepted)


class LengthPolicy:
    def __init__(self, name: str, config: ModelConfig, max_verify_len: int = 16,
                 device: torch.device | str = "cpu"):
        if name not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {name!r}")
        self.name, self.max_verify_len = name, max_verify_len
        self.device = torch.device(device)  # where the joint planner's tensors live (the model's device)
        self.num_moe_layers = sum(config.moe_layers)
        self.estimator = ExpertEstimator(max(self.num_moe_layers, 1), max(config.num_experts, 1),
                                         max(config.num_experts_per_tok, 1))
        self.latency = LatencyModel(estimator=self.estimator)
        self.token_costs = TokenCostTable()
        self.calibrator = AcceptanceCalibrator(max_positions=max(max_verify_len + 1, 16))
        self.steps = 0
        self._pending_counts: list[torch.Tensor] | None = None
        self._touch: torch.Tensor | None = None  # [MoE layers, E] touch probabilities for the device planner

    @property
    def uses_extra_token(self) -> bool:
        return self.name == "hybridspec"

    def warm(self) -> bool:
        return self.steps >= WARMUP_STEPS and self.latency.fitted

    def lengths(self, drafter: str, caps: list[int], confidences: list[list[float]], tokens: list[int],
                contexts: list[int]) -> list[int]:
        """caps/confidences per request of the step (prefill rows: cap 0, no confidences)."""
        if self.name == "ar":
            return [0] * len(caps)
        caps = [min(c, len(conf)) for c, conf in zip(caps, confidences)]
        if self.name == "fixed" or not self.warm():
            return fixed_lengths(caps, self.max_verify_len)
        acc = [self.calibrator.calibrate_row(drafter, conf) for conf in confidences]
        survival = survival_from_acceptance(acc)
        if self.name == "budget":
            return budget_plan(survival, caps, self.token_costs, sum(tokens)).lengths
        return self._plan_device(survival, caps, tokens, contexts)

    def _plan_device(self, survival: list[list[float]], caps: list[int], tokens: list[int],
                     contexts: list[int]) -> list[int]:
        """The joint plan on torch tensors (planner_torch): the host version walks layers x experts in Python,
        ~100 ms a step at 40 x 256; this one is a few small tensor ops (and one read of the result)."""
        coefs = self.latency.coefs
        width = max((len(r) for r in survival), default=0)
        if width == 0:
            return [0] * len(caps)
        surv = torch.zeros(len(survival), width, dtype=torch.float64)
        for i, row in enumerate(survival):
            surv[i, :len(row)] = torch.tensor(row, dtype=torch.float64)
        if self._touch is None:  # [MoE layers, E]: the planner's work is B x K x layers x E, so on the device
            self._touch = torch.tensor(self.estimator.touch_prob_table(), dtype=torch.float64, device=self.device)
        fixed_ms = (coefs.const_ms + coefs.ms_per_token * sum(tokens) + coefs.ms_per_request * len(tokens)
                    + coefs.ms_per_context_token * sum(contexts))
        lengths = plan_with_experts_device(surv.to(self.device), torch.tensor(caps, device=self.device), fixed_ms,
                                           coefs.ms_per_token, coefs.ms_per_expert, self._touch,
                                           torch.tensor(tokens, device=self.device))
        return [int(x) for x in lengths.tolist()]

    def observe(self, drafter: str | None, obs: StepObservation, expert_counts: list[torch.Tensor] | None) -> None:
        self.steps += 1
        comp = StepComposition(obs.tokens_per_request, obs.context_lens, self.num_moe_layers,
                               obs.distinct_experts if self.num_moe_layers and obs.distinct_experts else None)
        if obs.forward_ms is not None:
            self.latency.observe(comp, obs.forward_ms)
            if not self.latency.fitted and len(self.latency.samples) >= self.latency.min_samples:
                self.latency.fit()
            self.token_costs.observe(sum(obs.tokens_per_request), obs.forward_ms)
        if drafter is not None and obs.verified:
            self.calibrator.observe_step(drafter, obs.verified)
        if expert_counts:  # routing popularity, folded in every few steps (pure Python, a few ms)
            stacked = torch.stack(expert_counts).float().cpu()
            self._pending_counts = [stacked] if self._pending_counts is None else self._pending_counts + [stacked]
            if len(self._pending_counts) >= 8:
                total = torch.stack(self._pending_counts).sum(0)
                self.estimator.observe_counts(total.tolist())
                self._pending_counts = None
                self._touch = None  # refreshed from the new routing statistics at the next plan

    def stats(self) -> dict[str, float]:
        err = self.latency.error_stats()
        return {"latency_samples": float(err.n), "latency_mean_abs_pct": err.mean_abs_pct,
                "latency_p90_abs_pct": err.p90_abs_pct}
