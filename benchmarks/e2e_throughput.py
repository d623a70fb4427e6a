"""End-to-end decode throughput on one CUDA GPU: apex (offload never) vs HF generate (static cache + compile) vs
the step's GEMM floor, per model shape, batch and prompt length, all in one run.

- apex: requests submitted to the engine, which is stepped by hand so every step is timed on the host (each step
  ends with the sampled ids on the host, so its wall time is its real time). decode step = median over the
  decode-only steps; tokens/s = new tokens / (time of the whole generate, prefill included).
- HF: `generate(cache_implementation="static")` (transformers compiles the forward), decode step = (time of a
  192-token generate - time of a 64-token generate) / 128, so prefill cancels.
- GEMM floor: every linear weight of one decode step (q, k, v, o, gate, up, down per layer and the LM head) as
  a cuBLAS GEMM at the batch's token count, captured in one CUDA graph; "x mfloor": the step against the same
  floor with each layer's q/k/v and gate/up weights as one GEMM each (the engine merges them).
- % HBM: (weight bytes + KV bytes read by a decode step at the mean context) / step time, against the H200's
  measured copy bandwidth (HBM_REFERENCE).
Also reported per shape: the warm-up (compile + graph capture) time of the engine, and a host-time breakdown
of decode steps (schedule, input fill + copy, graph replay + sampling).

    python benchmarks/e2e_throughput.py --out benchmarks/results/e2e_throughput/<date>_<machine>.json
    python benchmarks/e2e_throughput.py --shapes llama3_8b --batches 1,16,64 --prompts 128 --no-hf
"""
import argparse
import cProfile
import datetime
import gc
import io
import json
import os
import platform
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from apex_compile.config import ApexConfig  # noqa: E402
from apex_compile.model import optimize  # noqa: E402
from apex_compile.runtime.perf_profile import linear_seconds  # noqa: E402
from apex_compile.runtime.request import SamplingParams  # noqa: E402

HBM_REFERENCE = 4.225e12  # bytes/s, device-to-device copy on the H200 (shared/DEVICE.md)
SHAPES = {
    "llama3_8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
    "llama2_7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096),
}


