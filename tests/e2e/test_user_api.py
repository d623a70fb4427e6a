"""What a new user meets first (issue 63), on the embedded SmolLM2-135M-Instruct: a SamplingParams the user builds
stops at the model's EOS, `ignore_eos` runs to length, `engine.chat` applies the chat template as vLLM's `LLM.chat`
(equal to HF greedy on the templated prompt), `generate` follows HF's length defaults and warnings, and mistakes
get clear errors."""
import warnings

import pytest
import torch

from apex_compile.config import ApexConfig
from apex_compile.model import optimize
from apex_compile.runtime.loader import load_model
from apex_compile.runtime.request import SamplingParams

pytestmark = pytest.mark.slow

MB = 1 << 20
CONFIG = dict(gpu_cache_size=64 * MB, cpu_cache_size=64 * MB, offload="never")


@pytest.fixture(scope="module")
def smol():
    return load_model()


@pytest.fixture(scope="module")
def apex(smol):
    model, tokenizer = smol
    with optimize(model, ApexConfig(**CONFIG), tokenizer=tokenizer) as apex_model:
        yield apex_model


def chat_ids(tokenizer, content):
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def hf_greedy(model, ids, new_tokens):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(ids):].tolist()


def test_user_sampling_params_stop_at_the_models_eos(smol, apex):
    model, tokenizer = smol
    eos = model.generation_config.eos_token_id
    done = apex.engine.generate([chat_ids(tokenizer, "What is the capital of France?")],
                                SamplingParams(max_new_tokens=48))
    assert done[0].finish_reason == "eos" and done[0].token_ids[-1] == eos
    assert "<|im_start|>" not in tokenizer.decode(done[0].token_ids)
    assert SamplingParams().eos_token_ids is None and SamplingParams(eos_token_ids=5).eos_token_ids == (5,)


def test_ignore_eos_runs_to_length(smol, apex):
    model, tokenizer = smol
    done = apex.engine.generate([chat_ids(tokenizer, "What is the capital of France?")],
                                SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert done[0].finish_reason == "length" and len(done[0].token_ids) == 24
    assert model.generation_config.eos_token_id in done[0].token_ids  # it passed an EOS and went on
    assert SamplingParams(eos_token_ids=(2,), ignore_eos=True).eos_token_ids == ()


def test_chat_equals_hf_greedy_with_the_template(smol, apex):
    model, tokenizer = smol
    conversations = [[{"role": "user", "content": "What is the capital of France?"}],
                     [{"role": "system", "content": "You answer in one word."},
                      {"role": "user", "content": "Name a colour of the sky."}]]
    done = apex.engine.chat(conversations, SamplingParams(max_new_tokens=24))
    for conversation, completion in zip(conversations, done):
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert completion.prompt_token_ids == ids
        assert completion.token_ids == hf_greedy(model, ids, 24)[:len(completion.token_ids)]
    assert "Paris" in done[0].text
    single = apex.engine.chat(conversations[0], SamplingParams(max_new_tokens=24))  # one conversation
    assert single[0].token_ids == done[0].token_ids


def test_chat_errors(smol, apex):
    model, tokenizer = smol
    with pytest.raises(ValueError, match="conversations must be"):
        apex.engine.chat("What is the capital of France?")
    with pytest.raises(ValueError, match="conversations must be"):
        apex.engine.chat([[{"text": "hi"}]])
    previous = apex.engine.tokenizer
    try:
        apex.engine.tokenizer = None
        with pytest.raises(ValueError, match="needs a tokenizer"):
            apex.engine.chat([{"role": "user", "content": "hi"}])
        class NoTemplate:
            chat_template = None
        apex.engine.tokenizer = NoTemplate()
        with pytest.raises(ValueError, match="chat template"):
            apex.engine.chat([{"role": "user", "content": "hi"}])
    finally:
        apex.engine.tokenizer = previous


def test_generate_follows_hfs_default_length(smol, apex):
    model, tokenizer = smol
    ids = torch.tensor([chat_ids(tokenizer, "Write a long poem about the sea.")])
    mask = torch.ones_like(ids)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = model.generate(ids, attention_mask=mask, do_sample=False)
    with pytest.warns(UserWarning, match="default `max_length`"):
        out = apex.generate(ids, attention_mask=mask)
    assert out.shape == reference.shape and torch.equal(out, reference)
    with torch.no_grad():
        reference = model.generate(ids, attention_mask=mask, do_sample=False, max_length=ids.shape[1] + 7)
    out = apex.generate(ids, attention_mask=mask, max_length=ids.shape[1] + 7)
    assert torch.equal(out, reference)
    with pytest.raises(ValueError, match="Input length of input_ids"):
        apex.generate(ids, attention_mask=mask, max_length=ids.shape[1])


def test_right_padding_without_mask_warns_as_hf(smol, apex):
    model, tokenizer = smol
    pad = model.generation_config.pad_token_id
    ids = torch.tensor([[1, 2, 3, 4], [1, 5, pad, pad]])
    with pytest.warns(UserWarning, match="right-padding was detected"):
        apex.generate(ids, max_new_tokens=2)


def test_nan_mask_and_positional_tokenizer(smol, apex):
    model, tokenizer = smol
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="attention_mask must hold 0/1 values"):
        apex.generate(ids, attention_mask=torch.tensor([[1.0, float("nan"), 1.0]]), max_new_tokens=2)
    with optimize(model, tokenizer) as positional:  # optimize(hf_model, tokenizer): taken as the tokenizer
        assert positional.engine.tokenizer is tokenizer
    with pytest.raises(TypeError, match="config must be an ApexConfig"):
        optimize(model, {"offload": "never"})


def test_explain_on_cpu_says_fusions_are_off_on_purpose(apex):
    apex.engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
    text = apex.explain(file=open("/dev/null", "w"))
    assert "unfused on purpose" in text and "rms_norm" not in text
