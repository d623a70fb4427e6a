"""The calls users make over the engine's step loop: `generate`, `stream`, `chat`, `abort`, and the run lock that
lets one thread step the engine at a time while others queue onto its asynchronous front (`Engine.front`).

`EngineAPI` is a mixin of `Engine` (runtime/engine.py): it uses the loop's `step`, `has_unfinished`,
`_new_request`, `_enqueue`, `_check_open`, `_closed`, `_drop_finished_ahead`, `scheduler`, `sampler`, `tokenizer`
and `model`, and keeps no state of its own beyond the run lock, its owner and the front."""
import dataclasses
import sys
import threading
from typing import Iterator, List, Optional, Sequence, Tuple, Union

from apex_compile.runtime.kv_manager import POOL_NAMES
from apex_compile.runtime.request import Request, SamplingParams

_PROGRESS_MIN_TOKENS = 4096  # default progress bar only for runs generating at least this many tokens
_FRONT_LOCK = threading.Lock()  # makes an engine's run lock and asynchronous front once (`Engine.front`)


@dataclasses.dataclass
class TokenEvent:
    """One generated token of request `index` (the position of its prompt in the `generate` call)."""

    index: int
    token_id: int
    text: str  # newly decoded text ("" without a tokenizer, or while a multi-byte character is incomplete)
    finish_reason: Optional[str]  # None while the request goes on


@dataclasses.dataclass
class Completion:
    """The result of one prompt."""

    index: int
    prompt_token_ids: List[int]
    token_ids: List[int]
    text: Optional[str]
    finish_reason: str
    steps_per_pool: dict  # {"device": steps, "host": steps} this request ran in each pool
    num_preemptions: int


