"""Serves a random LLaMA of a real shape over the OpenAI API, through the server `python -m apex_compile serve`
runs, with the engine config the offline and online benchmarks build. `online.py --http` starts one per (pool,
mode) to time the same workload over HTTP as in-process, on machines without checkpoints.

    python benchmarks/serve_random.py --shape llama3_8b --mode never --device-gib 2 --port 8000
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offline import engine_config  # noqa: E402
from workload import build_model  # noqa: E402

from apex_compile import optimize  # noqa: E402
from apex_compile.entrypoints.openai.cli import serve  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama3_8b", help="llama3_8b | llama2_7b | smollm2 (embedded)")
    parser.add_argument("--mode", default="auto", help="offload mode")
    parser.add_argument("--device-gib", type=float, default=1.0)
    parser.add_argument("--host-gib", type=float, default=32.0)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-waiting", type=int, default=4096)
    args = parser.parse_args(argv)
    model, label = build_model(args.shape)
    apex = optimize(model, engine_config(args.mode, args.device_gib, args.host_gib, args))
    return serve(apex, model_name=label, host=args.host, port=args.port, max_waiting=args.max_waiting,
                 log_level="warning")


if __name__ == "__main__":
    sys.exit(main())
