"""The staggered plan's CPU job executors: `LayerJobs` (one lane, a C++ runner thread appending and attending
layer by layer while the GPU waits per layer on the device), `AsyncJobs` (two lanes, a worker thread running
each lane's job between its steps, with `CudaCopies` staging on a GPU) and `SyncJobs` (a CPU-only run)."""
import collections
import concurrent.futures
import time
from typing import Callable, Deque, Dict, List, Optional, Tuple

import torch

from apex_compile.kernels.stagger import WAIT_TIMEOUT_S
from apex_compile.ops.cpu_attention import StaggerRunner
from apex_compile.runtime.stagger.pinning import _pin_worker, worker_cores

ABORTED = 1 << 62  # a failed layered job's done flags: the device waits pass at once (the engine raises its error)


class LayerJobs:
    """The one-lane plan's CPU jobs: one per turn on a C++ worker thread (`StaggerRunner`, pinned like `AsyncJobs`'
    worker, over `caches`: the host pool's per-layer key and value caches), appending and attending layer by layer
    as the GPU step stages the layers. A job needs no GIL to start, return or hand over its timings: jobs are
    queued with `submit`, and their timings reach this object when the launching thread next calls `collect`,
    `launch` or `submit` (and a job's `observe` callback then). The device
    reads and writes host buffers directly (pinned on a GPU): every layer's staged q/k/v and outputs, and per layer two
    counters, `ready` (raised by the step behind its staging of the layer) and `done` (raised by the job once it
    wrote the layer's outputs; the next step's layer waits for it on the device). `stalls`: each layer's last
    device wait (ns on a GPU); `status`: a turn whose device wait timed out. A job that fails raises every done
    flag to ABORTED, so the GPU goes on (its block rows wrong) and the next `collect` or `launch` raises."""

    def __init__(self, staged: torch.Tensor, outputs: torch.Tensor,
                 caches: Tuple[List[torch.Tensor], List[torch.Tensor]], pin_memory: bool = True,
                 threads: Optional[int] = None):
        layers = staged.shape[0]
        self.staged = torch.zeros(staged.shape, dtype=staged.dtype, pin_memory=pin_memory)
        self.outputs = torch.zeros(outputs.shape, dtype=outputs.dtype, pin_memory=pin_memory)
        counters = torch.zeros(3 * layers + 1, dtype=torch.int64, pin_memory=pin_memory)
        self.ready, self.done = counters[:layers], counters[layers:2 * layers]
        self.stalls, self.status = counters[2 * layers:3 * layers], counters[3 * layers:]
        self._stalls, self._status = self.stalls.numpy(), self.status.numpy()  # read each step: no torch op
        self.stall_unit = 1e-9 if pin_memory else 0.0  # seconds per unit of `stalls` (polls under the interpreter)
        self.cores = worker_cores(threads)
        self.runner = StaggerRunner(caches[0], caches[1], self.cores)
        self._observers: Dict[int, object] = {}  # submitted turn -> its observe(waited, ran, busy) callback
        self._gates: Dict[int, Tuple[torch.Tensor, int]] = {}  # submitted turn -> its gate (counter, value)
        # recent timings, seconds: (waiting for the layers' flags, running) per job, and per step the device's
        # waits for the CPU (how far the CPU is behind the GPU), as AsyncJobs' collect waits
        self.job_seconds: Deque[Tuple[float, float]] = collections.deque(maxlen=4096)
        self.collect_seconds: Deque[float] = collections.deque(maxlen=4096)
        self.waited_s = 0.0  # the sum of collect_seconds since the executor was built
        # per job, the team's thread-seconds inside work items; over the running time x len(cores), the share of
        # the team that was working, not waiting between items
        self.job_busy: Deque[float] = collections.deque(maxlen=4096)
        # per job (perf_counter seconds): submitted, started on the worker, ended: the worker's time between jobs
        self.job_times: Deque[Tuple[float, float, float]] = collections.deque(maxlen=4096)
        # per job with rows, seconds: waiting for prompt exports before the call, the C++ call beyond its waits and
        # running (checks, plans, frees), the Python call beyond the C++ one (glue, the GIL taken back)
        self.job_parts: Deque[Tuple[float, float, float]] = collections.deque(maxlen=4096)
        # the last jobs' timelines for a timed-out device wait's error (the state when it is read may be long past
        # the stall): (turn, submitted, started, ended, gate wait, flags wait, running), perf_counter seconds
        self._timelines: Deque[Tuple[int, float, float, float, float, float, float]] = collections.deque(maxlen=3)
        self._last_submit: Optional[Tuple[int, float]] = None  # (turn, perf_counter) of the last job queued
        self.gate_state: Optional[Callable[[], str]] = None  # where what the jobs' gates wait for stands (exports)

    def _raise_errors(self) -> None:
        """Takes the C++ runner's finished jobs' records; raises a finished job's error, or a device wait that timed
        out."""
        for record in self.runner.poll():
            self._record(*record)
        if self._status[0]:
            raise RuntimeError(f"the GPU waited more than {WAIT_TIMEOUT_S:.0f} s for the staggered CPU job of turn "
                               f"{int(self._status[0])}: the CPU worker is stuck or gone ({self.stuck_state()})")

    def stuck_state(self) -> str:
        """Where the jobs stand, for the error of a device wait that timed out: the layers' flags (ready: raised by
        the steps' staging; done: by the jobs), and what the worker is doing (the C++ runner's phase and the turn in
        it, with that job's gate)."""
        ready, done = self.ready.tolist(), self.done.tolist()
        told = [f"ready flags {min(ready)}..{max(ready)}, done flags {min(done)}..{max(done)}"]
        if self.stall_unit:  # the device's last wait per layer: a clock that jumped would show here too
            layer = int(self._stalls.argmax())
            longest = self._stalls[layer] * self.stall_unit
            told.append(f"the device's longest last wait {longest:.1f} s, at layer {layer}")
        state = self.runner.state()
        told.append(f"runner: {state['submitted']} job(s) submitted, {state['queued']} queued, {state['finished']} "
                    f"finished, {state['phase']}" + (f" (turn {state['turn']})" if state["turn"] is not None else ""))
        gate = self._gates.get(state["turn"])
        if gate is not None:
            told.append(f"its gate {int(gate[0][0])} of {gate[1]}")
        now = time.perf_counter()
        if self._last_submit is not None:
            told.append(f"the last job queued: turn {self._last_submit[0]}, {now - self._last_submit[1]:.1f} s ago")
        for turn, submitted, started, ended, gate_wait, waited, ran in self._timelines:
            told.append(f"turn {turn}: queued {now - submitted:.1f} s ago, started {started - submitted:.3f} s "
                        f"later, its gate {gate_wait:.3f} s, the layers' flags {waited:.3f} s, running {ran:.3f} s, "
                        f"ended {now - ended:.1f} s ago")
        if self.gate_state is not None:
            told.append(self.gate_state())
        return "; ".join(told)

    def _record(self, turn, waited, ran, busy, call, gate_wait, submitted, started, ended) -> None:
        """A C++ runner job's record (StaggerRunner.RECORD_FIELDS) into the timings."""
        self.job_times.append((submitted, started, ended))
        self._timelines.append((int(turn), submitted, started, ended, gate_wait, waited, ran))
        self._gates.pop(int(turn), None)
        observe = self._observers.pop(int(turn), None)
        if observe is None or ran != ran:  # a turn without rows, or a failed job (its error was raised by `poll`)
            return
        self.job_seconds.append((waited, ran))
        # exports waited for, the C++ call beyond its waits and running, the rest of the runner's time on the job
        self.job_parts.append((gate_wait, call - waited - ran, max(ended - started - gate_wait - call, 0.0)))
        self.job_busy.append(busy)
        observe(waited, ran, busy)

    def submit(self, turn: int, observe, **job) -> None:
        """Queues `turn`'s job on the C++ runner: the layer-by-layer job (`stagger_layer_job`) over the staged
        rows into the outputs with these flags, `job` naming its other arguments (cache_index, block_tables,
        context_lens, slot_mapping, rows, num_heads, scale; gate and gate_value: what it waits for before it
        starts); observe(waited, ran, busy) is called with its timings once it is done."""
        self._raise_errors()
        self._last_submit = (int(turn), time.perf_counter())
        self._observers[int(turn)] = observe
        if job.get("gate") is not None:
            self._gates[int(turn)] = (job["gate"], int(job["gate_value"]))
        self.runner.submit(turn, self.outputs, self.ready, self.done, staged=self.staged, **job)

    def launch(self, turn: int, job, inputs: List[torch.Tensor], output: torch.Tensor) -> None:
        """A turn without rows (`job` None): its done flags rise as soon as the jobs before it are done.
        inputs / output: unused (the device reads and writes the host buffers itself)."""
        self._raise_errors()
        self._last_submit = (int(turn), time.perf_counter())
        if job is not None:
            raise RuntimeError("LayerJobs takes jobs by `submit`, not as Python callables")
        self.runner.submit(turn, self.outputs, self.ready, self.done)

    def collect(self, key: int, out: torch.Tensor) -> None:
        """Before a step: raises a failed job's error; records the device's waits of the last steps' layers."""
        self._raise_errors()
        self.collect_seconds.append(float(self._stalls.sum()) * self.stall_unit)
        self.waited_s += self.collect_seconds[-1]

    def drain(self) -> None:
        """Waits for every launched job (their steps are queued: each job's flags come)."""
        self.runner.drain()
        self._raise_errors()

    def close(self) -> None:
        """Stops the worker once its queued jobs are done."""
        self.runner.close()
        self._observers.clear()
        self._gates.clear()


