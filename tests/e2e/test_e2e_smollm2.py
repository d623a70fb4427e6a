"""End to end on the embedded SmolLM2-135M-Instruct in fp32: ApexModel.generate gives HF generate's tokens
(offload never / all / half, chunked prefill, pools forced full), sampling is sane, bad input fails early.

One compiled step serves every ApexModel of the module's model, so the apex backend compiles once.
"""
import copy
import io

import pytest
import torch

from apex_compile.config import ApexConfig
from apex_compile.model import optimize
from apex_compile.runtime.loader import load_model
from apex_compile.runtime.request import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain gravity to a child in two sentences.",
    "hi",
    "List three primary colors and say which one you like best and why, in one short paragraph.",
    "What is 12 times 12?",
    "Tell me a short joke about computers.",
    "Describe the ocean at night, using vivid imagery, in about three sentences, for a poem I am writing.",
]
NEW_TOKENS = 64
MB = 1 << 20


@pytest.fixture(scope="module")
def smol():
    torch.manual_seed(0)
    model, tokenizer = load_model()
    return model, tokenizer


@pytest.fixture(scope="module")
def batch(smol):
    model, tokenizer = smol
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in PROMPTS]
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    lengths = enc.attention_mask.sum(1).tolist()
    assert len(set(lengths)) >= 6  # prompts of different lengths
    return enc.input_ids, enc.attention_mask


@pytest.fixture(scope="module")
def hf_reference(smol, batch):
    model, _ = smol
    input_ids, mask = batch
    with torch.no_grad():
        return model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)


def assert_blocks_returned(apex_model):
    assert apex_model.engine.blocks_in_use() == {"device": 0, "host": 0}
    assert not apex_model.engine.kv.tables


@pytest.mark.parametrize("offload", ["never", "all", 0.5])
def test_greedy_equals_hf_generate(smol, batch, hf_reference, offload):
    model, tokenizer = smol
    apex = optimize(model, ApexConfig(offload=offload, gpu_cache_size=64 * MB, cpu_cache_size=64 * MB), tokenizer)
    input_ids, mask = batch
    out = apex.generate(input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert out.dtype == torch.long and out.shape == hf_reference.shape
    assert torch.equal(out, hf_reference)
    per_pool = apex.engine.stats.requests_per_pool
    expected = {"never": [8, 0], "all": [0, 8], 0.5: [4, 4]}[offload]
    assert per_pool == expected
    assert_blocks_returned(apex)
    assert "compiled graph 0" in apex.explain(file=io.StringIO())


@pytest.mark.filterwarnings("ignore:.*split across steps")  # a 40-token budget splits host prompts on purpose
def test_full_pools_wait_preempt_and_resume_with_identical_tokens(smol, batch, hf_reference):
    model, tokenizer = smol
    input_ids, mask = batch
    block_bytes = 2 * 30 * 3 * 16 * 64 * 4  # SmolLM2 fp32, 16-token blocks
    # Each pool holds ~1.5 finished requests: requests wait, move between pools when theirs is full, and are
    # recomputed when both are; a 40-token budget also splits every prompt into chunks.
    config = ApexConfig(offload=0.5, gpu_cache_size=12 * block_bytes, cpu_cache_size=12 * block_bytes,
                        max_num_batched_tokens=40)
    apex = optimize(model, config, tokenizer)
    out = apex.generate(input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(out, hf_reference)
    stats = apex.engine.stats
    assert stats.moved > 0 and stats.recomputed > 0
    assert_blocks_returned(apex)


def test_forward_logits_match_hf(smol):
    model, tokenizer = smol
    apex = optimize(model, ApexConfig(offload=0.5, gpu_cache_size=16 * MB, cpu_cache_size=16 * MB))
    ids = tokenizer(["The quick brown fox jumps over the lazy dog.", "Paris is the capital of"],
                    return_tensors="pt", padding=True).input_ids[:, :8]
    with torch.no_grad():
        ref = model(ids).logits
        exact = copy.deepcopy(model).double()(ids).logits
    ours = apex(ids).logits
    assert ours.shape == ref.shape
    # fp32 against the float64 model: apex's error (oneDNN GEMMs on a CPU, another summation order than HF's MKL)
    # stays within an order of magnitude of HF's own fp32 error and within 2e-4 of the largest logit.
    hf_error = float((ref.double() - exact).abs().max())
    apex_error = float((ours.double() - exact).abs().max())
    assert apex_error <= max(10 * hf_error, 2e-4 * float(exact.abs().max()))
    assert_blocks_returned(apex)


def test_seeded_sampling_is_sane_and_respects_top_k(smol, batch):
    model, tokenizer = smol
    apex = optimize(model, ApexConfig(offload=0.5, gpu_cache_size=32 * MB, cpu_cache_size=32 * MB), tokenizer)
    input_ids, mask = batch
    rows = [input_ids[i][mask[i].bool()].tolist() for i in range(4)]
    params = SamplingParams(max_new_tokens=24, do_sample=True, temperature=0.9, top_k=5, seed=11)
    first = apex.engine.generate(rows, params)
    second = apex.engine.generate(rows, params)
    assert [c.token_ids for c in first] == [c.token_ids for c in second]
    # every sampled token is among the 5 most likely continuations of its prefix
    sequences = [c.prompt_token_ids + c.token_ids for c in first]
    scores = apex.engine.score(sequences)
    for completion, logits in zip(first, scores):
        assert not logits.isnan().any()
        start = len(completion.prompt_token_ids) - 1
        for i, token in enumerate(completion.token_ids):
            assert token in logits[start + i].topk(5).indices.tolist()
    # HF-style call with the global RNG
    torch.manual_seed(3)
    out = apex.generate(input_ids[:2], attention_mask=mask[:2], max_new_tokens=8, do_sample=True, top_k=3)
    assert out.shape[0] == 2 and int(out.min()) >= 0 and int(out.max()) < model.config.vocab_size
    assert_blocks_returned(apex)


def test_streaming_and_stop_strings(smol):
    model, tokenizer = smol
    apex = optimize(model, ApexConfig(gpu_cache_size=16 * MB, cpu_cache_size=16 * MB), tokenizer)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Count from 1 to 20, separated by commas."}],
                                           tokenize=False, add_generation_prompt=True)
    events = list(apex.engine.stream([prompt], SamplingParams(max_new_tokens=48, eos_token_ids=(2,))))
    streamed = "".join(e.text for e in events)
    [completion] = apex.engine.generate([prompt], SamplingParams(max_new_tokens=48, eos_token_ids=(2,)))
    assert [e.token_id for e in events] == completion.token_ids
    assert streamed.replace("<|im_end|>", "") == completion.text
    assert events[-1].finish_reason == completion.finish_reason and events[0].finish_reason is None
    stop = completion.text[len(completion.text) // 2:][:3]
    [stopped] = apex.engine.generate([prompt], SamplingParams(max_new_tokens=48, stop_strings=(stop,)))
    assert stopped.finish_reason == "stop" and stop not in stopped.text
    assert completion.text.startswith(stopped.text)
    assert_blocks_returned(apex)


def test_bad_input_fails_before_any_work(smol):
    model, tokenizer = smol
    apex = optimize(model, ApexConfig(gpu_cache_size=4 * MB, cpu_cache_size=4 * MB), tokenizer)
    engine = apex.engine
    steps = engine.stats.steps
    too_long = torch.ones(1, model.config.max_position_embeddings, dtype=torch.long)
    with pytest.raises(ValueError, match="too long"):
        apex.generate(too_long, max_new_tokens=4)
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]])
    with pytest.raises(ValueError, match="empty"):
        apex.generate(torch.ones(1, 3, dtype=torch.long), attention_mask=torch.zeros(1, 3, dtype=torch.long),
                      max_new_tokens=4)
    with pytest.raises(ValueError, match="left-padded"):
        apex.generate(torch.ones(1, 3, dtype=torch.long), attention_mask=torch.tensor([[1, 1, 0]]), max_new_tokens=4)
    with pytest.raises(ValueError, match="largest pool"):  # 4 MiB hold ~88 tokens: the request needs more
        apex.generate(torch.ones(2, 50, dtype=torch.long), max_new_tokens=60)
    with pytest.raises(ValueError, match="does not support num_beams"):
        apex.generate(torch.ones(1, 3, dtype=torch.long), max_new_tokens=4, num_beams=2)
    assert engine.stats.steps == steps and not engine.has_unfinished()
    assert_blocks_returned(apex)
    with pytest.raises(ValueError, match="holds no KV block"):
        optimize(model, ApexConfig(offload="all", cpu_cache_size=1000))


