"""The CPU path under a competing load: apex engine vs HF generate tokens/s, quiet vs one core busy.

A busy loop pinned to one core (`taskset -c CORE`) stands for another process on the machine. Each arm (an
OpenMP wait policy, fixed when libgomp loads, so one child process per arm and run) measures apex and HF in the
same process, alternating quiet and loaded, and reports each side's loaded/quiet slowdown. Arms alternate across
runs so that a drift in the machine's other load reaches every arm alike.

    python benchmarks/cpu_contention.py --runs 3 --out benchmarks/results/cpu_contention/2026-12-06_ci-2core.json
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The arm's environment, applied before the child imports torch (libgomp reads it once, at load).
ARMS = {
    "libgomp-default": {"APEX_COMPILE_OMP_WAIT_POLICY": "keep"},
    "apex-default": {},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "spin-1k": {"GOMP_SPINCOUNT": "1000"},
    "spin-10k": {"GOMP_SPINCOUNT": "10000"},
    "spin-30k": {"GOMP_SPINCOUNT": "30000"},
    "spin-100k": {"GOMP_SPINCOUNT": "100000"},
}


def busy_loop(core: int) -> subprocess.Popen:
    """A process spinning on one core."""
    return subprocess.Popen(["taskset", "-c", str(core), sys.executable, "-c", "while True: pass"])


def child(args) -> dict:
    """One arm's measurements in this process: per repeat, quiet then loaded (or the reverse on odd repeats)."""
    import apex_compile  # noqa: F401  (first: it chooses the OpenMP wait policy before torch loads libgomp)
    import torch
    from apex_compile.__main__ import DEFAULT_PROMPTS, chat_batch, run_hf
    from apex_compile.config import ApexConfig
    from apex_compile.model import optimize
    from apex_compile.runtime.loader import load_model
    from apex_compile.runtime.request import SamplingParams

    model, tokenizer = load_model()
    rows = chat_batch(tokenizer, DEFAULT_PROMPTS, args.batch_size)
    eos = [int(tokenizer.eos_token_id)]
    apex = optimize(model, ApexConfig(), tokenizer)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, eos_token_ids=tuple(eos))
    apex.engine.warmup()
    run_hf(model, tokenizer, rows, 4, eos)

    def rates():
        start = time.perf_counter()
        completions = apex.engine.generate(rows, sampling)
        apex_rate = sum(len(c.token_ids) for c in completions) / (time.perf_counter() - start)
        hf_rows, seconds = run_hf(model, tokenizer, rows, args.max_new_tokens, eos)
        return apex_rate, sum(len(r) for r in hf_rows) / seconds

    samples = {"quiet": [], "loaded": []}
    for repeat in range(args.repeat):
        for state in (("quiet", "loaded") if repeat % 2 == 0 else ("loaded", "quiet")):
            busy = busy_loop(args.core) if state == "loaded" else None
            try:
                time.sleep(0.2 if busy else 0.0)
                samples[state].append(rates())
            finally:
                if busy:
                    busy.kill()
                    busy.wait()
    result = {"wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset)"),
              "spincount": os.environ.get("GOMP_SPINCOUNT", "(unset)"), "threads": torch.get_num_threads()}
    for side, i in (("apex", 0), ("hf", 1)):
        quiet = statistics.median(s[i] for s in samples["quiet"])
        loaded = statistics.median(s[i] for s in samples["loaded"])
        result[side] = {"quiet_tokens_per_s": quiet, "loaded_tokens_per_s": loaded, "slowdown": quiet / loaded,
                        "quiet_samples": [s[i] for s in samples["quiet"]],
                        "loaded_samples": [s[i] for s in samples["loaded"]]}
    return result


def main():
    """Runs every arm `--runs` times in alternation (one child process each) and prints / writes the results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {sorted(ARMS)}")
    parser.add_argument("--runs", type=int, default=2, help="child processes per arm, alternating arms")
    parser.add_argument("--repeat", type=int, default=2, help="quiet/loaded pairs per child")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--core", type=int, default=1, help="the core the busy loop spins on")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return

    arms = args.arms.split(",")
    runs = {arm: [] for arm in arms}
    for run in range(args.runs):
        for arm in (arms if run % 2 == 0 else arms[::-1]):
            env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
            env.update(ARMS[arm])
            env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--repeat", str(args.repeat),
                   "--batch-size", str(args.batch_size), "--max-new-tokens", str(args.max_new_tokens),
                   "--core", str(args.core)]
            load = os.getloadavg()[0]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            result["loadavg_1min_before"] = load
            runs[arm].append(result)
            print(f"{arm:16} run {run}: apex {result['apex']['quiet_tokens_per_s']:6.1f} -> "
                  f"{result['apex']['loaded_tokens_per_s']:6.1f} tok/s ({result['apex']['slowdown']:.2f}x), HF "
                  f"{result['hf']['quiet_tokens_per_s']:6.1f} -> {result['hf']['loaded_tokens_per_s']:6.1f} "
                  f"({result['hf']['slowdown']:.2f}x); load {load:.2f}", flush=True)
    summary = {}
    print(f"{'arm':16}{'apex quiet':>11}{'loaded':>8}{'slow':>6}{'HF quiet':>10}{'loaded':>8}{'slow':>6}")
    for arm in arms:
        row = {side: {key: statistics.median(r[side][key] for r in runs[arm])
                      for key in ("quiet_tokens_per_s", "loaded_tokens_per_s", "slowdown")}
               for side in ("apex", "hf")}
        summary[arm] = row
        print(f"{arm:16}{row['apex']['quiet_tokens_per_s']:>11.1f}{row['apex']['loaded_tokens_per_s']:>8.1f}"
              f"{row['apex']['slowdown']:>6.2f}{row['hf']['quiet_tokens_per_s']:>10.1f}"
              f"{row['hf']['loaded_tokens_per_s']:>8.1f}{row['hf']['slowdown']:>6.2f}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"benchmark": "cpu_contention", "date": datetime.datetime.now().isoformat(timespec="seconds"),
                       "cores": os.cpu_count(), "busy_core": args.core, "batch_size": args.batch_size,
                       "max_new_tokens": args.max_new_tokens, "repeat": args.repeat, "arms": ARMS,
                       "summary": summary, "runs": runs}, f, indent=2)


if __name__ == "__main__":
    main()
