"""Piecewise CUDA graphs against the uncaptured compiled step, on one CUDA GPU.

Per random LLaMA shape (bf16), in one run:
- prefill: one prompt of T tokens generating one token, the step's wall time (host included, median of
  repeats) with piecewise graphs (captured up to --capture-max tokens here, to find where capture stops
  paying) and without CUDA graphs; plus the capture time of each new key;
- hybrid decode: --batch requests, half of them in the host pool (their attention runs on the CPU between the
  pieces), the median decode step with piecewise graphs and without.

    python benchmarks/e2e_piecewise.py --out benchmarks/results/e2e_piecewise_<date>_h200.json
"""
import argparse
import datetime
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_hybrid import decode_steps  # noqa: E402
from e2e_throughput import SHAPES, kv_bytes_per_token, random_llama, write_json  # noqa: E402

from apex_compile import ApexConfig, SamplingParams, optimize  # noqa: E402
from apex_compile.runtime.cuda_graphs import PiecewiseGraphs, piecewise_sizes  # noqa: E402


def prefill_rows(model, shape, tokens_list, capture_max, repeats):
    """{graphs: {T: (median step s, capture s)}} for single-prompt prefills of T tokens."""
    longest = max(tokens_list)
    out = {}
    for graphs in (True, False):
        config = ApexConfig(offload="never", gpu_cache_size=1 << 30, cpu_cache_size=0, max_num_seqs=8,
                            max_num_batched_tokens=longest, max_model_len=longest + 64, cuda_graphs=graphs,
                            mixed_graphs=False)  # the piecewise graphs (a whole mixed graph would take these steps)
        engine = optimize(model, config).engine
        if graphs:  # this benchmark captures beyond the engine's cap, to measure where capture stops paying
            engine.pieces = PiecewiseGraphs(piecewise_sizes(capture_max), capture_max, engine.pieces.pool)
        engine.warmup()
        rows = {}
        for tokens in tokens_list:
            prompt = torch.randint(3, shape["vocab_size"], (tokens,)).tolist()
            sampling = SamplingParams(max_new_tokens=1)
            captured = engine.pieces.capture_seconds if graphs else 0.0
            engine.generate([prompt], sampling)
            capture = (engine.pieces.capture_seconds - captured) if graphs else 0.0
            times = []
            for _ in range(repeats):
                torch.cuda.synchronize()
                start = time.perf_counter()
                engine.generate([prompt], sampling)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            rows[tokens] = (statistics.median(times), capture)
        out[graphs] = rows
        del engine
        torch.cuda.empty_cache()
    return out


def decode_step_median(engine, prompts, new_tokens):
    """Median wall time of the steps in which every running request decodes."""
    _, steps = decode_steps(engine, prompts, SamplingParams(max_new_tokens=new_tokens))
    return statistics.median(step[3] for step in steps)


def hybrid_rows(model, shape, batch, prompt_len, new_tokens):
    """{graphs: median decode step s} with half of `batch` requests in the host pool."""
    need = int(batch * (prompt_len + new_tokens + 32) * kv_bytes_per_token(shape) * 0.6) + (256 << 20)
    prompts = torch.randint(3, shape["vocab_size"], (batch, prompt_len)).tolist()
    out = {}
    for graphs in (True, False):
        config = ApexConfig(offload=0.5, gpu_cache_size=need, cpu_cache_size=need, max_num_seqs=batch,
                            max_num_batched_tokens=2048, max_model_len=prompt_len + new_tokens + 64,
                            cuda_graphs=graphs)
        engine = optimize(model, config).engine
        engine.warmup()
        decode_step_median(engine, prompts, 8)  # captures this batch's keys
        out[graphs] = decode_step_median(engine, prompts, new_tokens)
        del engine
        torch.cuda.empty_cache()
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="llama3_8b")
    parser.add_argument("--tokens", default="16,64,128,512,1024,2048")
    parser.add_argument("--capture-max", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("e2e_piecewise.py needs a CUDA GPU")
    result = {"benchmark": "e2e_piecewise", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": {"gpu": torch.cuda.get_device_name(), "cpus": os.cpu_count(), "torch": torch.__version__,
                          "python": platform.python_version()}, "args": vars(args), "shapes": {}}
    tokens_list = [int(t) for t in args.tokens.split(",")]
    for shape_name in args.shapes.split(","):
        shape = SHAPES[shape_name]
        torch.manual_seed(0)
        model = random_llama(shape)
        prefill = prefill_rows(model, shape, tokens_list, args.capture_max, args.repeats)
        print(f"{shape_name} prefill, one prompt: tokens | piecewise ms | uncaptured ms | ratio | capture s")
        for tokens in tokens_list:
            (graph_s, capture), (eager_s, _) = prefill[True][tokens], prefill[False][tokens]
            print(f"  {tokens:6} | {graph_s * 1e3:8.2f} | {eager_s * 1e3:8.2f} | {eager_s / graph_s:5.2f}x | "
                  f"{capture:.2f}", flush=True)
        hybrid = hybrid_rows(model, shape, args.batch, args.prompt, args.new_tokens)
        print(f"{shape_name} hybrid decode, batch {args.batch} (half in the host pool), prompt {args.prompt}: "
              f"piecewise {hybrid[True] * 1e3:.2f} ms, uncaptured {hybrid[False] * 1e3:.2f} ms, "
              f"{hybrid[False] / hybrid[True]:.2f}x", flush=True)
        result["shapes"][shape_name] = {
            "prefill": {str(t): {"piecewise_s": prefill[True][t][0], "uncaptured_s": prefill[False][t][0],
                                 "capture_s": prefill[True][t][1]} for t in tokens_list},
            "hybrid_decode": {"piecewise_s": hybrid[True], "uncaptured_s": hybrid[False]}}
        del model
        torch.cuda.empty_cache()
    write_json(args.out, result)


if __name__ == "__main__":
    main()
