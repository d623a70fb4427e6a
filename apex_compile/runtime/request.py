"""Requests and their sampling parameters."""
import dataclasses
import enum
from typing import List, Optional, Sequence, Tuple


@dataclasses.dataclass
class SamplingParams:
    """How one request's tokens are chosen and when it stops.

    do_sample False: greedy (temperature/top_k/top_p ignored). top_k 0 and top_p 1.0 disable those filters.
    seed: a private generator for this request (reproducible whatever the batch); None uses torch's global RNG.
    eos_token_ids: generation stops after emitting one of them (it is kept in the output); None (the default):
        the model's EOS token(s) (`model.generation_config.eos_token_id`), filled in by the engine when it builds
        the request; () stops at no token.
    ignore_eos: run to max_new_tokens whatever the EOS tokens (as vLLM's `ignore_eos`); stop_strings still apply.
    stop_strings: generation stops once the decoded output contains one (needs a tokenizer; the text is cut
        before it).
    repetition_penalty: HF's: the logit of every token already in the prompt or output is divided by it (multiplied
        when negative), before temperature and the filters; 1.0 is off.
    min_new_tokens: the EOS tokens cannot be chosen before this many new tokens (HF's MinNewTokens processor).
    """

    max_new_tokens: int = 64
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    eos_token_ids: Optional[Tuple[int, ...]] = None
    stop_strings: Tuple[str, ...] = ()
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    ignore_eos: bool = False

    def __post_init__(self):
        if self.eos_token_ids is not None:
            eos = self.eos_token_ids
            self.eos_token_ids = (int(eos),) if isinstance(eos, int) else tuple(int(t) for t in eos)
        if self.ignore_eos:
            self.eos_token_ids = ()
        self.stop_strings = tuple(self.stop_strings)
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature > 0:  # checked for greedy requests too: a bad value is a mistake either way
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"  # no KV (new, or preempted by recompute)
    RUNNING = "running"  # KV in a pool that attends this run's requests
    PARKED = "parked"  # KV swapped out to the pool that runs nothing under the offload mode
    FINISHED = "finished"


@dataclasses.dataclass
class Request:
    """One prompt and its generation so far."""

    request_id: int
    prompt_token_ids: List[int]
    sampling: SamplingParams
    output_token_ids: List[int] = dataclasses.field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed: int = 0  # leading tokens of prompt + output whose K/V are in the cache
    finish_reason: Optional[str] = None  # "eos", "length", "stop"
    output_text: str = ""
    steps_per_pool: List[int] = dataclasses.field(default_factory=lambda: [0, 0])
    num_preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> Sequence[int]:
        """Tokens start..end-1 of prompt + output."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]

    @property
    def is_finished(self) -> bool:
        """Whether generation has stopped."""
        return self.status is RequestStatus.FINISHED
