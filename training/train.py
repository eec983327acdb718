"""Train the embedded model pair on real text: the CPython standard library sources of this machine.

    python -m training.train --out models --device cuda --steps 2000     # on the H200 (a few minutes)
    python -m training.train --out /tmp/m --steps 20 --tiny              # a smoke run on CPU

Reproducible from --seed: a byte-level BPE tokenizer (--vocab, default 8192) trained with `tokenizers`, then a
GDN + MoE target (both layer kinds, MoE with shared expert) and a small draft model of the same family, trained with
transformers' own Qwen3.5-MoE implementation (the engine's correctness oracle) and written with save_pretrained,
so this engine and transformers both load them. Every 20th source file (sorted by path) is held out; held-out
perplexity of each model is written to `<out>/metrics.json`. Not trained here: an MTP head (transformers has no
MTP training path; the engine's MTP drafter needs `mtp.*` tensors).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sysconfig
import time
from pathlib import Path

import torch

EOS = "<|endoftext|>"
HOLDOUT_EVERY = 20
MAX_MODEL_BYTES = 16 * 1024 * 1024  # everything under models/ together (the GPU machine gets the whole tree)


def source_files(root: Path | None = None) -> tuple[list[Path], list[Path]]:
    """(train, held-out) .py files of the standard library, deterministic for a given Python install."""
    root = root or Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.stat().st_size < 200_000)
    held = files[::HOLDOUT_EVERY]
    held_set = set(held)
    return [f for f in files if f not in held_set], held


def read_texts(files: list[Path], limit_bytes: int) -> list[str]:
    texts, total = [], 0
    for f in files:
        try:
            t = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(t)
        total += len(t)
        if total >= limit_bytes:
            break
    return texts


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    return tok


def model_config(vocab: int, eos_id: int, hidden: int, layers: int, experts: int, inner: int):
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

    kinds = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    if "full_attention" not in kinds:
        kinds[-1] = "full_attention"
    if "linear_attention" not in kinds:
        kinds[0] = "linear_attention"
    heads = max(2, hidden // 64)
    return Qwen3_5MoeTextConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, layer_types=kinds,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=hidden // heads,
        linear_num_key_heads=max(1, heads // 2), linear_num_value_heads=heads, linear_key_head_dim=hidden // heads,
        linear_value_head_dim=hidden // heads, num_experts=experts, num_experts_per_tok=2,
        moe_intermediate_size=inner, shared_expert_intermediate_size=inner, max_position_embeddings=4096,
        tie_word_embeddings=True, eos_token_id=eos_id, rms_norm_eps=1e-6)


def batches(ids: torch.Tensor, seq_len: int, batch: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, ids.numel() - seq_len - 1, (batch,), generator=gen)
        yield torch.stack([ids[s:s + seq_len] for s in starts])


def train_model(model, data: torch.Tensor, steps: int, seq_len: int, batch: int, lr: float, device: str,
                seed: int, log_every: int = 50) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, steps // 20)) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    losses = []
    model.train()
    it = batches(data, seq_len, batch, gen)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else torch.autocast("cpu",
                                                                                                         enabled=False)
    for step in range(steps):
        x = next(it).to(device)
        with amp:
            loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss))
        if log_every and step % log_every == 0:
            print(f"step {step} loss {losses[-1]:.3f}", flush=True)
    model.eval()
    return losses


@torch.no_grad()
def perplexity(model, data: torch.Tensor, seq_len: int, device: str, max_windows: int = 64) -> float:
    total, count = 0.0, 0
    for s in range(0, min(data.numel() - seq_len - 1, max_windows * seq_len), seq_len):
        x = data[s:s + seq_len][None].to(device)
        total += float(model(input_ids=x, labels=x).loss) * (seq_len - 1)
        count += seq_len - 1
    return math.exp(total / max(count, 1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--draft-steps", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--data-mb", type=float, default=40.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="toy sizes for a smoke run")
    ap.add_argument("--stdlib", default=None, help="source tree (default: this Python's standard library)")
    args = ap.parse_args(argv)
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    out = Path(args.out)
    t0 = time.time()
    train_files, held_files = source_files(Path(args.stdlib) if args.stdlib else None)
    limit = int(args.data_mb * 1e6)
    train_texts, held_texts = read_texts(train_files, limit), read_texts(held_files, max(limit // 20, 100_000))
    vocab = 512 if args.tiny else args.vocab
    tok = train_tokenizer(train_texts, vocab, out / "target")
    eos = tok.token_to_id(EOS)
    encode = lambda texts: torch.tensor([i for t in texts for i in tok.encode(t).ids + [eos]], dtype=torch.long)  # noqa: E731
    train_ids, held_ids = encode(train_texts), encode(held_texts)
    sizes = {"target": (64, 4, 8, 64) if args.tiny else (256, 8, 16, 256),
             "draft": (32, 2, 4, 32) if args.tiny else (128, 2, 8, 128)}
    metrics = {"train_tokens": train_ids.numel(), "heldout_tokens": held_ids.numel(), "vocab": tok.get_vocab_size(),
               "train_files": len(train_files), "heldout_files": len(held_files), "seed": args.seed}
    for name, (hidden, layers, experts, inner) in sizes.items():
        cfg = model_config(tok.get_vocab_size(), eos, hidden, layers, experts, inner)
        model = Qwen3_5MoeForCausalLM(cfg).to(args.device)
        steps = args.steps if name == "target" else (args.draft_steps or args.steps)
        losses = train_model(model, train_ids, steps, args.seq_len, args.batch, args.lr, args.device, args.seed)
        model = model.float().cpu()
        metrics[name] = {"params": sum(p.numel() for p in model.parameters()), "steps": steps,
                         "first_loss": losses[0], "last_loss": sum(losses[-10:]) / len(losses[-10:]),
                         "heldout_ppl": perplexity(model, held_ids, args.seq_len, "cpu")}
        model.save_pretrained(out / name)
        if name == "draft":
            (out / "draft" / "tokenizer.json").write_bytes((out / "target" / "tokenizer.json").read_bytes())
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    metrics["bytes"], metrics["seconds"] = total, time.time() - t0
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    print(json.dumps(metrics))
    if total > MAX_MODEL_BYTES:
        print(f"warning: {total} bytes written, more than the {MAX_MODEL_BYTES} allowed under models/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
