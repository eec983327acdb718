"""Train the embedded model pair on real text: the CPython standard library sources of this machine.

The run on the H200 (one command; everything under $OUT/models, 7 files, 15.4 MB; 277 s of work + start-up):
    PYTHONUNBUFFERED=1 PYTHONPATH=. python -m training.train --out $OUT/models --device cuda --time-budget-s 300
A smoke run on CPU (seconds):
    python -m training.train --out /tmp/m --tiny --steps 20 --device cpu

Reproducible from --seed: a byte-level BPE tokenizer (--vocab, default 8192) trained with `tokenizers`, then
- the target: a GDN + MoE model of this engine's architecture (Qwen3.5-MoE layout: 3 Gated-DeltaNet layers to
  1 gated-attention layer, top-2 of 8 experts plus a shared expert, tied embeddings), trained with transformers'
  own Qwen3.5-MoE implementation (the engine's correctness oracle) and written with save_pretrained;
- its MTP head (workers/mtp.py's structure: one full-attention MoE layer on (x_q, h_{q-1}) pairs, predicting
  x_{q+1} through the target's LM head), trained on the frozen target (training/mtp_head.py) and written as
  `mtp.*` tensors into the target's model.safetensors (transformers ignores them: `_keys_to_ignore_on_load_unexpected`);
- a small draft model of the same family and tokenizer.
Drafters learn from the true next tokens and from the target's distribution (--distill weight of a KL term),
since what they are for is agreeing with the target. Weights are written in bfloat16.

Every 20th source file (sorted by path) is held out; `<out>/metrics.json` has the held-out perplexity of target
and draft, the MTP head's held-out top-1 accuracy, how often each drafter's top-1 equals the target's (a
teacher-forced proxy for first-token acceptance), and the held-out files (paths relative to the stdlib, so
bench/acceptance.py on another machine takes its prompts from the same files).

--time-budget-s splits the time left after the tokenizer between target (55%), MTP head (15%) and draft (30%),
keeping a reserve for evaluation and writing; each phase's cosine schedule runs on its share of wall-clock
time (or --steps, whichever ends first), so the run ends on time with every file written (so the step counts,
and the weights, vary a little between runs). Without a budget the run is --steps steps per model: the same
tokenizer, data order and initialisation for a seed (bitwise on CPU; CUDA's index_add_ in the MoE is not
deterministic). transformers is needed at run time (the H200 machine has 5.17; tested here with 5.24).
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
import torch.nn.functional as F

EOS = "<|endoftext|>"
HOLDOUT_EVERY = 20
MAX_MODEL_BYTES = 16 * 1024 * 1024  # everything under models/ together (the GPU machine gets the whole tree)

# (hidden, layers, experts, expert inner, shared-expert inner)
SIZES = {"target": (256, 4, 8, 64, 128), "draft": (128, 2, 4, 64, 64)}
TINY_SIZES = {"target": (64, 4, 8, 32, 64), "draft": (32, 2, 4, 32, 32)}
SHARES = {"target": 0.55, "mtp": 0.15, "draft": 0.30}


def log(msg: str) -> None:
    print(f"[train {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path | None = None) -> tuple[list[Path], list[Path]]:
    """(train, held-out) .py files of the standard library, deterministic for a given Python install."""
    root = root or stdlib_root()
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.stat().st_size < 200_000)
    held = files[::HOLDOUT_EVERY]
    held_set = set(held)
    return [f for f in files if f not in held_set], held


def read_texts(files: list[Path], limit_bytes: float) -> list[str]:
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
    tok.save(str(out_dir / "tokenizer.json"), pretty=False)
    return tok


def model_config(vocab: int, eos_id: int, hidden: int, layers: int, experts: int, inner: int, shared: int):
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
        moe_intermediate_size=inner, shared_expert_intermediate_size=shared, max_position_embeddings=4096,
        tie_word_embeddings=True, eos_token_id=eos_id, bos_token_id=None, pad_token_id=None, rms_norm_eps=1e-6)


class Clock:
    """A phase's progress in [0, 1]: the larger of steps done / max steps and time used / time allotted."""

    def __init__(self, steps: int, seconds: float | None):
        self.steps, self.seconds, self.t0 = steps, seconds, time.time()

    def progress(self, step: int) -> float:
        p = step / max(1, self.steps)
        if self.seconds is not None:
            p = max(p, (time.time() - self.t0) / max(self.seconds, 1e-3))
        return min(p, 1.0)


