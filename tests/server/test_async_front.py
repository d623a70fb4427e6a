"""AsyncEngine (issue 62 item 1) on the tiny random Llama: submissions from several threads join a running
batch with the tokens a lone run gives, abort, the bounded queue, asyncio iteration, and errors that fail one
request (or one step) without stopping the front."""
import asyncio
import threading

import pytest

from apex_compile.config import ApexConfig
from apex_compile.model import optimize
from apex_compile.runtime.async_engine import AsyncEngine, QueueFullError
from apex_compile.runtime.request import SamplingParams

MB = 1 << 20
PROMPTS = [[5, 6, 7], [8, 9, 10, 11], [12, 13], [1, 2, 3, 4, 5, 6], [7], [20, 21, 22]]


@pytest.fixture()
def engine(tiny_llama):
    engine = optimize(tiny_llama, ApexConfig(offload=0.5, gpu_cache_size=4 * MB, cpu_cache_size=4 * MB)).engine
    yield engine
    engine.close()


def idle(engine):
    return engine.blocks_in_use() == {"device": 0, "host": 0} and not engine.has_unfinished()


def test_submissions_from_threads_join_the_batch_and_match_lone_runs(engine):
    sampling = SamplingParams(max_new_tokens=12)
    expected = [c.token_ids for c in engine.generate(PROMPTS, sampling)]
    front = engine.front
    first = front.submit(PROMPTS[0], SamplingParams(max_new_tokens=40))
    next(iter(first))  # running: the others arrive while it decodes
    streams = [None] * len(PROMPTS)

    def submit(i):
        streams[i] = front.submit(PROMPTS[i], sampling)

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = [s.result(timeout=120).token_ids for s in streams]
    assert got == expected
    assert [e.token_id for e in streams[1]] == expected[1] and len(streams[1].token_times) == 12
    assert first.result(timeout=120).finish_reason == "length"
    assert idle(engine)


def test_sync_generate_from_two_threads_both_answer(engine):
    sampling = SamplingParams(max_new_tokens=16)
    expected = [c.token_ids for c in engine.generate(PROMPTS, sampling)]
    results, errors = {}, []

    def run(name, prompts):
        try:
            results[name] = [c.token_ids for c in engine.generate(prompts, sampling)]
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(0, PROMPTS[:3])), threading.Thread(target=run, args=(1, PROMPTS[3:]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and results[0] + results[1] == expected and idle(engine)


def test_abort_ends_the_stream_and_returns_the_blocks(engine):
    front = engine.front
    stream = front.submit(PROMPTS[1], SamplingParams(max_new_tokens=50))
    other = front.submit(PROMPTS[2], SamplingParams(max_new_tokens=20))
    next(iter(stream))
    stream.abort(wait=True)
    assert stream.done and stream.finish_reason == "abort"
    assert stream.result().finish_reason == "abort" and len(list(stream)) < 50
    assert other.result(timeout=120).finish_reason == "length"
    assert idle(engine)


def test_a_full_queue_raises_and_validation_errors_raise_in_the_caller(engine):
    front = AsyncEngine(engine, max_waiting=2)
    held = engine.stream([[1, 2]], SamplingParams(max_new_tokens=30))
    next(held)  # an in-thread run holds the engine: submissions wait
    try:
        waiting = [front.submit([3, 4]) for _ in range(2)]
        with pytest.raises(QueueFullError):
            front.submit([3, 4])
        assert front.num_waiting == 2
        with pytest.raises(ValueError, match="empty prompt"):
            front.submit([])
        with pytest.raises(ValueError, match="token ids"):
            front.submit([10 ** 6])
    finally:
        held.close()
    assert all(s.result(timeout=120).finish_reason == "length" for s in waiting)
    front.shutdown()
    assert idle(engine)


def test_async_iteration(engine):
    front = engine.front

    async def main():
        streams = [front.submit(p, SamplingParams(max_new_tokens=8)) for p in PROMPTS[:3]]

        async def read(stream):
            return [event.token_id async for event in stream]

        return await asyncio.gather(*(read(s) for s in streams))

    got = asyncio.run(main())
    assert got == [c.token_ids for c in engine.generate(PROMPTS[:3], SamplingParams(max_new_tokens=8))]


def test_an_error_fails_only_its_request_and_a_failed_step_only_the_streams_in_flight(engine, monkeypatch):
    front = engine.front
    real_add = engine.add_request

    def add_request(ids, sampling=None):
        if ids == [66, 66]:
            raise RuntimeError("this request is bad")
        return real_add(ids, sampling)

    monkeypatch.setattr(engine, "add_request", add_request)
    bad = front.submit([66, 66], SamplingParams(max_new_tokens=4))
    good = front.submit([5, 6], SamplingParams(max_new_tokens=4))
    with pytest.raises(RuntimeError, match="this request is bad"):
        bad.result(timeout=60)
    assert good.result(timeout=60).finish_reason == "length"

    real_step, calls = engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the step broke")
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    doomed = front.submit([5, 6, 7], SamplingParams(max_new_tokens=10))
    with pytest.raises(RuntimeError, match="the step broke"):
        list(doomed)
    assert idle(engine) and front.is_running
    assert front.submit([5, 6, 7], SamplingParams(max_new_tokens=3)).result(timeout=60).finish_reason == "length"


def test_close_stops_the_front(engine):
    front = engine.front
    stream = front.submit([5, 6], SamplingParams(max_new_tokens=60))
    engine.close()
    assert stream.done and not front.is_running
