"""The one-lane staggered plan with its CPU jobs beside the step (`LayerJobs`): each layer's device wait (a
Triton kernel polling a host flag) and the worker thread's layer-by-layer job, on CPU tensors under
TRITON_INTERPRET=1 (tests/kernels/test_triton_interpreter.py runs this file that way) or on a GPU."""
import pytest
import torch

from apex_compile import SamplingParams
from apex_compile.runtime.stagger import LayerJobs
from tests.devices import INTERPRET
from tests.runtime.test_runtime_stagger import hf_tokens, sharp_model, staggered

pytestmark = pytest.mark.skipif(not INTERPRET, reason="the device waits run under TRITON_INTERPRET=1 on a CPU")


def test_one_lane_with_layered_jobs_gives_hf_tokens():
    """The job of turn t runs on the worker (the C++ runner's thread) while step t's layers stage their rows, and
    step t + 1's layers each wait for their layer of it: tokens equal HF's, every job ran through its layers'
    flags."""
    torch.manual_seed(21)
    model = sharp_model()
    prompts = [torch.randint(3, 96, (n,)).tolist() for n in (5, 9, 3, 12, 7, 4, 8, 6, 10)]
    reference = hf_tokens(model, prompts, 9)
    apex = staggered(model, width=2, lanes=1)
    jobs = apex.engine.stagger.executor
    assert isinstance(jobs, LayerJobs)
    done = apex.engine.generate(prompts, SamplingParams(max_new_tokens=9))
    assert [c.token_ids for c in done] == reference
    assert sum(1 for c in done if c.steps_per_pool["host"]) >= 3
    assert len(jobs.job_seconds) >= 9 and int(jobs.status[0]) == 0
    jobs.drain()
    # each job's team thread-seconds inside items (the default "flow" schedule times them): within its running
    # time over the team, and some work in every job that had rows (a job of only empty layers reads 0)
    busy = list(jobs.job_busy)
    assert len(busy) == len(jobs.job_seconds) and max(busy) > 0
    assert all(0 <= b <= ran * len(jobs.cores) + 1e-4 for b, (_, ran) in zip(busy, jobs.job_seconds))
    turns = apex.engine.stagger.steps  # (the last turn may have been begun and never run)
    assert jobs.done.tolist() in ([turns] * len(jobs.done), [turns - 1] * len(jobs.done))  # every layer raised
    assert apex.engine.blocks_in_use() == {"device": 0, "host": 0}


def test_the_row_fit_takes_the_jobs_work(monkeypatch):
    """The adaptive rows fit each flow job's work (its team's busy thread-seconds over the team's threads) rather
    than its running time; the tokens are HF's."""
    torch.manual_seed(23)
    model = sharp_model()
    prompts = [torch.randint(3, 96, (n,)).tolist() for n in (5, 9, 3, 12, 7, 4, 8)]
    reference = hf_tokens(model, prompts, 8)
    apex = staggered(model, width=2, lanes=1)
    jobs, rows = apex.engine.stagger.executor, apex.engine.stagger.rows
    fitted = []
    observe = rows.observe_job
    monkeypatch.setattr(rows, "observe_job", lambda seconds, work, decode=True: (fitted.append(seconds),
                                                                                 observe(seconds, work, decode)))
    done = apex.engine.generate(prompts, SamplingParams(max_new_tokens=8))
    assert [c.token_ids for c in done] == reference
    jobs.drain()
    runs = [(ran, busy) for (_, ran), busy in zip(jobs.job_seconds, jobs.job_busy)]
    assert len(fitted) == len(runs) >= 8
    expected = [busy / len(jobs.cores) if busy > 0 else ran for ran, busy in runs]
    assert fitted == pytest.approx(expected, rel=1e-12)
    assert any(abs(f - ran) > 1e-9 for f, (ran, _) in zip(fitted, runs))