class SyncJobs:
    """CPU-only run: a job runs when launched; its output is handed out by the next `collect` of its key.
    A job is called as job(*inputs, out, ready_flags, ready_values) (`AsyncJobs`; nothing to wait for here)
    and writes its rows of `out` (shaped like `output`)."""

    def __init__(self):
        self.results: Dict[int, Optional[torch.Tensor]] = {}
        self.buffers: Dict[int, torch.Tensor] = {}

    def launch(self, key: int, job, inputs: List[torch.Tensor], output: torch.Tensor) -> None:
        if job is None:
            self.results[key] = None
            return
        out = self.buffers.get(key)
        if out is None or out.shape != output.shape:
            out = self.buffers[key] = torch.zeros(output.shape, dtype=output.dtype)
        job(*inputs, out, None, ())
        self.results[key] = out

    def collect(self, key: int, out: torch.Tensor) -> None:
        result = self.results.pop(key, None)
        if result is None:
            out.zero_()
        else:
            out.copy_(result)

    def drain(self) -> None:
        """Nothing runs in the background."""

    def close(self) -> None:
        self.results.clear()
        self.buffers.clear()


class CudaCopies:
    """The copies of `AsyncJobs` on CUDA, both on the compute stream (so the next step's writes to the staged
    device buffers come after their copy out): inputs to pinned staging, outputs back. Each staging is followed
    on the stream by a raise of a pinned counter (`flags`) that a CPU job polls in C++ without the GIL; one
    stream completes its work in order, so the counter's value says every copy queued before it is done,
    copies back included: a copy back is done once the next staging's raise is seen (no raise of its own in
    the host gap before a step). Each returns (flag index, value)."""

    def __init__(self, device: torch.device):
        self.device = device
        # [0]: raised by the stream behind each staging
        self.flags = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        self._device_flag = torch.zeros(1, dtype=torch.int64, device=device)
        self._raised = 0

    def stage(self, pairs: List[Tuple[torch.Tensor, torch.Tensor]]) -> Tuple[int, int]:
        """Copies each (pinned dst, device src) after the work queued so far."""
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)
        self._raised += 1
        self._device_flag.fill_(self._raised)
        self.flags[:1].copy_(self._device_flag, non_blocking=True)
        return 0, self._raised

    def restore(self, dst: torch.Tensor, src: torch.Tensor) -> Tuple[int, int]:
        """Copies the pinned `src` into the device `dst`."""
        dst.copy_(src, non_blocking=True)
        return 0, self._raised + 1  # the next staging comes after it on the stream


