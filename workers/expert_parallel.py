"""Expert parallelism: each rank of a torch.distributed group holds a shard of every MoE layer's routed experts;
attention, GDN, dense MLPs, routers and shared experts are replicated and run data-parallel (each rank runs its own
requests). Around every MoE layer the ranks exchange token rows with all-to-all:

1. route locally (every rank has the router); the first MoE layer of a forward also all-reduces (max) the experts
   covered by the ranks' non-extra tokens, so the router correction keeps an extra verification token only where
   all its experts are activated somewhere in the deployment (on their owners);
2. static-split exchange (no host read, no count exchange): every rank knows, on the host, every rank's row
   capacity for the step (`step_rows`, an upper bound on the rows of its forward, set before the forward by
   `execute_rank` from what the driver / scheduler sends each rank: `step_rows_bound`). Rank s sends each peer a
   fixed block of C_s = step_rows[s] rows: token n goes to peer d once (slot = its rank among the tokens with an
   expert on d, a cumsum), whatever number of its top-k experts d owns, with a [2k] fp32 side row (d's local expert
   id per routing slot, -1 where that expert is elsewhere or the token is masked, and the routing weights). So
   both all-to-alls have host-known splits: [C_me] * W sent, [C_s for s] received;
3. the receiver expands its rows to one row per (row, routing slot) and runs them through the existing
   `dispatch.fused_moe` (ids [R*k, 1], weight 1, token_mask = slot valid: padding rows and other ranks' slots cost
   no expert work), weights and sums each row's local results in fp32, and sends the fp32 partial sums back with
   the inverse all-to-all; the sender adds each token's per-rank partials (fp32, rounded once).
Masked tokens (router correction, padding rows) send nothing and get no routed output. The shared expert stays
local. No host sync in the layer (CUDA-graph friendly shapes: they depend on the step's capacities only). The old
exchange (counts all-to-all + one host read of the split sizes per layer) stays behind `ExpertParallelMoE.static =
False`.

Lockstep: every MoE layer is a collective, so every rank runs one target forward per engine step; a rank with no
requests runs `idle_forward` (only the per-layer exchanges, with zero rows). Drafters (draft model, MTP head)
are replicated and local: they never call these collectives.

`ExpertParallelActor` is the per-rank worker of engine/ep_executor.py (a plain class the engine wraps with
ray.remote, as workers/ray_actor.py); it joins the group, builds the runner with only its experts' weights (the
others never reach its device: a model larger than one GPU fits when its experts are spread) and makes the latency
model observe the slowest rank's forward time (all-reduce max once per step).
"""

from __future__ import annotations

import datetime
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from kernels import dispatch


# ------------------------------------------------------------------------------------------------- placement
@dataclass
class ExpertShard:
    """Which rank owns each of a layer's experts. `owner[e]` = rank of expert e; a rank keeps its experts in
    ascending global id order (`local_experts`)."""

    owner: list[int]
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        bad = [r for r in self.owner if not 0 <= r < self.world_size]
        if bad:
            raise ValueError(f"expert placement names ranks outside 0..{self.world_size - 1}: {sorted(set(bad))}")
        self.num_experts = len(self.owner)
        self.experts_of = [[e for e, r in enumerate(self.owner) if r == rank] for rank in range(self.world_size)]
        self.local_experts = self.experts_of[self.rank]
        self.num_local = [len(x) for x in self.experts_of]
        # position of each expert in the rank-major layout; index E is the "not sent" sentinel
        position = [0] * (self.num_experts + 1)
        rank_major = [e for experts in self.experts_of for e in experts]
        for p, e in enumerate(rank_major):
            position[e] = p
        position[self.num_experts] = self.num_experts
        self.position = torch.tensor(position, dtype=torch.long)
        self.rank_of_position = torch.tensor(
            [r for r, n in enumerate(self.num_local) for _ in range(n)], dtype=torch.long)
        # static exchange: each expert's owner and its index among the owner's local experts
        self.rank_of = torch.tensor(self.owner, dtype=torch.long)
        local_index = [0] * self.num_experts
        for experts in self.experts_of:
            for i, e in enumerate(experts):
                local_index[e] = i
        self.local_index = torch.tensor(local_index, dtype=torch.long)

    @classmethod
    def even(cls, num_experts: int, world_size: int, rank: int) -> ExpertShard:
        """Contiguous even split: rank r owns experts [r*E/W, (r+1)*E/W) (the first E % W ranks one more)."""
        base, extra = divmod(num_experts, world_size)
        owner = []
        for r in range(world_size):
            owner += [r] * (base + (1 if r < extra else 0))
        return cls(owner, rank, world_size)


