"""Shared by the Triton kernel benchmarks (triton_rms_norm.py, triton_swiglu.py, triton_decode.py,
triton_prefill.py, triton_rope.py, their driver triton_kernels.py, and triton_sweep.py): timing, rotating input
sets, result rows and targets, the HBM reference, the command line and the JSON file.

Timing, two ways, with every measured function rotating over several input sets that together exceed twice
the L2 cache when one set is smaller (so no call finds its inputs in L2):
  - "time" (GPU time): the calls over all input sets are captured once in a CUDA graph; the graph is replayed
    back to back between CUDA events (median of rounds) and the time divided by the number of calls.
    Targets and the dispatch table use this: it is what the kernels cost in a CUDA-graphed step, free of host
    launch overhead. `Bench.flushed_graph_ms` times the same graph with do_bench's L2-clearing write before
    every replay, for comparison (triton_sweep.py "timing").
  - "eager": one Python call per timed run with triton.testing.do_bench (L2 cleared before each run), so
    host overhead that the GPU cannot hide shows (op dispatch, Triton launch); reported for kernel and baseline.
Every kernel output is checked against its baseline before timing; any error is printed with its row and the
script exits with status 1 after finishing the other rows. Table to stdout, JSON to --out.
"""
import argparse
import dataclasses
import datetime
import json
import math
import os
import sys
import traceback
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)  # the benchmark scripts import apex_compile from this checkout

import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

DEVICE = "cuda"
DTYPE = torch.bfloat16
WARMUP_MS = 10
REP_MS = 50
MAX_ROTATION_SETS = 16
DECISION_ROUNDS = 3
"""Rounds of `interleaved_medians` (their median decides, e.g., the MLP dispatch table)."""

ATTENTION_LAYOUTS = {"llama2-7b": (32, 32, 128), "llama3-8b": (32, 8, 128)}
"""(query heads, KV heads, head dim) of the attention rows (decode, prefill, rope)."""


# ----------------------------------------------------------------------------------------------------------
# measurement helpers


