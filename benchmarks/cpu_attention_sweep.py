"""Sweeps of the CPU attention op's settings: its work-split parameters (the defaults in
csrc/openmp/work_plan.cpp), or its vector kernel paths (APEX_CPU_ISA).

    python benchmarks/cpu_attention_sweep.py --out sweep.json               # work split
    python benchmarks/cpu_attention_sweep.py --sweep isa --out sweep.json   # kernel paths

For small and large decode shapes (the ones the targets of benchmarks/cpu_attention.py are hardest on), times
`paged_attention_cpu` under each setting (taking turns over three rounds, median of the round medians): the
(items_per_thread, min_item_bytes, min_thread_bytes) settings below, set with
`apex_compile.ops.cpu_attention_work_split`, or each vector kernel path this CPU supports, on the same
rotated KV pool and read-bandwidth reference as cpu_attention.py. Results never depend on the split
(tests/test_cpu_attention.py), only speed does; the kernel paths agree within the dtype's tolerance.
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

from apex_compile.ops import cpu_attention_work_split, cpu_isa  # noqa: E402

SHAPES = [("SmolLM2-135M", "bf16", 1, 2048), ("SmolLM2-135M", "bf16", 1, 16384), ("SmolLM2-135M", "bf16", 16, 512),
          ("Llama-3-8B", "bf16", 1, 16384), ("Llama-3-8B", "bf16", 4, 512), ("Llama-2-7B", "fp32", 1, 2048),
          ("Llama-2-7B", "fp32", 1, 8192), ("Llama-2-7B", "fp32", 1, 32768), ("Llama-2-7B", "bf16", 1, 16384),
          ("Llama-2-7B", "bf16", 16, 8192)]
KIB = 1024
SETTINGS = [(ipt, mib * KIB, 64 * KIB) for ipt, mib in ((1, 64), (1, 128), (1, 256), (2, 128), (4, 128))]
"""(items_per_thread, min_item_bytes, min_thread_bytes) of the guided split (an equal split, 4-16 items per
thread, lost to it by up to 17% at batch 1 on 2026-11-30: cpu_attention_sweep_*_s4_guided.txt)"""
ISA_SHAPES = [("SmolLM2-135M", "bf16", 1, 2048), ("SmolLM2-135M", "bf16", 1, 16384),
              ("SmolLM2-135M", "bf16", 16, 2048), ("Llama-3-8B", "bf16", 1, 2048), ("Llama-3-8B", "bf16", 1, 16384),
              ("Llama-3-8B", "bf16", 16, 8192), ("Llama-2-7B", "bf16", 1, 16384), ("Llama-2-7B", "bf16", 16, 8192),
              ("Llama-2-7B", "fp32", 1, 8192)]
"""Shapes of the kernel-path sweep: every GQA group size of the benchmark (1, 3, 4), small and large calls."""
ROUNDS = 3
"""Rounds in which all settings of a shape take turns (one sweep of 2026-11-30 measured each setting once, and
two such sweeps on different hosts disagreed by up to 20% on the same small call)."""


def supported_vector_isas():
    """The vector kernel paths (APEX_CPU_ISA names) this CPU supports, best first."""
    names = []
    for name in ("avx512", "avx2"):
        os.environ["APEX_CPU_ISA"] = name
        try:
            names.append(cpu_isa())
        except RuntimeError:
            pass
    os.environ.pop("APEX_CPU_ISA", None)
    return names


def split_settings():
    """(label, apply, JSON fields) of each work-split setting."""
    return [(f"ipt={ipt:3d} item>={mib // KIB:4d}K thread>={mtb // KIB:5d}K",
             lambda setting=(ipt, mib, mtb): cpu_attention_work_split(*setting),
             dict(items_per_thread=ipt, min_item_bytes=mib, min_thread_bytes=mtb)) for ipt, mib, mtb in SETTINGS]


def isa_settings():
    """(label, apply, JSON fields) of each vector kernel path."""
    return [(f"{name:<7}", lambda name=name: os.environ.__setitem__("APEX_CPU_ISA", name), dict(isa=name))
            for name in supported_vector_isas()]


def main():
    """Times every setting on every shape; prints rows, writes JSON, restores the defaults."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out")
    parser.add_argument("--sweep", choices=("split", "isa"), default="split")
    parser.add_argument("--pool-gib", type=float, default=12.0)
    parser.add_argument("--seconds", type=float, default=0.25)
    parser.add_argument("--threads", type=int, help="threads of the op (default: torch's)")
    parser.add_argument("--shapes", help="comma-separated model:dtype:batch:context (default: the built-in list)")
    args = parser.parse_args()
    shapes = SHAPES if args.sweep == "split" else ISA_SHAPES
    if args.shapes:
        shapes = [(model, dtype, int(batch), int(context))
                  for model, dtype, batch, context in (item.split(":") for item in args.shapes.split(","))]
    settings = split_settings() if args.sweep == "split" else isa_settings()
    if args.threads:
        torch.set_num_threads(args.threads)
    defaults = cpu_attention_work_split()
    pool = Pool(int(max(args.pool_gib * GIB, 4 * last_level_cache_bytes())))
    bandwidth = max(pool.read_bandwidth(repeats=10).values())
    busy = busy_cores()
    print(f"CPU: {cpu_model()}, {torch.get_num_threads()} threads; read bandwidth {bandwidth:.1f} GB/s; "
          f"work-split defaults {defaults}; cores busy with other work: {busy}", flush=True)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for model, dtype, batch, context in shapes:
        # Settings take turns over ROUNDS rounds (a drift of the machine's state hits all alike); each round's
        # median is kept and the median of those is the setting's time.
        per_setting = [[] for _ in settings]
        for _ in range(ROUNDS):
            for (_, apply, _), measured in zip(settings, per_setting):
                apply()
                measured.append(bench_config(pool, MODELS[model], DTYPES[dtype], batch, context, 16,
                                             args.seconds / ROUNDS, gen, with_sdpa=False))
        for (label, _, fields), measured in zip(settings, per_setting):
            round_ms = [r["op_ms"] for r in measured]
            op_ms = statistics.median(round_ms)
            row = dict(measured[0], op_ms=op_ms, op_ms_rounds=round_ms,
                       op_gbps=measured[0]["step_bytes"] / op_ms / 1e6)
            row.pop("op_mean_ms", None)
            row.update(model=model, dtype=dtype, batch=batch, context=context,
                       fraction_of_read_bw=row["op_gbps"] / bandwidth, **fields)
            rows.append(row)
            rounds_text = " ".join(f"{ms * 1e3:.1f}" for ms in round_ms)
            print(f"{model:<13} {dtype} b={batch:3d} ctx={context:6d} {label} {op_ms * 1e3:9.1f} us "
                  f"{100 * row['fraction_of_read_bw']:5.1f}%  (rounds: {rounds_text})", flush=True)
    cpu_attention_work_split(**defaults)
    os.environ.pop("APEX_CPU_ISA", None)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"cpu": cpu_model(), "threads": torch.get_num_threads(), "read_bandwidth_gbps": bandwidth,
                       "busy_cores_before": busy, "sweep": args.sweep, "defaults": defaults, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