class AsyncJobs:
    """Asynchronous CPU jobs, one in flight per key (a lane): `launch` stages the inputs into pinned buffers
    (`copies.stage`) and a worker thread runs the job into the key's pinned output buffer; the key's next
    `collect` waits for it and copies the output to the device (`copies.restore`). A job is called as
    job(*staged, out, ready_flags, ready_values) and must touch neither before ready_flags[i] >=
    ready_values[i] for every i (`wait_host_flags`; the engine's job waits in its C++ call): its inputs are
    staged and the output buffer's last copy to the device is done (the guard). It returns (seconds waiting,
    seconds running)."""

    def __init__(self, copies, pin_memory: bool = True, threads: Optional[int] = None):
        """threads: the worker's OpenMP threads, pinned to the last `threads` cores this process may use (None:
        all of them but the first, left to the thread that launches GPU work)."""
        self.copies = copies
        self.pin_memory = pin_memory
        self.cores = worker_cores(threads)
        self.worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="apex-stagger",
                                                            initializer=_pin_worker, initargs=(self.cores,))
        self.buffers: Dict[tuple, torch.Tensor] = {}
        self.guards: Dict[int, Tuple[int, int]] = {}  # key -> (flag, value) of its output buffer's last copy back
        self.pending: Dict[int, Optional[concurrent.futures.Future]] = {}
        # recent timings, seconds: (waiting for the inputs' copy and the guard, running the job) per job, and
        # the launching thread's wait in each collect (how far the CPU is behind the GPU)
        self.job_seconds: Deque[Tuple[float, float]] = collections.deque(maxlen=4096)
        self.collect_seconds: Deque[float] = collections.deque(maxlen=4096)
        self.waited_s = 0.0  # the sum of collect_seconds since the executor was built

    def _buffer(self, name: str, key: int, like: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get((name, key))
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = self.buffers[(name, key)] = torch.zeros(like.shape, dtype=like.dtype, pin_memory=self.pin_memory)
        return buf

    def launch(self, key: int, job, inputs: List[torch.Tensor], output: torch.Tensor) -> None:
        """Stages `inputs` and runs the job on the worker; its out is pinned, shaped like `output` (the device
        buffer the key's next `collect` fills)."""
        if job is None:
            self.pending[key] = None
            return
        staged = [self._buffer(f"in{i}", key, t) for i, t in enumerate(inputs)]
        values = [0] * len(self.copies.flags)
        flag, value = self.copies.stage(list(zip(staged, inputs)))
        values[flag] = value
        guard = self.guards.get(key)
        if guard is not None:
            values[guard[0]] = max(values[guard[0]], guard[1])
        out_buf = self._buffer("out", key, output)
        flags = self.copies.flags

        def run():
            with torch.inference_mode():
                self.job_seconds.append(job(*staged, out_buf, flags, tuple(values)))

        self.pending[key] = self.worker.submit(run)

    def collect(self, key: int, out: torch.Tensor) -> None:
        future = self.pending.pop(key, None)
        if future is None:
            out.zero_()
            self.collect_seconds.append(0.0)
            return
        start = time.perf_counter()
        future.result()
        self.collect_seconds.append(time.perf_counter() - start)
        self.waited_s += self.collect_seconds[-1]
        self.guards[key] = self.copies.restore(out, self.buffers[("out", key)])

    def drain(self) -> None:
        """Waits for every launched job (before their requests' blocks are freed)."""
        for future in self.pending.values():
            if future is not None:
                future.result()

    def close(self) -> None:
        """Stops the worker thread once its queued jobs are done (their outputs are dropped); frees the buffers."""
        self.pending = {}
        self.worker.shutdown(wait=True)
        self.buffers.clear()
        self.guards.clear()
