"""Loading and saving safetensors checkpoints in the Hugging Face layouts of both model families.

Accepted layouts (converted to workers.model's canonical one):
- experts per expert (`mlp.experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`, what transformers'
  save_pretrained writes) or fused (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]);
- Qwen3-Next GDN projections `in_proj_qkvz` / `in_proj_ba` (grouped per key head) or Qwen3.5's split
  `in_proj_qkv` / `in_proj_z` / `in_proj_b` / `in_proj_a`;
- the multimodal prefix `model.language_model.` (read as `model.`); `mtp.*` (the MTP head, read by its
  drafter) and `model.visual.*` are not part of the decoder and are skipped.
Any other missing, unexpected or mis-shaped tensor is an error that names it. safetensors only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from workers.config import ModelConfig, lfs_pointer_hint
from workers.model import HybridModel, local_expert_rows, put_experts_

SKIPPED_PREFIXES = ("mtp.", "model.visual.")
_EXPERT_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class WeightsError(ValueError):
    """The checkpoint does not match the config: names every missing, unexpected or mis-shaped tensor."""


class Checkpoint:
    """Tensor names -> lazily read tensors, over `model.safetensors` or a sharded index. Every file's header is read
    up front: a truncated, corrupt or missing file, or an index naming a tensor its shard lacks, is a WeightsError
    naming the file (and the tensor)."""

    def __init__(self, model_dir: str | Path):
        root = Path(model_dir)
        index = root / "model.safetensors.index.json"
        single = root / "model.safetensors"
        self._handles: dict[Path, object] = {}
        if index.is_file():
            files = {name: root / shard for name, shard in self._weight_map(index).items()}
            for shard in sorted(set(files.values())):
                if not shard.is_file():
                    named = sorted(n for n, f in files.items() if f == shard)
                    raise FileNotFoundError(f"{index}: shard {shard.name} (holding {len(named)} tensors, e.g. "
                                            f"{named[0]!r}) is not in the model directory")
                held = set(self._open(shard).keys())
                absent = sorted(n for n, f in files.items() if f == shard and n not in held)
                if absent:
                    raise WeightsError(f"{index} maps {len(absent)} tensors to {shard.name}, which does not hold them "
                                       f"(e.g. {absent[0]!r}): a stale index or a wrong shard")
        elif single.is_file():
            files = {name: single for name in self._open(single).keys()}
        else:
            found = sorted(p.name for p in root.glob("*.bin")) + sorted(p.name for p in root.glob("*.pt*"))
            hint = f" (found {found}: pickle checkpoints are not loaded; convert them to safetensors)" if found else ""
            raise FileNotFoundError(f"model directory {root}: no model.safetensors or model.safetensors.index.json{hint}")
        self._files = {self._canonical(n): path for n, path in files.items()}
        self._raw_names = {self._canonical(n): n for n in files}

    @staticmethod
    def _weight_map(index: Path) -> dict[str, str]:
        try:
            data = json.loads(index.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise WeightsError(f"{index}: not valid JSON ({e}){lfs_pointer_hint(index)}") from e
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) and v for k, v in weight_map.items()):
            raise WeightsError(f"{index}: needs a \"weight_map\" object of tensor name -> shard file name")
        return weight_map

    def _open(self, path: Path):
        if path not in self._handles:
            try:
                self._handles[path] = safe_open(str(path), "pt")
            except (SafetensorError, OSError) as e:
                raise WeightsError(f"{path}: not a readable safetensors file ({e}); a partial download? "
                                   f"{lfs_pointer_hint(path)}".rstrip()) from e
        return self._handles[path]

    @staticmethod
    def _canonical(name: str) -> str:
        return "model." + name[len("model.language_model."):] if name.startswith("model.language_model.") else name

    def names(self) -> set[str]:
        return set(self._files)

    def shape(self, name: str) -> list[int]:
        return list(self._open(self._files[name]).get_slice(self._raw_names[name]).get_shape())

    def get(self, name: str) -> Tensor:
        path = self._files[name]
        try:
            return self._open(path).get_tensor(self._raw_names[name])
        except SafetensorError as e:
            raise WeightsError(f"{path}: tensor {self._raw_names[name]!r} could not be read ({e})") from e


def _qwen3_next_gdn_sources(cfg: ModelConfig, prefix: str) -> dict[str, Callable]:
    """Qwen3-Next stores q, k, v, z (and b, a) grouped per key head; split them into the canonical rows."""
    hk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = cfg.linear_num_value_heads // hk

    def qkvz(ck: Checkpoint) -> tuple[Tensor, Tensor]:
        w = ck.get(f"{prefix}.in_proj_qkvz.weight")  # [hk * (2dk + 2 r dv), H]
        w = w.view(hk, 2 * dk + 2 * r * dv, -1)
        q, k, v, z = torch.split(w, [dk, dk, r * dv, r * dv], dim=1)
        flat = lambda t: t.reshape(-1, w.shape[-1])  # noqa: E731
        return torch.cat([flat(q), flat(k), flat(v)]), flat(z)

    def ba(ck: Checkpoint) -> tuple[Tensor, Tensor]:
        w = ck.get(f"{prefix}.in_proj_ba.weight").view(hk, 2 * r, -1)  # [hk * 2r, H]
        b, a = torch.split(w, [r, r], dim=1)
        return b.reshape(-1, w.shape[-1]), a.reshape(-1, w.shape[-1])

    return {
        f"{prefix}.in_proj_qkv.weight": lambda ck: qkvz(ck)[0],
        f"{prefix}.in_proj_z.weight": lambda ck: qkvz(ck)[1],
        f"{prefix}.in_proj_b.weight": lambda ck: ba(ck)[0],
        f"{prefix}.in_proj_a.weight": lambda ck: ba(ck)[1],
    }


def _has_fused_experts(prefix: str, names: set[str]) -> bool:
    """A layer's experts are read fused when either 3-D tensor is there; otherwise per expert."""
    return f"{prefix}.gate_up_proj" in names or f"{prefix}.down_proj" in names


