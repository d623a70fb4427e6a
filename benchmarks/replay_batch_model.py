"""Replays the batch model's prediction of an offline run off the GPU, beside what the run measured.

Each CUDA row of `benchmarks/offline.py` keeps what its prediction was made from (`model_inputs`: the profile,
the graphs' calibration, the batch limits). This tool re-draws the row's lengths (the result's workload and
seed), predicts the batch again with the current `runtime/batch_model.py` as the engine did at the batch's start
(`Engine.predict_batch`: a fresh policy, nothing learned yet), and prints the makespan, the steps and each kind of
step against the measured ones. It is how the model is studied and refitted between GPU sessions.

    python benchmarks/replay_batch_model.py benchmarks/results/offline/2026-12-07_h100_s70.json
    python benchmarks/replay_batch_model.py RESULT.json --rows 2,3
    python benchmarks/replay_batch_model.py RESULT.json --map      # the model's verdicts over the issue's grid

`--map` predicts, with one row's inputs (its machine's profile and calibration), the batches of the issue's
target range (64 to 4,000 requests; fixed, uniform and chat lengths; device pools of 1, 2 and 4 GiB of that
row's model): GPU-only, the pipeline taking the tail, and auto's batch gate (`batch_model.batch_verdict`).
These are predictions, not measurements: they show where the gate opens by a thin margin, which are the batches
a GPU session should measure first.
"""
import argparse
import dataclasses
import json
import os
import sys
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import Lengths, parse_range  # noqa: E402

from apex_compile.runtime.batch_model import (BatchLimits, BatchPrediction, BatchState,  # noqa: E402
                                              batch_verdict, predict_batch)
from apex_compile.runtime.perf_model import AutoOffload, PerfModel, Profile, StepCalibration  # noqa: E402


def row_lengths(result: dict, row: dict) -> List[Tuple[int, int]]:
    """The row's (prompt, output) lengths, drawn again from the workload it names and the run's seed."""
    text = row.get("workload") or result.get("lengths")
    if not text:
        raise ValueError("the result names no workload (its 'lengths' or the row's 'workload')")
    words = text.split()
    if len(words) != 5 or words[1] != "prompt" or words[3] != "output":
        raise ValueError(f"unreadable workload {text!r}: expected '<dist> prompt <lo[:hi]> output <lo[:hi]>'")
    spec = Lengths(words[0], parse_range(words[2]), parse_range(words[4]))
    return spec.draw(int(row["num_requests"]), int(result.get("seed", 0)))


def row_model(row: dict) -> Tuple[PerfModel, BatchLimits]:
    """The model (profile, calibration) and batch limits a row's prediction was made from."""
    inputs = row.get("model_inputs")
    if inputs is None:
        raise ValueError("the row has no model_inputs (a CPU run, or one from before they were kept)")
    fields = BatchLimits.__dataclass_fields__
    limits = BatchLimits(**{k: tuple(v) if k == "piece_sizes" else v for k, v in inputs["limits"].items()
                            if k in fields})
    fields = StepCalibration.__dataclass_fields__
    calibration = StepCalibration(**{k: v for k, v in inputs["calibration"].items() if k in fields})
    return PerfModel(Profile(**inputs["profile"]), calibration), limits


# --map's grid: the target range of offline batches
MAP_WORKLOADS = (("fixed", (128, 128), (64, 64)), ("fixed", (1024, 1024), (256, 256)),
                 ("fixed", (2048, 2048), (512, 512)), ("uniform", (128, 2048), (64, 512)),
                 ("chat", (128, 2048), (64, 512)))
MAP_COUNTS = (64, 192, 400, 1000, 4000)
MAP_POOLS_GIB = (1.0, 2.0, 4.0)


