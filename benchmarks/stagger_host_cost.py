"""Host cost of a staggered lane turn's CPU-job metadata (`HostJob.of`, built on the launching thread while the
GPU runs the step), on synthetic groups of a model's shape; no GPU needed.

    python benchmarks/stagger_host_cost.py --layers 32 --width 4 --context 704
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from apex_compile.runtime.stagger import HostJob, StaggerGroup  # noqa: E402


def groups(layers: int, width: int, table_width: int, full: bool):
    rows = np.arange(width) if full else np.arange(0, width, 2)
    return [StaggerGroup([None] * width, rows=rows, slots=rows.copy(),
                         block_tables=np.zeros((len(rows), table_width), dtype=np.int32),
                         context_lens=np.full(len(rows), 600, dtype=np.int32), prefix=width if full else 0)
            for _ in range(layers)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--context", type=int, default=704, help="max_model_len (the block table's width)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--calls", type=int, default=1000)
    args = parser.parse_args()
    table_width = -(-args.context // args.block_size)
    for full in (True, False):
        lane = groups(args.layers, args.width, table_width, full)
        for _ in range(100):
            HostJob.of(lane, args.width)
        start = time.perf_counter()
        for _ in range(args.calls):
            HostJob.of(lane, args.width)
        micros = (time.perf_counter() - start) / args.calls * 1e6
        print(f"HostJob.of, {args.layers} layers x width {args.width}, "
              f"{'every row holds a request' if full else 'half the rows free'}: {micros:.0f} us per turn")


if __name__ == "__main__":
    main()
