"""The `hybridspec` command line.

    hybridspec generate PROMPT [--model DIR] [--device cpu|cuda] [--dtype float32|bfloat16] [sampling options]
"""

from __future__ import annotations

import argparse
import sys

from scheduler.types import MAX_NEW_TOKENS, InvalidRequest, SamplingParams


def _add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--spec", default="off", choices=["off", "ngram", "draft", "mtp", "replay"],
                   help="speculative decoding method (default off)")
    p.add_argument("--policy", default="hybridspec", choices=["ar", "fixed", "budget", "hybridspec"],
                   help="verification-length policy (default hybridspec)")
    p.add_argument("--max-verify-len", type=int, default=16, help="longest verification, 1..16 (default 16)")
    p.add_argument("--draft-model", default=None, help="draft model directory (with --spec draft)")


def _add_sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64, help=f"1..{MAX_NEW_TOKENS} (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridspec", description="Serving engine for hybrid GDN + MoE models.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion for PROMPT and stream it to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help="model directory (default: the embedded default model)")
    _add_model_options(gen)
    _add_sampling_options(gen)
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.llm import LLM  # heavy import (torch) only when needed

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_new_tokens=args.max_new_tokens, stop=list(args.stop), seed=args.seed,
                            ignore_eos=args.ignore_eos)
    llm = LLM(model=args.model, device=args.device, dtype=args.dtype, spec=args.spec, policy=args.policy,
              max_verify_len=args.max_verify_len, draft_model=args.draft_model)
    out = sys.stdout
    out.write(args.prompt)
    last = None
    for last in llm.stream(args.prompt, params):
        out.write(last.new_text)
        out.flush()
    out.write("\n")
    if last is not None:
        print(f"[{len(llm.last_stream_tokens)} tokens, finish_reason={last.finish_reason}]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return cmd_generate(args)
    except (InvalidRequest, ValueError, FileNotFoundError) as e:
        print(f"hybridspec: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