def _stack(experts: list[Tensor], shape: list[int]) -> Tensor:
    """Per-expert tensors stacked [E_kept, ...]; a rank that keeps none of a layer's experts gets [0, ...]."""
    return torch.stack(experts) if experts else torch.empty(0, *shape[1:])


def _plan(model, ck: Checkpoint) -> tuple[dict[str, Callable], dict[str, list[int]]]:
    """For every model parameter, how to read it; and every checkpoint tensor this reads, with its shape."""
    cfg = model.config
    names = ck.names()
    sources: dict[str, Callable] = {}
    expected: dict[str, list[int]] = {}
    hidden = cfg.hidden_size
    for name, param in model.state_dict().items():
        shape = list(param.shape)
        gdn = re.match(r"^(model\.layers\.\d+\.linear_attn)\.in_proj_(qkv|z|b|a)\.weight$", name)
        experts = re.match(r"^((?:model|mtp)\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$", name)
        split_present = gdn and any(f"{gdn.group(1)}.in_proj_{w}.weight" in names for w in ("qkv", "z", "b", "a"))
        fused_gdn = gdn and (f"{gdn.group(1)}.in_proj_qkvz.weight" in names or f"{gdn.group(1)}.in_proj_ba.weight"
                             in names or (cfg.model_type == "qwen3_next" and not split_present))
        if fused_gdn:
            prefix = gdn.group(1)
            sources[name] = _qwen3_next_gdn_sources(cfg, prefix)[name]
            hk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
            r = cfg.linear_num_value_heads // hk
            expected[f"{prefix}.in_proj_qkvz.weight"] = [hk * (2 * dk + 2 * r * dv), hidden]
            expected[f"{prefix}.in_proj_ba.weight"] = [hk * 2 * r, hidden]
        elif experts and name not in names and not _has_fused_experts(experts.group(1), names):
            prefix, which = experts.groups()
            n_exp, inner = cfg.num_experts, cfg.moe_intermediate_size
            if which == "gate_up_proj":
                for e in range(n_exp):
                    expected[f"{prefix}.{e}.gate_proj.weight"] = [inner, hidden]
                    expected[f"{prefix}.{e}.up_proj.weight"] = [inner, hidden]
                sources[name] = lambda ck, keep=None, p=prefix, n=n_exp, s=shape: _stack([
                    torch.cat([ck.get(f"{p}.{e}.gate_proj.weight"), ck.get(f"{p}.{e}.up_proj.weight")])
                    for e in (range(n) if keep is None else keep)], s)
            else:
                for e in range(n_exp):
                    expected[f"{prefix}.{e}.down_proj.weight"] = [hidden, inner]
                sources[name] = lambda ck, keep=None, p=prefix, n=n_exp, s=shape: _stack(
                    [ck.get(f"{p}.{e}.down_proj.weight") for e in (range(n) if keep is None else keep)], s)
        elif experts:  # fused in the checkpoint: [E, ...] read whole, this rank's rows kept
            expected[name] = shape
            sources[name] = lambda ck, keep=None, n=name: (
                ck.get(n) if keep is None else ck.get(n).index_select(0, torch.tensor(keep, dtype=torch.long)))
        else:
            expected[name] = shape
            sources[name] = lambda ck, n=name: ck.get(n)
    return sources, expected


