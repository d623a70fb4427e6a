"""What a new user meets (issue 15): streams never leave the engine stuck, abort(), max_new_tokens capped by the
model's length, clear errors for bad input, explain() counting only the user's runs, the main job's errors."""
import io
import subprocess
import sys

import pytest
import torch

from apex_compile.config import ApexConfig
from apex_compile.model import optimize
from apex_compile.runtime.request import SamplingParams

MB = 1 << 20


@pytest.fixture()
def tiny(tiny_llama):
    return tiny_llama


@pytest.fixture()
def engine(tiny):
    return optimize(tiny, ApexConfig(offload=0.5, gpu_cache_size=4 * MB, cpu_cache_size=4 * MB)).engine


PROMPTS = [[5, 6, 7], [8, 9, 10, 11]]
LONG = SamplingParams(max_new_tokens=20)


def idle(engine):
    return engine.blocks_in_use() == {"device": 0, "host": 0} and not engine.has_unfinished()


def test_a_stream_never_iterated_queues_nothing(engine):
    stream = engine.stream(PROMPTS, LONG)
    assert idle(engine)
    del stream
    assert len(engine.generate(PROMPTS, SamplingParams(max_new_tokens=2))) == 2 and idle(engine)


def test_a_stream_closed_before_its_first_token(engine):
    stream = engine.stream(PROMPTS, LONG)
    stream.close()
    assert idle(engine)
    assert len(engine.generate(PROMPTS, SamplingParams(max_new_tokens=2))) == 2


def test_a_stream_closed_after_a_break_returns_its_blocks(engine):
    stream = engine.stream(PROMPTS, LONG)
    for _ in stream:
        break
    assert not idle(engine)  # suspended and still referenced: its requests hold blocks
    stream.close()
    assert idle(engine)


def test_abort_cancels_a_suspended_stream_which_then_ends(engine):
    stream = engine.stream(PROMPTS, LONG)
    next(stream)
    with pytest.raises(RuntimeError, match="engine.abort"):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=2))
    assert engine.abort() == 2 and idle(engine)
    rest = list(stream)  # at most the other token of the step already computed, marked aborted; then it ends
    assert len(rest) <= 1 and all(e.finish_reason == "abort" for e in rest)
    assert len(engine.generate(PROMPTS, SamplingParams(max_new_tokens=2))) == 2 and idle(engine)


def test_abort_of_one_request_lets_the_other_finish(engine):
    stream = engine.stream(PROMPTS, LONG)
    first = next(stream)
    request_ids = sorted(r.request_id for r in engine.scheduler.running)
    assert engine.abort([request_ids[0]]) == 1
    rest = list(stream)
    later = [e for e in rest if e.index == 0]  # request 0 may still show the token its last step computed
    assert len(later) <= 1 and all(e.finish_reason == "abort" for e in later)
    assert rest[-1].index == 1 and rest[-1].finish_reason == "length"
    assert first.index in (0, 1) and idle(engine)


def test_max_new_tokens_beyond_the_model_is_capped(engine):
    [completion] = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=10 ** 7))
    assert completion.finish_reason == "length" and len(completion.token_ids) == 64 - 3


def test_float_input_ids_and_bad_sampling_values_are_rejected(tiny):
    apex = optimize(tiny, ApexConfig(gpu_cache_size=4 * MB, cpu_cache_size=4 * MB))
    with pytest.raises(ValueError, match="integer token ids"):
        apex.generate(torch.tensor([[1.0, 2.0]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=2.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)


def test_a_bare_decoder_gets_a_clear_error(tiny):
    with pytest.raises(TypeError, match="no language-model head"):
        optimize(tiny.model)


def test_explain_counts_only_the_runs_after_warmup(tiny):
    apex = optimize(tiny, ApexConfig(gpu_cache_size=4 * MB, cpu_cache_size=4 * MB))
    apex.engine.warmup()
    assert "run so far" not in apex.explain(file=io.StringIO())
    apex.engine.generate(PROMPTS, SamplingParams(max_new_tokens=3))
    assert apex.engine.stats.generated_tokens == 6
    assert "6 tokens generated" in apex.explain(file=io.StringIO())


@pytest.mark.parametrize("args, message", [(["--model", "/nonexistent/model"], "error: cannot load the model"),
                                           (["--batch-size", "0"], "--batch-size must be >= 1")])
def test_main_job_reports_bad_arguments_in_one_line(args, message):
    done = subprocess.run([sys.executable, "-m", "apex_compile", *args], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr
    assert "loaded" not in done.stdout  # rejected before any model is loaded (--batch-size) or loading failed


def test_sampling_params_at_top_level():
    import apex_compile

    assert apex_compile.SamplingParams is SamplingParams


def test_main_job_shows_progress_and_streams_answers():
    done = subprocess.run([sys.executable, "-m", "apex_compile", "--no-hf", "--batch-size", "2", "--max-new-tokens",
                           "3"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    order = [out.index(s) for s in ("warming up", "warmed up in", "first token after", "[0]", "apex: ")]
    assert order == sorted(order)


def test_main_job_compiles_on_request():
    done = subprocess.run([sys.executable, "-m", "apex_compile", "--no-hf", "--batch-size", "1", "--max-new-tokens",
                           "2", "--compile", "on"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    order = [out.index(s) for s in ("compiling the model", "compiled and warmed up", "first token after")]
    assert order == sorted(order)


def test_close_frees_the_pools_and_later_use_raises(tiny):
    import gc
    import weakref

    with optimize(tiny, ApexConfig(offload=0.5, gpu_cache_size=4 * MB, cpu_cache_size=4 * MB)) as apex:
        engine = apex.engine
        caches = [weakref.ref(pool.key_caches[0]) for pool in engine.kv.pools]
        stream = engine.stream(PROMPTS, LONG)
        next(iter(stream))  # a request is mid-generation when the engine closes
    del stream
    gc.collect()
    assert [ref() for ref in caches] == [None, None]  # both pools' memory is free
    assert not engine.has_unfinished() and engine.abort() == 0
    for call in (engine.step, lambda: engine.generate(PROMPTS, LONG), lambda: engine.add_request([1, 2]),
                 engine.warmup, lambda: apex.generate(torch.tensor([[1, 2]]))):
        with pytest.raises(RuntimeError, match="engine is closed"):
            call()
    apex.close()  # a second close does nothing
