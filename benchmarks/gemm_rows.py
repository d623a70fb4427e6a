"""A decode step's weight GEMMs by row count on a GPU: cuBLAS (F.linear), the skinny Triton linear
(`apex_compile.kernels.skinny_linear`, a sweep of configs) and the MLP's apex.swiglu paths, per row count M.

Each timing is one CUDA graph of `--calls` launches cycling over `--copies` weight copies (more bytes than L2),
median of `--reps` replays, in microseconds a call. The per-step line adds a model's layers' linears (qkv, o,
swiglu, down) and its lm_head per M: what the step's GEMMs cost at each batch size, cuBLAS against the best.
`--write-dispatch` writes the skinny kernel's dispatch table (the kernel where it beat cuBLAS by MARGIN).

    python benchmarks/gemm_rows.py [--shape llama3_8b] [--rows 8,16,24,32] [--write-dispatch]
"""
import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from apex_compile.kernels import skinny_linear as sk  # noqa: E402
from apex_compile.kernels import swiglu as ksw  # noqa: E402


def timed_graph(fn, reps):
    """Median seconds of one replay of fn's captured graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(times)

SHAPES = {  # hidden, intermediate, heads, kv heads, vocab, layers
    "llama3_8b": (4096, 14336, 32, 8, 128256, 32),
    "llama2_7b": (4096, 11008, 32, 32, 32000, 32),
}
MARGIN = 0.97  # the kernel takes a row count when it runs in at most this share of cuBLAS's time


def graph_us(fn, calls, reps):
    """Median microseconds of one of `calls` launches of fn(i), captured in one CUDA graph."""
    return timed_graph(lambda: [fn(i) for i in range(calls)], reps) * 1e6 / calls


def configs(m, n, k, stages=(4,)):
    """The sweep's configs for one shape: 32 to 128 columns a program, 128 or 256 of K a step, K split so
    that the programs cover the SMs about once or twice (no split when the columns alone do)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = []
    for block_n in (32, 64, 128):
        for block_k in (128, 256):
            for split in (1, 2, 4, 8):
                programs = sk.cdiv(n, block_n) * split
                if not 0.9 * sms <= programs <= 16 * sms or k // split < 2 * block_k:
                    continue
                if split > 1 and programs // 2 >= 0.9 * sms:
                    continue  # half this split already covers the SMs
                for num_stages in stages:
                    cfg = {"BLOCK_M": 16 if m <= 16 else 32, "BLOCK_N": block_n, "BLOCK_K": block_k,
                           "SPLIT_K": split, "num_warps": 4, "num_stages": num_stages}
                    if sk.config_fits(cfg, 2):
                        out.append(cfg)
    return out


def swiglu_configs():
    """The fused gate/up kernel's configs tried at 17-32 rows (one 32-row tile)."""
    out = []
    for block_n in (32, 64):
        for block_k in (64, 128, 256):
            for stages in (3, 4):
                cfg = {"BLOCK_M": 32, "BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": 4, "num_stages": stages}
                if ksw.fused_config_fits(cfg, 2):
                    out.append(cfg)
    return out