def random_llama(shape: dict, dtype=torch.bfloat16):
    """A randomly initialised LlamaForCausalLM of `shape`, built on the GPU, no EOS (every request runs long)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(LlamaConfig(**shape)).eval()
    finally:
        torch.set_default_dtype(previous)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def linear_weights(model):
    return [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]


def gemm_floor(model, tokens: int, replays: int = 20) -> float:
    """Seconds of every linear weight as a cuBLAS GEMM at `tokens` rows, in one CUDA graph."""
    with torch.inference_mode():
        return linear_seconds(model, tokens, replays)


def merged_gemm_floor(model, tokens: int, replays: int = 20) -> float:
    """The GEMM floor with each layer's q/k/v and gate/up weights as one GEMM each, as the engine runs them (it
    merged them into one buffer per group)."""
    from apex_compile.ops.linear import PROJECTION_GROUPS, merged_view
    from apex_compile.runtime.perf_profile import _graph_seconds

    weights, grouped = [], set()
    for module in model.modules():
        for names in PROJECTION_GROUPS:
            linears = [getattr(module, n, None) for n in names]
            if all(isinstance(lin, torch.nn.Linear) for lin in linears):
                merged = merged_view([lin.weight for lin in linears])
                if merged is not None:
                    weights.append(merged)
                    grouped.update(id(lin) for lin in linears)
    weights += [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear) and id(m) not in grouped]
    inputs = {w.shape[1]: torch.randn(tokens, w.shape[1], dtype=w.dtype, device=w.device) for w in weights}

    def run():
        for w in weights:
            torch.nn.functional.linear(inputs[w.shape[1]], w)

    with torch.inference_mode():
        return _graph_seconds(run, replays)


def kv_bytes_per_token(shape: dict, dtype_bytes: int = 2) -> int:
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    return 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim * dtype_bytes


class HostTimer:
    """Wraps engine methods to add up host seconds per phase of the decode-only steps."""

    def __init__(self, engine):
        self.seconds = {"schedule": 0.0, "fill+copy": 0.0, "forward": 0.0, "wait+finish": 0.0}
        self.active = False
        for name, obj, attr in (("schedule", engine, "_schedule"), ("fill+copy", engine.buffers, "fill"),
                                ("forward", engine.plan, "run_model"), ("wait+finish", engine, "_resolve")):
            setattr(obj, attr, self._wrap(name, getattr(obj, attr)))
        for graphs in (engine.graphs, engine.pieces, engine.mixed):
            if graphs is not None:
                graphs.replay = self._wrap("forward", graphs.replay)

    def _wrap(self, name, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.active:
                    self.seconds[name] += time.perf_counter() - start
        return timed


def run_apex(model, shape, batch, prompt_len, new_tokens, prompts, args, async_scheduling=None):
    """tokens/s and the median decode step of apex, plus warm-up seconds and host breakdown (async_scheduling:
    ApexConfig's, None its default)."""
    need = batch * (prompt_len + new_tokens + 32) * kv_bytes_per_token(shape)
    config = ApexConfig(offload="never", gpu_cache_size=int(need * 1.1) + (256 << 20), cpu_cache_size=0,
                        max_num_seqs=batch, max_num_batched_tokens=args.prefill_tokens,
                        max_model_len=prompt_len + new_tokens + 64, cuda_graphs=not args.no_graphs,
                        async_scheduling=async_scheduling)
    apex = optimize(model, config)
    engine = apex.engine
    start = time.perf_counter()
    engine.warmup()
    warmup_seconds = time.perf_counter() - start
    timer = HostTimer(engine)
    sampling = SamplingParams(max_new_tokens=new_tokens)
    results = []
    profile = None
    if batch in args.profile_batches:
        from torch.profiler import ProfilerActivity, profile as torch_profile
        profile = torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        print(f"profile of 5 decode steps at batch {batch} (cuda time over the 5 steps):")
    for _ in range(args.repeats):
        torch.cuda.synchronize()
        step_times, decode_steps = [], 0
        begin = time.perf_counter()
        for p in prompts:
            engine.add_request(p, sampling)
        while engine.has_unfinished():
            # (with a step queued ahead, its rows' KV is counted in num_computed before their token arrives)
            decoding = bool(engine.scheduler.running) and not engine.scheduler.waiting and all(
                r.num_computed >= r.num_tokens - 1 for r in engine.scheduler.running)
            timer.active = decoding
            if profile is not None and decode_steps == 40 and decoding:
                profile.__enter__()
            t0 = time.perf_counter()
            engine.step()
            if profile is not None and decode_steps == 44 and decoding:
                profile.__exit__(None, None, None)
                print(profile.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))
                profile = None
            if decoding:
                step_times.append(time.perf_counter() - t0)
                decode_steps += 1
        timer.active = False
        total = time.perf_counter() - begin
        results.append((total, statistics.median(step_times), decode_steps))
    total, step, decode_steps = min(results)
    breakdown = {k: v / max(decode_steps * args.repeats, 1) for k, v in timer.seconds.items()}
    apex.close()  # its pools and threads go now, not at a later garbage collection
    del apex, engine
    return {"tokens_per_s": batch * new_tokens / total, "decode_step_s": step, "warmup_s": warmup_seconds,
            "host_breakdown_s": breakdown, "async_scheduling": async_scheduling}


def timed_generate(model, ids: torch.Tensor, tokens: int, **kwargs):
    """(seconds, new tokens per row) of one greedy HF `generate` of exactly `tokens` new tokens (GPU synced)."""
    if ids.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                             min_new_tokens=tokens, do_sample=False, **kwargs)
    if ids.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start, out.shape[1] - ids.shape[1]