def popularity_placement(counts: Sequence[float], world_size: int) -> list[int]:
    """Owner per expert from measured popularity (tokens routed to each expert): every rank holds the same number
    of experts (within one, for memory), and the greedy longest-processing-time rule balances the routed tokens:
    experts by decreasing popularity, each to the least loaded rank that still has room."""
    num_experts = len(counts)
    base, extra = divmod(num_experts, world_size)
    room = [base + (1 if r < extra else 0) for r in range(world_size)]
    load = [0.0] * world_size
    owner = [0] * num_experts
    for e in sorted(range(num_experts), key=lambda e: (-float(counts[e]), e)):
        r = min((r for r in range(world_size) if room[r] > 0), key=lambda r: (load[r], r))
        owner[e], room[r], load[r] = r, room[r] - 1, load[r] + float(counts[e])
    return owner


# ------------------------------------------------------------------------------------------------ the exchange
class ExpertParallelMoE:
    """A SparseMoe's routed experts over the group (set as `SparseMoe.ep`; the layer then calls it for its whole
    output). `first`: the first MoE layer of the model (does the router-correction coverage all-reduce).
    `timing`: accumulate the time spent in the collectives (`comm_ms()`; CUDA events on GPU)."""

    def __init__(self, shard: ExpertShard, group: Any = None, first: bool = False):
        self.shard, self.group, self.first = shard, group, first
        self.timing = False
        self.static = True  # False: the old exchange (counts all-to-all + a host read of the splits per layer)
        # every rank's row capacity for the current step (host ints, the same list on every rank); set before
        # each forward (`set_step_rows`); None with one rank: this forward's own rows
        self.step_rows: list[int] | None = None
        self._spans: list[tuple[Any, Any]] = []
        self._position: Tensor | None = None
        self._rank_of_position: Tensor | None = None
        self._rank_of: Tensor | None = None
        self._local_index: Tensor | None = None

    # collectives, optionally timed
    def _timed(self, fn: Callable[[], Any], device: torch.device) -> None:
        if not self.timing:
            fn()
            return
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            self._spans.append((begin, end))
        else:
            t0 = time.perf_counter()
            fn()
            self._spans.append((t0, time.perf_counter()))

    def comm_ms(self) -> float:
        """Milliseconds spent in this layer's collectives since the last call (synchronizes on CUDA)."""
        total = 0.0
        for begin, end in self._spans:
            if isinstance(begin, float):
                total += (end - begin) * 1e3
            else:
                end.synchronize()
                total += begin.elapsed_time(end)
        self._spans = []
        return total

    def _tables(self, device: torch.device) -> tuple[Tensor, Tensor]:
        if self._position is None or self._position.device != device:
            self._position = self.shard.position.to(device)
            self._rank_of_position = self.shard.rank_of_position.to(device)
        return self._position, self._rank_of_position

    def __call__(self, moe: nn.Module, x: Tensor, weights: Tensor, ids: Tensor, ctx: Any = None) -> Tensor:
        """The layer's output (routed experts over the group + the local shared expert) for x [N, H]."""
        shard = self.shard
        num_experts = shard.num_experts
        if self.first:  # router correction against the whole deployment's activated experts (every rank, always)
            extra_rows = ctx.extra_rows if ctx is not None else None
            row_mask = ctx.row_mask if ctx is not None else None
            others = ids if row_mask is None else torch.where(row_mask[:, None], ids, num_experts)
            if extra_rows is not None:  # extra rows point at a dummy expert
                others = torch.where(extra_rows[:, None], num_experts, others)
            covered = torch.zeros(num_experts + 1, dtype=torch.int32, device=x.device)
            covered[others.reshape(-1)] = 1
            self._timed(lambda: dist.all_reduce(covered, op=dist.ReduceOp.MAX, group=self.group), x.device)
            if extra_rows is not None and ctx.token_mask is None:
                mask = ~extra_rows | covered[ids].bool().all(dim=-1)
                ctx.token_mask = mask if row_mask is None else mask & row_mask
        # the mask of this layer, and what the latency model learns (this rank's batch: distinct experts, counts)
        token_mask = ctx.mask_for(ids, num_experts) if ctx is not None else None
        exchange = self.exchange if self.static else self.exchange_dynamic
        routed = exchange(x, moe.experts.gate_up_proj, moe.experts.down_proj, weights, ids, token_mask)
        shared = moe.shared_output(x)
        return routed + shared

    def _static_tables(self, device: torch.device) -> tuple[Tensor, Tensor]:
        if self._rank_of is None or self._rank_of.device != device:
            self._rank_of = self.shard.rank_of.to(device)
            self._local_index = self.shard.local_index.to(device)
        return self._rank_of, self._local_index

    def capacities(self, num_rows: int) -> list[int]:
        """Every rank's row capacity this step (host ints): `step_rows`, checked against this rank's rows."""
        shard = self.shard
        rows = self.step_rows
        if rows is None:
            if shard.world_size != 1:
                raise RuntimeError("expert-parallel exchange: step_rows (every rank's row capacity this step) not "
                                   "set; call set_step_rows(model, rows) / execute_rank(runner, requests, rows)")
            rows = [num_rows]
        if len(rows) != shard.world_size or num_rows > rows[shard.rank]:
            raise RuntimeError(f"expert-parallel exchange: rank {shard.rank} has {num_rows} rows, its step capacity "
                               f"is {rows[shard.rank] if len(rows) == shard.world_size else '?'} (step_rows {rows})")
        return [int(r) for r in rows]

    def exchange(self, x: Tensor, w_gate_up: Tensor, w_down: Tensor, weights: Tensor, ids: Tensor,
                 token_mask: Tensor | None = None) -> Tensor:
        """sum_j weights[n, j] * expert_{ids[n, j]}(x_n) with the experts on their owners: [N, H], through the
        static-split exchange (module docstring; no host sync). `w_gate_up` / `w_down` hold this rank's experts
        only (local order)."""
        shard, group = self.shard, self.group
        world, me = shard.world_size, shard.rank
        num_tokens, top_k = ids.shape
        hidden, dev = x.shape[1], x.device
        caps = self.capacities(num_tokens)  # host ints
        cap = caps[me]
        n_send, n_recv = world * cap, sum(caps)
        if n_recv == 0 and n_send == 0:
            return torch.zeros_like(x)
        rank_of, local_index = self._static_tables(dev)
        # per (token, peer): does the token go there (one row, however many of its experts the peer owns) and where
        dest = rank_of[ids]  # [N, k]
        if token_mask is not None:
            dest = torch.where(token_mask[:, None], dest, world)  # masked: sent nowhere
        hit = torch.zeros(num_tokens, world + 1, dtype=torch.int32, device=dev).scatter_(1, dest, 1)[:, :world]
        slot = torch.cumsum(hit, dim=0) - 1  # [N, W] rank among the tokens going to each peer
        base = torch.arange(world, device=dev) * cap
        row = torch.where(hit.bool(), base + slot, n_send)  # [N, W] send-buffer row; n_send: not sent (dump row)
        # the token filling each send row (num_tokens for a padding row; its data is whatever, never used)
        token_of_row = torch.full((n_send + 1,), num_tokens, dtype=torch.long, device=dev)
        token_ids = torch.arange(num_tokens, device=dev)[:, None].expand(num_tokens, world)
        token_of_row.scatter_(0, row.reshape(-1), token_ids.reshape(-1))
        token_of_row = token_of_row[:n_send]
        send_x = x.index_select(0, token_of_row.clamp(max=num_tokens - 1)) if num_tokens else \
            x.new_zeros(n_send, hidden)
        # side row per send row: k local expert ids (-1: none) then k routing weights (fp32, 0 where no id)
        pair_row = row.gather(1, dest.clamp(max=world - 1))  # [N, k] the row of each (token, expert) pair
        if token_mask is not None:
            pair_row = torch.where(token_mask[:, None], pair_row, n_send)
        meta = torch.zeros(n_send + 1, 2 * top_k, dtype=torch.float32, device=dev)
        meta[:, :top_k] = -1.0
        col = torch.arange(top_k, device=dev)
        flat = (pair_row * (2 * top_k) + col).reshape(-1)
        meta.view(-1).scatter_(0, flat, local_index[ids].reshape(-1).float())
        meta.view(-1).scatter_(0, flat + top_k, weights.reshape(-1).float())
        meta = meta[:n_send]
        # the exchange: every split host-known
        send_splits, recv_splits = [cap] * world, caps
        recv_x = x.new_empty(n_recv, hidden)
        recv_meta = meta.new_empty(n_recv, 2 * top_k)
        self._timed(lambda: dist.all_to_all_single(recv_x, send_x, recv_splits, send_splits, group=group), dev)
        self._timed(lambda: dist.all_to_all_single(recv_meta, meta, recv_splits, send_splits, group=group), dev)
        # this rank's experts over every received (row, routing slot); invalid slots cost no expert work
        local_ids = recv_meta[:, :top_k].long()  # [R, k]
        valid = local_ids >= 0
        if shard.num_local[me] and n_recv:
            rows_x = recv_x[:, None, :].expand(n_recv, top_k, hidden).reshape(n_recv * top_k, hidden)
            y = dispatch.fused_moe(rows_x, w_gate_up, w_down,
                                   x.new_ones(n_recv * top_k, 1), local_ids.clamp(min=0).reshape(-1, 1),
                                   valid.reshape(-1))  # [R*k, H], 0 for invalid slots
            w = torch.where(valid, recv_meta[:, top_k:], 0.0)
            part = torch.bmm(w[:, None, :], y.view(n_recv, top_k, hidden).float()).squeeze(1)  # [R, H] fp32
        else:
            part = torch.zeros(n_recv, hidden, dtype=torch.float32, device=dev)
        back = part.new_empty(n_send, hidden)
        self._timed(lambda: dist.all_to_all_single(back, part, send_splits, recv_splits, group=group), dev)
        out = torch.zeros(num_tokens + 1, hidden, dtype=torch.float32, device=dev)  # fp32 sum, rounded once
        out.index_add_(0, token_of_row, back)
        return out[:num_tokens].to(x.dtype)

    def exchange_dynamic(self, x: Tensor, w_gate_up: Tensor, w_down: Tensor, weights: Tensor, ids: Tensor,
                         token_mask: Tensor | None = None) -> Tensor:
        """As `exchange`, the old way: per-expert counts all-to-all, then one host read of the split sizes (a host
        sync per layer); exact-size buffers, one row per (token, expert) pair."""
        shard, group = self.shard, self.group
        world, me = shard.world_size, shard.rank
        num_experts, top_k = shard.num_experts, ids.shape[1]
        hidden = x.shape[1]
        position, rank_of_position = self._tables(x.device)
        key = position[ids.reshape(-1)]  # [N*k] rank-major position of each pair's expert
        if token_mask is not None:
            key = torch.where(token_mask.repeat_interleave(top_k), key, num_experts)
        order = torch.argsort(key, stable=True)
        counts = torch.zeros(num_experts + 1, dtype=torch.long, device=x.device).index_add_(
            0, key, torch.ones_like(key))[:num_experts]  # rows per expert position (bincount would read its max)
        recv_counts = torch.empty(world * shard.num_local[me], dtype=counts.dtype, device=x.device)
        self._timed(lambda: dist.all_to_all_single(recv_counts, counts, [shard.num_local[me]] * world,
                                                   shard.num_local, group=group), x.device)
        send_per_rank = torch.zeros(world, dtype=counts.dtype, device=x.device).index_add_(0, rank_of_position, counts)
        recv_per_rank = recv_counts.view(world, shard.num_local[me]).sum(dim=1)
        splits = torch.cat([send_per_rank, recv_per_rank]).tolist()  # the layer's one host read
        send_splits, recv_splits = splits[:world], splits[world:]
        n_send, n_recv = sum(send_splits), sum(recv_splits)
        pairs = order[:n_send]
        tokens = pairs // top_k
        send_rows = x[tokens]
        recv_rows = x.new_empty(n_recv, hidden)
        self._timed(lambda: dist.all_to_all_single(recv_rows, send_rows, recv_splits, send_splits, group=group),
                    x.device)
        local_ids = torch.arange(shard.num_local[me], device=x.device).repeat(world)
        local_ids = torch.repeat_interleave(local_ids, recv_counts, output_size=n_recv)[:, None]  # [R, 1]
        y = dispatch.fused_moe(recv_rows, w_gate_up, w_down, x.new_ones(n_recv, 1), local_ids)
        back = x.new_empty(n_send, hidden)
        self._timed(lambda: dist.all_to_all_single(back, y.contiguous(), send_splits, recv_splits, group=group),
                    x.device)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # top-k summed in fp32, rounded once
        out.index_add_(0, tokens, back.float() * weights.reshape(-1)[pairs, None].float())
        return out.to(x.dtype)


