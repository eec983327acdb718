"""Merges bench/e2e.py results, one command on any machine (CPU, seconds):

    python bench/e2e_merge.py --out RUN.json --note "..." A/e2e.json B/e2e.json
        one run split over processes (c=1,4,16 in one, c=64 in another): rows concatenated, meta merged
    python bench/e2e_merge.py --mean --out MEAN.json RUN32.json RUN33.json
        repeated runs of the same cells: each policy's decode tok/s over its own run's ar, averaged over the runs
        (ar = 1.0 in the output), as the README's table and bench/plot_e2e.py take it

A cell or policy missing from a run is an error (a mean over fewer runs would not say so).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.e2e import speedup_table  # noqa: E402


def merge_processes(results: list[dict], note: str | None = None) -> dict:
    """One run whose concurrencies ran in separate processes: rows concatenated; max_new per concurrency and the
    other meta of the first part, wall_s summed, graphs_captured listed per part."""
    if not results:
        raise ValueError("nothing to merge: give at least one e2e.json")
    meta = dict(results[0]["meta"])
    seen: set[int] = set()
    for part in results:
        conc = {r["concurrency"] for r in part["rows"]}
        if conc & seen:
            raise ValueError(f"concurrency {sorted(conc & seen)} is in more than one part: not one run")
        seen |= conc
    meta["max_new"] = {k: v for part in results for k, v in part["meta"].get("max_new", {}).items()}
    meta["wall_s"] = sum(part["meta"].get("wall_s", 0.0) for part in results)
    meta["graphs_captured"] = [part["meta"].get("graphs_captured") for part in results]
    if note is not None:
        meta["note"] = note
    return {"meta": meta, "rows": [r for part in results for r in part["rows"]]}


def mean_of_runs(results: list[dict], note: str | None = None) -> dict:
    """Each policy's speedup over ar (decode tok/s), averaged over the runs cell by cell; rows as e2e.py's with
    decode_tokens_per_s = that mean (ar's = 1.0)."""
    tables = [{(c["concurrency"], c["acceptance"]): c for c in speedup_table(run["rows"])} for run in results]
    keys = set(tables[0])
    for t in tables[1:]:
        if set(t) != keys:
            raise ValueError(f"runs cover different cells: {sorted(keys ^ set(t))}")
    rows = [{"policy": "ar", "concurrency": c, "acceptance": None, "decode_tokens_per_s": 1.0}
            for c in sorted({c for c, _ in keys})]
    for key in sorted(keys):
        policies = [p for p in tables[0][key] if p not in ("concurrency", "acceptance", "fixed-best")]
        for p in policies:
            vals = [t[key].get(p) for t in tables]
            if any(v is None for v in vals):
                raise ValueError(f"policy {p} is missing from a run at concurrency {key[0]}, acceptance {key[1]}")
            rows.append({"policy": p, "concurrency": key[0], "acceptance": key[1],
                         "decode_tokens_per_s": sum(vals) / len(vals)})
    first = results[0]["meta"]
    meta = {"layers": first.get("layers"), "device": first.get("device"),
            "commit": " + ".join(dict.fromkeys(str(r["meta"].get("commit")) for r in results)) + " (mean of runs)",
            "runs": len(results),
            "note": note or "derived: decode_tokens_per_s is each policy's decode tok/s over its run's ar, averaged "
                            "over the runs (ar = 1.0)"}
    return {"meta": meta, "rows": rows}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("inputs", nargs="+", help="e2e.json files")
    ap.add_argument("--out", required=True)
    ap.add_argument("--mean", action="store_true", help="average repeated runs (else: parts of one run)")
    ap.add_argument("--note", default=None)
    args = ap.parse_args(argv)
    results = [json.loads(Path(p).read_text()) for p in args.inputs]
    merged = mean_of_runs(results, args.note) if args.mean else merge_processes(results, args.note)
    Path(args.out).write_text(json.dumps(merged, indent=1))
    for cell in speedup_table(merged["rows"]):
        print(f"c={cell['concurrency']} acc={cell['acceptance']}: " +
              ", ".join(f"{k} {v:.2f}" for k, v in cell.items() if isinstance(v, float) and k != "acceptance"))


if __name__ == "__main__":
    main()
