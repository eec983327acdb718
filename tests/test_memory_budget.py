"""The KV pool's automatic size on a GPU: what the worker will hold (weights, GDN state, a drafter's) is counted
before it loads anything (workers/footprint.py), and the pool gets what the card's free memory leaves after it and
a reserve (engine/core.py plan_kv_pages). Before, the pool took half of the free memory measured before the
weights were loaded, whatever their size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.core import GIB, EngineConfig, EngineCore, plan_kv_pages
from engine.default_model import default_model_dir
from checkpoints import make_qwen3_next, make_qwen35_moe, with_mtp_head
from workers.cache import AttentionKV, GDNState
from workers.config import ModelConfig
from workers.footprint import Footprint, model_footprint, mtp_footprint
from workers.mtp import MTPDrafter
from workers.runner import ModelRunner


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("make", [make_qwen3_next, make_qwen35_moe])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_footprint_is_what_the_loaded_runner_holds(tmp_path, make, dtype):
    model_dir = make(tmp_path / "m")
    cfg = ModelConfig.from_dir(model_dir)
    pages, page_size, slots = 5, 4, 3
    runner = ModelRunner.create(cfg, Path(model_dir), dtype, "cpu", pages, page_size, slots)
    fp = model_footprint(cfg, dtype)
    assert fp.weight_bytes == _bytes(list(runner.model.parameters()) + list(runner.model.buffers()))
    kv = [t for layer in runner.cache.layers if isinstance(layer, AttentionKV) for t in (layer.k, layer.v)]
    state = [t for layer in runner.cache.layers if isinstance(layer, GDNState) for t in (layer.recurrent, layer.conv)]
    assert kv and state
    assert _bytes(kv) == fp.kv_bytes_per_token * page_size * (pages + 1)  # (+1: the graphs' spare page)
    assert _bytes(state) == fp.state_bytes_per_slot * (slots + 1) == runner.cache.gdn_bytes_per_request() * (slots + 1)


def test_mtp_footprint_is_what_the_mtp_drafter_holds(tmp_path):
    model_dir = with_mtp_head(default_model_dir(), tmp_path / "mtp")
    cfg = ModelConfig.from_dir(model_dir)
    runner = ModelRunner.create(cfg, model_dir, torch.float32, "cpu", 4, 16, 2)
    drafter = MTPDrafter(runner.model, model_dir, 4, 16, 2)
    fp = mtp_footprint(cfg, model_dir, torch.float32)
    assert fp.weight_bytes == _bytes(list(drafter.head.parameters()) + list(drafter.head.buffers())) > 0
    kv = [t for layer in drafter.cache.layers if isinstance(layer, AttentionKV) for t in (layer.k, layer.v)]
    assert _bytes(kv) == fp.kv_bytes_per_token * 16 * 5


def test_plan_gives_what_is_left_after_weights_state_and_the_reserve():
    target = Footprint(weight_bytes=70 * GIB, kv_bytes_per_token=20 * 1024, state_bytes_per_slot=64 << 20)
    page_bytes = 20 * 1024 * 16
    # an H200's 139 GiB: a 70 GiB model, 64 requests of 32k tokens (43 GB of KV) fit beside it
    wanted = 64 * 2048
    assert plan_kv_pages(139 * GIB, 140 * GIB, wanted, 16, 64, 32768, target) == wanted
    # twice the context: capped at what is left (free - weights - 65 slots - 14 GiB reserve), not half the card
    room = 139 * GIB - 70 * GIB - 65 * (64 << 20) - 14 * GIB
    assert plan_kv_pages(139 * GIB, 140 * GIB, 2 * wanted, 16, 64, 65536, target) == room // page_bytes
    # a drafter's weights, slots and its own KV per page come off too
    drafter = Footprint(2 * GIB, 4 * 1024, 1 << 20)
    with_drafter = plan_kv_pages(139 * GIB, 140 * GIB, 2 * wanted, 16, 64, 65536, target, drafter, 129)
    assert with_drafter == (room - 2 * GIB - 129 * (1 << 20)) // (page_bytes + 4 * 1024 * 16)
    # a model without attention layers: no KV per page, the pool is what was wanted
    assert plan_kv_pages(139 * GIB, 140 * GIB, 10, 16, 64, 4096, Footprint(GIB, 0, 1 << 20)) == 10


def test_a_model_that_leaves_no_room_for_one_request_is_refused_naming_the_options():
    target = Footprint(weight_bytes=70 * GIB, kv_bytes_per_token=20 * 1024, state_bytes_per_slot=64 << 20)
    with pytest.raises(ValueError, match=r"cuda:0 has 79\.0 GiB free: .* lower max_model_len or max_running"):
        plan_kv_pages(79 * GIB, 80 * GIB, 64 * 2048, 16, 64, 32768, target, device="cuda:0")
    # weights that do not fit whatever the lengths: the advice is more GPUs (and no drafter), not shorter requests
    big = Footprint(weight_bytes=75 * GIB, kv_bytes_per_token=20 * 1024, state_bytes_per_slot=64 << 20)
    with pytest.raises(ValueError, match=r"the weights need 75\.0 GiB and .*expert_parallel") as e:
        plan_kv_pages(79 * GIB, 80 * GIB, 2048, 16, 1, 32768, big, device="cuda:0")
    assert "max_model_len" not in str(e.value) and "spec off" not in str(e.value)
    with pytest.raises(ValueError, match=r"75\.0 GiB \+ 2\.0 GiB for the drafter .*spec off"):
        plan_kv_pages(79 * GIB, 80 * GIB, 2048, 16, 1, 32768, big, Footprint(2 * GIB, 0, 0), 3, device="cuda:0")


def _engine_on_a_fake_gpu(monkeypatch, free: int, total: int, **options) -> EngineCore:
    """EngineCore._auto_num_pages on 'cuda' with the card's memory faked (no worker is built)."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    core = object.__new__(EngineCore)
    core.config = EngineConfig(**options)
    core.model_dir = Path(core.config.model) if core.config.model else default_model_dir()
    core.model_config = ModelConfig.from_dir(core.model_dir)
    core.max_model_len = 4096
    return core