def steady_replay_ms(replay: Callable, rounds: int = 21, round_ms: float = 2.0) -> float:
    """Median milliseconds of one `replay()` issued back to back: rounds of k replays between two CUDA events,
    k chosen so that a round lasts about `round_ms` (after a warm-up of the same length)."""
    replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        replay()
    end.record()
    end.synchronize()
    per_replay = max(start.elapsed_time(end) / 3, 1e-3)
    k = max(1, min(1000, round(round_ms / per_replay)))
    for _ in range(k):
        replay()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(k):
            replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / k)
    return sorted(times)[len(times) // 2]


def interleaved_medians(graphs: dict, calls_per_replay: int) -> dict:
    """{label: median ms of one call} over DECISION_ROUNDS rounds, each timing every graph once in turn."""
    rounds = {label: [] for label in graphs}
    for _ in range(DECISION_ROUNDS):
        for label, graph in graphs.items():
            rounds[label].append(steady_replay_ms(graph.replay) / calls_per_replay)
    return {label: sorted(times)[len(times) // 2] for label, times in rounds.items()}


@dataclasses.dataclass
class Timing:
    """Median milliseconds of one call: from a CUDA graph replay (GPU time) and, when measured, eagerly."""

    graph_ms: float
    eager_ms: Optional[float] = None


class Bench:
    """Timing, rotation and result rows shared by the sections."""

    def __init__(self, hbm_gbps: float):
        self.hbm_gbps = hbm_gbps
        props = torch.cuda.get_device_properties(DEVICE)
        self.l2_bytes = getattr(props, "L2_cache_size", 50 << 20) or (50 << 20)
        self.rows = []
        self.errors = []

    def rotation(self, bytes_per_set: int) -> int:
        """Number of input sets so that all sets together exceed twice the L2 cache (at most 16)."""
        return max(1, min(MAX_ROTATION_SETS, math.ceil(2 * self.l2_bytes / max(1, bytes_per_set))))

    @staticmethod
    def capture(calls: List[Callable]) -> torch.cuda.CUDAGraph:
        """One CUDA graph running all `calls` (warmed up first, outside the capture: compilation, allocator,
        cuBLAS workspaces)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for call in calls:
                call()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for call in calls:
                call()
        return graph

    @classmethod
    def graph_ms(cls, calls: List[Callable]) -> float:
        """GPU milliseconds of one call in steady state: all `calls` (one per input set) in one CUDA graph,
        replayed back to back; median over rounds of the replay time / number of calls."""
        graph = cls.capture(calls)
        ms = steady_replay_ms(graph.replay) / len(calls)
        del graph
        return ms

    @classmethod
    def flushed_graph_ms(cls, calls: List[Callable]) -> float:
        """Like graph_ms but timed by triton's do_bench, which writes a 256 MB buffer (clearing L2) before every
        replay; kept for comparison in the tuning sweep."""
        graph = cls.capture(calls)
        ms = do_bench(graph.replay, warmup=WARMUP_MS, rep=REP_MS, return_mode="median") / len(calls)
        del graph
        return ms

    @staticmethod
    def eager_ms(calls: List[Callable]) -> float:
        """Milliseconds of one eager call (host overhead included when the GPU cannot hide it)."""
        state = {"i": 0}

        def run():
            calls[state["i"] % len(calls)]()
            state["i"] += 1

        return do_bench(run, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")

    def measure(self, calls: List[Callable], eager: bool = True) -> Timing:
        """GPU time (and eager time unless `eager` is False) of one call cycling over `calls`."""
        return Timing(self.graph_ms(calls), self.eager_ms(calls) if eager else None)

    def add(self, section, name, kernel: Timing, baseline: Optional[Timing] = None, bytes_moved=None, flops=None,
            target=None, **extra):
        """Records and prints one row; `target(row) -> (text, met)` judges the GPU-time columns."""
        ms = kernel.graph_ms
        row = {"section": section, "name": name, "ms": ms, "eager_ms": kernel.eager_ms,
               "baseline_ms": baseline.graph_ms if baseline else None,
               "baseline_eager_ms": baseline.eager_ms if baseline else None,
               "gbps": bytes_moved / ms / 1e6 if bytes_moved else None,
               "tflops": flops / ms / 1e9 if flops else None, **extra}
        row["speedup"] = row["baseline_ms"] / ms if baseline else None
        row["eager_speedup"] = (row["baseline_eager_ms"] / kernel.eager_ms
                                if baseline and kernel.eager_ms and baseline.eager_ms else None)
        row["pct_hbm"] = 100 * row["gbps"] / self.hbm_gbps if row["gbps"] else None
        if target is not None:
            row["target"], row["meets"] = target(row)
        self.rows.append(row)
        print(format_row(row), flush=True)
        return row

    def guard(self, section, name, fn):
        """Runs one row; an exception is reported (with its row) and recorded instead of stopping the run."""
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - every failure must be reported, then the run goes on
            message = f"{type(exc).__name__}: {exc}"
            print(f"!! ERROR in {section} [{name}]: {message}", flush=True)
            traceback.print_exc(file=sys.stderr)
            self.errors.append({"section": section, "name": name, "error": message})
            return None
        finally:
            torch.cuda.empty_cache()


HEADER = (f"{'section':<10} {'case':<46} {'time':>10} {'bandwidth':>13} {'':>10} {'compute':>12}  {'baseline':>12}"
          f" {'ratio':>6} | {'eager':>10} {'base':>10} {'ratio':>6} | target")


def format_row(row) -> str:
    def num(value, fmt, scale=1.0):
        return format(value * scale, fmt) if value is not None else "-"

    meets = {True: "ok", False: "MISS", None: ""}[row.get("meets")]
    return (f"{row['section']:<10} {row['name']:<46} {num(row['ms'], '7.1f', 1e3)} us"
            f" {num(row['gbps'], '8.0f')} GB/s {num(row['pct_hbm'], '5.1f')} %HBM {num(row['tflops'], '6.1f')} TF/s"
            f"  {num(row['baseline_ms'], '9.1f', 1e3)} us x{num(row['speedup'], '5.2f')}"
            f" | {num(row['eager_ms'], '7.1f', 1e3)} us {num(row['baseline_eager_ms'], '7.1f', 1e3)} us"
            f" x{num(row['eager_speedup'], '5.2f')} | {row.get('target', '')} {meets}")


def check_close(name, out, ref, rel=2e-2):
    """Raises with a readable message unless max |out - ref| <= rel * max |ref| (and out has no NaN)."""
    out64, ref64 = out.double(), ref.double()
    if torch.isnan(out64).any():
        raise AssertionError(f"{name}: NaN in kernel output")
    err = (out64 - ref64).abs().max().item()
    scale = ref64.abs().max().item()
    if err > rel * max(scale, 1e-30):
        raise AssertionError(f"{name}: kernel differs from baseline: max error {err:.3g} vs max |ref| {scale:.3g}")


# ----------------------------------------------------------------------------------------------------------
# torch baseline shared by the attention families


def sdpa_function(q, k, v, causal):
    """A call of torch SDPA with GQA on the first backend that accepts these inputs, and its name."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gqa = q.shape[1] != k.shape[1]
    failures = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.MATH):
        def call(q=q, k=k, v=v, backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

        try:
            call()
            torch.cuda.synchronize()
            return call, backend.name
        except RuntimeError as exc:
            failures.append(f"{backend.name}: {str(exc).splitlines()[0]}")
    raise RuntimeError("no SDPA backend accepts these inputs: " + "; ".join(failures))


# ----------------------------------------------------------------------------------------------------------
# command line and run
#
# A family is a module with SECTIONS (names, in run order) and run(bench, sections, grid, args) -> dict of
# extra JSON fields (sections: the chosen ones of SECTIONS, maybe none); optionally add_arguments(parser) and
# finish(fields, args), called after every family has run.


def section_names(families) -> List[str]:
    """Every section of `families`, in run order."""
    return [section for family in families for section in family.SECTIONS]


def make_parser(families, description: str) -> argparse.ArgumentParser:
    """The command line of a benchmark script running `families`."""
    sections = section_names(families)
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", help="write the results as JSON to this path")
    for family in families:
        if hasattr(family, "add_arguments"):
            family.add_arguments(parser)
    parser.add_argument("--sections", default=",".join(sections),
                        help=f"comma-separated subset of: {', '.join(sections)}")
    parser.add_argument("--quick", action="store_true", help="smaller shape grids")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size of the attention rows")
    parser.add_argument("--hbm-gbps", type=float, default=4200.0, help="HBM bandwidth the %%HBM column uses")
    return parser


def main(families, doc: str, argv=None):
    """Runs the chosen sections of `families` in order: env line, table, targets summary, JSON to --out; exit
    status 1 after all rows if any row failed. `doc`: the script's docstring (its first line describes it)."""
    args = make_parser(families, doc.splitlines()[0]).parse_args(argv)
    script = os.path.basename(sys.argv[0])
    if not torch.cuda.is_available():
        sys.exit(f"{script} needs a CUDA GPU (torch.cuda.is_available() is False)")
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - set(section_names(families))
    if unknown:
        sys.exit(f"unknown sections: {sorted(unknown)}")

    torch.manual_seed(0)
    bench = Bench(args.hbm_gbps)
    grid = "quick" if args.quick else "full"
    env = {"device": torch.cuda.get_device_name(DEVICE), "torch": torch.__version__, "triton": triton.__version__,
           "sm_count": torch.cuda.get_device_properties(DEVICE).multi_processor_count, "l2_bytes": bench.l2_bytes,
           "hbm_gbps_reference": args.hbm_gbps, "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "dtype": str(DTYPE), "block_size": args.block_size, "quick": args.quick,
           "timing": "time/ratio: CUDA-graph GPU time per call; eager: one Python call per timed run"}
    print(json.dumps(env))
    print(HEADER)

    results = []
    with torch.inference_mode():
        for family in families:
            chosen = [s for s in family.SECTIONS if s in sections]
            results.append((family, family.run(bench, chosen, grid, args) or {}))
    fields = {}
    for family, family_fields in results:
        if hasattr(family, "finish"):
            family.finish(family_fields, args)
        fields.update(family_fields)

    judged = [r for r in bench.rows if r.get("meets") is not None]
    missed = [r for r in judged if not r["meets"]]
    print(f"\ntargets met (GPU time): {len(judged) - len(missed)}/{len(judged)}")
    for r in missed:
        pct = f"{r['pct_hbm']:.1f} %HBM" if r["pct_hbm"] is not None else ""
        print(f"  MISS {r['section']} {r['name']}: {r['target']} (x{r['speedup']:.2f} {pct})")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"env": env, "rows": bench.rows, **fields, "errors": bench.errors}, f, indent=1)
        print(f"wrote {args.out}")
    if bench.errors:
        print(f"\n{len(bench.errors)} ERROR(S):")
        for e in bench.errors:
            print(f"  {e['section']} [{e['name']}]: {e['error']}")
        sys.exit(1)
