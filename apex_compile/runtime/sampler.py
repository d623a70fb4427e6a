"""Next-token choice from a step's logits: greedy, or temperature -> top-k -> top-p sampling (HF's order),
as batched ops on the logits' device."""
from typing import Dict, List, Optional, Sequence

import torch

from apex_compile.ops.kv_layout import to_device
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


_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) of int64 tensors holding values < 2**32; the constants
    are below 2**31, so no int64 product overflows."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _MASK32
    return x ^ (x >> 16)


def seeded_uniform(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform (0, 1) float32 [N, vocab], a pure function of (seed, counter, column) per row: every seeded row of
    a batch draws from its own stream in one batched op, whatever else is in the batch."""
    key = _mix32(seeds & _MASK32)
    key = _mix32(key ^ ((seeds >> 32) & _MASK32))
    key = _mix32(key ^ (counters & _MASK32))
    columns = _mix32(torch.arange(vocab, device=seeds.device, dtype=torch.int64))
    bits = _mix32(key[:, None] ^ columns[None, :])
    return ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))


def process_logits(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """HF's logits processors that the requests ask for, in HF's order: repetition penalty over prompt + output
    tokens, then EOS masked until min_new_tokens. Returns `logits` itself when none applies (else a copy)."""
    penalised = [i for i, r in enumerate(requests) if r.sampling.repetition_penalty != 1.0]
    early = [i for i, r in enumerate(requests)
             if r.sampling.eos_token_ids and len(r.output_token_ids) < r.sampling.min_new_tokens]
    if not penalised and not early:
        return logits
    logits = logits.clone()
    device = logits.device
    if penalised:
        seen = [requests[i].prompt_token_ids + requests[i].output_token_ids for i in penalised]
        width = max(len(tokens) for tokens in seen)
        ids = to_device([tokens + tokens[-1:] * (width - len(tokens)) for tokens in seen], torch.long, device)
        rows = to_device(penalised, torch.long, device)
        penalty = to_device([requests[i].sampling.repetition_penalty for i in penalised], logits.dtype,
                            device)[:, None]
        picked = logits[rows].gather(1, ids)
        picked = torch.where(picked < 0, picked * penalty, picked / penalty)
        logits[rows] = logits[rows].scatter(1, ids, picked)
    if early:  # -inf at every (row, EOS id), one fill by flat index (a CPU scalar assigned by index would sync)
        vocab = logits.shape[-1]
        flat = [i * vocab + t for i in early for t in requests[i].sampling.eos_token_ids]
        logits.view(-1).index_fill_(0, to_device(flat, torch.long, device), float("-inf"))
    return logits


def host_wait_event() -> "torch.cuda.Event":
    """A CUDA event the launching thread will wait on, sleeping (a blocking event) rather than spinning: a step's
    sampled ids, the pinned step buffers and pipeline positions before they are rewritten, block moves. A spinning
    launcher (CUDA's default with one context on many cores) holds a core the CPU attention team reads with; the
    decode steps are queued ahead, so the wake-up is hidden."""
    return torch.cuda.Event(blocking=True)


class PendingTokens:
    """Sampled ids on their way to the host: `result()` waits for their copy (an event) and returns them;
    `device` holds them on the logits' device (the next step's input ids when it is queued before they arrive)."""

    def __init__(self, host: torch.Tensor, copied: Optional["torch.cuda.Event"], device: torch.Tensor):
        self.host = host
        self.copied = copied
        self.device = device

    def result(self) -> List[int]:
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.tolist()


class Sampler:
    """Chooses one token per logits row with batched ops on the logits' device and one copy to the host.

    Sampled rows draw by an exponential race (argmax of p / E, E ~ Exp(1), an exact draw from p; unlike
    torch.multinomial, whose input check waits for the GPU, it queues without a sync). Unseeded rows take E from
    torch's global RNG (`torch.manual_seed` reproduces a run); seeded rows from a hash of (seed, draws so far,
    token): reproducible per request, independent of the batch.
    """

    def __init__(self):
        self._draws: Dict[int, int] = {}
        self._pinned: List[Optional[torch.Tensor]] = [None, None]  # the sampled ids' host copies (CUDA logits)
        self._turn = 0  # which of them the next launch fills

    def forget(self, request_id: int) -> None:
        """Drops a finished request's draw counter."""
        self._draws.pop(request_id, None)

    def sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> List[int]:
        """Next token of each request from its logits row (logits [len(requests), vocab])."""
        return self.launch(logits, requests).result()

    def launch(self, logits: torch.Tensor, requests: Sequence[Request]) -> "PendingTokens":
        """`sample` without waiting: the tokens are chosen by ops queued on the logits' device and copied to
        pinned host memory behind them; `result()` waits for that copy only. The caller may queue more device
        work in between (it runs after the copy, not before it), including one more launch: two pinned
        buffers take turns, so a result must be taken before the second launch after its own."""
        tokens = self._choose(logits, requests)
        if tokens.device.type != "cuda":
            return PendingTokens(tokens, None, tokens)
        n = tokens.numel()
        turn, self._turn = self._turn, 1 - self._turn
        if self._pinned[turn] is None or self._pinned[turn].numel() < n:
            self._pinned[turn] = torch.empty(max(n, 64), dtype=torch.int64, pin_memory=True)
        host = self._pinned[turn][:n]
        host.copy_(tokens, non_blocking=True)
        copied = host_wait_event()
        copied.record(torch.cuda.current_stream(tokens.device))
        return PendingTokens(host, copied, tokens)

    def _choose(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """The chosen token ids [len(requests)] int64 on the logits' device."""
        params: List[SamplingParams] = [r.sampling for r in requests]
        logits = process_logits(logits, requests)
        greedy = logits.argmax(dim=-1)
        sampled_rows = [i for i, p in enumerate(params) if p.do_sample]
        if not sampled_rows:
            return greedy
        device = logits.device
        temperature = to_device([p.temperature if p.do_sample else 1.0 for p in params], torch.float32, device)
        top_k = to_device([p.top_k if p.do_sample else 1 for p in params], torch.long, device)
        top_p = to_device([p.top_p if p.do_sample else 1.0 for p in params], torch.float32, device)
        probs = filter_logits(logits, temperature, top_k, top_p).softmax(dim=-1)
        tokens = greedy.clone()
        unseeded = [i for i in sampled_rows if params[i].seed is None]
        if unseeded:
            index = to_device(unseeded, torch.long, device)
            picked = probs[index]
            race = torch.empty_like(picked).exponential_().clamp_(min=torch.finfo(picked.dtype).tiny)  # no 0 / 0
            tokens[index] = (picked / race).argmax(dim=-1)
        seeded = [i for i in sampled_rows if params[i].seed is not None]
        if seeded:
            counters = []
            for i in seeded:
                rid = requests[i].request_id
                counters.append(self._draws.get(rid, 0))
                self._draws[rid] = counters[-1] + 1
            index = to_device(seeded, torch.long, device)
            noise = seeded_uniform(to_device([params[i].seed for i in seeded], torch.long, device),
                                   to_device(counters, torch.long, device), logits.shape[-1])
            tokens[index] = (probs[index] / -torch.log(noise)).argmax(dim=-1)
        return tokens
