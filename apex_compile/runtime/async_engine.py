"""An asynchronous front for the engine: requests join the running batch from any thread or asyncio task.

    front = AsyncEngine(engine)                      # or engine.front (one per engine, made on first use)
    stream = front.submit("Why is the sky blue?", SamplingParams(max_new_tokens=32))
    for event in stream: ...                         # blocking; `async for event in stream` inside asyncio
    completion = stream.result()

One stepping thread per front makes every engine call (add_request, abort, step): `submit` and `abort` hand
their work over through an inbox that the thread applies between two steps, so a request submitted while
others decode joins the batch at the next step (continuous batching across arrivals). The thread sleeps on a
condition when there is no work.

Invariants:
- Every stream ends: with its finish event (eos / length / stop), aborted (iteration stops, finish_reason
  "abort"), or failed (iteration raises the error). Nothing waits forever on a request the front dropped.
- An error attributable to one request (adding it, detokenizing its tokens) fails that stream only; an error of
  `engine.step()` as a whole fails the streams in flight, their requests are dropped (blocks returned) and the
  front goes on accepting. If even dropping them fails, the front is broken: every stream is failed and
  `submit` raises.
- The engine is used by one thread at a time: the front holds `engine._run_lock` while it has requests in the
  engine, and an in-thread `Engine.generate`/`stream` call (the single-caller path, unchanged) holds it during
  its run. While one holds it the other waits (a synchronous caller arriving while the front runs queues onto
  the front instead: `Engine._events`).
"""
import asyncio
import collections
import threading
import time
from typing import Callable, Deque, Dict, Iterator, List, Optional, Sequence, Union

from apex_compile.runtime.request import Request, RequestStatus, SamplingParams

_LOCK_POLL_S = 0.05  # how often the stepping thread retries the engine's run lock held by an in-thread call


class QueueFullError(RuntimeError):
    """`AsyncEngine.submit` found max_waiting requests already waiting (a server answers 429)."""


class EngineShutdownError(RuntimeError):
    """The front no longer accepts requests: it was shut down or is broken (a server answers 503)."""