# ------------------------------------------------------------------------------------------ model surgery
def moe_layers(model: nn.Module) -> list[nn.Module]:
    from workers.model import SparseMoe

    return [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoe)]


def plan_shards(experts_per_layer: Sequence[int], rank: int, world_size: int,
                placement: Sequence[int] | Sequence[Sequence[int]] | None = None) -> list[ExpertShard]:
    """Each MoE layer's ExpertShard for this rank. placement: None (even contiguous split), one owner list for
    every layer, or one per MoE layer (e.g. from `popularity_placement`)."""
    shards = []
    for j, num_experts in enumerate(experts_per_layer):
        if placement is None:
            shards.append(ExpertShard.even(num_experts, world_size, rank))
            continue
        owner = placement[j] if placement and isinstance(placement[0], (list, tuple)) else placement
        if len(owner) != num_experts:
            raise ValueError(f"expert placement for MoE layer {j} has {len(owner)} entries, expected {num_experts}")
        shards.append(ExpertShard(list(owner), rank, world_size))
    return shards


@torch.no_grad()
def shard_model_(model: nn.Module, group: Any = None,
                 placement: Sequence[int] | Sequence[Sequence[int]] | None = None,
                 shards: Sequence[ExpertShard] | None = None) -> list[ExpertShard]:
    """Keeps only this rank's experts in every MoE layer of `model` (in place; the full tensors are freed; a model
    loaded with only them, ModelRunner.create's `local_experts`, keeps what it has) and hooks the exchange in
    (`SparseMoe.ep`). placement: as plan_shards'; or `shards`, planned already."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    layers = moe_layers(model)
    if shards is None:
        shards = plan_shards([mlp.gate.weight.shape[0] for mlp in layers], rank, world, placement)
    for j, (mlp, shard) in enumerate(zip(layers, shards, strict=True)):
        shard_moe_(mlp, shard, group, first=j == 0)
    return list(shards)


@torch.no_grad()
def shard_moe_(mlp: nn.Module, shard: ExpertShard, group: Any = None, first: bool = False) -> None:
    """One SparseMoe: keep `shard.local_experts` (local order), free the rest, hook the exchange in. Expert
    tensors that hold `shard.local_experts` rows already (loaded so) are kept as they are."""
    rows = mlp.experts.gate_up_proj.shape[0]
    if rows != shard.num_experts:
        if rows != len(shard.local_experts) or mlp.experts.down_proj.shape[0] != rows:
            raise ValueError(f"a MoE layer's experts have {rows} rows: neither all {shard.num_experts} nor this "
                             f"rank's {len(shard.local_experts)}")
    else:
        keep = torch.tensor(shard.local_experts, dtype=torch.long, device=mlp.experts.gate_up_proj.device)
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(mlp.experts, name)
            setattr(mlp.experts, name, nn.Parameter(full.data.index_select(0, keep).contiguous(), requires_grad=False))
            del full
    mlp.ep = ExpertParallelMoE(shard, group, first=first)


@torch.inference_mode()
def idle_forward(model: nn.Module) -> None:
    """A rank with no requests this step: takes part in every MoE layer's exchanges with zero tokens."""
    cfg = model.config
    for mlp in moe_layers(model):
        if mlp.ep is None:
            continue
        x = torch.empty(0, cfg.hidden_size, dtype=model.dtype, device=model.device)
        ids = torch.empty(0, mlp.top_k, dtype=torch.long, device=model.device)
        mlp.ep(mlp, x, x.new_empty(0, mlp.top_k), ids, None)


