"""Core pinning of the staggered plan: the CPU attention worker's cores, and the launching threads kept off them."""
import os
import threading
from typing import Dict, List, Optional

import torch


def worker_cores(threads: Optional[int] = None) -> List[int]:
    """The cores of the CPU attention worker: the last `threads` of those this process may use (None: all
    but the first when there are more than two)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count()))
    if threads is None:
        threads = len(cores) - 1 if len(cores) > 2 else len(cores)
    if not 1 <= threads <= len(cores):
        raise ValueError(f"cpu_attention_threads must be in 1..{len(cores)} (the cores this process may use), "
                         f"got {threads}")
    return cores[len(cores) - threads:]


def _pin_worker(cores: List[int]) -> None:
    """Worker-thread initializer: this thread (and the OpenMP team it starts) runs on `cores`, that many
    threads wide (the OpenMP thread count is per calling thread)."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))


class LauncherPin:
    """Keeps the threads that launch GPU work (those calling `ensure`) on the cores the CPU attention worker
    leaves free, so that the worker's OpenMP team does not share a core with the launcher (or its hyperthread
    sibling's load) while a step's host work runs; each pinned thread gets its affinity back on `release`.
    Nothing happens where no core is left free (a worker on every core) or affinity cannot be set."""

    def __init__(self, worker: List[int]):
        allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        busy = set(worker)
        self.cores = [c for c in allowed if c not in busy]
        self._pinned: Dict[int, set] = {}  # native thread id -> its affinity before

    def ensure(self) -> None:
        if not self.cores:
            return
        tid = threading.get_native_id()
        if tid not in self._pinned:
            self._pinned[tid] = os.sched_getaffinity(0)
            os.sched_setaffinity(0, self.cores)

    def release(self) -> None:
        for tid, cores in self._pinned.items():
            try:
                os.sched_setaffinity(tid, cores)
            except OSError:  # that thread has ended
                pass
        self._pinned.clear()
