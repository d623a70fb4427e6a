"""Plots an e2e_hybrid.py result: tokens/s against the device KV pool size, one line per mode, and the bound
never + ideal_gain (what the CPU's measured attention bandwidth could add), never + the staggered plan's bound
(e2e_hybrid.staggered_bound) where the result has it, and HF generate with its offloaded cache where the result
has it. One PNG per shape.

    python benchmarks/plot_hybrid.py benchmarks/results/e2e_hybrid_<date>_h200.json
"""
import argparse
import json
import os
from collections import defaultdict


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("result", help="JSON written by benchmarks/e2e_hybrid.py --out")
    parser.add_argument("--out", default=None, help="PNG path (default: the result's path, .png, per shape)")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(args.result) as f:
        result = json.load(f)
    rows = [r for r in result["rows"] if not r.get("partial")]
    if not rows:
        raise SystemExit(f"{args.result} has no finished row (a run cut short keeps only partial rows)")
    by_shape = defaultdict(list)
    for row in rows:
        by_shape[row["shape"]].append(row)
    for shape, shape_rows in by_shape.items():
        shape_rows.sort(key=lambda r: r["device_gib"])
        pools = [r["device_gib"] for r in shape_rows]
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        modes = [m for m in shape_rows[0]["modes"] if all(m in r["modes"] for r in shape_rows)]
        for mode in modes:
            ax.plot(pools, [r["modes"][mode]["tokens_per_s"] for r in shape_rows], marker="o", label=mode)
        bound = [r["modes"]["never"]["tokens_per_s"] + r["ideal_gain"] for r in shape_rows if "never" in r["modes"]]
        if len(bound) == len(pools):
            ax.plot(pools, bound, linestyle="--", color="gray", label="never + ideal_gain")
        reach = [r["modes"]["never"]["tokens_per_s"] + r["staggered_bound"]["gain"] for r in shape_rows
                 if "never" in r["modes"] and r.get("staggered_bound")]
        if len(reach) == len(pools):  # e2e_hybrid.staggered_bound: what the staggered design can add at most
            ax.plot(pools, reach, linestyle="-.", color="gray", label="never + staggered bound")
        hf = [(r["device_gib"], r["hf_offloaded"]["tokens_per_s"]) for r in shape_rows
              if (r.get("hf_offloaded") or {}).get("tokens_per_s")]
        if hf:  # HF generate with its offloaded cache, batch = the requests the device pool holds
            ax.plot(*zip(*hf), marker="x", linestyle=":", color="black", label="HF generate, offloaded cache")
        ax.set_xlabel("device KV pool (GiB)")
        ax.set_ylabel("tokens/s (steady-state window)")
        machine = result.get("machine", {})
        ax.set_title(f"{shape}: hybrid decode, {machine.get('gpu', '?')}, {result.get('date', '')[:10]}")
        ax.set_xticks(pools)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        out = args.out or os.path.splitext(args.result)[0] + (f"_{shape}.png" if len(by_shape) > 1 else ".png")
        fig.savefig(out, dpi=120)
        plt.close(fig)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
