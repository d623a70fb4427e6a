"""Offline throughput, like `vllm bench throughput`: R requests submitted at once, measured to the last token.

Per device KV pool size (emulating smaller GPUs) and per offload mode, in one process: an engine with the
default config (but the pools), warmed up, is handed all R requests in one `stream` call; the run ends with
the batch's last token. Reports makespan, requests/s, output tokens/s, TTFT and TPOT (p50/p90/p99), the
requests that ran in each pool, GPU energy per token on CUDA, and each mode's tokens/s against the first mode
(the baseline, "never" by default). Several --requests values give one row each (tokens/s against R in the plot).
On CUDA each row also keeps the batch model's prediction and its inputs (the profile, the graphs' calibration,
the limits: `model_inputs`), so that the prediction can be replayed off the GPU. Each row's `diagnostics` say
where its steps went: per kind of step (count, seconds, the longest), the graphs captured inside the batch, and
the batch's five slowest steps with the main thread's phases inside each (where a one-off spent its time).

Before the first measured row, a rehearsal engine runs a slice of the workload (its first prompts, a few
tokens each) and is discarded: the process's first engine otherwise pays torch.compile's traces of the prompt
steps' shapes inside its timed batch, which the later engines of the process reuse (the first mode would look
up to 2x slower on a short batch).

    python benchmarks/offline.py --shape llama3_8b --device-gib 1,2 --requests 192 --prompt 768 --output 192
    python benchmarks/offline.py --shape llama3_8b --device-gib 1 --requests 1000 --prompt 1024 --output 256
    python benchmarks/offline.py --shape llama2_7b --dist chat --prompt 128:2048 --output 64:512 --requests 64,400
    python benchmarks/offline.py --shape smollm2 --requests 16 --prompt 64 --output 32 --device-gib 0.01  # CPU smoke
"""
import argparse
import dataclasses
import gc
import os
import statistics
import sys
import time
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import (GiB, Lengths, RequestTimes, EnergyMeter, build_model, fmt_ms, machine,  # noqa: E402
                      parse_range, prompts_for, run_to_length, summarize, write_json)

from apex_compile import ApexConfig, optimize  # noqa: E402
from apex_compile.runtime.batch_model import engine_limits, engine_state  # noqa: E402
from apex_compile.runtime.perf_profile import engine_profile  # noqa: E402


def parse_offload(mode: str):
    """An offload mode as ApexConfig takes it: a name or a host fraction."""
    try:
        return float(mode)
    except ValueError:
        return mode