class EngineAPI:
    """generate / stream / chat / abort over `Engine`'s loop (see the module docstring)."""

    def _encode(self, prompt: Union[str, Sequence[int]]) -> List[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer: pass one to apex_compile.optimize(..., "
                                 "tokenizer=...) or give token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return list(prompt)

    def stream(self, prompts: Sequence[Union[str, Sequence[int]]],
               sampling: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
               progress: Optional[bool] = None) -> Iterator[TokenEvent]:
        """Generates for every prompt (strings or token-id lists), yielding each token as it is produced.

        sampling: one SamplingParams for all prompts or one per prompt (default: greedy, 64 new tokens, the
        model's EOS). Every prompt is validated here, before any work; the requests are queued when iteration
        starts, and closing the stream (`close()`, garbage collection, an error) at any point drops its
        unfinished requests and returns their blocks. progress: a tqdm bar (default: on a terminal when the run
        may generate many tokens).
        """
        return self._events(self._prepare(prompts, sampling), progress, [])

    def abort(self, request_ids: Optional[Sequence[int]] = None) -> int:
        """Cancels the unfinished requests with these ids (every one when None), returning their blocks; an
        open stream over them then ends. Returns how many were cancelled."""
        if self._closed:
            return 0
        front = self.__dict__.get("_front")
        if front is not None and self._run_owner == front._thread.ident != threading.get_ident():
            return front._call(lambda: self.abort(request_ids))  # the engine is used by one thread at a time
        dropped = self.scheduler.abort(request_ids)  # (freed host blocks wait for their exports: settle_host)
        for request in dropped:
            self.sampler.forget(request.request_id)
        self._drop_finished_ahead()
        return len(dropped)

    def _events(self, prepared: List[Request], progress: Optional[bool], queued: List[Request]
                ) -> Iterator[TokenEvent]:
        """Queues `prepared` (into `queued` too), steps until they finish and yields their tokens; when the
        generator ends in any way, its unfinished requests are dropped.

        The single caller steps the engine in its own thread (holding `_run_lock` while its run lasts); a call
        from another thread while the engine runs (the asynchronous front's thread, or another synchronous
        caller) queues onto the front instead (`apex_compile.runtime.async_engine`), so both get their answers.
        A call nested in the running caller's own thread raises as before (`_queue`)."""
        claimed = self._claim_run()
        if claimed is None:
            yield from self.front._sync_events(prepared, queued)
            return
        try:
            yield from self._events_in_thread(prepared, progress, queued)
        finally:
            if claimed:
                self._run_owner = None
                self._run_lock.release()

    def _claim_run(self) -> Optional[bool]:
        """True: this thread now holds the engine's run lock; False: it held it already (a nested call);
        None: another thread holds it."""
        if self._run_owner == threading.get_ident():
            return False
        if self._run_lock.acquire(blocking=False):
            self._run_owner = threading.get_ident()
            return True
        return None

    @property
    def _run_lock(self) -> threading.Lock:
        """Held by the thread that steps the engine: an in-thread generate/stream run, or the front."""
        with _FRONT_LOCK:
            return self.__dict__.setdefault("_run_lock_", threading.Lock())

    @property
    def _run_owner(self) -> Optional[int]:
        return self.__dict__.get("_run_owner_")

    @_run_owner.setter
    def _run_owner(self, ident: Optional[int]) -> None:
        self.__dict__["_run_owner_"] = ident

    @property
    def front(self):
        """This engine's asynchronous front (`AsyncEngine`), made on first use; `close()` stops it."""
        with _FRONT_LOCK:
            if self.__dict__.get("_front") is None:
                self._check_open()
                from apex_compile.runtime.async_engine import AsyncEngine

                self._front = AsyncEngine(self)
            return self._front

    @front.setter
    def front(self, front) -> None:
        """Installs a front built with other settings (`AsyncEngine(engine, max_waiting=...)`)."""
        with _FRONT_LOCK:
            self._front = front

    def _stop_front(self) -> None:
        front = self.__dict__.pop("_front", None)
        if front is not None:
            front.shutdown(drain=False)

    def _events_in_thread(self, prepared: List[Request], progress: Optional[bool], queued: List[Request]
                          ) -> Iterator[TokenEvent]:
        requests = self._queue(prepared)
        queued.extend(requests)
        index_of = {r.request_id: i for i, r in enumerate(requests)}
        decoded = {r.request_id: "" for r in requests}
        total = sum(r.sampling.max_new_tokens for r in requests)
        if progress is None:
            progress = sys.stderr.isatty() and total >= _PROGRESS_MIN_TOKENS
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=total, unit="tok", desc="apex generate")
        try:
            while self.has_unfinished():
                for request in self.step():
                    text = ""
                    if self.tokenizer is not None:
                        full = self.tokenizer.decode(request.output_token_ids)
                        if request.finish_reason == "stop":
                            full = request.output_text
                        if not full.endswith("\ufffd") or request.is_finished:
                            text, decoded[request.request_id] = full[len(decoded[request.request_id]):], full
                    if bar is not None:
                        bar.update(1)
                    yield TokenEvent(index_of[request.request_id], request.output_token_ids[-1], text,
                                     request.finish_reason)
        finally:
            self.abort([r.request_id for r in requests])  # none left after a normal end
            if bar is not None:
                bar.close()

    def _prepare(self, prompts, sampling) -> List[Request]:
        """Validates every prompt and builds its Request (nothing is queued; raises on the first bad one)."""
        if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts:
            raise ValueError("prompts must be a non-empty list of strings or token-id lists")
        token_lists = [self._encode(p) for p in prompts]
        if sampling is None or isinstance(sampling, SamplingParams):
            params = [sampling or self.default_sampling() for _ in token_lists]
        else:
            params = list(sampling)
            if len(params) != len(token_lists):
                raise ValueError(f"{len(params)} SamplingParams for {len(token_lists)} prompts")
        return [self._new_request(tokens, param) for tokens, param in zip(token_lists, params)]

    def _queue(self, prepared: List[Request]) -> List[Request]:
        """Queues prepared requests under fresh ids; raises if the engine is busy with other requests."""
        if self.has_unfinished():
            raise RuntimeError("the engine is already running requests (generate/stream calls do not nest; a "
                               "stream still open holds its requests: close it, or call engine.abort())")
        requests = []
        try:
            for request in prepared:
                requests.append(self._enqueue(request))
        except BaseException:
            self.abort([r.request_id for r in requests])
            raise
        return requests

    def model_eos_token_ids(self) -> Tuple[int, ...]:
        """The model's EOS token(s) as HF `generate` takes them: `generation_config.eos_token_id`, () when it has
        none (a generation config that unsets it runs to length, as in HF, whatever the model config says)."""
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return tuple(int(t) for t in eos)

    def default_sampling(self) -> SamplingParams:
        """Greedy, 64 new tokens, stopping at the model's EOS token(s)."""
        return SamplingParams(eos_token_ids=self.model_eos_token_ids())

    def generate(self, prompts: Sequence[Union[str, Sequence[int]]],
                 sampling: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                 progress: Optional[bool] = None) -> List[Completion]:
        """Generates for every prompt and returns one Completion per prompt, in order (see `stream`)."""
        requests: List[Request] = []
        for _ in self._events(self._prepare(prompts, sampling), progress, requests):
            pass
        return [self._completion(i, r) for i, r in enumerate(requests)]

    def chat(self, conversations, sampling: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
             progress: Optional[bool] = None) -> List[Completion]:
        """Answers chat conversations, as vLLM's `LLM.chat`: one Completion per conversation, in order.

        conversations: a list of conversations, each a list of {"role": ..., "content": ...} messages (a single
        conversation, a list of such dicts, is accepted too). Each is rendered by the tokenizer's chat template
        with the assistant's turn opened (`apply_chat_template(conv, add_generation_prompt=True,
        tokenize=False)`), then encoded without special tokens (the template writes them). sampling, progress:
        as `generate` (default: greedy, 64 new tokens, stopping at the model's EOS).
        """
        return self.generate(self.chat_prompts(conversations), sampling, progress)

    def chat_prompts(self, conversations) -> List[List[int]]:
        """Token ids of each conversation in the tokenizer's chat template, the assistant's turn opened."""
        if self.tokenizer is None:
            raise ValueError("engine.chat needs a tokenizer with a chat template: pass tokenizer= to "
                             "apex_compile.optimize")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(f"engine.chat needs a chat template, and the tokenizer "
                             f"({type(self.tokenizer).__name__}) has none: use engine.generate with raw prompts, "
                             f"or set tokenizer.chat_template")
        if isinstance(conversations, Sequence) and conversations and all(isinstance(m, dict) for m in conversations):
            conversations = [conversations]  # one conversation
        if (isinstance(conversations, (str, dict)) or not isinstance(conversations, Sequence) or not conversations
                or not all(isinstance(c, Sequence) and not isinstance(c, str) and c
                           and all(isinstance(m, dict) and "role" in m and "content" in m for m in c)
                           for c in conversations)):
            raise ValueError('conversations must be a non-empty list of conversations, each a non-empty list of '
                             '{"role": ..., "content": ...} messages (or one such conversation)')
        rows = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(list(conversation), add_generation_prompt=True,
                                                      tokenize=False)
            rows.append(self.tokenizer.encode(text, add_special_tokens=False))
        return rows

    def _completion(self, index: int, request: Request) -> Completion:
        text = None
        if self.tokenizer is not None:
            text = request.output_text if request.finish_reason == "stop" else self.tokenizer.decode(
                request.output_token_ids, skip_special_tokens=True)
        return Completion(index, request.prompt_token_ids, list(request.output_token_ids), text,
                          request.finish_reason, dict(zip(POOL_NAMES, request.steps_per_pool)),
                          request.num_preemptions)

