"""Plots an e2e_hybrid.py result: tokens/s against the device KV pool size, one line per mode, and the bound
never + ideal_gain (what the CPU's measured attention bandwidth could add), never + the staggered plan's bound
(e2e_hybrid.staggered_bound) where the result has it, and HF generate with its offloaded cache where the result
has it. One PNG per shape; a hollow point: that mode's window decoded no token from the host pool.

    python benchmarks/plot_hybrid.py benchmarks/results/e2e_hybrid/<date>_<machine>.json [more results of the same run]

--steady plots each mode's steady-state tokens/s (e2e_hybrid.steady_tokens_per_s: every window token charged
its request's prefill, the window's own prefill taken out), computed from the steps where a result predates it.
Rows cut short after their modes (partial) are plotted without the bounds they lack; results of different
machines plotted together compare only loosely (the CPU's bandwidth differs between device hosts).

--series "LABEL=MODE|MODE" (repeatable) plots one line from whichever listed mode each row has, the first
listed that it has (tables whose A/B modes were named differently, e.g. by their suffixes); with it only never
and the series are plotted.
"""
import argparse
import gzip
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


def parse_series(specs):
    """[(label, [modes, in order of preference])] from "LABEL=MODE|MODE" strings."""
    series = []
    for spec in specs:
        label, sep, modes = spec.partition("=")
        if not sep or not label or not modes:
            raise SystemExit(f"--series {spec!r}: expected LABEL=MODE|MODE")
        series.append((label, modes.split("|")))
    return series


def add_series(row, series):
    """The row with each series' label standing for the first of its modes the row has (in its modes and its
    steady-state figures); a row with none of them gets no point on that line."""
    for label, modes in series:
        mode = next((m for m in modes if m in row["modes"]), None)
        if mode is None:
            continue
        row["modes"][label] = row["modes"][mode]
        if row.get("steady_tokens_per_s") and mode in row["steady_tokens_per_s"]:
            row["steady_tokens_per_s"][label] = row["steady_tokens_per_s"][mode]
        if row.get("steps") and mode in row["steps"]:
            row["steps"][label] = row["steps"][mode]
    return row


def tokens_per_s(row, steady: bool):
    """Mode -> the row's tokens/s: the window's own, or its steady-state figure."""
    if not steady:
        return {m: r["tokens_per_s"] for m, r in row["modes"].items()}
    if row.get("steady_tokens_per_s"):
        return row["steady_tokens_per_s"]
    import e2e_hybrid  # (torch and the engine: only where an older result needs its figures computed)
    runs = {m: dict(r, steps=row["steps"][m]) for m, r in row["modes"].items()}
    return e2e_hybrid.steady_tokens_per_s(runs, row["prompt"], row["new_tokens"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("result", nargs="+", help="JSON written by benchmarks/e2e_hybrid.py --out")
    parser.add_argument("--steady", action="store_true", help="plot the steady-state tokens/s (see above)")
    parser.add_argument("--out", default=None, help="PNG path (default: the first result's path, .png, per shape)")
    parser.add_argument("--series", action="append", default=[],
                        help='"LABEL=MODE|MODE": one line from whichever of those modes each row has (see above)')
    args = parser.parse_args()
    series = parse_series(args.series)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = []
    for path in args.result:
        with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:  # large results are gzipped
            results.append(json.load(f))
    for result in results:  # the run's prompt and new tokens on each row (the steady figures need them)
        for row in result["rows"]:
            for key in ("prompt", "new_tokens"):
                row.setdefault(key, result.get("args", {}).get(key))
    rows = [add_series(row, series) for row in rows_of(results)]
    if not rows:
        raise SystemExit(f"{', '.join(args.result)}: no row with a finished mode")
    by_shape = defaultdict(list)
    for row in rows:
        by_shape[row["shape"]].append(row)
    for shape, shape_rows in by_shape.items():
        shape_rows.sort(key=lambda r: r["device_gib"])
        pools = [r["device_gib"] for r in shape_rows]
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        if series:  # never and the series, each where its rows have it
            modes = [m for m in ["never"] + [label for label, _ in series] if any(m in r["modes"] for r in shape_rows)]
        else:  # every mode that all the rows ran
            modes = [m for m in shape_rows[0]["modes"] if all(m in r["modes"] for r in shape_rows)]
        rates = [tokens_per_s(r, args.steady) for r in shape_rows]
        hollow = False
        for mode in modes:
            have = [(r, t) for r, t in zip(shape_rows, rates) if mode in t]
            line, = ax.plot([r["device_gib"] for r, _ in have], [t[mode] for _, t in have], marker="o", label=mode)
            idle = [(r["device_gib"], t[mode]) for r, t in have
                    if mode != "never" and not r["modes"][mode].get("host_tokens")]
            if idle:  # no host token in the window: never's plan ran, its gap to never is no host gain
                ax.plot(*zip(*idle), marker="o", linestyle="none", markerfacecolor="white",
                        markeredgecolor=line.get_color())
                hollow = True
        bound = [(r["device_gib"], t["never"] + r["ideal_gain"]) for r, t in zip(shape_rows, rates)
                 if "never" in r["modes"] and r.get("ideal_gain")]
        if bound:
            ax.plot(*zip(*bound), linestyle="--", color="gray", label="never + ideal_gain")
        # e2e_hybrid.staggered_bound: what the staggered design can add at most (one lane: the engine's default)
        reach = [(r["device_gib"], t["never"] + (r.get("staggered_bound_1lane") or r["staggered_bound"])["gain"])
                 for r, t in zip(shape_rows, rates) if "never" in r["modes"] and (r.get("staggered_bound_1lane")
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
        ax.set_ylabel("tokens/s, each token charged its prefill" if args.steady else "tokens/s (steady-state window)")
        machine = results[0].get("machine", {})
        dates = sorted({r.get("date", "")[:10] for r in results})
        ax.set_title(f"{shape}: hybrid decode, {machine.get('gpu', '?')}, {', '.join(dates)}")
        ax.set_xticks(pools)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        stem = os.path.splitext(args.out or args.result[0])[0]
        out = stem + (f"_{shape}.png" if len(by_shape) > 1 else ".png")  # one file per shape
        fig.savefig(out, dpi=120)
        plt.close(fig)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