def engine_config(mode: str, device_gib: float, host_gib: float, args) -> ApexConfig:
    """The default config, but the pools, the mode and the user's explicit overrides."""
    extra = {}
    if args.max_num_seqs:
        extra["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens:
        extra["max_num_batched_tokens"] = args.max_num_batched_tokens
    return ApexConfig(offload=parse_offload(mode), gpu_cache_size=int(device_gib * GiB),
                      cpu_cache_size=int(host_gib * GiB), max_model_len=args.max_model_len, **extra)


def rehearse(model, config: ApexConfig, prompts, lengths, count: int = 64) -> float:
    """Runs the workload's first `count` prompts for 4 tokens each on a throwaway engine; returns its seconds."""
    start = time.perf_counter()
    apex = optimize(model, config)
    try:
        apex.engine.warmup()
        apex.engine.generate(prompts[:count], [run_to_length(min(out, 4)) for _, out in lengths[:count]],
                             progress=False)
    finally:
        apex.close()
        del apex
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return time.perf_counter() - start


def engine_counters(engine) -> dict:
    """The engine's counters that tell where a batch's time went (their differences over the batch go into
    its row): steps queued ahead and why others were not, the main thread's seconds per part of a step, moves
    between the pools, and the GPU's waits for the staggered plan's CPU jobs."""
    stats = engine.stats
    executor = getattr(getattr(getattr(engine, "plan", None), "pipeline", None), "executor", None)
    return {"ahead_steps": stats.ahead_steps, "not_ahead": dict(stats.not_ahead),
            "phase_seconds": dict(stats.phase_seconds), "forward_seconds": stats.forward_seconds,
            "moved": stats.moved, "parked": stats.parked, "recomputed": stats.recomputed,
            "migrated": stats.migrated, "emptied": stats.emptied, "last_host_entry_step": stats.last_host_entry_step,
            "cpu_job_wait_s": getattr(executor, "waited_s", 0.0),
            "step_kinds": {kind: list(v) for kind, v in stats.step_kinds.items()},
            "captures": graph_captures(getattr(engine, "plan", None))}


# the plan's graph families captured lazily, the first time a step meets a key (the decode graphs are captured by
# the warm-up): the piecewise and whole mixed graphs, GPU-only and staggered
LAZY_GRAPHS = ("pieces", "mixed", "stagger_pieces", "stagger_mixed")


def graph_captures(plan) -> dict:
    """{family: [keys captured, seconds]} of the plan's lazily captured graphs (none without CUDA graphs): over a
    batch, the captures that landed inside it, whose seconds its makespan includes and the batch model leaves out."""
    out = {}
    for name in LAZY_GRAPHS:
        graphs = getattr(plan, name, None)
        if graphs is not None:
            keys = getattr(graphs, "pieces", None)
            out[name] = [len(keys if keys is not None else graphs.graphs), graphs.capture_seconds]
    return out


def row_limit_sample(engine) -> Optional[dict]:
    """Where the staggered pipeline's adaptive row limit stands (None without a pipeline or before its CPU job was
    fitted): the rows a step serves (unrounded) and the job's fitted rate beside the profile's, in seconds per
    context token over all layers, so a run tells whether the profile's CPU rate held while the pipeline ran."""
    pipeline = getattr(getattr(engine, "plan", None), "pipeline", None)
    rows = getattr(pipeline, "rows", None)
    if rows is None or rows.rate is None:
        return None
    layers = rows.num_layers
    return {"step": engine.stats.steps, "rows": rows.fraction, "rate_s_per_token": rows.rate * layers,
            "fixed_s": rows.fixed,
            "profile_s_per_token": None if rows.prior_rate is None else rows.prior_rate * layers}


def difference(after, before):
    """after - before, through dicts and [count, seconds, longest] lists (a fresh engine's warm-up zeroes its
    counters, so the longest is the batch's)."""
    if isinstance(after, dict):
        return {k: difference(v, before.get(k, 0 if not isinstance(v, (dict, list)) else type(v)()))
                for k, v in after.items()}
    if isinstance(after, list):
        return [a - (before[i] if i < len(before) else 0) for i, a in enumerate(after)]
    return after - before


def run_batch(model, config: ApexConfig, prompts, lengths, progress_s: float = 10.0) -> dict:
    """One engine over one batch: every request submitted at once, timed to its last token."""
    apex = optimize(model, config)
    engine = apex.engine
    try:
        start = time.perf_counter()
        engine.warmup()
        warmup_s = time.perf_counter() - start
        predicted = engine.predict_batch(lengths) if engine.device.type == "cuda" else {}
        held = sorted(engine_state(engine)[1].captured)  # the pipeline prompt sizes captured before the batch
        sampling = [run_to_length(out) for _, out in lengths]
        requests_before = list(engine.stats.requests_per_pool)
        steps_before = engine.stats.steps
        counters_before = engine_counters(engine)
        with EnergyMeter() as energy:
            start = time.perf_counter()
            times = [RequestTimes(start) for _ in prompts]
            last_print, last_sample, done, samples = start, start, 0, []
            for event in engine.stream(prompts, sampling, progress=False):
                now = time.perf_counter()
                times[event.index].token_times.append(now)
                done += event.finish_reason is not None
                if now - last_sample > 1.0:
                    last_sample = now
                    sample = row_limit_sample(engine)
                    if sample is not None:
                        samples.append(sample)
                if now - last_print > progress_s:
                    last_print = now
                    print(f"    {now - start:6.0f}s  {done}/{len(prompts)} requests done", flush=True)
            end = time.perf_counter()
        result = summarize(times, start, end)
        result.update(energy.report(result["output_tokens"]))
        result["warmup_s"] = warmup_s
        # the model's makespan for this engine's plan (GPU-only unless auto runs the staggered plan) and the other
        own = predicted.get("auto", predicted.get("never"))
        if own is not None:
            result["predicted"] = {plan: {"makespan_s": p.makespan_s, "steps": p.steps, "host_requests":
                                          p.host_requests, "parks": p.parks, "migrated": p.migrated,
                                          "last_entry_step": p.last_entry_step, "captures": p.captures,
                                          "step_kinds": {k: list(v) for k, v in p.kinds.items()}}
                                   for plan, p in predicted.items()}
            result["predicted_plan"] = own.plan
            # what the prediction was made from, so that it can be replayed (and its prices studied) off the GPU:
            # the profile, the graphs' calibration, the batch limits and the piece sizes captured before it
            profile = (engine.auto_policy.model.profile if engine.auto_policy is not None
                       else engine_profile(engine))  # (read from the on-disk cache predict_batch filled)
            result["model_inputs"] = {"profile": dataclasses.asdict(profile),
                                      "calibration": dataclasses.asdict(engine.calibration),
                                      "limits": dataclasses.asdict(engine_limits(engine)), "captured": held}
            result["predicted_makespan_s"] = own.makespan_s
            result["prediction_error"] = own.makespan_s / result["duration_s"] - 1
        result["steps"] = engine.stats.steps - steps_before
        result["requests_per_pool"] = dict(zip(("device", "host"),
                                               (a - b for a, b in zip(engine.stats.requests_per_pool,
                                                                      requests_before))))
        result["diagnostics"] = difference(engine_counters(engine), counters_before)
        # the batch's slowest steps: the warm-up zeroed the counters, so every step kept is the batch's
        result["diagnostics"]["slowest_steps"] = [dict(entry) for entry in engine.stats.slowest_steps]
        if samples:
            result["row_limit"] = samples
        return result
    finally:
        apex.close()
        del apex, engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def print_row(pool, mode, requests, result, base):
    ratio = "" if base is None else f"{result['output_tokens_per_s'] / base:5.2f}x"
    print(f"  {pool:>5} GiB  {mode:>10}  R={requests:<5} {result['output_tokens_per_s']:8.1f} tok/s {ratio:>6}  "
          f"makespan {result['duration_s']:7.1f}s  {result['requests_per_s']:6.2f} req/s  "
          f"TTFT p50/p99 {fmt_ms(result['ttft_s']['p50'])}/{fmt_ms(result['ttft_s']['p99'])} ms  "
          f"TPOT p50/p99 {fmt_ms(result['tpot_s']['p50'])}/{fmt_ms(result['tpot_s']['p99'])} ms  "
          f"host requests {result['requests_per_pool']['host']}"
          + (f"  predicted makespan {result['predicted_makespan_s']:.1f}s ({result['prediction_error']:+.1%})"
             if "predicted_makespan_s" in result else "")
          + (f"  {result['tokens_per_joule']:.2f} tok/J" if "tokens_per_joule" in result else ""), flush=True)
    d = result.get("diagnostics")
    if d:
        phases = ", ".join(f"{k} {v:.1f}" for k, v in d["phase_seconds"].items())
        not_ahead = ", ".join(f"{k} {v}" for k, v in sorted(d["not_ahead"].items()) if v)
        print(f"      {result['steps']} steps, {d['ahead_steps']} queued ahead (not: {not_ahead or '-'}); main thread "
              f"s: {phases}; GPU waited {d['cpu_job_wait_s']:.1f} s for CPU jobs; moved {d['moved']}, parked "
              f"{d['parked']}, migrated {d['migrated']}, parked by a falling ceiling {d['emptied']}"
              + (f", last host entry at step {d['last_host_entry_step']}" if result["requests_per_pool"]["host"]
                 else ""), flush=True)
        predicted = (result.get("predicted") or {}).get(result.get("predicted_plan"))
        if predicted and predicted["host_requests"]:
            print(f"      predicted: {predicted['steps']} steps, {predicted['host_requests']} host requests, migrated "
                  f"{predicted['migrated']}, last host entry at step {predicted['last_entry_step']}, "
                  f"{predicted.get('captures', 0)} pipeline prompt sizes captured", flush=True)
        own = (result.get("predicted") or {}).get(result.get("predicted_plan"), {}).get("step_kinds", {})
        kinds = [f"{kind} {n} x {1e3 * s / n:.2f} ms (longest {1e3 * longest:.1f})"
                 + (f" (predicted {own[kind][0]} x {1e3 * own[kind][1] / max(own[kind][0], 1):.2f})" if kind in own
                    else "") for kind, (n, s, longest) in d["step_kinds"].items() if n]
        print(f"      steps by kind: {'; '.join(kinds)}", flush=True)
        captured = [f"{name} {n} in {seconds:.1f} s" for name, (n, seconds) in d.get("captures", {}).items() if n]
        if captured:
            print(f"      graphs captured inside the batch: {'; '.join(captured)}", flush=True)
        slowest = [f"#{e['step']} {e['kind']} {1e3 * e['seconds']:.0f} ms ("
                   + ", ".join(f"{phase} {1e3 * t:.0f}" for phase, t in e["phases"].items() if t >= 0.1 * e["seconds"])
                   + (f", captures {1e3 * e['captured']:.0f}" if e["captured"] else "") + ")"
                   for e in d.get("slowest_steps", [])]
        if slowest:
            print(f"      slowest steps: {'; '.join(slowest)}", flush=True)
    samples = result.get("row_limit")
    if samples:
        mid = lambda key: statistics.median(s[key] for s in samples)  # noqa: E731
        prior = samples[-1]["profile_s_per_token"]
        print(f"      CPU job (median of {len(samples)} samples): {mid('rows'):.2f} rows a step, "
              f"{1e6 * mid('rate_s_per_token'):.2f} us per context token (all layers) + {1e3 * mid('fixed_s'):.2f} ms"
              + (f"; profile {1e6 * prior:.2f} us" if prior else ""), flush=True)


def plot(result: dict, path: str) -> None:
    """tokens/s against R, one line per (mode, pool)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = {}
    for row in result["rows"]:
        series.setdefault((row["mode"], row["device_gib"]), []).append((row["num_requests"],
                                                                        row["output_tokens_per_s"]))
    for (mode, pool), points in sorted(series.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"{mode}, {pool} GiB")
    ax.set_xlabel("requests in the batch (R)")
    ax.set_ylabel("output tokens/s (to the last token)")
    ax.set_title(f"offline: {result['model']}, {result['lengths']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama3_8b", help="llama3_8b | llama2_7b | smollm2 (embedded)")
    parser.add_argument("--modes", default="never,auto", help="offload modes; the first is the baseline")
    parser.add_argument("--device-gib", default="1,2", help="device KV pool sizes, GiB")
    parser.add_argument("--host-gib", type=float, default=32.0, help="host KV pool, GiB")
    parser.add_argument("--requests", default="192", help="batch sizes R (comma-separated)")
    parser.add_argument("--dist", choices=("fixed", "uniform", "chat"), default="fixed")
    parser.add_argument("--prompt", default="768", help="prompt length, or lo:hi for uniform / chat")
    parser.add_argument("--output", default="192", help="output length, or lo:hi for uniform / chat")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=None, help="override ApexConfig.max_num_seqs")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--out", default=None, help="JSON result path")
    parser.add_argument("--plot", default=None, help="PNG path (tokens/s against R)")
    parser.add_argument("--no-rehearsal", action="store_true", help="skip the throwaway warm-up batch")
    args = parser.parse_args(argv)

    lengths_spec = Lengths(args.dist, parse_range(args.prompt), parse_range(args.output))
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    pools = [float(x) for x in args.device_gib.split(",")]
    counts = [int(x) for x in args.requests.split(",")]
    model, label = build_model(args.shape)
    result = {"benchmark": "offline", "model": label, "lengths": lengths_spec.describe(), "seed": args.seed,
              "modes": modes, "host_gib": args.host_gib, "machine": machine(), "rows": []}
    print(f"offline: {label}, {lengths_spec.describe()}, modes {modes}, device pools {pools} GiB, "
          f"host {args.host_gib} GiB", flush=True)
    for count in counts:
        lengths = lengths_spec.draw(count, args.seed)
        prompts = prompts_for(lengths, model.config.vocab_size, args.seed)
        if not args.no_rehearsal and count == counts[0]:
            seconds = rehearse(model, engine_config(modes[0], pools[0], args.host_gib, args), prompts, lengths)
            result["rehearsal_s"] = seconds
            print(f"  rehearsal (throwaway engine, first prompts, 4 tokens each): {seconds:.1f} s", flush=True)
        for pool in pools:
            base = None
            for mode in modes:
                row = run_batch(model, engine_config(mode, pool, args.host_gib, args), prompts, lengths)
                row.update(mode=mode, device_gib=pool, num_requests=count)
                if base is None:
                    base = row["output_tokens_per_s"]
                else:
                    row["vs_baseline"] = row["output_tokens_per_s"] / base
                print_row(pool, mode, count, row, None if mode == modes[0] else base)
                result["rows"].append(row)
                write_json(args.out, result)  # after every row: a run cut short keeps what it measured
    if args.plot:
        plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