def write_swiglu_rows(result, key, margin):
    """Rows of the swiglu dispatch table for the measured row counts in (16, 32]: the fused kernel (its best
    config) where it ran in at most `margin` of the cuBLAS path's time, else what the table's next row says."""
    table = ksw.load_dispatch_table()
    if not table or table.get("device_name") != result["device"] or key not in table.get("shapes", {}):
        return False
    rows = [r for r in table["shapes"][key] if not (16 < r["max_m"] < 32)]
    above = next(r for r in rows if r["max_m"] >= 32)
    for m, r in result["swiglu"].items():
        if 16 < m < 32 and "fused_best" in r:
            win = r["fused_best"] <= margin * r["cublas"]
            rows.append({"max_m": m, "config": r["fused_config"] if win else above["config"],
                         "merged": "fused" if win else above["merged"], "separate": "fused" if win else above["separate"]})
    table["shapes"][key] = sorted(rows, key=lambda r: r["max_m"])
    with open(ksw.DISPATCH_TABLE_PATH, "w") as f:
        json.dump(table, f, indent=1)
    return True


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama3_8b")
    parser.add_argument("--rows", default="1,2,4,8,12,16,20,24,28,32")
    parser.add_argument("--copies", type=int, default=4)
    parser.add_argument("--calls", type=int, default=32)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--no-sweep", action="store_true", help="cuBLAS, the table's choice and swiglu only")
    parser.add_argument("--stages", default="4", help="num_stages values of the sweep")
    parser.add_argument("--write-dispatch", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    hidden, inter, heads, kv_heads, vocab, layers = SHAPES[args.shape]
    head_dim = hidden // heads
    dtype, device = torch.bfloat16, torch.device("cuda")
    linears = {"qkv": (hidden + 2 * kv_heads * head_dim, hidden), "o": (hidden, hidden), "down": (hidden, inter),
               "lm_head": (vocab, hidden)}
    rows = [int(r) for r in args.rows.split(",")]
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "shape": args.shape,
              "timing": "CUDA-graph GPU time, us a call", "linears": {}, "swiglu": {}}
    gen = torch.Generator(device=device).manual_seed(0)
    for name, (n, k) in linears.items():
        copies = 1 if name == "lm_head" else args.copies
        calls = 4 if name == "lm_head" else args.calls
        weights = [torch.randn(n, k, dtype=dtype, device=device, generator=gen) * 0.02 for _ in range(copies)]
        entry = result["linears"][name] = {"n": n, "k": k, "rows": {}}
        for m in rows:
            x = torch.randn(m, k, dtype=dtype, device=device, generator=gen)
            outs = [torch.empty(m, n, dtype=dtype, device=device) for _ in range(copies)]
            ref = F.linear(x, weights[0])
            cublas = graph_us(lambda i: torch.mm(x, weights[i % copies].t(), out=outs[i % copies]), calls, args.reps)
            row = {"cublas": cublas}
            table_cfg = sk.lookup(sk.load_dispatch_table(), result["device"], sk.dispatch_key(dtype, n, k), m)
            if table_cfg is not None:
                row["table"] = graph_us(lambda i: sk.skinny_linear(x, weights[i % copies], table_cfg,
                                                                   out=outs[i % copies]), calls, args.reps)
            if not args.no_sweep and m <= sk.MAX_ROWS:
                best = None
                for cfg in configs(m, n, k, tuple(int(v) for v in args.stages.split(","))):
                    try:
                        got = sk.skinny_linear(x, weights[0], cfg)
                        err = (got.float() - ref.float()).abs().max().item()
                        if err > 0.05 * ref.float().abs().max().item() + 1e-2:
                            print(f"  {name} M={m} {cfg}: wrong result (max err {err:.3g})", flush=True)
                            continue
                        us = graph_us(lambda i: sk.skinny_linear(x, weights[i % copies], cfg, out=outs[i % copies]),
                                      calls, args.reps)
                    except Exception as error:  # noqa: BLE001 (a config the compiler rejects)
                        print(f"  {name} M={m} {cfg}: {type(error).__name__}: {str(error)[:120]}", flush=True)
                        continue
                    if best is None or us < best[0]:
                        best = (us, cfg)
                if best is not None:
                    row["triton"], row["config"] = best
            gbps = {v: n * k * 2 / (row[v] * 1e-6) / 1e9 for v in ("cublas", "triton", "table") if v in row}
            row["GBps"] = gbps
            entry["rows"][m] = row
            print(f"{name:8} {n:6d}x{k:<6d} M={m:3d}  cublas {cublas:7.1f} us ({gbps['cublas']:5.0f} GB/s)"
                  + (f"  triton {row['triton']:7.1f} us ({gbps['triton']:5.0f} GB/s) x{cublas / row['triton']:.2f} "
                     f"{row['config']}" if "triton" in row else "")
                  + (f"  table {row['table']:7.1f} us" if "table" in row else ""), flush=True)
        del weights
        torch.cuda.empty_cache()
    # the MLP's gate/up + SiLU-mul (merged weights) through apex.swiglu's paths
    w = [torch.randn(2 * inter, hidden, dtype=dtype, device=device, generator=gen) * 0.02 for _ in range(args.copies)]
    for m in rows:
        x = torch.randn(m, hidden, dtype=dtype, device=device, generator=gen)
        row = {}
        for path in ("dispatch", "cublas", "fused"):
            def run(i, path=path):
                wg, wu = w[i % args.copies][:inter], w[i % args.copies][inter:]
                return ksw.swiglu_triton(x, wg, wu, path=None if path == "dispatch" else path)
            row[path] = graph_us(run, args.calls, args.reps)
        row["dispatch_path"] = ksw.choose_swiglu_path(x, w[0][:inter], True)[0]
        if not args.no_sweep and 16 < m <= sk.MAX_ROWS:  # the fused kernel's configs at 17-32 rows
            for cfg in swiglu_configs():
                def fused(i, cfg=cfg):
                    return ksw.swiglu_fused_launch(x, w[i % args.copies][:inter], w[i % args.copies][inter:], cfg)
                try:
                    us = graph_us(fused, args.calls, args.reps)
                except Exception as error:  # noqa: BLE001
                    print(f"  swiglu M={m} {cfg}: {type(error).__name__}: {str(error)[:120]}", flush=True)
                    continue
                if "fused_best" not in row or us < row["fused_best"]:
                    row["fused_best"], row["fused_config"] = us, cfg
        result["swiglu"][m] = row
        print(f"swiglu   M={m:3d}  " + "  ".join(f"{p} {row[p]:6.1f} us" for p in ("dispatch", "cublas", "fused"))
              + f"  (table: {row['dispatch_path']})"
              + (f"  fused best {row['fused_best']:6.1f} us {row['fused_config']}" if "fused_best" in row else ""),
              flush=True)
    del w
    # a step's GEMMs per M: layers x (qkv + o + swiglu + down) + lm_head
    result["step_us"] = {}
    for m in rows:
        lin = result["linears"]
        def total(pick):
            return (layers * (sum(pick(lin[nm]["rows"][m]) for nm in ("qkv", "o", "down"))
                              + result["swiglu"][m]["dispatch"]) + pick(lin["lm_head"]["rows"][m]))
        cub = total(lambda r: r["cublas"])
        best = total(lambda r: min(r["cublas"], r.get("triton", r["cublas"])))
        result["step_us"][m] = {"cublas": cub, "best": best}
        print(f"step GEMMs M={m:3d}: cuBLAS linears {cub:7.0f} us, best per linear {best:7.0f} us", flush=True)
    if args.write_dispatch:
        table = {"device_name": result["device"], "torch": torch.__version__, "measured_with": "benchmarks/gemm_rows.py",
                 "margin": MARGIN, "shapes": {}}
        for name, entry in result["linears"].items():
            key = sk.dispatch_key(dtype, entry["n"], entry["k"])
            table["shapes"][key] = [
                {"max_m": m, "path": "triton" if r.get("triton", 1e9) <= MARGIN * r["cublas"] else "cublas",
                 **({"config": r["config"]} if "config" in r else {})}
                for m, r in sorted(entry["rows"].items()) if m <= sk.MAX_ROWS]
        if os.path.exists(sk.DISPATCH_TABLE_PATH):  # keep other shapes measured before
            old = json.load(open(sk.DISPATCH_TABLE_PATH))
            if old.get("device_name") == table["device_name"]:
                table["shapes"] = {**old.get("shapes", {}), **table["shapes"]}
        with open(sk.DISPATCH_TABLE_PATH, "w") as f:
            json.dump(table, f, indent=1)
        print(f"wrote {sk.DISPATCH_TABLE_PATH}", flush=True)
        if write_swiglu_rows(result, ksw.dispatch_key(dtype, hidden, inter), MARGIN):
            print(f"wrote rows 17-31 of {ksw.DISPATCH_TABLE_PATH}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