def test_unsupported_model_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    with pytest.raises(ValueError, match="unsupported model type 'gpt2'"):
        optimize(gpt2)
    with pytest.raises(TypeError, match="HuggingFace causal LM"):
        optimize(torch.nn.Linear(2, 2))


def test_hf_generate_options_give_hf_tokens(smol, batch):
    """repetition_penalty, min_new_tokens, stop_strings with tokenizer=, return_dict_in_generate: same tokens as HF."""
    model, tokenizer = smol
    apex = optimize(model, ApexConfig(offload=0.5, gpu_cache_size=64 * MB, cpu_cache_size=64 * MB))
    input_ids, mask = batch[0][:4], batch[1][:4]
    for options in (dict(repetition_penalty=1.3), dict(min_new_tokens=20, max_new_tokens=24),
                    dict(stop_strings=["."], tokenizer=tokenizer), dict(repetition_penalty=0.8, min_new_tokens=5)):
        options = {"max_new_tokens": 24, **options}
        with torch.no_grad():
            ref = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, **options)
        out = apex.generate(input_ids, attention_mask=mask, do_sample=False, **options)
        assert torch.equal(out, ref), options
    result = apex.generate(input_ids, attention_mask=mask, max_new_tokens=4, return_dict_in_generate=True)
    assert torch.equal(result.sequences, model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=4,
                                                        do_sample=False))
    assert_blocks_returned(apex)


def test_streamer_and_model_attributes(smol, batch):
    from transformers import TextIteratorStreamer

    model, tokenizer = smol
    apex = optimize(model, ApexConfig(gpu_cache_size=64 * MB, cpu_cache_size=64 * MB)).eval()
    assert apex.config is model.config and apex.generation_config is model.generation_config
    assert apex.device == model.device and apex.dtype == torch.float32
    row, row_mask = batch[0][3:4], batch[1][3:4]
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    out = apex.generate(row, attention_mask=row_mask, max_new_tokens=16, streamer=streamer)
    new_tokens = out[0, row.shape[1]:]
    assert "".join(streamer) == tokenizer.decode(new_tokens, skip_special_tokens=True)
    with pytest.raises(ValueError, match="num_beams"):
        apex.generate(row, attention_mask=row_mask, max_new_tokens=4, num_beams=2)
