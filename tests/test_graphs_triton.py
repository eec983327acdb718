"""The CUDA-graph step path with the Triton kernels (TRITON_INTERPRET=1 on CPU, fp32, a tiny model): the padded
static batches of workers/graphs.py, with the kernels taking the buckets' size hints instead of the real host
lengths exactly as under capture on the GPU, give the same greedy tokens as the eager reference path.

Run as a script by the test below (the interpreter must be set before triton is imported); prints one JSON line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from interp import run_interpreted  # noqa: E402  (tests/ is on sys.path under pytest)

ROOT = Path(__file__).resolve().parents[1]

PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [9, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
MAX_NEW = [7, 5, 6]


def _tiny_dir(root: Path) -> Path:
    import torch  # noqa: F401

    from engine.default_model import DEFAULT_CONFIG
    from engine.tokenizer import write_byte_tokenizer
    from workers.config import ModelConfig
    from workers.model import HybridModel
    from workers.random_init import init_random_
    from workers.weights import save_weights

    cfg = dict(DEFAULT_CONFIG, hidden_size=32, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
               num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=1,
               linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4,
               num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
               eos_token_id=None)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg))
    save_weights(init_random_(HybridModel(ModelConfig.from_dict(cfg)), 5, matrix_gain=2.0), root)
    write_byte_tokenizer(root)
    return root


def main() -> None:
    import tempfile

    import torch

    torch.set_num_threads(1)
    from engine import LLM, SamplingParams

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = str(_tiny_dir(Path(tmp) / "m"))
        params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in MAX_NEW]
        reference = [r.token_ids for r in LLM(model=model).generate(PROMPTS, params)]
        llm = LLM(model=model, spec="replay", policy="fixed", max_verify_len=3, replay_acceptance=0.6,
                  max_running=4, max_model_len=64)
        for p, ref in zip(PROMPTS[:2], reference[:2]):
            llm.set_replay_reference(p, ref)
        runner = llm.engine.executor.runner
        assert runner.enable_graphs(4, 64 // llm.engine.config.page_size + 1, warm=False, capture=False) is None
        results = llm.generate(PROMPTS, params)
        out["equal"] = [r.token_ids for r in results] == reference
        out["drafted"] = sum(r.stats.draft_tokens for r in results)
        out["accepted"] = sum(r.stats.accepted_tokens for r in results)
        out["buckets"] = sorted({k.max_block for k in runner.step_graphs().graphs})
    print(json.dumps(out))


def test_graph_padding_with_triton_kernels_is_lossless():
    out = run_interpreted(__file__, timeout=600)
    assert out["equal"], out
    assert out["drafted"] > 0 and out["buckets"] == [1, 4], out


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
