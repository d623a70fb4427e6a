"""The overlap plan: host-pool requests share each step's batch with the device pool's, attending on the CPU.

On CUDA the compiled step is built with the `overlap` pass: each layer's attention becomes `offload_launch`
(the host rows' q/k/v to pinned staging, a worker thread appends and attends them on the CPU),
`device_attention` (the device rows, meanwhile) and `offload_wait` (join, the host rows' output back); the
host-pool side is `_HostOffload` in `attention_runner.py`. Steps with host rows replay piecewise graphs, split
at those ops (the GPU-only plan's forward picks them). On a CPU both pools are host memory: the same step runs
without the split.

Chosen by offload="all" or a fraction (a fixed share of running requests in the host pool), or by "auto" when
its model predicts host requests pay for some typical load (`AutoOffload` then admits each host request and
learns from the decode steps' measured times: `observe_step`).
"""
import time
from typing import Optional

from apex_compile.runtime.kv_manager import DEVICE_POOL, HOST_POOL
from apex_compile.runtime.perf_model import AutoOffload
from apex_compile.runtime.plans.base import typical_contexts
from apex_compile.runtime.plans.gpu_only import GpuOnlyPlan


class OverlapPlan(GpuOnlyPlan):
    """Device and host rows in one batch; on CUDA the host rows' attention overlaps the device rows'."""

    name = "overlap"

    def __init__(self, engine, host_policy: Optional[AutoOffload] = None):
        super().__init__(engine)
        self.host_policy = host_policy

    @staticmethod
    def auto_host_policy(engine) -> Optional[AutoOffload]:
        """The engine's auto policy if its model predicts that host requests pay for some typical load, else None
        (then the host pool only parks swapped-out requests and the overlapped graph is never compiled)."""
        policy = engine.auto_policy
        if policy is None:
            return None
        kv = engine.kv
        tokens = [p.num_blocks * kv.block_size for p in kv.pools]
        return policy if policy.worth_enabling(tokens[DEVICE_POOL], tokens[HOST_POOL], engine.config.max_num_seqs,
                                               typical_contexts(engine)) else None

    @property
    def overlap(self) -> bool:
        """Whether compiled graphs split attention into launch / device / wait (CUDA with host-pool requests)."""
        engine = self.engine
        return engine.device.type == "cuda" and HOST_POOL in engine.scheduler.run_pools

    def observe_step(self, chunks, start: float) -> None:
        """A decode step's wall time (the sampled ids' copy waits for the GPU) corrects auto's model."""
        policy = self.engine.scheduler.host_policy
        if policy is None:
            return
        on_host = sum(1 for c in chunks if c.pool == HOST_POOL)
        context = sum(c.start + 1 for c in chunks) / len(chunks)
        policy.observe(len(chunks) - on_host, on_host, context, time.perf_counter() - start)
