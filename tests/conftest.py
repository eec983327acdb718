"""Shared fixtures: tiny random checkpoints written by transformers (tests/checkpoints.py), the transformers
oracle for each, and our model loaded from each. Everything heavy is session-scoped and built lazily, on first
use, so test files that do not ask for a checkpoint never import transformers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# The test models are tiny: one thread avoids oversubscribing CI's 2 cores (2 threads on a busy 2-core
# machine made a 70-token forward ~100x slower than 1 thread).
torch.set_num_threads(1)
# Tests that use the embedded default model rely on the random byte-tokenizer model's exact shapes; the trained
# pair under models/ (what users get) is tested by tests/test_training.py, which asks for it explicitly.
os.environ.setdefault("HYBRIDSPEC_DEFAULT_MODEL", "random")

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT), str(ROOT / "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# name -> (how to build it, the checkpoint whose transformers model is its oracle)
# The derived variants hold exactly the weights of their source, in another layout.
CHECKPOINTS = {
    "qwen3_next": ("make_qwen3_next", None),
    "qwen35_moe": ("make_qwen35_moe", None),
    # Qwen3-Next options the default one does not exercise: top-k weights not renormalised, MoE every other
    # layer (decoder_sparse_step=2), attention biases, half-width partial rotary, another rope theta.
    "qwen3_next_alt": ("make_qwen3_next_alt", None),
    "qwen35_moe_tied": ("make_qwen35_moe_tied", None),
    "qwen3_next_sharded": ("shard", "qwen3_next"),
    "qwen35_moe_fused_experts": ("fuse_experts", "qwen35_moe"),
    "qwen35_moe_language_model_prefix": ("add_language_model_prefix", "qwen35_moe"),
}


class Checkpoints:
    """Lazily built checkpoint directories, their transformers oracles and our loaded models (all cached)."""

    def __init__(self, root: Path):
        self.root = root
        self._dirs: dict[str, Path] = {}
        self._hf: dict[str, object] = {}
        self._ours: dict[str, object] = {}
        self._hf_logits: dict[tuple, object] = {}

    def path(self, name: str) -> Path:
        if name not in self._dirs:
            import checkpoints as ck

            how, source = CHECKPOINTS[name]
            dst = self.root / name
            if how == "make_qwen3_next":
                ck.make_qwen3_next(dst, seed=0)
            elif how == "make_qwen35_moe":
                ck.make_qwen35_moe(dst, seed=1)
            elif how == "make_qwen3_next_alt":
                ck.make_qwen3_next(
                    dst, seed=2, norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[],
                    attention_bias=True,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5})
            elif how == "make_qwen35_moe_tied":
                ck.make_qwen35_moe(dst, seed=3, tie_word_embeddings=True)
            else:
                getattr(ck, how)(self.path(source), dst)
            self._dirs[name] = dst
        return self._dirs[name]

    def oracle_name(self, name: str) -> str:
        return CHECKPOINTS[name][1] or name

    def hf(self, name: str):
        """The transformers model that is the oracle for checkpoint `name` (loaded with from_pretrained)."""
        name = self.oracle_name(name)
        if name not in self._hf:
            import checkpoints as ck

            self._hf[name] = ck.load_hf(self.path(name))
        return self._hf[name]

    def hf_logits(self, name: str, ids: list[int]):
        """transformers' logits [T, V] for the whole sequence `ids` (one forward, no cache)."""
        import torch

        key = (self.oracle_name(name), tuple(ids))
        if key not in self._hf_logits:
            with torch.no_grad():
                self._hf_logits[key] = self.hf(name)(torch.tensor([ids])).logits[0].float()
        return self._hf_logits[key]

    def ours(self, name: str):
        """Our HybridModel (fp32, CPU) loaded from checkpoint `name` with workers.weights.load_weights."""
        if name not in self._ours:
            import checkpoints as ck

            self._ours[name] = ck.load_ours(self.path(name))
        return self._ours[name]


@pytest.fixture(scope="module")
def single_thread_torch():
    """torch on one intra-op thread for a module: these models are tiny, and on a small shared machine extra
    OpenMP threads only spin against each other (a 70-token forward goes from ~20 ms to seconds)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="session")
def qwen3_next_dir(ckpts) -> Path:
    return ckpts.path("qwen3_next")


@pytest.fixture(scope="session")
def qwen35_moe_dir(ckpts) -> Path:
    return ckpts.path("qwen35_moe")


@pytest.fixture(scope="session")
def tied_dir(ckpts) -> Path:
    return ckpts.path("qwen35_moe_tied")


@pytest.fixture(scope="session")
def sharded_dir(ckpts) -> Path:
    return ckpts.path("qwen3_next_sharded")


@pytest.fixture(scope="session")
def fused_experts_dir(ckpts) -> Path:
    return ckpts.path("qwen35_moe_fused_experts")


@pytest.fixture(scope="session")
def language_model_prefix_dir(ckpts) -> Path:
    return ckpts.path("qwen35_moe_language_model_prefix")
