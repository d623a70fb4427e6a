"""The layered jobs' C++ runner (`StaggerRunner`): each submitted turn's job writes what a direct
`stagger_layer_job` call writes, in submission order, behind its gate and flags, without the GIL; a failed job is
reported once by `poll` and releases the device's waits; close runs what is queued."""
import ctypes
import math
import re
import sys
import time

import pytest
import torch

from apex_compile.ops import StaggerRunner
from tests.kernels.test_cpu_attention_multi import run_layer_job, stagger_job_case

LAYERS, WIDTH, HEADS = 3, 3, 4


def submit_case(runner, caches, staged, meta, turn, ready, done, picked=None, **kwargs):
    """Queues the job of `turn` over rows `picked` (None: all) into a NaN-filled output, which it returns."""
    rows = None if picked is None else torch.tensor(picked)
    chosen = {k: v if rows is None else v[rows] for k, v in meta.items()}
    out = torch.full(staged.shape[:2] + (HEADS, staged.shape[3]), float("nan"), dtype=staged.dtype)
    runner.submit(turn, out, ready, done, staged=staged, cache_index=chosen["cache_index"],
                  block_tables=chosen["block_tables"], context_lens=chosen["context_lens"],
                  slot_mapping=chosen["slot_mapping"], rows=rows, num_heads=HEADS, scale=0.3, **kwargs)
    return out


def wait_for(predicate, seconds=30.0):
    start = time.perf_counter()
    while not predicate():
        assert time.perf_counter() - start < seconds, "timed out"
        time.sleep(0.001)


@pytest.mark.parametrize("picked", [None, [0, 2, 7, 8]])
def test_runner_jobs_equal_direct_calls_in_order_and_report_each(picked, threads):
    """A job and an empty turn behind it: outputs and caches equal a direct call's bit for bit, the done flags end
    at the last turn, and poll returns one record per job in order (the empty turn's without busy time)."""
    caches, staged, meta = stagger_job_case(13, layers=LAYERS, width=WIDTH)
    expected = [(k.clone(), v.clone()) for k, v in caches]
    torch.set_num_threads(1)
    want, _ = run_layer_job(expected, staged, meta, picked, torch.ones(LAYERS, dtype=torch.int64),
                            torch.zeros(LAYERS, dtype=torch.int64), 1)
    ready, done = torch.ones(LAYERS, dtype=torch.int64), torch.zeros(LAYERS, dtype=torch.int64)
    runner = StaggerRunner([k for k, _ in caches], [v for _, v in caches], cores=[])
    try:
        got = submit_case(runner, caches, staged, meta, 1, ready, done, picked)
        runner.submit(2, got, ready, done)  # a turn without rows
        runner.drain()
        records = runner.poll()
    finally:
        runner.close()
    assert torch.equal(got.nan_to_num(-7.0), want.nan_to_num(-7.0))
    for (k, v), (k1, v1) in zip(caches, expected):
        assert torch.equal(k.nan_to_num(-7.0), k1.nan_to_num(-7.0))
        assert torch.equal(v.nan_to_num(-7.0), v1.nan_to_num(-7.0))
    assert done.tolist() == [2] * LAYERS
    fields = {name: i for i, name in enumerate(StaggerRunner.RECORD_FIELDS)}
    assert [r[fields["turn"]] for r in records] == [1.0, 2.0]
    first, empty = records
    assert first[fields["ran"]] > 0 and first[fields["call"]] >= first[fields["ran"]]
    assert not math.isnan(first[fields["busy"]]) and math.isnan(empty[fields["busy"]])
    assert first[fields["submitted"]] <= first[fields["started"]] <= first[fields["ended"]] <= empty[fields["started"]]