def set_step_rows(model: nn.Module, rows: Sequence[int] | None) -> None:
    """Every rank's row capacity for the next forward (host ints, the same list on every rank): each MoE layer's
    static exchange sizes its buffers from it."""
    rows = None if rows is None else [int(r) for r in rows]
    for mlp in moe_layers(model):
        if mlp.ep is not None:
            mlp.ep.step_rows = rows


def step_rows_bound(requests: Sequence[Any]) -> int:
    """An upper bound on the rows of the target forward `ModelRunner.execute(requests)` runs, from the plain step
    data alone (what the driver knows): each request's new tokens, plus up to `draft_cap` drafted tokens (the
    router-correction extra token included) for a decode that may speculate. Exact without speculation."""
    rows = 0
    for r in requests:
        rows += len(r.tokens)
        if r.sample and len(r.tokens) == 1 and r.context_len > 0 and r.draft_cap > 0:
            rows += r.draft_cap
    return rows


def set_timing(model: nn.Module, on: bool) -> None:
    for mlp in moe_layers(model):
        if mlp.ep is not None:
            mlp.ep.timing = on
            mlp.ep._spans = []


def comm_ms(model: nn.Module) -> float:
    """Milliseconds in the MoE collectives since the last call, over every layer (needs set_timing(model, True))."""
    return sum(mlp.ep.comm_ms() for mlp in moe_layers(model) if mlp.ep is not None)