def map_rows(row: dict, workloads=MAP_WORKLOADS, counts=MAP_COUNTS, pools_gib=MAP_POOLS_GIB,
             seed: int = 0) -> List[dict]:
    """The batch gate's verdict over a grid of batches, with `row`'s model: per (pool, workload, count) the
    predicted makespan without new pipeline members ("gpu_only"), with the pipeline taking the tail
    ("pipeline"), whether the gate opens, and the ratio auto is predicted to run at (1 where it stays shut)."""
    model, limits = row_model(row)
    if not limits.cycle:
        raise ValueError("the row ran no staggered plan (its limits have no pipeline cycle): nothing to map")
    blocks_per_gib = limits.device_blocks / float(row.get("device_gib") or 1.0)
    out = []
    for gib in pools_gib:
        pool = dataclasses.replace(limits, device_blocks=int(round(blocks_per_gib * gib)))
        for dist, prompt, output in workloads:
            for count in counts:
                spec = Lengths(dist, prompt, output)
                policy = AutoOffload(model, stagger_groups=pool.cycle, max_stagger_rows=pool.max_rows)
                without, with_pipeline, opens = batch_verdict(policy, spec.draw(count, seed), pool)
                out.append({"device_gib": gib, "workload": spec.describe(), "requests": count,
                            "gpu_only_s": without.makespan_s,
                            "pipeline_s": with_pipeline.makespan_s, "host_requests": with_pipeline.host_requests,
                            "gate": opens,
                            "auto_vs_gpu_only": without.makespan_s / with_pipeline.makespan_s if opens else 1.0})
    return out


def replay_row(result: dict, row: dict) -> Dict[str, BatchPrediction]:
    """The batch model's predictions for `row` ("never", and "auto" where the engine ran the pipeline)."""
    model, limits = row_model(row)
    lengths = row_lengths(result, row)
    state = BatchState(captured=set(row["model_inputs"].get("captured", ())))  # as the engine stood before it
    out = {"never": predict_batch(model, lengths, limits, state=state)}
    if limits.cycle and row.get("predicted_plan") == "auto":
        policy = AutoOffload(model, stagger_groups=limits.cycle, max_stagger_rows=limits.max_rows)
        out["auto"] = predict_batch(policy, lengths, limits, pipeline=True, state=state)
    return out


def report(row: dict, predicted: Dict[str, BatchPrediction]) -> List[str]:
    """Lines of the row's replayed prediction against its measurement (and the prediction stored with it)."""
    own = predicted.get(row.get("predicted_plan") or "never", predicted["never"])
    measured_s, steps = row["duration_s"], row.get("steps")
    stored = row.get("predicted_makespan_s")
    lines = [f"{row.get('mode', '?')} R={row['num_requests']} {row.get('device_gib', '?')} GiB: measured "
             f"{measured_s:.1f} s, {steps} steps; replayed {own.plan} {own.makespan_s:.1f} s "
             f"({own.makespan_s / measured_s - 1:+.1%}), {own.steps} steps"
             + (f" ({own.steps / steps - 1:+.1%})" if steps else "")
             + (f"; stored prediction {stored:.1f} s" if stored is not None else "")]
    kinds = (row.get("diagnostics") or {}).get("step_kinds", {})
    for kind, (count, seconds) in sorted(own.kinds.items()):
        got: Optional[list] = kinds.get(kind)
        measured = (f"measured {got[0]} x {1e3 * got[1] / got[0]:.2f} ms" if got and got[0] else "measured none")
        lines.append(f"    {kind}: {count} x {1e3 * seconds / max(count, 1):.2f} ms, {measured}")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("result", help="a JSON result of benchmarks/offline.py")
    parser.add_argument("--rows", default=None, help="row indices, comma-separated (default: every CUDA row)")
    parser.add_argument("--map", action="store_true",
                        help="the batch gate's verdicts over the issue's grid, with the first chosen row's model")
    args = parser.parse_args(argv)
    with open(args.result) as f:
        result = json.load(f)
    rows = result.get("rows", [])
    indices = ([int(i) for i in args.rows.split(",")] if args.rows
               else [i for i, r in enumerate(rows) if "model_inputs" in r])
    if not indices:
        sys.exit(f"{args.result}: no row keeps model_inputs (CUDA rows of benchmarks/offline.py do)")
    for index in indices:
        if not 0 <= index < len(rows):
            sys.exit(f"{args.result}: no row {index} (it has {len(rows)})")
    if args.map:
        print(f"row {indices[0]}'s model (predictions, not measurements):")
        for m in map_rows(rows[indices[0]]):
            print(f"  {m['device_gib']:3.0f} GiB  {m['workload']:<36} R={m['requests']:<5} GPU-only "
                  f"{m['gpu_only_s']:7.1f} s  pipeline {m['pipeline_s']:7.1f} s ({m['host_requests']} host)  gate "
                  f"{'open' if m['gate'] else 'shut'}  auto {m['auto_vs_gpu_only']:.2f}x", flush=True)
        return
    for index in indices:
        print(f"row {index}:", "\n".join(report(rows[index], replay_row(result, rows[index]))))


if __name__ == "__main__":
    main()