def test_runner_waits_for_its_gate_and_flags_and_keeps_the_order(threads):
    """A job does not start before gate[0] reaches its value, nor write a layer before its ready flag; the empty
    turn queued behind it raises its done flags only after it (the device's next step waits on them). `state`
    tells each wait: the gate, then the team on the job, then idle."""
    caches, staged, meta = stagger_job_case(17, layers=LAYERS, width=2)
    ready, done = torch.zeros(LAYERS, dtype=torch.int64), torch.zeros(LAYERS, dtype=torch.int64)
    gate = torch.zeros(1, dtype=torch.int64)
    runner = StaggerRunner([k for k, _ in caches], [v for _, v in caches], cores=[])
    try:
        out = submit_case(runner, caches, staged, meta, 1, ready, done, gate=gate, gate_value=2)
        runner.submit(2, out, ready, done)
        ready[:-1] = 1
        gate[0] = 1
        time.sleep(0.05)
        assert done.tolist() == [0] * LAYERS and torch.isnan(out).all()  # the gate holds it
        assert runner.state() == {"submitted": 2, "queued": 1, "finished": 0, "phase": "waiting for its gate",
                                  "turn": 1}
        gate[0] = 2
        wait_for(lambda: done.tolist()[:-1] == [1] * (LAYERS - 1))
        time.sleep(0.02)
        assert done.tolist()[-1] == 0  # the last layer's flag holds it
        assert runner.state()["phase"] == "running it" and runner.state()["turn"] == 1
        ready[-1] = 1
        wait_for(lambda: done.tolist() == [2] * LAYERS)
        runner.drain()
        wait_for(lambda: runner.state()["phase"] == "idle")
        assert runner.state() == {"submitted": 2, "queued": 0, "finished": 2, "phase": "idle", "turn": None}
        job, _ = runner.poll()
    finally:
        runner.close()
    assert not torch.isnan(out).any()
    assert job[StaggerRunner.RECORD_FIELDS.index("gate_wait")] >= 0.04


@pytest.mark.parametrize("team", [1, 2])
def test_runner_runs_its_jobs_while_python_holds_the_gil(threads, team):
    """Two queued jobs, one after the other, finish while this thread runs pure Python with forced GIL switches
    pushed out to 30 s: the runner needs no GIL to start a job, end it or begin the next (a Python worker thread
    needs it between two jobs), on a team of one thread or two (the jobs back to back in one region)."""
    import os

    caches, staged, meta = stagger_job_case(4, layers=LAYERS, width=2)
    ready, done = torch.zeros(LAYERS, dtype=torch.int64), torch.zeros(LAYERS, dtype=torch.int64)
    cores = [] if team == 1 else sorted(os.sched_getaffinity(0))[:team]
    runner = StaggerRunner([k for k, _ in caches], [v for _, v in caches], cores=cores)
    interval = sys.getswitchinterval()
    try:
        submit_case(runner, caches, staged, meta, 1, ready, done)
        submit_case(runner, caches, staged, meta, 2, ready, done)
        time.sleep(0.05)
        flags = [ctypes.c_int64.from_address(ready.data_ptr() + 8 * i) for i in range(LAYERS)]
        last = ctypes.c_int64.from_address(done.data_ptr() + 8 * (LAYERS - 1))
        sys.setswitchinterval(30.0)
        try:
            for flag in flags:  # no op call: the GIL stays here
                flag.value = 2
            start = time.perf_counter()
            while last.value != 2 and time.perf_counter() - start < 1.0:
                pass
            finished = last.value == 2
        finally:
            sys.setswitchinterval(interval)
        runner.drain()
        assert finished
        assert [r[0] for r in runner.poll()] == [1.0, 2.0]
    finally:
        runner.close()