# ----------------------------------------------------------------------------------------------- process group
def init_group(rank: int, world_size: int, init_method: str, device: str, timeout_s: float = 120.0) -> str:
    """Joins the group: gloo on CPU, NCCL on CUDA (NVLink SHARP/multicast off: NCCL_NVLS_ENABLE=0). Returns the
    backend."""
    on_gpu = device.startswith("cuda")
    if on_gpu:
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # forced: an inherited 1 would turn multicast on
        torch.cuda.set_device(torch.device(device).index or 0)  # "cuda" in a Ray actor: its one visible GPU
    if init_method.startswith("tcp://127.0.0.1"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback deployments (and gloo side groups)
    backend = "nccl" if on_gpu else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return backend


def all_reduce_max(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


# ------------------------------------------------------------------------------------------- one rank's step
def _observe_slowest(runner: Any) -> None:
    """Makes the runner's latency model observe the slowest rank's forward time: its policy's `observe` (called
    once per non-empty step, after the forward) all-reduces (max) the measured time first. Idempotent; re-applied
    after `set_policy` replaced the policy."""
    if getattr(runner, "defer_learning", False):  # (before the first EP step only: observe not wrapped yet)
        runner.flush_learning()  # a learning left by a step before EP, learned locally
    runner.defer_learning = False  # the learning's all-reduce stays in this step on every rank
    policy = runner.policy
    if getattr(policy, "_observes_slowest", False):
        return
    # hybridspec's speculation gate measures whole steps, which under EP include waiting at the exchanges for the
    # other ranks (and carry capacities sized by the draft caps): it cannot see a plain-decoding win, and ranks
    # would decide apart. Off under EP until the driver decides for the deployment. So is ExtraGate, for the same
    # reason (its rates are whole steps too): the router correction's rule applies ungated on each rank's batch.
    policy.gate = None
    policy.extra_gate = None
    observe = policy.observe

    def observe_slowest(drafter, obs, expert_counts, fold=True):
        runner.ep_forward_ms = obs.forward_ms  # this rank's own
        obs.forward_ms = all_reduce_max(obs.forward_ms, runner.device)
        observe(drafter, obs, expert_counts, fold)

    policy.observe = observe_slowest
    policy._observes_slowest = True


def execute_rank(runner: Any, requests: list, step_rows: Sequence[int] | None = None) -> tuple[Any, float]:
    """One rank's part of an engine step: (StepResult, this rank's target forward ms). Every rank must call it
    every step: with no requests it runs only the exchanges (`idle_forward`) and the step-time reduction.
    `step_rows`: every rank's `step_rows_bound` of its requests this step (the same list on every rank); needed
    with more than one rank."""
    from scheduler.types import StepResult

    _observe_slowest(runner)
    set_step_rows(runner.model, step_rows)
    if requests:
        runner.ep_forward_ms = 0.0
        return runner.execute(requests), runner.ep_forward_ms
    start = time.perf_counter()
    idle_forward(runner.model)
    all_reduce_max(0.0, runner.device)  # the busy ranks' latency-model reduction
    return StepResult(step_ms=(time.perf_counter() - start) * 1e3), 0.0


# ------------------------------------------------------------------------------------------------ the actor
class ExpertParallelActor:
    """One rank of an expert-parallel deployment (wrapped by ray.remote in engine/ep_executor.py). Every step the
    engine calls `execute` on every rank (an empty list included: that rank then only takes part in the
    exchanges)."""

    def __init__(self, factory: Callable[..., Any], rank: int, world_size: int, init_method: str, device: str,
                 placement: Sequence[int] | Sequence[Sequence[int]] | None = None, timeout_s: float = 120.0,
                 num_threads: int | None = None, experts_per_layer: Sequence[int] | None = None):
        """`experts_per_layer` (routed experts of each MoE layer): the rank loads only its share of them
        (`factory(local_experts=...)`: a model larger than one device fits when its experts are spread); None:
        `factory()` loads every expert and the rank then drops the others (its peak holds them all)."""
        if num_threads is not None and not device.startswith("cuda"):
            torch.set_num_threads(num_threads)
        self.rank, self.world_size = rank, world_size
        self.backend = init_group(rank, world_size, init_method, device, timeout_s)
        if experts_per_layer is not None:
            shards = plan_shards(experts_per_layer, rank, world_size, placement)
            self.runner = factory(local_experts=[s.local_experts for s in shards])
        else:
            shards, self.runner = None, factory()
        self.runner.graph_config = None  # no CUDA graphs (yet): the exchange's buffers follow the step's capacities
        self.shards = shard_model_(self.runner.model, placement=placement, shards=shards)
        self.incarnation = uuid.uuid4().hex

    def ready(self) -> tuple[str, int]:
        return self.incarnation, os.getpid()

    def execute(self, requests: list, step_rows: Sequence[int] | None = None) -> tuple[Any, float]:
        """(StepResult, this rank's forward ms). `step_rows`: every rank's row bound this step (execute_rank)."""
        return execute_rank(self.runner, requests, step_rows)

    def release(self, request_ids: list[str]) -> None:
        self.runner.release(request_ids)

    def expert_bytes(self) -> int:
        """Bytes of routed-expert weights this rank holds."""
        return sum(m.experts.gate_up_proj.nbytes + m.experts.down_proj.nbytes for m in moe_layers(self.runner.model))

    def pool_sizes(self) -> tuple[int, int]:
        """(KV pages, GDN slots) this rank allocated, its spare page and slot not counted."""
        return self.runner.cache.num_pages - 1, self.runner.cache.num_slots - 1

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
