"""Plots an e2e_hybrid.py result: tokens/s against the device KV pool size, one line per mode, and the bound
never + ideal_gain (what the CPU's measured attention bandwidth could add), never + the staggered plan's bound
(e2e_hybrid.staggered_bound) where the result has it, and HF generate with its offloaded cache where the result
has it. One PNG per shape; a hollow point: that mode's window decoded no token from the host pool.

    python benchmarks/plot_hybrid.py benchmarks/results/e2e_hybrid_<date>_h200.json [more results of the same run]

Rows cut short after their modes (partial) are plotted without the bounds they lack; results of different
machines plotted together compare only loosely (the CPU's bandwidth differs between device hosts).
"""
import argparse
import json
import os
from collections import defaultdict


def rows_of(results):
    """The rows to plot from e2e_hybrid results (one call may hold a shape's pool sizes, or each its own): per
    (shape, pool), the last row, a partial one (a run cut short after its modes) included."""
    rows = {}
    for result in results:
        for row in result["rows"]:
            if row.get("modes"):
                rows[(row["shape"], row["device_gib"])] = row
    return list(rows.values())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("result", nargs="+", help="JSON written by benchmarks/e2e_hybrid.py --out")
    parser.add_argument("--out", default=None, help="PNG path (default: the first result's path, .png, per shape)")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = []
    for path in args.result:
        with open(path) as f:
            results.append(json.load(f))
    rows = rows_of(results)
    if not rows:
        raise SystemExit(f"{', '.join(args.result)}: no row with a finished mode")
    by_shape = defaultdict(list)
    for row in rows:
        by_shape[row["shape"]].append(row)
    for shape, shape_rows in by_shape.items():
        shape_rows.sort(key=lambda r: r["device_gib"])
        pools = [r["device_gib"] for r in shape_rows]
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        modes = [m for m in shape_rows[0]["modes"] if all(m in r["modes"] for r in shape_rows)]
        hollow = False
        for mode in modes:
            line, = ax.plot(pools, [r["modes"][mode]["tokens_per_s"] for r in shape_rows], marker="o", label=mode)
            idle = [(r["device_gib"], r["modes"][mode]["tokens_per_s"]) for r in shape_rows
                    if mode != "never" and not r["modes"][mode].get("host_tokens")]
            if idle:  # no host token in the window: never's plan ran, its gap to never is no host gain
                ax.plot(*zip(*idle), marker="o", linestyle="none", markerfacecolor="white",
                        markeredgecolor=line.get_color())
                hollow = True
        bound = [(r["device_gib"], r["modes"]["never"]["tokens_per_s"] + r["ideal_gain"]) for r in shape_rows
                 if "never" in r["modes"] and r.get("ideal_gain")]
        if bound:
            ax.plot(*zip(*bound), linestyle="--", color="gray", label="never + ideal_gain")
        # e2e_hybrid.staggered_bound: what the staggered design can add at most (one lane: the engine's default)
        reach = [(r["device_gib"], r["modes"]["never"]["tokens_per_s"]
                  + (r.get("staggered_bound_1lane") or r["staggered_bound"])["gain"])
                 for r in shape_rows if "never" in r["modes"] and (r.get("staggered_bound_1lane")
                                                                    or r.get("staggered_bound"))]
        if reach:
            ax.plot(*zip(*reach), linestyle="-.", color="gray", label="never + staggered bound")
        # its decode rate (batch / decode step): the baseline runs fewer tokens than the window (--hf-tokens)
        hf = [(r["device_gib"], r["hf_offloaded"]["decode_tokens_per_s"]) for r in shape_rows
              if (r.get("hf_offloaded") or {}).get("decode_tokens_per_s")]
        if hf:  # HF generate with its offloaded cache, batch = the requests the device pool holds
            ax.plot(*zip(*hf), marker="x", linestyle=":", color="black", label="HF generate, offloaded cache (decode)")
        if hollow:
            ax.plot([], [], marker="o", linestyle="none", markerfacecolor="white", markeredgecolor="gray",
                    label="no host token in the window")
        ax.set_xlabel("device KV pool (GiB)")
        ax.set_ylabel("tokens/s (steady-state window)")
        machine = results[0].get("machine", {})
        dates = sorted({r.get("date", "")[:10] for r in results})
        ax.set_title(f"{shape}: hybrid decode, {machine.get('gpu', '?')}, {', '.join(dates)}")
        ax.set_xticks(pools)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        out = args.out or os.path.splitext(args.result[0])[0] + (f"_{shape}.png" if len(by_shape) > 1 else ".png")
        fig.savefig(out, dpi=120)
        plt.close(fig)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
