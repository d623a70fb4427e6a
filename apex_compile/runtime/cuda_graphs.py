"""Whole-forward CUDA graphs of decode steps, one per capture size, owned by one engine.

A graph bakes in the addresses of the engine's StepBuffers views, KV caches and attention plan, so it is
captured per engine. A decode-only step of the device pool with B rows replays the graph of the smallest
capture size >= B; the rows past B are padding (slot -1, context length 1, logits ignored). Capture runs the
compiled step once per size first (outside the capture), so compilation and Triton JIT never happen inside a
capture; sizes are captured largest first into one memory pool, which the smaller graphs then reuse.
"""
import bisect
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch


def capture_sizes(max_rows: int) -> List[int]:
    """2, 4, 8, then every multiple of 8 up to `max_rows`, and `max_rows` itself (at least 2).

    A lone decode row runs padded to 2: the same memory-bound GEMMs, and the step never meets dynamo's
    specialisation of size-1 dimensions, so one compiled graph serves every capture size."""
    max_rows = max(max_rows, 2)
    sizes = [s for s in (2, 4) if s < max_rows] + list(range(8, max_rows, 8)) + [max_rows]
    return sorted(set(sizes))


class DecodeGraphs:
    """The captured graphs of an engine: `size_for(rows)`, `capture(...)`, `replay(size)`."""

    def __init__(self, sizes: List[int]):
        self.sizes = sorted(sizes)
        self.graphs: Dict[int, Tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0
        self.replays = 0

    @property
    def ready(self) -> bool:
        """Whether every size is captured."""
        return len(self.graphs) == len(self.sizes)

    def size_for(self, rows: int) -> Optional[int]:
        """The capture size that serves a step of `rows` decode rows (None when larger than every size)."""
        index = bisect.bisect_left(self.sizes, rows)
        return self.sizes[index] if index < len(self.sizes) else None

    def capture(self, prepare: Callable[[int], None], forward: Callable[[int], torch.Tensor],
                progress: bool = True) -> None:
        """Captures every size: `prepare(size)` writes and copies a padded step's inputs (outside the graph),
        `forward(size)` runs the model on them and returns its logits (captured)."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        order = sorted(self.sizes, reverse=True)
        for done, size in enumerate(order, 1):
            if progress:
                print(f"\rapex_compile: capturing CUDA graphs {done}/{len(order)} (batch {size})", end="",
                      file=sys.stderr, flush=True)
            prepare(size)
            forward(size)  # warm-up: compiles this size's specialisations and kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = forward(size)
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        if progress:
            print(f"\rapex_compile: captured {len(order)} CUDA graphs in {self.capture_seconds:.1f} s",
                  file=sys.stderr, flush=True)

    def replay(self, size: int) -> torch.Tensor:
        """Replays the graph of `size` rows and returns its logits [size, vocab] (valid until the next replay)."""
        graph, out = self.graphs[size]
        graph.replay()
        self.replays += 1
        return out
