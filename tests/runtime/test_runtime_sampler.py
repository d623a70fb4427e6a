"""Sampler: greedy, HF-equal filtering (temperature, top-k, top-p), seeded reproducibility, frequencies."""
import pytest
import torch
from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor,
                                                    RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from apex_compile.runtime.request import Request, SamplingParams
from apex_compile.runtime.sampler import Sampler, filter_logits, process_logits


def requests_with(params):
    return [Request(i, [1], p) for i, p in enumerate(params)]


def hf_filter(logits, temperature, top_k, top_p):
    scores = logits.clone()
    scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.9), (0.5, 20, 0.6),
                                                     (1.0, 1, 1.0), (2.0, 0, 0.05)])
def test_filter_keeps_the_same_tokens_as_hf_warpers(temperature, top_k, top_p):
    torch.manual_seed(int(temperature * 1000) + top_k * 7 + int(top_p * 100))  # stable per case
    logits = torch.randn(6, 300) * 3
    n = logits.shape[0]
    ours = filter_logits(logits, torch.full((n,), temperature), torch.full((n,), top_k, dtype=torch.int64),
                         torch.full((n,), top_p))
    ref = hf_filter(logits, temperature, top_k, top_p)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    kept = ~torch.isinf(ref)
    torch.testing.assert_close(ours[kept], ref[kept].float())


def test_filter_applies_parameters_per_row():
    torch.manual_seed(1)
    logits = torch.randn(3, 50)
    ours = filter_logits(logits, torch.tensor([1.0, 0.5, 1.0]), torch.tensor([3, 0, 0]),
                         torch.tensor([1.0, 1.0, 0.5]))
    for row, (t, k, p) in enumerate([(1.0, 3, 1.0), (0.5, 0, 1.0), (1.0, 0, 0.5)]):
        ref = hf_filter(logits[row:row + 1], t, k, p)[0]
        assert torch.equal(torch.isinf(ours[row]), torch.isinf(ref))


def test_greedy_takes_the_argmax():
    torch.manual_seed(2)
    logits = torch.randn(5, 1000)
    tokens = Sampler().sample(logits, requests_with([SamplingParams()] * 5))
    assert tokens == logits.argmax(-1).tolist()


def test_mixed_greedy_and_sampled_rows():
    torch.manual_seed(3)
    logits = torch.randn(4, 100)
    params = [SamplingParams(), SamplingParams(do_sample=True, top_k=3, seed=1), SamplingParams(),
              SamplingParams(do_sample=True, top_p=0.5)]
    tokens = Sampler().sample(logits, requests_with(params))
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())
    assert tokens[1] in logits[1].topk(3).indices.tolist()


def test_top_k_is_respected_and_seeds_reproduce():
    torch.manual_seed(4)
    logits = torch.randn(1, 500)
    allowed = set(logits[0].topk(7).indices.tolist())
    params = SamplingParams(do_sample=True, top_k=7, temperature=1.5, seed=1234)
    draws = []
    for _ in range(2):
        sampler = Sampler()
        request = requests_with([params])
        draws.append([sampler.sample(logits, request)[0] for _ in range(200)])
    assert draws[0] == draws[1]
    assert set(draws[0]) <= allowed and len(set(draws[0])) > 1


@pytest.mark.parametrize("seed", [7, None])
def test_sampled_frequencies_follow_the_softmax(seed):
    torch.manual_seed(5)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]])
    sampler = Sampler()
    request = requests_with([SamplingParams(do_sample=True, temperature=1.0, seed=seed)])
    counts = torch.zeros(5)
    for _ in range(4000):
        counts[sampler.sample(logits, request)[0]] += 1
    expected = logits[0].double().softmax(-1) * 4000
    assert counts[4] == 0
    assert torch.all((counts[:4] - expected[:4].float()).abs() < 4 * expected[:4].float().sqrt() + 5)


def test_processors_equal_hf_row_by_row():
    """Repetition penalty and EOS masked before min_new_tokens, batched over rows that ask for different ones
    (several EOS ids, rows past min_new_tokens untouched), against HF's processors applied to each row."""
    torch.manual_seed(6)
    logits = torch.randn(5, 50)
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(eos_token_ids=(3, 9), min_new_tokens=4),
              SamplingParams(), SamplingParams(eos_token_ids=(9,), min_new_tokens=6, repetition_penalty=0.7),
              SamplingParams(eos_token_ids=(1,), min_new_tokens=2)]
    requests = [Request(i, [4, 5, 4, 11], p) for i, p in enumerate(params)]
    for i, request in enumerate(requests):
        request.output_token_ids = [7, 3, 9, 20, 1][:i + 1]
    ours = process_logits(logits, requests)
    for i, (request, p) in enumerate(zip(requests, params)):
        ids = torch.tensor([request.prompt_token_ids + request.output_token_ids])
        ref = logits[i:i + 1].clone()
        if p.repetition_penalty != 1.0:
            ref = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, ref)
        if p.eos_token_ids:
            prompt = len(request.prompt_token_ids)
            ref = MinNewTokensLengthLogitsProcessor(prompt, p.min_new_tokens, list(p.eos_token_ids))(ids, ref)
        assert torch.equal(ours[i], ref[0]), i
    assert torch.isinf(ours[1, [3, 9]]).all() and torch.isinf(ours[3, 9]) and not torch.isinf(ours[4]).any()
    assert process_logits(logits, requests[2:3]) is logits


def test_invalid_sampling_parameters_are_rejected():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(do_sample=True, top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(do_sample=True, top_k=-1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_launched_sampling_gives_the_tokens_of_sample(device):
    torch.manual_seed(5)
    logits = torch.randn(6, 300, device=device)
    params = [SamplingParams(), SamplingParams(do_sample=True, top_k=4, seed=3), SamplingParams(),
              SamplingParams(do_sample=True, top_p=0.7, seed=9), SamplingParams(), SamplingParams()]
    expected = Sampler().sample(logits, requests_with(params))
    sampler = Sampler()
    first = sampler.launch(logits, requests_with(params))
    logits.neg_()  # device work queued after the launch does not change its tokens
    assert first.result() == expected
    greedy = requests_with([SamplingParams()] * 2)
    again = sampler.launch(logits[:2], greedy)  # the pinned buffer is reused, shorter
    assert again.result() == logits[:2].argmax(-1).tolist()
    if device == "cuda":
        assert first.host.is_pinned()