def test_a_failed_layered_job_raises_at_the_next_step_without_hanging(monkeypatch):
    """A job that fails on the worker (the C++ runner's, on rows whose cache_index is not their layer) lifts its
    done flags past any turn (the device waits pass at once) and its error reaches the caller at the next step."""
    from apex_compile.ops.cpu_attention import StaggerRunner
    from apex_compile.runtime import stagger as stagger_module

    submit = StaggerRunner.submit

    def corrupted(self, *args, **kwargs):
        if kwargs.get("cache_index") is not None:
            kwargs["cache_index"] = kwargs["cache_index"] + 1
        return submit(self, *args, **kwargs)

    monkeypatch.setattr(StaggerRunner, "submit", corrupted)
    error = "failed: .*cache_index must name each row's layer"
    torch.manual_seed(22)
    model = sharp_model()
    prompts = [torch.randint(3, 96, (n,)).tolist() for n in (5, 9, 3, 12, 7, 4)]
    apex = staggered(model, width=2, lanes=1)
    with pytest.raises(RuntimeError, match=error):
        apex.engine.generate(prompts, SamplingParams(max_new_tokens=6))
    assert min(apex.engine.stagger.executor.done.tolist()) >= stagger_module.ABORTED


def test_layered_jobs_do_not_wait_for_exports_into_blocks_they_do_not_read(monkeypatch):
    """A job waits only for the prompt exports into its rows' blocks (`KVExports.gate` over its block tables): an
    export into a block no request holds, whose copy flag stays down for the whole run, holds no job (with every
    export gated on, each job would wait for it and the run could not end before it lands); tokens are HF's."""
    from apex_compile.ops import cache_append_cpu
    from apex_compile.runtime.attention_runner import KVExports

    class HeldCopies(KVExports):
        def _copied_now(self, index: int) -> None:  # the copy flag stays down until the test raises it
            pass

    torch.manual_seed(26)
    model = sharp_model()
    prompts = [torch.randint(3, 96, (n,)).tolist() for n in (5, 9, 3, 12, 7, 4, 8)]
    reference = hf_tokens(model, prompts, 8)
    apex = staggered(model, width=2, lanes=1)
    engine = apex.engine
    exports = engine.runner.exports = HeldCopies(cache_append_cpu, background=True)
    cache = engine.kv.pools[1].key_caches[0]
    blocks = cache.shape[0]
    spare = torch.zeros(blocks + 1, *cache.shape[1:]), torch.zeros(blocks + 1, *cache.shape[1:])
    kv = torch.ones(2, *cache.shape[1:2], cache.shape[3])
    slot = blocks * engine.kv.block_size  # in a block past the pool: no request's table holds it
    exports.submit(kv, kv, *spare, torch.tensor([slot, slot + 1]))
    gates = []
    submit = engine.stagger.executor.submit
    monkeypatch.setattr(engine.stagger.executor, "submit",
                        lambda turn, observe, **job: (gates.append(job["gate"]), submit(turn, observe, **job)))
    held = []
    abort = engine.abort

    def release_then_abort(request_ids=None):  # the stream's end drops what is left, after every export
        held.append(exports.queued())
        exports._copied[0] = 1
        return abort(request_ids)

    monkeypatch.setattr(engine, "abort", release_then_abort)
    done = engine.generate(prompts, SamplingParams(max_new_tokens=8))
    assert [c.token_ids for c in done] == reference
    assert sum(1 for c in done if c.steps_per_pool["host"]) >= 3
    assert held[0] == 1  # still held when every step had run: no job waited for it
    assert len(gates) >= 8 and not any(g is not None for g in gates)
    exports.wait()
    assert torch.equal(spare[1][blocks, :, :2], torch.ones(*cache.shape[1:2], 2, cache.shape[3]))
    apex.close()


def test_quiet_leaves_turn_and_flags_as_they_were():
    """A graph's warm-up run executes the step: meanwhile both turns are 0 (its waits pass, its raises say
    nothing to a job), and they, the ready flags and the residual rows come back after."""
    torch.manual_seed(23)
    apex = staggered(sharp_model(), width=2, lanes=1)
    stagger = apex.engine.stagger
    stagger.turn.fill_(5)
    stagger.after.fill_(3)
    stagger.executor.ready.fill_(4)
    residual = torch.randn_like(stagger.residual)
    stagger.residual.copy_(residual)
    with stagger.quiet():
        assert int(stagger.turn) == 0 and int(stagger.after) == 0
        stagger.executor.ready.fill_(0)
        stagger.residual.zero_()
    assert int(stagger.turn) == 5 and int(stagger.after) == 3 and stagger.executor.ready.tolist() == [4] * len(stagger.executor.ready)
    assert torch.equal(stagger.residual, residual)


