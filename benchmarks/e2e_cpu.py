"""End-to-end CPU benchmark: apex engine vs HF generate (eager, DynamicCache) on the embedded SmolLM2-135M-Instruct.

Batch of chat prompts, greedy, fp32, both timed in the same process after a warm-up (the apex warm-up compiles
the step graphs). Prints a table; --out writes JSON. Target: apex >= 1.5x HF tokens/s.

    python benchmarks/e2e_cpu.py --out benchmarks/results/e2e_cpu/<date>_<machine>.json
    python benchmarks/e2e_cpu.py --offload all --inner inductor --profile
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from apex_compile.__main__ import DEFAULT_PROMPTS, chat_batch, parse_offload, run_hf  # noqa: E402
from apex_compile.config import ApexConfig  # noqa: E402
from apex_compile.model import optimize  # noqa: E402
from apex_compile.runtime.loader import load_model  # noqa: E402
from apex_compile.runtime.request import SamplingParams  # noqa: E402


def cpu_name() -> str:
    """The CPU model name from /proc/cpuinfo (or platform.processor())."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def time_apex(apex, rows, sampling, repeat):
    """(completions of the last run, list of seconds per run)."""
    seconds = []
    for _ in range(repeat):
        start = time.perf_counter()
        completions = apex.engine.generate(rows, sampling)
        seconds.append(time.perf_counter() - start)
    return completions, seconds


def profile_apex(apex, rows, sampling):
    """Top ops by self CPU time over one apex run (a table string)."""
    from torch.profiler import profile

    with profile() as prof:
        apex.engine.generate(rows, sampling)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)


def main():
    """Runs the benchmark and prints / writes the results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--offload", type=parse_offload, default="never")
    parser.add_argument("--inner", choices=("inductor", "eager"), default=None,
                        help="the apex backend's inner compiler (default: the backend's choice)")
    parser.add_argument("--repeat", type=int, default=1, help="timed runs of each side (median reported)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--profile", action="store_true", help="print the op profile of one apex run")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tokenizer = load_model()
    rows = chat_batch(tokenizer, DEFAULT_PROMPTS, args.batch_size)
    eos = [int(tokenizer.eos_token_id)]
    apex = optimize(model, ApexConfig(offload=args.offload, inner=args.inner), tokenizer)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, eos_token_ids=tuple(eos))

    start = time.perf_counter()
    apex.engine.warmup()
    compile_seconds = time.perf_counter() - start
    run_hf(model, tokenizer, rows, 4, eos)  # HF warm-up

    hf_seconds = []
    for _ in range(args.repeat):
        hf_rows, seconds = run_hf(model, tokenizer, rows, args.max_new_tokens, eos)
        hf_seconds.append(seconds)
    steps_before = apex.engine.stats.steps
    completions, apex_seconds = time_apex(apex, rows, sampling, args.repeat)
    steps = (apex.engine.stats.steps - steps_before) // args.repeat

    hf_tokens = sum(len(r) for r in hf_rows)
    apex_tokens = sum(len(c.token_ids) for c in completions)
    hf_rate = hf_tokens / statistics.median(hf_seconds)
    apex_rate = apex_tokens / statistics.median(apex_seconds)
    same = sum(h == c.token_ids for h, c in zip(hf_rows, completions))
    result = {
        "benchmark": "e2e_cpu",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "torch": torch.__version__, "python": platform.python_version()},
        "model": "SmolLM2-135M-Instruct (fp32, dequantised Q4_1 GGUF)",
        "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens, "offload": args.offload,
        "inner": args.inner or "backend default",
        "hf": {"tokens": hf_tokens, "seconds": hf_seconds, "tokens_per_s": hf_rate},
        "apex": {"tokens": apex_tokens, "seconds": apex_seconds, "tokens_per_s": apex_rate, "steps": steps,
                 "compile_seconds": compile_seconds},
        "speedup": apex_rate / hf_rate,
        "identical_rows": f"{same}/{len(rows)}",
    }
    print(f"{'':8}{'tokens':>8}{'seconds':>10}{'tokens/s':>10}")
    print(f"{'HF':8}{hf_tokens:>8}{statistics.median(hf_seconds):>10.2f}{hf_rate:>10.1f}")
    print(f"{'apex':8}{apex_tokens:>8}{statistics.median(apex_seconds):>10.2f}{apex_rate:>10.1f}")
    print(f"speedup {result['speedup']:.2f}x (target 1.5x); identical rows {same}/{len(rows)}; apex compile "
          f"{compile_seconds:.1f}s; {torch.get_num_threads()} threads on {result['machine']['cpu']}")
    if args.profile:
        print(profile_apex(apex, rows, sampling))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