def test_engine_sizes_the_pool_from_the_footprint_on_a_gpu(monkeypatch, tmp_path):
    core = _engine_on_a_fake_gpu(monkeypatch, 16 * GIB, 16 * GIB, max_running=8)
    wanted = 8 * 4096 // 16
    assert core._auto_num_pages(torch.bfloat16, torch.device("cuda")) == wanted
    target = model_footprint(core.model_config, torch.bfloat16)
    # a card whose free memory holds the weights and the reserve, and KV for 3000 pages (one request needs 256,
    # 16 of them 4096)
    page_bytes = target.kv_bytes_per_token * 16
    free = target.weight_bytes + 17 * target.state_bytes_per_slot + 4 * GIB + 3000 * page_bytes
    core = _engine_on_a_fake_gpu(monkeypatch, free, 16 * GIB, max_running=16)
    assert core._auto_num_pages(torch.bfloat16, torch.device("cuda")) == 3000
    # the MTP head's weights, slots and KV come off it as well
    core = _engine_on_a_fake_gpu(monkeypatch, free, 16 * GIB, max_running=16, spec="mtp",
                                 model=str(with_mtp_head(default_model_dir(), tmp_path / "mtp")))
    mtp = mtp_footprint(core.model_config, core.model_dir, torch.bfloat16)
    left = 3000 * page_bytes - mtp.weight_bytes - 17 * mtp.state_bytes_per_slot
    assert 256 <= core._auto_num_pages(torch.bfloat16, torch.device("cuda")) == left // (
        page_bytes + mtp.kv_bytes_per_token * 16) < 3000
    # not even one request of max_model_len: refused at start, not an out-of-memory error in the worker
    free = target.weight_bytes + 9 * target.state_bytes_per_slot + 4 * GIB + 100 * page_bytes
    core = _engine_on_a_fake_gpu(monkeypatch, free, 16 * GIB, max_running=8)
    with pytest.raises(ValueError,
                       match=r"cuda has 4\.0 GiB free: .* MiB .* less than one request of max_model_len 4096"):
        core._auto_num_pages(torch.bfloat16, torch.device("cuda"))


def test_an_expert_parallel_rank_sizes_its_own_pool_for_its_share_of_the_requests(monkeypatch):
    """Under expert parallelism each rank holds the KV and GDN state of its share of max_running only: its pool
    wants pages for that share, and the GDN state it sets aside is that share's."""
    target = model_footprint(ModelConfig.from_dir(default_model_dir()), torch.bfloat16, 2)
    page_bytes = target.kv_bytes_per_token * 16
    free = target.weight_bytes + 5 * target.state_bytes_per_slot + 4 * GIB + 1500 * page_bytes
    core = _engine_on_a_fake_gpu(monkeypatch, free, 16 * GIB, max_running=8, executor="ray", expert_parallel=2)
    assert core._auto_num_pages(torch.bfloat16, torch.device("cuda"), 4) == 1024  # 4 requests of 4096 tokens
    core = _engine_on_a_fake_gpu(monkeypatch, free, 16 * GIB, max_running=16, executor="ray", expert_parallel=2)
    # 9 slots' GDN state, not 5: 4 slots' bytes less room for pages
    assert core._auto_num_pages(torch.bfloat16, torch.device("cuda"), 8) == (
        1500 * page_bytes - 4 * target.state_bytes_per_slot) // page_bytes < 1500
    # too small for one request: the message counts the rank's share, and says it is one
    free = target.weight_bytes + 5 * target.state_bytes_per_slot + 4 * GIB + 100 * page_bytes
    core = _engine_on_a_fake_gpu(monkeypatch, free, 16 * GIB, max_running=8, executor="ray", expert_parallel=2)
    with pytest.raises(ValueError, match=r"the GDN state of 4 \(this rank's share of max_running 8\) requests"):
        core._auto_num_pages(torch.bfloat16, torch.device("cuda"), 4)


def test_an_expert_parallel_rank_counts_its_share_of_the_experts(tmp_path):
    """ModelRunner.create(local_experts=...) keeps at most ceil(E / N) experts a layer on a rank: the footprint
    counts the largest rank's share (and every non-expert weight in full)."""
    from workers.expert_parallel import plan_shards

    model_dir = make_qwen35_moe(tmp_path / "m")
    cfg = ModelConfig.from_dir(model_dir)
    experts_per_layer = [cfg.num_experts for moe in cfg.moe_layers if moe]
    for world in (2, 3):
        rank0 = [s.local_experts for s in plan_shards(experts_per_layer, 0, world)]  # (rank 0 gets the remainder)
        model = ModelRunner.create(cfg, model_dir, torch.bfloat16, "cpu", 4, 16, 2, local_experts=rank0).model
        assert model_footprint(cfg, torch.bfloat16, world).weight_bytes == _bytes(
            list(model.parameters()) + list(model.buffers())) < model_footprint(cfg, torch.bfloat16).weight_bytes