def run_hf(model, batch, prompt_len, prompts):
    """HF generate with the static cache (compiled by transformers): tokens/s of 128 tokens, decode step."""
    ids = torch.tensor(prompts, device="cuda")

    def generate(n):
        return timed_generate(model, ids, n, cache_implementation="static")[0]

    start = time.perf_counter()
    generate(8)  # compile for this batch size
    compile_s = time.perf_counter() - start
    t64 = min(generate(64) for _ in range(2))
    t192 = min(generate(192) for _ in range(2))
    t128 = min(generate(128) for _ in range(2))
    return {"tokens_per_s": batch * 128 / t128, "decode_step_s": (t192 - t64) / 128, "compile_s": compile_s}


def compile_seconds() -> dict:
    """Seconds per phase of the compilations so far (dynamo's counters)."""
    from torch._dynamo.utils import compile_times

    headers, values = compile_times(repr="csv", aggregate=True)
    return dict(zip(headers, map(float, values)))


def compile_phases() -> str:
    """Seconds per phase of the compilations so far: dynamo's trace, the backend (apex passes + inductor)."""
    times = compile_seconds()
    names = {"_compile.compile_inner": "dynamo total", "bytecode_tracing": "trace",
             "OutputGraph.call_user_compiler": "backend", "compile_fx": "inductor", "build_guards": "guards"}
    return ", ".join(f"{label} {times[name]:.1f}" for name, label in names.items() if name in times)


