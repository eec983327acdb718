"""Plot of an e2e.py result: speedup over ar (decode phase) vs replay acceptance, one line per concurrency,
one panel per policy (fixed-best = the best fixed K of each cell).

    python bench/plot_e2e.py bench/results/e2e_40layers_graphs_run2.json bench/results/e2e_speedup.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.e2e import speedup_table  # noqa: E402


def plot(result_json: str, out_png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(result_json).read_text())
    cells = speedup_table(data["rows"])
    for c in cells:  # fixed-best is (speedup, policy)
        if isinstance(c.get("fixed-best"), (list, tuple)):
            c["fixed-best"] = c["fixed-best"][0]
    policies = [p for p in ("fixed-best", "fixed16", "budget", "hybridspec") if any(p in c for c in cells)]
    concurrencies = sorted({c["concurrency"] for c in cells})
    fig, axes = plt.subplots(1, len(policies), figsize=(4 * len(policies), 3.4), sharey=True)
    for ax, policy in zip(axes, policies):
        for conc in concurrencies:
            pts = sorted((c["acceptance"], c[policy]) for c in cells if c["concurrency"] == conc and policy in c)
            ax.plot([a for a, _ in pts], [s for _, s in pts], marker="o", label=f"concurrency {conc}")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_title(policy)
        ax.set_xlabel("replay acceptance")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("decode tok/s over ar")
    axes[-1].legend(fontsize=8)
    meta = data["meta"]
    fig.suptitle(f"{meta['layers']}-layer Qwen3.6-35B-A3B-shaped bench model, {meta['device']}, commit {meta['commit']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)


if __name__ == "__main__":
    plot(sys.argv[1], sys.argv[2])