class RequestStream:
    """The tokens of one submitted request, as `TokenEvent`s.

    Iterate it (blocking) or `async for` it (awaits without blocking the event loop); each iteration starts
    from the first event, so it may be read more than once. Iteration ends after the event whose
    finish_reason is set, ends early if the request is aborted (`finish_reason` "abort"), or raises the
    request's error. `result()` blocks until the end and returns the `Completion`.

    Timing (`time.perf_counter()` seconds): `submit_time` when submitted, `token_times[i]` when the stepping
    thread produced token i, `finish_time` when the stream ended.
    """

    def __init__(self, front: "AsyncEngine", request_id: int, prompt_token_ids: List[int], index: int = 0,
                 sink=None):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.index = index  # the TokenEvents' index (the prompt's position in a synchronous multi-prompt call)
        self.submit_time = time.perf_counter()
        self.token_times: List[float] = []
        self.finish_time: Optional[float] = None
        self.finish_reason: Optional[str] = None
        self._front = front
        self._sink = sink  # a queue receiving (stream, event or None at the end) too: `AsyncEngine._sync_events`
        self._cond = threading.Condition()
        self._events: list = []
        self._done = False
        self._error: Optional[BaseException] = None
        self._completion = None
        self._waiters: list = []  # (event loop, asyncio.Event) of async iterators waiting for events
        # the stepping thread's own state of the request
        self._request: Optional[Request] = None  # the engine's Request once added
        self._decoded = ""  # text sent so far (incremental detokenization, as Engine.stream does)

    # --- producer side (the stepping thread) -------------------------------------------------------------

    def _wake(self) -> None:
        for loop, event in self._waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # that loop is closed: its iterator is gone
                pass

    def _push(self, event) -> None:
        with self._cond:
            self.token_times.append(time.perf_counter())
            self._events.append(event)
            self._cond.notify_all()
            self._wake()
        if self._sink is not None:
            self._sink.put((self, event))

    def _end(self, reason: Optional[str], completion=None, error: Optional[BaseException] = None,
             event=None) -> None:
        """Ends the stream, after its last `event` if given (both seen at once: a reader that gets the finish
        event finds the completion there)."""
        with self._cond:
            if self._done:
                return
            if event is not None:
                self.token_times.append(time.perf_counter())
                self._events.append(event)
            self.finish_reason = reason
            self._completion = completion
            self._error = error
            self.finish_time = time.perf_counter()
            self._done = True
            self._cond.notify_all()
            self._wake()
        if self._sink is not None:
            if event is not None:
                self._sink.put((self, event))
            self._sink.put((self, None))

    # --- consumer side -----------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """Whether the stream has ended (finished, aborted or failed)."""
        return self._done

    @property
    def error(self) -> Optional[BaseException]:
        """The request's error if it failed."""
        return self._error

    def __iter__(self) -> Iterator:
        position = 0
        while True:
            with self._cond:
                while position == len(self._events) and not self._done:
                    self._cond.wait()
                fresh = self._events[position:]
                done, error = self._done, self._error
            yield from fresh
            position += len(fresh)
            if done and position == len(self._events):
                if error is not None:
                    raise error
                return

    async def __aiter__(self):
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        waiter = (loop, wake)
        with self._cond:
            self._waiters.append(waiter)
        try:
            position = 0
            while True:
                wake.clear()  # before the look: an event pushed after it sets `wake` again
                with self._cond:
                    fresh = self._events[position:]
                    done, error = self._done, self._error
                for event in fresh:
                    yield event
                position += len(fresh)
                if done and position == len(self._events):
                    if error is not None:
                        raise error
                    return
                if not fresh:
                    await wake.wait()
        finally:
            with self._cond:
                self._waiters.remove(waiter)

    def result(self, timeout: Optional[float] = None):
        """The `Completion` once the request ends (its finish_reason "abort" if aborted); raises the request's
        error if it failed, TimeoutError after `timeout` seconds."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._done, timeout):
                raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._completion

    def abort(self, wait: bool = False) -> None:
        """Cancels the request (its blocks return at the stepping thread's next turn; with `wait`, before this
        returns). The stream then ends; a finished stream is left as it is."""
        self._front._abort(self, wait)

    @property
    def num_generated(self) -> int:
        """Tokens produced so far."""
        return len(self.token_times)


class AsyncEngine:
    """The engine's asynchronous front (see the module docstring). `max_waiting`: most requests submitted and
    not yet running (in the inbox or the engine's waiting queue) before `submit` raises QueueFullError."""

    def __init__(self, engine, max_waiting: int = 1024):
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.engine = engine
        self.max_waiting = max_waiting
        self.on_finish: List[Callable[[RequestStream], None]] = []  # called on the stepping thread as streams end
        self._cond = threading.Condition()
        self._inbox: Deque[tuple] = collections.deque()  # ("add", stream, request) | ("abort", stream, done)
        self._next_id = 0
        self._queued_adds = 0  # adds in the inbox or pending (not yet in the engine)
        self._engine_waiting = 0  # front requests in the engine still waiting for their first step
        self._num_running = 0
        self._stopping = False
        self._broken: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="apex-engine-front", daemon=True)
        self._thread.start()
        engine.__dict__.setdefault("_front", self)  # `engine.front` and `engine.close()` know it

    # --- public API --------------------------------------------------------------------------------------

    def submit(self, prompt: Union[str, Sequence[int]], sampling: Optional[SamplingParams] = None) -> RequestStream:
        """Queues one prompt (a string, encoded without special tokens, or token ids); thread-safe. Raises
        ValueError here for a bad prompt or sampling (empty, too long, ids outside the vocabulary, cannot fit),
        QueueFullError when max_waiting requests wait, EngineShutdownError after shutdown."""
        request = self.engine._prepare([prompt], sampling)[0]  # validation in the caller's thread
        scheduler = self.engine.scheduler
        if self.engine.config.objective == "auto" and scheduler is not None:
            scheduler.objective = "latency"  # requests arrive over time: judged by TTFT and TPOT
        return self._submit_prepared(request, bounded=True)

    @property
    def num_waiting(self) -> int:
        """Requests submitted and not yet running."""
        return self._queued_adds + self._engine_waiting

    @property
    def num_running(self) -> int:
        """Requests in the engine past their first step (running, parked or in the staggered pipeline)."""
        return self._num_running

    @property
    def is_running(self) -> bool:
        """Whether the front accepts requests."""
        return not self._stopping and self._broken is None and self._thread.is_alive()

    def shutdown(self, drain: bool = True, timeout: Optional[float] = None) -> None:
        """Stops accepting requests; with `drain`, lets those submitted finish (up to `timeout` seconds, then
        aborts the rest), else aborts them; then stops the stepping thread. A second call does nothing more."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if threading.current_thread() is self._thread:
            return  # (from an on_finish callback: the thread ends once its work is done)
        if not drain:
            self._abort_everything()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._abort_everything()
            self._thread.join()

    # --- internals ---------------------------------------------------------------------------------------

    def _submit_prepared(self, request: Request, bounded: bool, index: int = 0, sink=None) -> RequestStream:
        with self._cond:
            if self._broken is not None:
                raise EngineShutdownError(f"the engine front is broken: {self._broken!r}") from self._broken
            if self._stopping:
                raise EngineShutdownError("the engine front is shut down: it accepts no more requests")
            if bounded and self.num_waiting >= self.max_waiting:
                raise QueueFullError(f"{self.num_waiting} requests are waiting (max_waiting={self.max_waiting}): "
                                     f"retry later")
            stream = RequestStream(self, self._next_id, list(request.prompt_token_ids), index, sink)
            self._next_id += 1
            self._queued_adds += 1
            self._inbox.append(("add", stream, request))
            self._cond.notify_all()
        return stream

    def _abort(self, stream: RequestStream, wait: bool) -> None:
        if stream.done:
            return
        applied = threading.Event()
        with self._cond:
            self._inbox.append(("abort", stream, applied))
            self._cond.notify_all()
        if wait and threading.current_thread() is not self._thread and self._thread.is_alive():
            applied.wait()

    def _abort_everything(self) -> None:
        with self._cond:
            self._inbox.append(("abort_all", None, None))
            self._cond.notify_all()

    def _call(self, fn: Callable):
        """fn() on the stepping thread between two steps, its result or error returned here (the engine's own
        abort() from another thread while the front runs)."""
        if threading.current_thread() is self._thread:
            return fn()
        box: dict = {}
        done = threading.Event()
        with self._cond:
            self._inbox.append(("call", fn, (box, done)))
            self._cond.notify_all()
        done.wait()
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def _sync_events(self, prepared: List[Request], queued: List[Request]) -> Iterator:
        """`Engine.stream`'s events for a synchronous caller while another thread runs the engine: its requests
        go through this front (unbounded: a synchronous call is never refused), its events in arrival order;
        closing the generator aborts the unfinished ones and waits until their blocks are back."""
        import queue as queue_module

        sink = queue_module.SimpleQueue()
        streams = []
        try:
            for index, request in enumerate(prepared):
                streams.append(self._submit_prepared(request, bounded=False, index=index, sink=sink))
            open_streams = len(streams)
            while open_streams:
                stream, event = sink.get()
                if event is None:
                    open_streams -= 1
                    if stream.error is not None:
                        raise stream.error
                    continue
                yield event
            queued.extend(s._request for s in streams)
        finally:
            for stream in streams:
                if not stream.done:
                    stream.abort(wait=True)

    # --- the stepping thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        pending: List[tuple] = []  # (stream, request) adds waiting for the engine
        active: Dict[int, RequestStream] = {}  # engine request id -> stream
        owns = False  # whether this thread holds the engine's run lock
        while True:
            with self._cond:
                while not (self._inbox or (owns and active) or pending or self._stopping):
                    self._cond.wait()
                if self._stopping and not (self._inbox or active or pending):
                    break
                inbox = list(self._inbox)
                self._inbox.clear()
            calls = []
            to_abort: List[RequestStream] = []
            for kind, item, extra in inbox:
                if kind == "add":
                    pending.append((item, extra))
                elif kind == "abort":
                    to_abort.append(item)
                    if extra is not None:
                        calls.append((None, extra))  # signalled once the abort is applied
                elif kind == "abort_all":
                    to_abort.extend(s for s, _ in pending)
                    to_abort.extend(active.values())
                else:
                    calls.append((item, extra))
            for stream in to_abort:  # not yet in the engine: ended here
                for i, (queued_stream, _) in enumerate(pending):
                    if queued_stream is stream:
                        del pending[i]
                        self._queued_adds -= 1
                        self._finish(stream, "abort", None)
                        break
            if not owns and (pending or active or any(fn is not None for fn, _ in calls)):
                if not engine._run_lock.acquire(timeout=_LOCK_POLL_S):
                    # an in-thread Engine.generate/stream holds the engine: its own calls run as before
                    for fn, signal in calls:
                        self._answer(fn, signal)
                    continue
                owns = True
                engine._run_owner = threading.get_ident()
            try:
                for fn, signal in calls:
                    if fn is not None:
                        self._answer(fn, signal)
                self._apply_aborts(to_abort, active)
                for _, signal in calls:
                    if not isinstance(signal, tuple):  # an abort's event: applied now
                        signal.set()
                for stream, request in pending:
                    self._queued_adds -= 1
                    self._add(stream, request, active)
                pending = []
                if active:
                    self._step(active)
            except BaseException as error:  # a broken engine: fail everything rather than hang anyone
                self._break(error, active, pending)
                pending = []
            self._count(active)
            if owns and not active and not pending:
                owns = False
                engine._run_owner = None
                engine._run_lock.release()
        if owns:
            engine._run_owner = None
            engine._run_lock.release()

    @staticmethod
    def _answer(fn, signal) -> None:
        if fn is None:
            signal.set()
            return
        box, done = signal
        try:
            box["value"] = fn()
        except BaseException as error:
            box["error"] = error
        done.set()

    def _add(self, stream: RequestStream, prepared: Request, active: Dict[int, RequestStream]) -> None:
        try:
            request = self.engine.add_request(prepared.prompt_token_ids, prepared.sampling)
        except Exception as error:  # this request's fault (or a closed engine): its stream fails alone
            self._finish(stream, None, None, error)
            return
        stream._request = request
        active[request.request_id] = stream

    def _apply_aborts(self, streams: List[RequestStream], active: Dict[int, RequestStream]) -> None:
        ids = [s._request.request_id for s in streams
               if s._request is not None and active.get(s._request.request_id) is s]
        if ids:
            self.engine.abort(ids)
        for request_id in ids:
            stream = active.pop(request_id)
            self._finish(stream, "abort", self._completion(stream))

    def _step(self, active: Dict[int, RequestStream]) -> None:
        engine = self.engine
        try:
            got = engine.step()
        except Exception as error:  # the step as a whole: its streams fail, the front goes on
            streams = list(active.values())
            active.clear()
            try:
                engine.abort([s._request.request_id for s in streams])  # raising here breaks the front (_run)
            finally:
                for stream in streams:
                    self._finish(stream, None, None, error)
            return
        for request in got:
            stream = active.get(request.request_id)
            if stream is None:
                continue
            try:
                event = self._event(stream, request)
            except Exception as error:  # detokenizing this request failed: it alone fails
                engine.abort([request.request_id])
                del active[request.request_id]
                self._finish(stream, None, None, error)
                continue
            if request.is_finished:
                del active[request.request_id]
                self._finish(stream, request.finish_reason, self._completion(stream), event=event)
            else:
                stream._push(event)
        # requests the engine ended without a token for them (none expected): their streams end too
        for request_id in [i for i, s in active.items() if s._request.is_finished]:
            stream = active.pop(request_id)
            self._finish(stream, stream._request.finish_reason, self._completion(stream))

    def _event(self, stream: RequestStream, request: Request):
        """The TokenEvent of the request's newest token, its text decoded as `Engine._events` does."""
        from apex_compile.runtime.engine_api import TokenEvent

        text = ""
        tokenizer = self.engine.tokenizer
        if tokenizer is not None:
            full = tokenizer.decode(request.output_token_ids)
            if request.finish_reason == "stop":
                full = request.output_text
            if not full.endswith("\ufffd") or request.is_finished:
                text, stream._decoded = full[len(stream._decoded):], full
        return TokenEvent(stream.index, request.output_token_ids[-1], text, request.finish_reason)

    def _completion(self, stream: RequestStream):
        try:
            return self.engine._completion(stream.index, stream._request)
        except Exception:
            return None

    def _finish(self, stream: RequestStream, reason, completion, error: Optional[BaseException] = None,
                event=None) -> None:
        stream._end(reason, completion, error, event)
        for callback in list(self.on_finish):
            try:
                callback(stream)
            except Exception:  # an observer's bug must not stop the engine
                pass

    def _count(self, active: Dict[int, RequestStream]) -> None:
        waiting = sum(1 for s in active.values() if s._request.status is RequestStatus.WAITING)
        self._engine_waiting = waiting
        self._num_running = len(active) - waiting

    def _break(self, error: BaseException, active: Dict[int, RequestStream], pending: List[tuple]) -> None:
        """Dropping the requests of a failed step failed too: the front is broken; every stream fails."""
        with self._cond:
            self._broken = error
            self._stopping = True
            inbox = list(self._inbox)
            self._inbox.clear()
        streams = list(active.values()) + [s for s, _ in pending]
        streams += [item for kind, item, _ in inbox if kind == "add"]
        active.clear()
        self._queued_adds = 0
        for stream in streams:
            self._finish(stream, None, None, error)
        for kind, item, extra in inbox:
            if kind == "abort" and extra is not None:
                extra.set()
            elif kind == "call":
                self._answer(item, extra)
