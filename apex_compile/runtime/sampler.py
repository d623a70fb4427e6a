"""Next-token choice from a step's logits: greedy, or temperature -> top-k -> top-p sampling (HF's order)."""
from typing import Dict, List, Sequence

import torch

from apex_compile.runtime.request import Request, SamplingParams


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor) -> torch.Tensor:
    """Per-row temperature, top-k and top-p applied to logits [N, V] (filtered entries become -inf).

    temperature [N] float (> 0); top_k [N] int (0: off); top_p [N] float (1.0: off). Top-p keeps the smallest
    set of most likely tokens whose probability reaches top_p (at least one token), as HF's TopPLogitsWarper.
    """
    scaled = logits.float() / temperature[:, None]
    vocab = scaled.shape[-1]
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    # Ties with the k-th value stay in, as with HF's `logits < topk(...).values[..., -1]` test.
    kth_value = sorted_logits.gather(1, (k - 1)[:, None])
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_value, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    remove = (mass_before >= top_p[:, None]) & (rank > 0) & (top_p < 1.0)[:, None]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(1, sorted_ids, sorted_logits)


class Sampler:
    """Chooses one token per logits row; requests with a seed draw from their own generator."""

    def __init__(self):
        self._generators: Dict[int, torch.Generator] = {}

    def forget(self, request_id: int) -> None:
        """Drops a finished request's generator."""
        self._generators.pop(request_id, None)

    def _generator(self, request: Request, device: torch.device) -> torch.Generator:
        gen = self._generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(request.sampling.seed)
            self._generators[request.request_id] = gen
        return gen

    def sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> List[int]:
        """Next token of each request from its logits row (logits [len(requests), vocab])."""
        params: List[SamplingParams] = [r.sampling for r in requests]
        if not any(p.do_sample for p in params):
            return logits.argmax(dim=-1).tolist()
        device = logits.device
        temperature = torch.tensor([p.temperature if p.do_sample else 1.0 for p in params], device=device)
        top_k = torch.tensor([p.top_k if p.do_sample else 1 for p in params], device=device)
        top_p = torch.tensor([p.top_p if p.do_sample else 1.0 for p in params], device=device)
        probs = filter_logits(logits, temperature, top_k, top_p).softmax(dim=-1)
        tokens = torch.empty(len(requests), dtype=torch.int64, device=device)
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if unseeded:
            index = torch.tensor(unseeded, device=device)
            tokens[index] = torch.multinomial(probs[index], 1).squeeze(1)
        for i, request in enumerate(requests):
            if params[i].seed is not None:
                tokens[i] = torch.multinomial(probs[i], 1, generator=self._generator(request, device))[0]
        return tokens.tolist()
