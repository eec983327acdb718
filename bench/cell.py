"""One e2e cell set up for the profiling scripts (bench/host_profile.py, bench/step_timeline.py): the bench model
(or the tiny CPU one), its cache with the graphs' spare page and slot, the replay drafter's DFlash-shaped cost
model, CUDA graphs (static batches run eagerly on the CPU), prompts, and the `ar` reference continuation that the
replay drafter follows."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bench.e2e import RunResult, drafter_model, serve, tiny_config
from workers.bench_model import build_bench_model
from workers.cache import ModelCache
from workers.drafters import DraftModelDrafter, ReplayDrafter
from workers.runner import ModelRunner


@dataclass
class Cell:
    runner: ModelRunner
    drafter_cost: DraftModelDrafter
    prompts: list[list[int]]
    ar: RunResult  # the plain greedy run: the reference every policy's tokens must equal
    vocab_size: int
    page_size: int
    num_pages: int
    device: str

    def replay(self, acceptance: float) -> ReplayDrafter:
        """A replay drafter on the reference continuations, spending the cost model's forward."""
        replay = ReplayDrafter(acceptance, self.vocab_size, seed=7, cost_model=self.drafter_cost)
        for p, cont in zip(self.prompts, self.ar.tokens):
            replay.set_reference(p, cont + [0] * 20)
        return replay

    def use_policy(self, policy: str, acceptance: float) -> int:
        """The runner takes `policy` (fixedK, budget, hybridspec[-noextra|-nocounts|-lean|-nogate|-nowidth], ar)
        with a fresh replay drafter; learned policies run the start-up profile first. -> the draft cap of its
        runs."""
        k = int(policy[5:]) if policy.startswith("fixed") else 16
        self.runner.drafter = self.replay(acceptance)
        self.runner.set_policy("fixed" if policy.startswith("fixed") else policy.split("-")[0], k)
        if policy.startswith("hybridspec-"):  # hybridspec with parts switched off (LengthPolicy.ablate)
            self.runner.policy.ablate(policy.split("-", 1)[1])
        if policy.split("-")[0] in ("budget", "hybridspec"):
            self.runner.profile(len(self.prompts))
        return 0 if policy == "ar" else k

    def serve(self, policy: str, max_new: int, max_draft: int) -> RunResult:
        return serve(self.runner, self.prompts, max_new, max_draft, self.page_size, self.num_pages, policy,
                     keep_policy=True)


def build_cell(layers: int, tiny: bool, concurrency: int, prompt_len: int, max_new: int) -> Cell:
    device = "cuda" if torch.cuda.is_available() and not tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    target = build_bench_model(config=tiny_config(), dtype=dtype, device=device, decisive=True) if tiny else \
        build_bench_model(num_layers=layers, routing="zipf", dtype=dtype, device=device, decisive=True)
    cfg, page_size, conc = target.config, 16, concurrency
    pages_per_req = -(-(prompt_len + max_new + 20) // page_size)
    num_pages = conc * pages_per_req
    cache = ModelCache(cfg, num_pages + 1, page_size, conc + 1, dtype, device)
    drafter_cost = DraftModelDrafter(drafter_model(cfg, 2, dtype, device), num_pages, page_size, conc)
    runner = ModelRunner(target, cache)
    why = runner.enable_graphs(conc, pages_per_req, warm=False, capture=device == "cuda")
    assert why is None, why
    drafter_cost.enable_graphs(conc, pages_per_req, 17, capture=device == "cuda")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, cfg.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(conc)]
    runner.drafter = None
    serve(runner, prompts, 16, 0, page_size, num_pages, "ar")  # warm-up
    ar = serve(runner, prompts, max_new, 0, page_size, num_pages, "ar")
    return Cell(runner, drafter_cost, prompts, ar, cfg.vocab_size, page_size, num_pages, device)
