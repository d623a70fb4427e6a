"""Sweep of the CPU attention op's work-split parameters (the defaults in csrc/openmp/work_plan.cpp).

    python benchmarks/cpu_attention_sweep.py --out sweep.json

For small and large decode shapes (the ones the targets of benchmarks/cpu_attention.py are hardest on), times
`paged_attention_cpu` under several (items_per_thread, min_item_bytes, min_thread_bytes) settings
(taking turns over three rounds, median of the round medians), set with
`apex_compile.ops.cpu_attention_work_split`, on the same rotated KV pool and read-bandwidth reference as
cpu_attention.py. Results never depend on the parameters (tests/test_cpu_attention.py), only speed does.
"""
import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cpu_attention import (  # noqa: E402
    DTYPES, GIB, MODELS, Pool, bench_config, busy_cores, cpu_model, last_level_cache_bytes,
)

from apex_compile.ops import cpu_attention_work_split  # noqa: E402

SHAPES = [("SmolLM2-135M", "bf16", 1, 2048), ("SmolLM2-135M", "bf16", 1, 16384), ("SmolLM2-135M", "bf16", 16, 512),
          ("Llama-3-8B", "bf16", 1, 16384), ("Llama-3-8B", "bf16", 4, 512), ("Llama-2-7B", "fp32", 1, 2048),
          ("Llama-2-7B", "fp32", 1, 8192), ("Llama-2-7B", "fp32", 1, 32768), ("Llama-2-7B", "bf16", 1, 16384),
          ("Llama-2-7B", "bf16", 16, 8192)]
KIB = 1024
SETTINGS = [(ipt, mib * KIB, 64 * KIB) for ipt, mib in ((1, 64), (1, 128), (1, 256), (2, 128), (4, 128))]
"""(items_per_thread, min_item_bytes, min_thread_bytes) of the guided split (an equal split, 4-16 items per
thread, lost to it by up to 17% at batch 1 on 2026-11-30: cpu_attention_sweep_*_s4_guided.txt)"""
ROUNDS = 3
"""Rounds in which all settings of a shape take turns (one sweep of 2026-11-30 measured each setting once, and
two such sweeps on different hosts disagreed by up to 20% on the same small call)."""


def main():
    """Times every setting on every shape; prints rows, writes JSON, restores the defaults."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out")
    parser.add_argument("--pool-gib", type=float, default=12.0)
    parser.add_argument("--seconds", type=float, default=0.25)
    parser.add_argument("--shapes", help="comma-separated model:dtype:batch:context (default: the built-in list)")
    args = parser.parse_args()
    shapes = SHAPES
    if args.shapes:
        shapes = [(model, dtype, int(batch), int(context))
                  for model, dtype, batch, context in (item.split(":") for item in args.shapes.split(","))]
    defaults = cpu_attention_work_split()
    pool = Pool(int(max(args.pool_gib * GIB, 4 * last_level_cache_bytes())))
    bandwidth = max(pool.read_bandwidth(repeats=10).values())
    busy = busy_cores()
    print(f"CPU: {cpu_model()}, {torch.get_num_threads()} threads; read bandwidth {bandwidth:.1f} GB/s; "
          f"defaults {defaults}; cores busy with other work: {busy}", flush=True)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for model, dtype, batch, context in shapes:
        # Settings take turns over ROUNDS rounds (a drift of the machine's state hits all alike); each round's
        # median is kept and the median of those is the setting's time.
        per_setting = {setting: [] for setting in SETTINGS}
        for _ in range(ROUNDS):
            for setting in SETTINGS:
                cpu_attention_work_split(*setting)
                row = bench_config(pool, MODELS[model], DTYPES[dtype], batch, context, 16, args.seconds / ROUNDS,
                                   gen, with_sdpa=False)
                per_setting[setting].append(row)
        for (ipt, mib, mtb), measured in per_setting.items():
            round_ms = [r["op_ms"] for r in measured]
            op_ms = statistics.median(round_ms)
            row = dict(measured[0], op_ms=op_ms, op_ms_rounds=round_ms, op_gbps=measured[0]["step_bytes"] / op_ms / 1e6)
            row.pop("op_mean_ms", None)
            row.update(model=model, dtype=dtype, batch=batch, context=context, items_per_thread=ipt,
                       min_item_bytes=mib, min_thread_bytes=mtb, fraction_of_read_bw=row["op_gbps"] / bandwidth)
            rows.append(row)
            print(f"{model:<13} {dtype} b={batch:3d} ctx={context:6d} ipt={ipt:3d} item>={mib // KIB:4d}K "
                  f"thread>={mtb // KIB:5d}K {op_ms * 1e3:9.1f} us {100 * row['fraction_of_read_bw']:5.1f}%  "
                  f"(rounds: {' '.join(f'{ms * 1e3:.1f}' for ms in round_ms)})", flush=True)
    cpu_attention_work_split(**defaults)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"cpu": cpu_model(), "threads": torch.get_num_threads(), "read_bandwidth_gbps": bandwidth,
                       "busy_cores_before": busy, "defaults": defaults, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