def test_a_turn_begun_but_never_run_is_not_waited_for():
    """Each step's device wait names the last turn whose job was launched, not the turn before: a turn begun and
    then not run (no block in that step) launches no job, and the next step must not wait for one."""
    torch.manual_seed(24)
    apex = staggered(sharp_model(), width=2, lanes=1)
    stagger = apex.engine.stagger
    stagger.begin_step()
    assert stagger._block_host[-2:].tolist() == [0, 1]
    stagger.begin_step()  # turn 1 never ran
    assert stagger._block_host[-2:].tolist() == [0, 2]
    stagger.end_step(apex.engine.runner)  # turn 2 ran (no rows: its done flags rise at once)
    stagger.begin_step()
    assert stagger._block_host[-2:].tolist() == [2, 3]
    stagger.executor.drain()
    assert stagger.executor.done.tolist() == [2] * len(stagger.executor.done)


def test_steps_queued_ahead_with_layered_jobs_give_the_synchronous_tokens():
    """Async scheduling with one lane: a step queued before the previous step's tokens reach the host takes the
    block's re-entering ids on the device, and a request that stops by EOS while its next turn's job runs is
    removed after that job (tokens and finish reasons equal the synchronous engine's, every block returned)."""
    import collections

    torch.manual_seed(25)
    model = sharp_model()
    prompts = [torch.randint(3, 96, (n,)).tolist() for n in (5, 9, 3, 12, 7, 4, 8, 6, 10)]
    lengths = [12, 8, 14, 10, 13, 9, 12, 14, 11]

    def generate(async_scheduling, eos=()):
        apex = staggered(model, width=2, lanes=1, device_blocks=6, async_scheduling=async_scheduling)
        sampling = [SamplingParams(max_new_tokens=n, eos_token_ids=eos) for n in lengths]
        done = apex.engine.generate(prompts, sampling)
        assert apex.engine.blocks_in_use() == {"device": 0, "host": 0}
        assert int(apex.engine.stagger.executor.status[0]) == 0
        return [(c.token_ids, c.finish_reason) for c in done], apex.engine.stats

    plain, _ = generate(False)
    eos = (collections.Counter(t for ids, _ in plain for t in ids).most_common(3)[2][0],)
    expected, _ = generate(False, eos)
    got, stats = generate(True, eos)
    assert got == expected and stats.ahead_steps > 0 and "eos" in [reason for _, reason in got]


def test_a_ceiling_of_zero_parks_the_one_lane_pipeline_with_steps_queued_ahead(monkeypatch):
    """The model's ceiling falls to 0 while one lane's steps run ahead: the pipeline empties as its requests
    sample, they are parked once their token is on the host and resume in the device pool; tokens are HF's."""
    from apex_compile.runtime.plans.pipeline_rules import PipelineRules

    parked = []
    park = PipelineRules.park
    monkeypatch.setattr(PipelineRules, "park", lambda self, r: parked.append(r) or park(self, r))
    torch.manual_seed(26)
    model = sharp_model()
    prompts = [torch.randint(3, 96, (n,)).tolist() for n in (5, 9, 3, 12, 7, 4, 8)]
    reference = hf_tokens(model, prompts, 10)
    apex = staggered(model, width=2, lanes=1, async_scheduling=True)
    stagger = apex.engine.stagger
    tokens, cut = [[] for _ in prompts], False
    for event in apex.engine.stream(prompts, SamplingParams(max_new_tokens=10)):
        tokens[event.index].append(event.token_id)
        if not cut and stagger.inside >= 2 and apex.engine.stats.ahead_steps:
            stagger.rows.set_ceiling(0)
            cut = True
    assert cut and tokens == reference
    assert len(parked) >= 2 and all(r.num_tokens == len(r.prompt_token_ids) + 10 for r in parked)
    assert not stagger.members()
    assert apex.engine.blocks_in_use() == {"device": 0, "host": 0}