def lr_at(progress: float, base: float, warmup: float = 0.05) -> float:
    return base * min(1.0, (progress + 1e-3) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def autocast(device: str):
    if device.startswith("cuda"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def windows(ids: torch.Tensor, seq_len: int, batch: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, ids.numel() - seq_len - 1, (batch,), generator=gen)
    return torch.stack([ids[s:s + seq_len] for s in starts])


def kd_loss(logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) per token, averaged."""
    t = F.log_softmax(teacher_logits.float(), dim=-1)
    return F.kl_div(F.log_softmax(logits.float(), dim=-1), t, log_target=True, reduction="batchmean")


def run_phase(name: str, params, loss_fn, data: torch.Tensor, clock: Clock, args, gen: torch.Generator,
              lr: float) -> list[float]:
    """The training loop shared by every phase: AdamW, warmup + cosine on the clock's progress, clipping."""
    params = [p for p in params if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=args.device.startswith("cuda"))
    losses: list[float] = []
    pending: list[torch.Tensor] = []
    step = 0
    log_every = 10 if args.tiny else 50
    while True:
        p = clock.progress(step)
        if p >= 1.0:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(p, lr)
        x = windows(data, args.seq_len, args.batch, gen).to(args.device, non_blocking=True)
        with autocast(args.device):
            loss, shown = loss_fn(x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        pending.append(shown.detach())
        step += 1
        if step % 10 == 0 or step == 1:
            losses.extend(float(v) for v in pending)  # syncs at most every 10 steps
            pending.clear()
        if step % log_every == 0 or step == 1:
            log(f"{name} step {step} loss {losses[-1]:.3f} lr {lr_at(p, lr):.2e} "
                f"({time.time() - clock.t0:.0f}s)")
    losses.extend(float(v) for v in pending)
    log(f"{name}: {step} steps in {time.time() - clock.t0:.1f}s, last loss {losses[-1]:.3f}")
    return losses


def eval_windows(data: torch.Tensor, seq_len: int, max_windows: int) -> torch.Tensor:
    n = min((data.numel() - 1) // seq_len, max_windows)
    return data[:n * seq_len].view(n, seq_len)


@torch.no_grad()
def evaluate(target, draft, head, held: torch.Tensor, args) -> dict:
    """Held-out perplexity of target and draft (fp32), the MTP head's top-1 accuracy on x_{q+1}, and how often
    each drafter's top-1 equals the target's (teacher forced)."""
    w = eval_windows(held, args.seq_len, 32 if args.tiny else 128)
    sums = {k: 0.0 for k in ("t_nll", "d_nll", "mtp_hit", "mtp_agree", "d_agree", "t_hit")}
    n_tok = n_mtp = 0
    for chunk in w.split(8):
        x = chunk.to(args.device)
        out = target.model(input_ids=x)
        h = out.last_hidden_state
        t_logits = F.linear(h, target.model.embed_tokens.weight).float()
        d_logits = draft(input_ids=x).logits.float()
        labels = x[:, 1:]
        sums["t_nll"] += float(F.cross_entropy(t_logits[:, :-1].flatten(0, 1), labels.flatten(), reduction="sum"))
        sums["d_nll"] += float(F.cross_entropy(d_logits[:, :-1].flatten(0, 1), labels.flatten(), reduction="sum"))
        t_top = t_logits.argmax(-1)
        sums["t_hit"] += float((t_top[:, :-1] == labels).sum())
        sums["d_agree"] += float((d_logits[:, :-1].argmax(-1) == t_top[:, :-1]).sum())
        n_tok += labels.numel()
        if head is not None:
            m = head(target.model.embed_tokens(x[:, 1:]), h[:, :-1])  # pair q at index q - 1
            mtp_top = F.linear(m[:, :-1], target.model.embed_tokens.weight).argmax(-1)  # predicts x_{q+1}
            sums["mtp_hit"] += float((mtp_top == x[:, 2:]).sum())
            sums["mtp_agree"] += float((mtp_top == t_top[:, 1:-1]).sum())  # the target's own x_{q+1}
            n_mtp += mtp_top.numel()
    res = {"target_heldout_ppl": math.exp(sums["t_nll"] / n_tok), "draft_heldout_ppl": math.exp(sums["d_nll"] / n_tok),
           "target_heldout_top1": sums["t_hit"] / n_tok, "draft_agrees_with_target_top1": sums["d_agree"] / n_tok, "heldout_eval_tokens": n_tok}
    if head is not None:
        res["mtp_heldout_top1"] = sums["mtp_hit"] / n_mtp
        res["mtp_agrees_with_target_top1"] = sums["mtp_agree"] / n_mtp
    return res


def save_model(model, directory: Path) -> None:
    """save_pretrained in bfloat16, without generation_config.json (config.json, model.safetensors and the
    tokenizer are the whole model; the device machine returns at most 8 files)."""
    model.to(torch.bfloat16).save_pretrained(directory)
    (directory / "generation_config.json").unlink(missing_ok=True)


def write_mtp_tensors(head, target_dir: Path) -> None:
    """Adds the head's `mtp.*` tensors to the target's model.safetensors (one file: what the engine reads)."""
    from safetensors.torch import load_file, save_file

    path = target_dir / "model.safetensors"
    tensors = load_file(str(path))
    tensors.update(head.mtp_tensors(torch.bfloat16))
    save_file(tensors, str(path), metadata={"format": "pt"})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="wall-clock budget for the whole run (tokenizer, three trainings, eval, writing)")
    ap.add_argument("--steps", type=int, default=None,
                    help="max steps per model (default: 20000 with a time budget, else 2000)")
    ap.add_argument("--mtp-steps", type=int, default=None)
    ap.add_argument("--draft-steps", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--distill", type=float, default=0.5, help="weight of the KL-to-target term for drafters")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--data-mb", type=float, default=40.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-mtp", action="store_true", help="skip the MTP head")
    ap.add_argument("--tiny", action="store_true", help="toy sizes for a smoke run")
    ap.add_argument("--stdlib", default=None, help="source tree (default: this Python's standard library)")
    args = ap.parse_args(argv)
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM

    from training.mtp_head import TrainableMTPHead
    from workers.config import ModelConfig

    t0 = time.time()
    deadline = t0 + args.time_budget_s if args.time_budget_s else None
    steps = args.steps or (20000 if deadline else 2000)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    out = Path(args.out)
    root = Path(args.stdlib) if args.stdlib else stdlib_root()
    train_files, held_files = source_files(root)
    limit = args.data_mb * 1e6
    train_texts, held_texts = read_texts(train_files, limit), read_texts(held_files, max(limit / 20, 100_000))
    log(f"{len(train_files)} train files ({sum(map(len, train_texts)) / 1e6:.1f} MB read), {len(held_files)} held "
        f"out, device {args.device}, budget {args.time_budget_s}s")
    vocab = 512 if args.tiny else args.vocab
    tok = train_tokenizer(train_texts, vocab, out / "target")
    eos = tok.token_to_id(EOS)

    def encode(texts: list[str]) -> torch.Tensor:
        return torch.tensor([i for e in tok.encode_batch(texts) for i in e.ids + [eos]], dtype=torch.long)

    train_ids, held_ids = encode(train_texts), encode(held_texts)
    log(f"tokenizer: {tok.get_vocab_size()} tokens; {train_ids.numel()} train / {held_ids.numel()} held-out tokens "
        f"({time.time() - t0:.1f}s)")
    sizes = TINY_SIZES if args.tiny else SIZES

    def allot(phase: str) -> float | None:
        """Seconds for a phase: its share of what is left now among the phases still to run."""
        if deadline is None:
            return None
        reserve = max(5.0, 0.08 * args.time_budget_s)
        left = [p for p in ("target", "mtp", "draft") if p == phase or not done.get(p)]
        if args.no_mtp:
            left = [p for p in left if p != "mtp"]
        share = SHARES[phase] / sum(SHARES[p] for p in left)
        return max(1.0, (deadline - time.time() - reserve) * share)

    done: dict[str, bool] = {}
    metrics: dict = {"train_tokens": train_ids.numel(), "heldout_tokens": held_ids.numel(),
                     "vocab": tok.get_vocab_size(), "train_files": len(train_files), "heldout_files": len(held_files),
                     "heldout_paths": [str(p.relative_to(root)) for p in held_files], "seed": args.seed,
                     "device": args.device, "torch": torch.__version__}
    if args.device.startswith("cuda"):
        metrics["gpu"] = torch.cuda.get_device_name()
        torch.backends.cuda.matmul.allow_tf32 = True

    # ---- target ----
    cfg = model_config(tok.get_vocab_size(), eos, *sizes["target"])
    target = Qwen3_5MoeForCausalLM(cfg).to(args.device)
    def lm_loss(model):
        def loss(x):
            out_ = model(input_ids=x, labels=x, output_router_logits=True)
            return out_.loss, out_.loss - model.router_aux_loss_coef * out_.aux_loss
        return loss
    losses = run_phase("target", target.parameters(), lm_loss(target), train_ids, Clock(steps, allot("target")),
                       args, gen, args.lr)
    done["target"] = True
    metrics["target"] = {"params": sum(p.numel() for p in target.parameters()), "steps": len(losses),
                         "first_loss": losses[0], "last_loss": sum(losses[-10:]) / len(losses[-10:])}
    target.eval().requires_grad_(False)
    save_model(target, out / "target")
    target.float()  # evaluation and teaching from the weights exactly as written (bf16 values, fp32 math)
    embed = target.model.embed_tokens.weight

    # ---- MTP head on the frozen target ----
    head = None
    if not args.no_mtp:
        head = TrainableMTPHead(ModelConfig.from_dir(out / "target")).to(args.device)
        last_attn = max(i for i, k in enumerate(cfg.layer_types) if k == "full_attention")
        missing = head.mtp.layers[0].load_state_dict(target.model.layers[last_attn].state_dict(), strict=False)
        if missing.missing_keys:
            log(f"mtp: warm start partial, missing {missing.missing_keys}")

        def mtp_loss(x):
            with torch.no_grad():
                h = target.model(input_ids=x).last_hidden_state
                teacher = F.linear(h[:, 1:-1], embed)  # the target's logits for x_{q+1}
            m = head(F.embedding(x[:, 1:], embed), h[:, :-1])
            logits = F.linear(m[:, :-1], embed)
            ce = F.cross_entropy(logits.float().flatten(0, 1), x[:, 2:].flatten())
            kd = kd_loss(logits.flatten(0, 1), teacher.flatten(0, 1)) if args.distill > 0 else 0.0
            return (1 - args.distill) * ce + args.distill * kd + 0.01 * head.aux_loss(), ce

        losses = run_phase("mtp", head.parameters(), mtp_loss, train_ids,
                           Clock(args.mtp_steps or steps, allot("mtp")), args, gen, args.lr)
        head.eval().requires_grad_(False)
        head.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in head.state_dict().items()})
        write_mtp_tensors(head, out / "target")
        metrics["mtp"] = {"params": sum(p.numel() for p in head.parameters()), "steps": len(losses),
                          "first_loss": losses[0], "last_loss": sum(losses[-10:]) / len(losses[-10:])}
    done["mtp"] = True

    # ---- draft ----
    dcfg = model_config(tok.get_vocab_size(), eos, *sizes["draft"])
    draft = Qwen3_5MoeForCausalLM(dcfg).to(args.device)

    def draft_loss(x):
        out_ = draft(input_ids=x, labels=x, output_router_logits=True)
        ce = out_.loss - draft.router_aux_loss_coef * out_.aux_loss
        if args.distill <= 0:
            return out_.loss, ce
        with torch.no_grad():
            teacher = target(input_ids=x).logits
        kd = kd_loss(out_.logits[:, :-1].flatten(0, 1), teacher[:, :-1].flatten(0, 1))
        return (1 - args.distill) * out_.loss + args.distill * kd, ce

    losses = run_phase("draft", draft.parameters(), draft_loss, train_ids,
                       Clock(args.draft_steps or steps, allot("draft")), args, gen, args.lr)
    done["draft"] = True
    metrics["draft"] = {"params": sum(p.numel() for p in draft.parameters()), "steps": len(losses),
                        "first_loss": losses[0], "last_loss": sum(losses[-10:]) / len(losses[-10:])}
    draft.eval().requires_grad_(False)
    save_model(draft, out / "draft")
    (out / "draft" / "tokenizer.json").write_bytes((out / "target" / "tokenizer.json").read_bytes())
    draft.float()

    # ---- evaluation ----
    t_eval = time.time()
    ev = evaluate(target, draft, head, held_ids, args)
    metrics["target"]["heldout_ppl"] = ev["target_heldout_ppl"]
    metrics["target"]["heldout_top1"] = ev["target_heldout_top1"]
    metrics["draft"]["heldout_ppl"] = ev["draft_heldout_ppl"]
    metrics["draft"]["agrees_with_target_top1"] = ev["draft_agrees_with_target_top1"]
    if head is not None:
        metrics["mtp"]["heldout_top1"] = ev["mtp_heldout_top1"]
        metrics["mtp"]["agrees_with_target_top1"] = ev["mtp_agrees_with_target_top1"]
    metrics["heldout_eval_tokens"] = ev["heldout_eval_tokens"]
    log(f"eval in {time.time() - t_eval:.1f}s: " + json.dumps({k: round(v, 4) for k, v in ev.items()}))
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file() and p.name != "metrics.json")
    metrics["bytes"], metrics["seconds"] = total, time.time() - t0
    metrics["files"] = {str(p.relative_to(out)): p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    summary = {k: v for k, v in metrics.items() if k not in ("heldout_paths", "files")}
    print(json.dumps(summary), flush=True)
    if total > MAX_MODEL_BYTES:
        log(f"warning: {total} bytes written, more than the {MAX_MODEL_BYTES} allowed under models/")
    log(f"done in {time.time() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
