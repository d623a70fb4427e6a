"""Replays the batch model's prediction of an offline run off the GPU, beside what the run measured.

Each CUDA row of `benchmarks/offline.py` keeps what its prediction was made from (`model_inputs`: the profile,
the graphs' calibration, the batch limits). This tool re-draws the row's lengths (the result's workload and
seed), predicts the batch again with the current `runtime/batch_model.py` as the engine did at the batch's start
(`Engine.predict_batch`: a fresh policy, nothing learned yet), and prints the makespan, the steps and each kind of
step against the measured ones. It is how the model is studied and refitted between GPU sessions.

    python benchmarks/replay_batch_model.py benchmarks/results/offline/2026-12-07_h100_s70.json
    python benchmarks/replay_batch_model.py RESULT.json --rows 2,3
"""
import argparse
import json
import os
import sys
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import Lengths, parse_range  # noqa: E402

from apex_compile.runtime.batch_model import BatchLimits, BatchPrediction, predict_batch  # noqa: E402
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


def replay_row(result: dict, row: dict) -> Dict[str, BatchPrediction]:
    """The batch model's predictions for `row` ("never", and "auto" where the engine ran the pipeline)."""
    inputs = row.get("model_inputs")
    if inputs is None:
        raise ValueError("the row has no model_inputs (a CPU run, or one from before they were kept)")
    fields = BatchLimits.__dataclass_fields__
    limits = BatchLimits(**{k: v for k, v in inputs["limits"].items() if k in fields})
    model = PerfModel(Profile(**inputs["profile"]), StepCalibration(**inputs["calibration"]))
    lengths = row_lengths(result, row)
    out = {"never": predict_batch(model, lengths, limits)}
    if limits.cycle and row.get("predicted_plan") == "auto":
        policy = AutoOffload(model, stagger_groups=limits.cycle, max_stagger_rows=limits.max_rows)
        out["auto"] = predict_batch(policy, lengths, limits, pipeline=True)
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
        print(f"row {index}:", "\n".join(report(rows[index], replay_row(result, rows[index]))))


if __name__ == "__main__":
    main()
