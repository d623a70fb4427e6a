"""Benchmark of the Triton SiLU-mul and fused MLP kernels vs torch/cuBLAS on one CUDA GPU; the swiglu dispatch table.

    python benchmarks/triton_swiglu.py --out swiglu.json [--quick] [--write-dispatch] [--sections silu_mul,mlp]

Sections:
  silu_mul   silu(gate) * up, bf16, I = 11008/14336, vs F.silu(gate) * up
  mlp        gate/up projections + SiLU-mul (Llama-2-7B 4096->11008, Llama-3-8B 4096->14336, SmolLM2 576->1536),
             bf16, M = 1..512: torch eager (two cuBLAS GEMMs + F.silu * up) vs cuBLAS + silu_mul (one GEMM over a
             merged [2I, H] buffer, or two GEMMs) vs the fused Triton GEMM (best of several configs). Produces
             the swiglu dispatch table (per shape, M and weight form: the fastest path by GPU time, fused only
             when it takes <= FUSED_MARGIN of the best cuBLAS path's time); --write-dispatch stores it in
             apex_compile/kernels/swiglu_dispatch.json (read by apex::swiglu). The chosen paths are timed again
             for the reported apex.swiglu rows.
Timing and the command line: benchmarks/kernel_bench.py. triton_kernels.py runs this with the other families.
"""
import datetime
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton

# kernel_bench first: it puts the repository root on sys.path for the apex_compile imports.
from kernel_bench import DECISION_ROUNDS, DEVICE, DTYPE, Timing, check_close, interleaved_medians, main

from apex_compile.kernels.swiglu import (
    DISPATCH_TABLE_PATH,
    dispatch_key,
    fused_config_fits,
    swiglu_fused_launch,
    swiglu_triton,
)
from apex_compile.ops import silu_mul

SECTIONS = ("silu_mul", "mlp")
FUSED_MARGIN = 0.99
"""The fused MLP kernel enters the dispatch table only where it takes <= 99% of the cuBLAS path's time (the
medians of interleaved rounds decide; a 3% margin kept cuBLAS where the fused kernel was 2.8% faster)."""
SILU_INTER = [11008, 14336]
SILU_TOKENS = {"full": [1, 64, 1024, 4096, 16384], "quick": [1, 1024, 16384]}
MLP_SHAPES = {"llama2-7b": (4096, 11008), "llama3-8b": (4096, 14336), "smollm2-135m": (576, 1536)}
MLP_TOKENS = {"full": [1, 2, 4, 8, 16, 32, 64, 128, 256, 512], "quick": [1, 8, 32, 64, 256, 512]}


def bench_silu_mul(bench, grid):
    for inter in SILU_INTER:
        for tokens in SILU_TOKENS[grid]:
            name = f"I={inter} tokens={tokens}"

            def row(inter=inter, tokens=tokens, name=name):
                bytes_moved = 3 * tokens * inter * 2
                sets = [torch.randn(tokens, 2 * inter, dtype=DTYPE, device=DEVICE) * 3
                        for _ in range(bench.rotation(bytes_moved))]

                def eager(gate_up):
                    gate, up = gate_up.chunk(2, dim=-1)
                    return F.silu(gate) * up

                check_close("silu_mul", silu_mul(sets[0]), eager(sets[0]))
                kernel = bench.measure([lambda s=s: silu_mul(s) for s in sets])
                base = bench.measure([lambda s=s: eager(s) for s in sets])
                def target(r):
                    return ">=85%HBM", r["pct_hbm"] >= 85

                bench.add("silu_mul", name, kernel, base, bytes_moved=bytes_moved,
                          target=target if tokens >= 4096 else None)

            bench.guard("silu_mul", name, row)


# ----------------------------------------------------------------------------------------------------------
# MLP (gate/up + SiLU-mul) and the dispatch table