def warmup_only(args):
    """Prints the warm-up seconds of a fresh engine per shape (compile, then graph capture)."""
    for shape_name in args.shapes.split(","):
        torch.manual_seed(0)
        model = random_llama(SHAPES[shape_name])
        batch = max(int(b) for b in args.batches.split(","))
        apex = optimize(model, ApexConfig(offload="never", gpu_cache_size=4 << 30, cpu_cache_size=0,
                                          max_num_seqs=batch, max_num_batched_tokens=args.prefill_tokens))
        profiler = cProfile.Profile() if args.cprofile else None
        start = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        apex.engine.warmup()
        total = time.perf_counter() - start
        if profiler is not None:  # where a warm-up's host time goes, by cumulative time
            profiler.disable()
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(args.cprofile)
            print(out.getvalue().split("ncalls", 1)[-1], flush=True)
        # (the first capture runs the step's first call, so capture_seconds includes its compile: compile time
        # comes from dynamo's own counters instead)
        compiled = compile_seconds().get("_compile.compile_inner", 0.0)
        print(f"warm-up {shape_name} batch {batch}: {total:.1f} s ({compiled:.1f} s compiling, the rest capturing "
              f"{len(apex.engine.graphs.sizes)} graphs, {len(apex.engine.pieces.pieces)} piecewise keys, "
              f"{len(apex.engine.mixed.graphs) if apex.engine.mixed else 0} mixed graphs and "
              "running the warm-up requests)", flush=True)
        print("  compile phases (s): " + compile_phases(), flush=True)
        from torch._dynamo.utils import counters
        caches = {f"{group}.{key}": n for group in ("aot_autograd", "inductor") for key, n in counters[group].items()
                  if "cache" in key}
        print(f"  caches: {caches}, dynamo restarts: {dict(counters['stats']).get('unique_graphs')} graphs", flush=True)
        del apex, model
        gc.collect()
        torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="llama3_8b,llama2_7b")
    parser.add_argument("--batches", default="1,16,64,128")
    parser.add_argument("--prompts", default="128,1024")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prefill-tokens", type=int, default=8192, help="max_num_batched_tokens")
    parser.add_argument("--repeats", type=int, default=2, help="runs per row; the fastest counts (the first JITs)")
    parser.add_argument("--no-hf", action="store_true", help="skip HF generate")
    parser.add_argument("--hf-batches", default=None, help="batches that also run HF (default: all)")
    parser.add_argument("--no-graphs", action="store_true", help="apex with cuda_graphs=False")
    parser.add_argument("--no-sync", action="store_true",
                        help="skip the second apex run with async_scheduling=False (by default both run per row)")
    parser.add_argument("--warmup-only", action="store_true",
                        help="time the warm-up of an engine (compile + capture at the largest batch) and exit; run "
                             "it in a fresh process twice to see the cold and the warm compile cache")
    parser.add_argument("--cprofile", type=int, default=0,
                        help="with --warmup-only: print the N functions of most cumulative time (cProfile)")
    parser.add_argument("--profile", default="", help="batches whose decode steps 41-45 are profiled")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("e2e_throughput.py needs a CUDA GPU")
    result = {"benchmark": "e2e_throughput", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                          "python": platform.python_version()}, "rows": []}
    args.profile_batches = {int(b) for b in args.profile.split(",") if b}
    if args.warmup_only:
        return warmup_only(args)
    hf_batches = None if args.hf_batches is None else {int(b) for b in args.hf_batches.split(",")}
    print(f"{'shape':10} {'batch':>5} {'prompt':>6} | {'apex tok/s':>10} {'step ms':>8} {'floor ms':>8} "
          f"{'x floor':>7} {'x mfloor':>8} {'HBM %':>6} | {'HF tok/s':>9} {'HF step':>8} {'apex/HF':>7} | "
          "warm-up s, host ms/step")
    for shape_name in args.shapes.split(","):
        shape = SHAPES[shape_name]
        torch.manual_seed(0)
        model = random_llama(shape)
        weight_bytes = sum(w.numel() * w.element_size() for w in linear_weights(model))
        for prompt_len in (int(p) for p in args.prompts.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):
                prompts = torch.randint(3, shape["vocab_size"], (batch, prompt_len)).tolist()
                floor = gemm_floor(model, batch)
                apex = run_apex(model, shape, batch, prompt_len, args.new_tokens, prompts, args)
                sync = None if args.no_sync else run_apex(model, shape, batch, prompt_len, args.new_tokens, prompts,
                                                          args, async_scheduling=False)
                merged_floor = merged_gemm_floor(model, batch)  # apex merged the weights (same values)
                gc.collect()
                torch.cuda.empty_cache()
                hf = None
                if not args.no_hf and (hf_batches is None or batch in hf_batches):
                    hf = run_hf(model, batch, prompt_len, prompts)
                    torch._dynamo.reset()
                    gc.collect()
                    torch.cuda.empty_cache()
                kv_read = batch * (prompt_len + args.new_tokens / 2) * kv_bytes_per_token(shape)
                row = {"shape": shape_name, "batch": batch, "prompt_len": prompt_len,
                       "new_tokens": args.new_tokens, "gemm_floor_s": floor, "merged_gemm_floor_s": merged_floor,
                       "apex": apex, "apex_sync": sync, "hf": hf,
                       "step_over_floor": apex["decode_step_s"] / floor,
                       "hbm_fraction": (weight_bytes + kv_read) / apex["decode_step_s"] / HBM_REFERENCE,
                       "apex_over_hf": apex["tokens_per_s"] / hf["tokens_per_s"] if hf else None}
                result["rows"].append(row)
                host = " ".join(f"{k} {v * 1e3:.2f}" for k, v in apex["host_breakdown_s"].items())
                if sync is not None:  # the same engine without async scheduling, same process
                    host += (f"; sync: step {sync['decode_step_s'] * 1e3:.2f} ms, {sync['tokens_per_s']:.0f} tok/s, "
                             + " ".join(f"{k} {v * 1e3:.2f}" for k, v in sync["host_breakdown_s"].items()))
                hf_text = (f"{hf['tokens_per_s']:9.0f} {hf['decode_step_s'] * 1e3:8.2f} {row['apex_over_hf']:7.2f}"
                           if hf else f"{'-':>9} {'-':>8} {'-':>7}")
                print(f"{shape_name:10} {batch:5} {prompt_len:6} | {apex['tokens_per_s']:10.0f} "
                      f"{apex['decode_step_s'] * 1e3:8.2f} {floor * 1e3:8.2f} {row['step_over_floor']:7.2f} "
                      f"{apex['decode_step_s'] / merged_floor:8.2f} "
                      f"{row['hbm_fraction'] * 100:6.1f} | {hf_text} | {apex['warmup_s']:.0f}, {host}", flush=True)
                write_json(args.out, result)  # after every row: a run cut short keeps what it measured
        del model
        gc.collect()
        torch.cuda.empty_cache()
    write_json(args.out, result)


def write_json(path, result):
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