def test_a_failed_job_is_raised_once_releases_the_device_and_the_next_job_runs(threads):
    """Rows out of layer order fail their job: its done flags go to 1 << 62 (the device's waits pass), poll
    raises the error once and returns every record at the next call, and the job queued after it still runs."""
    caches, staged, meta = stagger_job_case(19, layers=2, width=2)
    ready, done = torch.ones(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    runner = StaggerRunner([k for k, _ in caches], [v for _, v in caches], cores=[])
    try:
        submit_case(runner, caches, staged, meta, 1, ready, done, picked=[2, 0])
        runner.drain()
        assert done.tolist() == [1 << 62] * 2
        done.zero_()
        ready.fill_(2)
        out = submit_case(runner, caches, staged, meta, 2, ready, done)
        runner.drain()
        with pytest.raises(RuntimeError, match="turn 1 failed: .*sorted by layer"):
            runner.poll()
        records = runner.poll()
        assert [r[0] for r in records] == [1.0, 2.0] and runner.poll() == []
        assert math.isnan(records[0][2]) and records[1][2] > 0  # the failed job's running time is NaN
        assert done.tolist() == [2, 2] and not torch.isnan(out).any()
    finally:
        runner.close()


def test_jobs_queued_back_to_back_run_on_a_team_as_direct_calls(threads):
    """Jobs queued back to back run one after the other on the runner's team (two threads here), woken once for
    them: each writes what a direct one-thread call writes, bit for bit; a failed job among them is raised once
    and lifts its done flags, and the jobs after it (a turn without rows, a job on fewer rows) still run."""
    import os

    caches, staged, meta = stagger_job_case(29, layers=LAYERS, width=WIDTH)
    pristine = [(k.clone(), v.clone()) for k, v in caches]
    picked = {1: None, 2: None, 3: [4, 1], 5: [0, 1, 4, 8]}  # turn 3: rows out of layer order, it fails
    torch.set_num_threads(1)
    expected, want = [(k.clone(), v.clone()) for k, v in pristine], {}
    for turn in (1, 2, 5):
        want[turn], _ = run_layer_job(expected, staged, meta, picked[turn], torch.full((LAYERS,), turn),
                                      torch.zeros(LAYERS, dtype=torch.int64), turn)
    cores = sorted(os.sched_getaffinity(0))[:2]
    runner = StaggerRunner([k for k, _ in caches], [v for _, v in caches], cores=cores)
    ready, done = torch.zeros(LAYERS, dtype=torch.int64), torch.zeros(LAYERS, dtype=torch.int64)
    try:
        got = {turn: submit_case(runner, caches, staged, meta, turn, ready, done, picked[turn]) for turn in (1, 2, 3)}
        runner.submit(4, got[3], ready, done)  # a turn without rows
        got[5] = submit_case(runner, caches, staged, meta, 5, ready, done, picked[5])
        ready[:] = 5  # every layer of every turn staged: the queued jobs run back to back
        runner.drain()
        with pytest.raises(RuntimeError, match="turn 3 failed: .*sorted by layer"):
            runner.poll()
        records = runner.poll()
    finally:
        runner.close()
    for turn in (1, 2, 5):
        assert torch.equal(got[turn].nan_to_num(-7.0), want[turn].nan_to_num(-7.0))
    for (k, v), (k1, v1) in zip(caches, expected):
        assert torch.equal(k.nan_to_num(-7.0), k1.nan_to_num(-7.0))
        assert torch.equal(v.nan_to_num(-7.0), v1.nan_to_num(-7.0))
    assert done.tolist() == [5] * LAYERS
    fields = {name: i for i, name in enumerate(StaggerRunner.RECORD_FIELDS)}
    assert [r[fields["turn"]] for r in records] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert [math.isnan(r[fields["ran"]]) for r in records] == [False, False, True, False, False]
    assert all(r[fields["ran"]] > 0 and r[fields["busy"]] > 0 for i, r in enumerate(records) if i in (0, 1, 4))
    assert all(a[fields["ended"]] <= b[fields["started"]] for a, b in zip(records, records[1:]))


def test_runner_close_runs_what_is_queued_and_refuses_later_work(threads):
    """close() lets the queued jobs finish before the thread stops; a second close does nothing; a closed runner
    refuses submissions, and bad arguments are clear errors."""
    caches, staged, meta = stagger_job_case(23, layers=2, width=2)
    ready, done = torch.ones(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    runner = StaggerRunner([k for k, _ in caches], [v for _, v in caches], cores=[])
    with pytest.raises(RuntimeError, match="needs cache_index"):
        runner.submit(1, torch.empty(0), ready, done, staged=staged)
    with pytest.raises(RuntimeError, match="contiguous int64"):
        runner.submit(1, torch.empty(0), ready.int(), done)
    out = submit_case(runner, caches, staged, meta, 1, ready, done)
    runner.close()
    runner.close()
    assert done.tolist() == [1, 1] and not torch.isnan(out).any()
    with pytest.raises(RuntimeError, match="closed"):
        runner.submit(2, out, ready, done)
    with pytest.raises(RuntimeError, match="no runner"):
        torch.ops.apex.stagger_runner_poll(10 ** 9)
    with pytest.raises(RuntimeError, match="non-empty"):
        StaggerRunner([], [], cores=[])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_runner_thread_runs_on_its_cores():
    """The runner's thread ("apex-runner") is pinned to the cores it was given."""
    import glob
    import os

    cores = sorted(os.sched_getaffinity(0))[-1:]
    caches, _, _ = stagger_job_case(3, layers=1, width=1)
    runner = StaggerRunner([k for k, _ in caches], [v for _, v in caches], cores=cores)
    try:
        ready, done = torch.ones(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
        runner.submit(1, torch.empty(0), ready, done)  # the thread has started and pinned itself once this ran
        runner.drain()
        tasks = [os.path.dirname(p) for p in glob.glob("/proc/self/task/*/comm")
                 if open(p).read().strip() == "apex-runner"]
        assert tasks
        tid = int(os.path.basename(tasks[-1]))
        assert sorted(os.sched_getaffinity(tid)) == cores
    finally:
        runner.close()


def test_a_device_wait_that_timed_out_tells_where_the_jobs_stand(threads):
    """The error of a device wait that timed out (the status word) says what the runner is doing: here a job held
    by its gate, the layers' flags and how far the gate is."""
    from apex_compile.runtime.stagger import LayerJobs

    caches, staged, meta = stagger_job_case(19, layers=LAYERS, width=2)
    outputs = torch.zeros(staged.shape[:2] + (HEADS, staged.shape[3]), dtype=staged.dtype)
    jobs = LayerJobs(staged, outputs, pin_memory=False, threads=1,
                     caches=([k for k, _ in caches], [v for _, v in caches]))
    gate = torch.zeros(1, dtype=torch.int64)
    try:
        jobs.staged.copy_(staged)
        jobs.ready[:] = 3
        jobs.submit(3, lambda *_: None, num_heads=HEADS, scale=0.3, gate=gate, gate_value=2, **meta)
        wait_for(lambda: jobs.runner.state()["phase"] == "waiting for its gate")
        jobs.status[0] = 3
        with pytest.raises(RuntimeError, match=r"job of turn 3: .*ready flags 3\.\.3, done flags 0\.\.0; runner: 1 "
                                               r"job\(s\) submitted, 0 queued, 0 finished, waiting for its gate "
                                               r"\(turn 3\); its gate 0 of 2"):
            jobs.collect(0, jobs.outputs)
        jobs.status[0] = 0
        gate[0] = 2
        jobs.drain()
        assert jobs.done.tolist() == [3] * LAYERS and not jobs._gates
        # once the job ran, the error tells its timeline: how long it was held by its gate; and (on a GPU, here
        # played) the device's longest wait
        jobs.status[0] = 3
        jobs.stall_unit, jobs.stalls[1] = 1e-9, 5 * 10 ** 9
        jobs.gate_state = lambda: "exports: 2 submitted, 2 landed"  # what the gate waited for (KVExports.state)
        with pytest.raises(RuntimeError) as error:
            jobs.collect(0, jobs.outputs)
        timeline = re.search(r"the last job queued: turn 3, [\d.]+ s ago; turn 3: queued [\d.]+ s ago, started "
                             r"[\d.]+ s later, its gate ([\d.]+) s, the layers' flags [\d.]+ s, running [\d.]+ s, "
                             r"ended [\d.]+ s ago", str(error.value))
        assert timeline, str(error.value)  # (the gate's seconds are printed, whatever they are)
        assert "the device's longest last wait 5.0 s, at layer 1" in str(error.value)
        assert re.search(r"ended [\d.]+ s ago; exports: 2 submitted, 2 landed\)$", str(error.value)), str(error.value)
        jobs.status[0] = 0
    finally:
        jobs.close()


def test_a_job_gated_on_prompt_exports_finishes_while_the_launching_thread_holds_the_gil():
    """What the GPU's wait for a layered job stands on, end to end without CUDA: the prompt exports land (their
    copies done) on the C++ lander and the job gated on them runs on the C++ runner while this thread holds the
    GIL (a busy loop, 30 s switch interval), as the launching thread may while the GPU waits."""
    from apex_compile.runtime.attention_runner import KVExports
    from apex_compile.runtime.stagger import LayerJobs

    caches, staged, meta = stagger_job_case(23, layers=LAYERS, width=2)
    outputs = torch.zeros(staged.shape[:2] + (HEADS, staged.shape[3]), dtype=staged.dtype)
    jobs = LayerJobs(staged, outputs, pin_memory=False, threads=1,
                     caches=([k for k, _ in caches], [v for _, v in caches]))
    from apex_compile.ops import cache_append_cpu

    exports = KVExports(cache_append_cpu, background=True)
    spare = torch.zeros_like(caches[0][0]), torch.zeros_like(caches[0][1])  # an export's own cache (not the job's)
    kv = torch.ones(2, caches[0][0].shape[1], caches[0][0].shape[3], dtype=caches[0][0].dtype)
    exports.submit(kv, kv, *spare, torch.tensor([2, 3]))  # a first export: whatever thread lands them exists
    exports.wait()
    interval = sys.getswitchinterval()
    try:
        jobs.staged.copy_(staged)
        jobs.ready[:] = 4
        sys.setswitchinterval(30.0)
        exports.submit(kv, kv, *spare, torch.tensor([0, 1]))
        gate, value = exports.gate()
        jobs.submit(4, lambda *_: None, num_heads=HEADS, scale=0.3, gate=gate, gate_value=value, **meta)
        done = jobs.done.numpy()
        deadline = time.perf_counter() + 10.0
        while done.min() < 4 and time.perf_counter() < deadline:  # (numpy: never releases the GIL)
            pass
        finished = int(done.min())
    finally:
        sys.setswitchinterval(interval)
        jobs.close()
        exports.close()
    assert finished == 4
    assert torch.equal(spare[1][0, :, :2], torch.ones(2, kv.shape[1], kv.shape[2], dtype=kv.dtype).transpose(0, 1))