def fused_candidates(m: int):
    """Fused-GEMM configs tried for `m` rows (BLOCK_N, BLOCK_K, warps, stages), filtered by the smem budget.

    Decode sizes stream the weights: narrow N tiles give every SM several programs (11008 / 32 = 344 tiles on
    132 SMs), deep K tiles and stages keep many weight bytes in flight; fewer stages or shorter K tiles fit
    three or four programs in an SM's shared memory, so 344 tiles run in one wave instead of 1.3. From M = 32,
    M tiles of 16 rows (the decode-size winners; the programs of one N tile run together, so the second reads
    the weight tile from L2) are also tried, and at M = 32 tiles of 64 rows (the M = 64 winners: on Hopper a
    warpgroup MMA is 64 rows tall; session 4 measured M = 64 faster than M = 32 with 32-row tiles)."""
    block_m = min(128, max(16, triton.next_power_of_2(m)))
    if block_m <= 16:
        shapes = [(16, 256, 4, 4), (32, 128, 4, 4), (32, 128, 4, 3), (32, 256, 4, 3), (64, 128, 4, 4),
                  (64, 256, 4, 3)]
    elif block_m <= 64:
        shapes = [(16, 256, 4, 4), (16, 512, 4, 3), (32, 128, 4, 4), (32, 128, 4, 3), (32, 64, 4, 4),
                  (32, 64, 4, 6), (32, 256, 4, 3), (32, 256, 4, 4), (32, 128, 8, 5), (64, 128, 4, 4),
                  (64, 128, 8, 4), (64, 64, 4, 3), (64, 256, 8, 3)]
    else:
        shapes = [(64, 64, 4, 3), (128, 64, 8, 3), (64, 128, 4, 3), (128, 32, 4, 4)]
    configs = [{"BLOCK_M": block_m, "BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "num_stages": s}
               for n, k, w, s in shapes]
    if 32 <= block_m <= 64:
        configs += [{"BLOCK_M": 16, "BLOCK_N": n, "BLOCK_K": k, "num_warps": 4, "num_stages": s}
                    for n, k, s in ((32, 128, 4), (32, 256, 3), (64, 128, 4), (16, 256, 4))]
    if block_m == 32:
        configs += [{"BLOCK_M": 64, "BLOCK_N": n, "BLOCK_K": k, "num_warps": 4, "num_stages": s}
                    for n, k, s in ((32, 64, 4), (32, 128, 3), (64, 64, 3))]
    return [c for c in configs if fused_config_fits(c, 2)]


def mlp_row(bench, model, hidden, inter, m, buffer, merged, separate):
    """Measures one (shape, M) and returns its dispatch-table row.

    The best fused config is found first. Then each candidate path (one cuBLAS GEMM over the merged buffer, two
    GEMMs over it, two GEMMs over separate weights, the fused kernel) and eager torch are timed
    DECISION_ROUNDS times, interleaved, and the medians decide: per weight form the fastest path, fused only
    when it takes <= FUSED_MARGIN of the best cuBLAS path. For the reported apex.swiglu rows the chosen path
    and eager torch are timed again, interleaved over DECISION_ROUNDS fresh rounds (not the ones that picked
    it): GPU clocks drift by several percent over a run at compute-bound sizes, so a ratio is only taken
    between timings made side by side."""
    name = f"{model} M={m}"
    flops = 2 * m * hidden * 2 * inter
    weight_bytes = 2 * inter * hidden * 2
    bytes_moved = weight_bytes + m * (hidden + inter) * 2
    weights_m = [merged] + [(lambda b: (b[:inter], b[inter:]))(buffer.clone())
                            for _ in range(bench.rotation(weight_bytes) - 1)]
    weights_s = [separate] + [(w[0].clone(), w[1].clone()) for w in weights_m[1:]]
    xs = [torch.randn(m, hidden, dtype=DTYPE, device=DEVICE) for _ in weights_m]
    forms = {"merged": weights_m, "separate": weights_s}

    def eager(x, w):
        return F.silu(F.linear(x, w[0])) * F.linear(x, w[1])

    def calls(path, weights, config=None):
        return [lambda x=x, w=w: swiglu_triton(x, *w, path=path, config=config) for x, w in zip(xs, weights)]

    ref = eager(xs[0], separate)
    eager_calls = [lambda x=x, w=w: eager(x, w) for x, w in zip(xs, weights_s)]
    eager_host_ms = bench.eager_ms(eager_calls)
    best_config, best_ms = None, None
    for config in fused_candidates(m):
        try:
            out = swiglu_fused_launch(xs[0], *merged, config=config)
        except Exception as exc:  # noqa: BLE001 - a config the GPU cannot run is skipped
            print(f"   (fused config {config} skipped: {type(exc).__name__}: {exc})", flush=True)
            continue
        check_close(f"fused {config}", out, ref)
        ms = bench.graph_ms(calls("fused", weights_m, config))
        if best_ms is None or ms < best_ms:
            best_config, best_ms = config, ms

    candidates = {"cublas_merged": ("cublas", "merged"), "cublas_merged_split": ("cublas_split", "merged"),
                  "cublas_separate": ("cublas", "separate")}
    if best_config is not None:
        candidates["fused"] = ("fused", "merged")
    graphs = {"eager": bench.capture(eager_calls)}
    for label, (path, form) in candidates.items():
        config = best_config if path == "fused" else None
        check_close(label, swiglu_triton(xs[0], *forms[form][0], path=path, config=config), ref)
        graphs[label] = bench.capture(calls(path, forms[form], config))
    decided = interleaved_medians(graphs, len(xs))
    eager_timing = Timing(decided.pop("eager"), eager_host_ms)
    del graphs

    choice = {"max_m": m, "config": best_config}
    cublas_paths = {"merged": {"cublas": "cublas_merged", "cublas_split": "cublas_merged_split"},
                    "separate": {"cublas": "cublas_separate"}}
    for form, paths in cublas_paths.items():
        path = min(paths, key=lambda p: decided[paths[p]])
        if "fused" in decided and decided["fused"] <= FUSED_MARGIN * decided[paths[path]]:
            path = "fused"
        choice[form] = path
    for label, ms in decided.items():
        bench.add("mlp", f"{name} {label} (median of {DECISION_ROUNDS})", Timing(ms), eager_timing,
                  bytes_moved=bytes_moved, flops=flops, config=best_config if label == "fused" else None)

    def target(r):
        if m <= 64:
            return ">=1.1x eager", r["speedup"] >= 1.1
        return ">=1.0x eager", r["speedup"] >= 1.0

    for form in ("merged", "separate"):
        config = best_config if choice[form] == "fused" else None
        chosen_calls = calls(choice[form], forms[form], config)
        paired = interleaved_medians({"apex": bench.capture(chosen_calls), "eager": bench.capture(eager_calls)},
                                     len(xs))
        bench.add("mlp", f"{name} apex.swiglu[{form}]->{choice[form]}",
                  Timing(paired["apex"], bench.eager_ms(chosen_calls)), Timing(paired["eager"], eager_host_ms),
                  bytes_moved=bytes_moved, flops=flops, target=target)
    return choice


def bench_mlp(bench, grid):
    table = {"device_name": torch.cuda.get_device_name(DEVICE),
             "measured": datetime.date.today().isoformat(),
             "torch": torch.__version__, "triton": triton.__version__, "timing": "CUDA-graph GPU time",
             "shapes": {}}
    for model, (hidden, inter) in MLP_SHAPES.items():
        buffer = torch.randn(2 * inter, hidden, dtype=DTYPE, device=DEVICE) / hidden ** 0.5
        merged = (buffer[:inter], buffer[inter:])
        separate = (merged[0].clone(), merged[1].clone())
        rows = []
        for m in MLP_TOKENS[grid]:
            # The weights as default arguments: the del below must find no closure over them.
            choice = bench.guard("mlp", f"{model} M={m}",
                                 lambda m=m, weights=(buffer, merged, separate):
                                 mlp_row(bench, model, hidden, inter, m, *weights))
            if choice is not None:
                rows.append(choice)
        table["shapes"][dispatch_key(DTYPE, hidden, inter)] = rows
        del buffer, merged, separate
    return table


def add_arguments(parser):
    parser.add_argument("--write-dispatch", action="store_true",
                        help=f"store the measured swiglu dispatch table in {os.path.relpath(DISPATCH_TABLE_PATH)}")


def run(bench, sections, grid, args):
    """The chosen sections of this family (see kernel_bench's family protocol); the dispatch table (None
    without the mlp section) goes to the JSON as "swiglu_dispatch"."""
    if "silu_mul" in sections:
        bench_silu_mul(bench, grid)
    return {"swiglu_dispatch": bench_mlp(bench, grid) if "mlp" in sections else None}


def finish(fields, args):
    """Prints the dispatch table and, with --write-dispatch, stores it."""
    table = fields["swiglu_dispatch"]
    if table is None:
        return
    print("\nswiglu dispatch table (per shape: rows apply to M <= max_m):")
    for key, rows in table["shapes"].items():
        summary = ", ".join(f"M<={r['max_m']}: merged={r['merged']} separate={r['separate']}" for r in rows)
        print(f"  {key}: {summary}")
    if args.write_dispatch:
        with open(DISPATCH_TABLE_PATH, "w") as f:
            json.dump(table, f, indent=1)
            f.write("\n")
        print(f"wrote {DISPATCH_TABLE_PATH}")


if __name__ == "__main__":
    main([sys.modules[__name__]], __doc__)
