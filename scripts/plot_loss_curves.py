"""Plot the loss curves of training runs (their metrics.jsonl) in one PNG, with the mean relative
difference of each run against the first printed in the legend.

    python scripts/plot_loss_curves.py OUT.png RUN_A/metrics.jsonl:label RUN_B/metrics.jsonl:label ...
"""

from __future__ import annotations

import json
import statistics
import sys


def load(path: str) -> dict[int, float]:
    with open(path) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, runs = sys.argv[1], [arg.rsplit(":", 1) for arg in sys.argv[2:]]
    curves = [(label, load(path)) for path, label in runs]
    base = curves[0][1]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, curve in curves:
        common = sorted(set(curve) & set(base))
        rel = statistics.mean(abs(curve[s] - base[s]) / abs(base[s]) for s in common)
        ax.plot(sorted(curve), [curve[s] for s in sorted(curve)],
                label=label if curve is base else f"{label} (mean rel diff {rel:.2%})")
        print(f"{label}: {len(curve)} steps, mean relative difference to {curves[0][0]}: {rel:.4%}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