def load_weights(model: HybridModel, model_dir: str | Path, scope: str = "decoder",
                 local_experts: Sequence[Sequence[int]] | None = None) -> None:
    """Fills every parameter of `model` from the checkpoint in `model_dir` (converting dtype and layout).

    scope "decoder": the model's own tensors (mtp.* skipped); "mtp": only the multi-token-prediction head's.
    `local_experts` (expert parallelism; one id list per MoE layer, the model built with experts_device "meta"):
    each MoE layer's routed experts become only those rows, read from the checkpoint (the full tensors never
    reach the device). A directory with `random_weights.json` (and no safetensors) is a random-weights model:
    the model is filled with the bench model's weights that file names (load_random_weights)."""
    if (Path(model_dir) / RANDOM_WEIGHTS_FILE).is_file():
        stored = [n for n in ("model.safetensors", "model.safetensors.index.json") if (Path(model_dir) / n).is_file()]
        if stored:  # which weights the user meant is not for the loader to guess
            raise WeightsError(f"model directory {model_dir} holds both {RANDOM_WEIGHTS_FILE} (random bench weights) "
                               f"and {stored[0]}: remove {RANDOM_WEIGHTS_FILE} to serve the stored weights")
        load_random_weights(model, model_dir, scope, local_experts)
        return
    keep = local_expert_rows(model, local_experts) if local_experts is not None else {}
    ck = Checkpoint(model_dir)
    sources, expected = _plan(model, ck)
    present = ck.names()
    if scope == "mtp":
        present = {n for n in present if n.startswith("mtp.")}
        if not present:
            raise WeightsError(f"checkpoint {model_dir} has no mtp.* tensors: it ships no multi-token-prediction "
                               "head (use spec 'draft' or 'ngram' with it)")
    problems = []
    for name in sorted(expected):
        if name not in present:
            problems.append(f"missing tensor {name!r} (expected shape {expected[name]})")
        elif ck.shape(name) != expected[name]:
            problems.append(f"tensor {name!r} has shape {ck.shape(name)}, expected {expected[name]}")
    tied_head = model.config.tie_word_embeddings and "lm_head.weight" in present
    for name in sorted(present - set(expected)):
        if (scope == "decoder" and name.startswith(SKIPPED_PREFIXES)) or (tied_head and name == "lm_head.weight"):
            continue
        problems.append(f"unexpected tensor {name!r} (not used by a {model.config.model_type} model with this config)")
    if problems:
        shown = "\n  ".join(problems[:20]) + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        raise WeightsError(f"checkpoint {model_dir} does not match its config.json:\n  {shown}")
    params = model.state_dict()
    with torch.no_grad():
        for name, read in sources.items():
            rows = keep.get(name.rsplit(".", 1)[0])
            if rows is not None:
                put_experts_(model, name, read(ck, rows))
            else:
                params[name].copy_(read(ck).to(params[name].dtype))


RANDOM_WEIGHTS_FILE = "random_weights.json"
RANDOM_WEIGHTS_KINDS = ("bench",)


def read_random_weights_spec(model_dir: str | Path) -> dict:
    """The marker of a random-weights model directory: {"kind": "bench", "routing": "zipf"|"uniform",
    "seed": int, "decisive": bool} (bench/bench_model_dir.py writes it)."""
    path = Path(model_dir) / RANDOM_WEIGHTS_FILE
    try:
        spec = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise WeightsError(f"{path}: cannot read the random-weights marker: {e}") from e
    if not isinstance(spec, dict) or spec.get("kind") not in RANDOM_WEIGHTS_KINDS:
        raise WeightsError(f"{path}: \"kind\" must be one of {RANDOM_WEIGHTS_KINDS}, got {spec!r}")
    seed = spec.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise WeightsError(f"{path}: \"seed\" must be an integer, got {seed!r}")
    return {"kind": spec["kind"], "routing": spec.get("routing", "zipf"), "seed": seed,
            "decisive": bool(spec.get("decisive", False))}


def load_random_weights(model: HybridModel, model_dir: str | Path, scope: str = "decoder",
                        local_experts: Sequence[Sequence[int]] | None = None) -> None:
    """Fills `model` in place with the bench model's random weights (workers/bench_model.fill_bench_weights_),
    made on the model's device: a 40-layer Qwen3.6-35B-A3B-shaped model is ~70 GB, never written to disk."""
    if scope == "mtp":
        raise WeightsError(f"random-weights model {model_dir} has no multi-token-prediction head "
                           "(use spec 'ngram' or 'replay' with it)")
    spec = read_random_weights_spec(model_dir)
    from workers.bench_model import ROUTINGS, fill_bench_weights_

    if spec["routing"] not in ROUTINGS:
        raise WeightsError(f"{Path(model_dir) / RANDOM_WEIGHTS_FILE}: \"routing\" must be one of {ROUTINGS}, "
                           f"got {spec['routing']!r}")
    fill_bench_weights_(model, routing=spec["routing"], seed=spec["seed"], decisive=spec["decisive"],
                        local_experts=local_experts)


def save_weights(model: HybridModel, model_dir: str | Path) -> None:
    """Writes `model.safetensors` in the canonical layout (fused experts, split GDN projections)."""
    tensors = {name: t.detach().contiguous().cpu() for name, t in model.state_dict().items()}
    save_file(tensors, str(Path(model_dir) / "model.safetensors"), metadata={"format": "pt"})
