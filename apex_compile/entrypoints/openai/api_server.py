"""The OpenAI-compatible HTTP app: `build_app(engine_or_model)` returns a FastAPI app serving one model.

    GET  /v1/models            the served model
    POST /v1/completions       text (or token ids) in, text out; `stream: true` sends server-sent events
    POST /v1/chat/completions  messages in the model's chat template
    GET  /health               200 while the engine front accepts requests, else 503
    GET  /metrics              Prometheus text (see `ServerMetrics`)

Requests go to the engine's asynchronous front (`apex_compile.runtime.async_engine`), whose stepping thread
batches them with everything else in flight; handlers only await their stream. A client that disconnects
aborts its request (its KV blocks return). Errors carry OpenAI's body: {"error": {message, type, param, code}}.
"""
import asyncio
import json
import os
from typing import AsyncIterator, List, Optional, Sequence, Union

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from apex_compile.entrypoints.openai import protocol as api
from apex_compile.runtime.async_engine import AsyncEngine, EngineShutdownError, QueueFullError, RequestStream
from apex_compile.runtime.request import SamplingParams

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
# finish reasons of the engine -> OpenAI's ("eos" and a stop string are both "stop")
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort"}


class APIError(Exception):
    """An error answered with an OpenAI-style body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: Optional[str] = None,
                 code: Union[None, int, str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return api.ErrorResponse(error=api.ErrorInfo(message=self.message, type=self.type, param=self.param,
                                                     code=self.code if self.code is not None else self.status)
                                 ).model_dump()

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


class ServerMetrics:
    """Prometheus metrics of one app (its own registry, so that several apps can live in one process):

    apex_num_requests_running / apex_num_requests_waiting          gauges, the front's requests
    apex_kv_blocks_used{pool} / apex_kv_blocks_total{pool}         gauges, KV blocks per pool (device, host)
    apex_requests_per_pool_total{pool}                             counter, requests the engine attended per pool
    apex_time_to_first_token_seconds                               histogram, submit -> first token
    apex_time_per_output_token_seconds                             histogram, per request: (last - first) / (n - 1)
    apex_prompt_tokens_total / apex_generation_tokens_total        counters, tokens of finished requests
    apex_request_finished_total{finished_reason}                   counter (stop, length, abort, error)
    """

    def __init__(self, engine, front: AsyncEngine):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        latency = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
        self.ttft = Histogram("apex_time_to_first_token_seconds", "Seconds from submission to the first token",
                              buckets=latency, registry=self.registry)
        self.tpot = Histogram("apex_time_per_output_token_seconds", "Seconds per output token after the first",
                              buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56),
                              registry=self.registry)
        self.prompt_tokens = Counter("apex_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=self.registry)
        self.generation_tokens = Counter("apex_generation_tokens", "Generated tokens of finished requests",
                                         registry=self.registry)
        self.finished = Counter("apex_request_finished", "Finished requests by reason", ["finished_reason"],
                                registry=self.registry)
        self.registry.register(_EngineCollector(engine, front))
        front.on_finish.append(self.observe)

    def observe(self, stream: RequestStream) -> None:
        """Records a stream that ended (called on the engine front's thread)."""
        times = stream.token_times
        if times:
            self.ttft.observe(times[0] - stream.submit_time)
            if len(times) > 1:
                self.tpot.observe((times[-1] - times[0]) / (len(times) - 1))
        self.prompt_tokens.inc(len(stream.prompt_token_ids))
        self.generation_tokens.inc(len(times))
        reason = "error" if stream.error is not None else FINISH_REASONS.get(stream.finish_reason, "abort")
        self.finished.labels(reason).inc()

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class _EngineCollector:
    """Gauges read from the engine and its front at scrape time."""

    def __init__(self, engine, front: AsyncEngine):
        self.engine, self.front = engine, front

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        from apex_compile.runtime.kv_manager import POOL_NAMES

        yield GaugeMetricFamily("apex_num_requests_running", "Requests running in the engine",
                                value=self.front.num_running)
        yield GaugeMetricFamily("apex_num_requests_waiting", "Requests submitted and not yet running",
                                value=self.front.num_waiting)
        used = GaugeMetricFamily("apex_kv_blocks_used", "KV blocks held by requests", labels=["pool"])
        total = GaugeMetricFamily("apex_kv_blocks_total", "KV blocks of the pool", labels=["pool"])
        per_pool = CounterMetricFamily("apex_requests_per_pool", "Requests the engine attended in each pool",
                                       labels=["pool"])
        kv = self.engine.kv
        if kv is not None:  # (None once the engine is closed)
            for pool, name in enumerate(POOL_NAMES):
                used.add_metric([name], kv.num_used(pool))
                total.add_metric([name], kv.pools[pool].num_blocks)
                per_pool.add_metric([name], self.engine.stats.requests_per_pool[pool])
        yield used
        yield total
        yield per_pool


class _Deltas:
    """The text a stream may send so far: a tail that could begin a stop string is held back (the engine cuts
    the stop string off the answer, and sent text cannot be taken back); the final delta comes from the
    completion's text, so that the streamed answer equals the non-streamed one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.text = ""
        self.sent = 0

    def add(self, text: str) -> str:
        self.text += text
        hold = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.text)), 0, -1):
                if self.text.endswith(stop[:k]):
                    hold = max(hold, k)
                    break
        upto = len(self.text) - hold
        out = self.text[self.sent:upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return out

    def final(self, text: Optional[str]) -> str:
        sent = self.text[:self.sent]
        if text is not None and text.startswith(sent):
            return text[len(sent):]
        return self.text[self.sent:]


async def _until_disconnect(request: Request) -> None:
    """Returns once the client has gone (the request body is already read: the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _sse(payload) -> str:
    body = payload if isinstance(payload, str) else payload.model_dump_json(exclude_unset=False)
    return f"data: {body}\n\n"


class OpenAIServing:
    """The endpoints' logic over one engine front (kept apart from the routes so that it reads top to bottom)."""

    def __init__(self, engine, front: AsyncEngine, model_name: str):
        self.engine, self.front, self.model_name = engine, front, model_name
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len

    # --- parameters ---------------------------------------------------------------------------------------

    def check_model(self, body: api._SamplingFields) -> None:
        if body.model is not None and body.model != self.model_name:
            raise APIError(404, f"The model `{body.model}` does not exist (this server serves "
                                f"`{self.model_name}`).", "NotFoundError", "model", "model_not_found")

    def sampling(self, body: api._SamplingFields, prompt_len: int, max_tokens: Optional[int],
                 default_max: Optional[int]) -> SamplingParams:
        """SamplingParams of a request; raises APIError(400) for a value apex does not take."""
        if body.n != 1:
            raise APIError(400, f"n={body.n} is not supported: apex returns one choice per request (n=1)",
                           param="n")
        for name in ("logprobs", "top_logprobs", "best_of", "suffix", "tools", "response_format"):
            value = getattr(body, name, None)
            if value not in ((None, 1) if name == "best_of" else (None, False, 0, [])):
                raise APIError(400, f"`{name}` is not supported by this server", param=name)
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(body, name, None) not in (None, 0, 0.0):
                raise APIError(400, f"`{name}` is not supported by this server (0 only)", param=name)
        room = self.max_model_len - prompt_len
        if room < 1:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                f"your prompt has {prompt_len} tokens (at least one token must be generated).",
                           param="messages" if isinstance(body, api.ChatCompletionRequest) else "prompt",
                           code="context_length_exceeded")
        if max_tokens is not None:
            if max_tokens < 1:
                raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
            if prompt_len + max_tokens > self.max_model_len:
                raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                    f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                                    f"{max_tokens} for the completion).", param="max_tokens",
                               code="context_length_exceeded")
        else:
            max_tokens = room if default_max is None else min(default_max, room)
        temperature = 1.0 if body.temperature is None else body.temperature
        if not 0 <= temperature <= 2:
            raise APIError(400, f"temperature must be in [0, 2], got {temperature}", param="temperature")
        top_p = 1.0 if body.top_p is None else body.top_p
        if not 0 < top_p <= 1:
            raise APIError(400, f"top_p must be in (0, 1], got {top_p}", param="top_p")
        top_k = 0 if body.top_k in (None, -1) else body.top_k
        if top_k < 0:
            raise APIError(400, f"top_k must be -1, 0 (off) or positive, got {top_k}", param="top_k")
        stops = () if body.stop is None else ((body.stop,) if isinstance(body.stop, str) else tuple(body.stop))
        if any(not s for s in stops):
            raise APIError(400, "stop strings must not be empty", param="stop")
        eos = () if body.ignore_eos else self.engine.default_sampling().eos_token_ids
        greedy = temperature == 0
        return SamplingParams(max_new_tokens=max_tokens, do_sample=not greedy,
                              temperature=1.0 if greedy else temperature, top_k=top_k, top_p=top_p,
                              seed=body.seed, eos_token_ids=eos, stop_strings=stops)

    def chat_prompt(self, body: api.ChatCompletionRequest) -> List[int]:
        """The messages in the model's chat template, as HF users build them: the template's text with the
        generation prompt, encoded without special tokens (the template writes them)."""
        tokenizer = self.tokenizer
        if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
            raise APIError(400, "this model has no chat template: use /v1/completions", param="messages")
        if not body.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        messages = []
        for message in body.messages:
            content = message.content
            if isinstance(content, list):  # content parts: only text ones
                if any(part.get("type") != "text" for part in content):
                    raise APIError(400, "only text content parts are supported", param="messages")
                content = "".join(part.get("text", "") for part in content)
            messages.append({"role": message.role, "content": content or ""})
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as error:  # the template rejected the conversation (a role it does not know, ...)
            raise APIError(400, f"the chat template rejected the messages: {error}", param="messages")
        return tokenizer.encode(text, add_special_tokens=False)

    def completion_prompt(self, body: api.CompletionRequest) -> List[int]:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, "one prompt per request (batched prompts are not supported)", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise APIError(400, "this server has no tokenizer: send token ids", param="prompt")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return list(prompt)

    def submit(self, prompt: List[int], sampling: SamplingParams) -> RequestStream:
        try:
            return self.front.submit(prompt, sampling)
        except QueueFullError as error:
            raise APIError(429, str(error), "rate_limit_error", code="queue_full")
        except EngineShutdownError as error:
            raise APIError(503, str(error), "service_unavailable", code="shutting_down")
        except ValueError as error:  # the engine's own checks (empty prompt, ids outside the vocabulary, fit)
            raise APIError(400, str(error), param="prompt")

    # --- running a request ---------------------------------------------------------------------------------

    async def run(self, body: api._SamplingFields, prompt: List[int], max_tokens: Optional[int],
                  default_max: Optional[int], raw: Request, chat: bool):
        self.check_model(body)
        sampling = self.sampling(body, len(prompt), max_tokens, default_max)
        if not prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        stream = self.submit(prompt, sampling)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self.events(stream, sampling, chat, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        completion = await self.wait(stream, raw)
        usage = api.UsageInfo(prompt_tokens=len(prompt), completion_tokens=len(completion.token_ids),
                              total_tokens=len(prompt) + len(completion.token_ids))
        reason = FINISH_REASONS.get(completion.finish_reason, completion.finish_reason)
        text = completion.text or ""
        if chat:
            return api.ChatCompletionResponse(model=self.model_name, usage=usage, choices=[api.ChatCompletionChoice(
                message=api.ChatResponseMessage(content=text), finish_reason=reason)])
        ids = None if self.tokenizer is not None else list(completion.token_ids)
        return api.CompletionResponse(model=self.model_name, usage=usage, choices=[
            api.CompletionChoice(text=text, finish_reason=reason, token_ids=ids)])

    async def wait(self, stream: RequestStream, raw: Request):
        """The stream's Completion; aborts the request if the client disconnects first."""
        async def consume():
            async for _ in stream:
                pass

        task = asyncio.ensure_future(consume())
        gone = asyncio.ensure_future(_until_disconnect(raw))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():  # the client went away (or this handler was cancelled)
                stream.abort()
                task.cancel()
            gone.cancel()
        if not task.done() or task.cancelled():
            raise APIError(499, "client disconnected", "client_closed_request")
        error = task.exception()
        if error is not None:
            raise APIError(500, f"the request failed in the engine: {error!r}", "internal_error")
        return stream.result()

    async def events(self, stream: RequestStream, sampling: SamplingParams, chat: bool,
                     include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events of a stream; the request is aborted if the client goes before its end."""
        ids = api._id("chatcmpl" if chat else "cmpl")
        created = api._now()
        deltas = _Deltas(sampling.stop_strings)

        def chunk(text: Optional[str], reason: Optional[str] = None, role: Optional[str] = None, token_id=None):
            if chat:
                return api.ChatCompletionChunk(id=ids, created=created, model=self.model_name, choices=[
                    api.ChatCompletionStreamChoice(delta=api.DeltaMessage(role=role, content=text),
                                                   finish_reason=reason)])
            return api.CompletionChunk(id=ids, created=created, model=self.model_name, choices=[api.CompletionChoice(
                text=text or "", finish_reason=reason, token_ids=None if token_id is None else [token_id])])

        # with no tokenizer (token-id prompts only) each token goes out as its id, in a chunk of its own
        by_id = self.tokenizer is None and not chat

        try:
            if chat:
                yield _sse(chunk("", role="assistant"))
            async for event in stream:
                if event.finish_reason is None:
                    if by_id:
                        yield _sse(chunk("", token_id=event.token_id))
                        continue
                    text = deltas.add(event.text)
                    if text:
                        yield _sse(chunk(text))
                    continue
                completion = stream.result()  # (ended together with its last event)
                reason = FINISH_REASONS.get(event.finish_reason, event.finish_reason)
                if by_id:
                    yield _sse(chunk("", reason, token_id=event.token_id))
                    continue
                yield _sse(chunk(deltas.final(completion.text if completion else None), reason))
            if stream.finish_reason == "abort":  # aborted by the server (shutdown without drain)
                yield _sse(chunk("", "abort"))
            if include_usage:
                n = stream.num_generated
                prompt = len(stream.prompt_token_ids)
                usage = api.UsageInfo(prompt_tokens=prompt, completion_tokens=n, total_tokens=prompt + n)
                cls = api.ChatCompletionChunk if chat else api.CompletionChunk
                yield _sse(cls(id=ids, created=created, model=self.model_name, choices=[], usage=usage))
            yield _sse("[DONE]")
        except Exception as error:  # the engine failed this request: an error event, then the end
            yield _sse(json.dumps(APIError(500, f"the request failed in the engine: {error!r}",
                                           "internal_error").body()))
            yield _sse("[DONE]")
        finally:
            if not stream.done:  # the client went away mid-stream (this generator was cancelled or closed)
                stream.abort()


def build_app(engine_or_model, model_name: Optional[str] = None, api_key: Optional[str] = None,
              max_waiting: Optional[int] = None) -> FastAPI:
    """The FastAPI app serving `engine_or_model` (an `Engine` or an `ApexModel`) under `model_name` (default: the
    HF config's name_or_path basename). api_key: /v1 routes then need `Authorization: Bearer <api_key>`.
    max_waiting: the front's bound on waiting requests (a new front replaces the engine's; default: the
    engine's front as it is). The app's shutdown drains the front; closing the engine is the caller's."""
    from contextlib import asynccontextmanager

    engine = getattr(engine_or_model, "engine", engine_or_model)
    if max_waiting is not None:
        old = engine.__dict__.get("_front")
        if old is not None:
            old.shutdown(drain=True)
            engine.__dict__.pop("_front", None)
        engine.front = AsyncEngine(engine, max_waiting=max_waiting)
    front = engine.front
    if model_name is None:
        path = getattr(engine.model.config, "name_or_path", "") or ""
        model_name = os.path.basename(path.rstrip("/")) or EMBEDDED_MODEL_NAME
    serving = OpenAIServing(engine, front, model_name)
    metrics = ServerMetrics(engine, front)

    @asynccontextmanager
    async def lifespan(app):
        yield
        # uvicorn has finished the requests in flight; drain whatever is left, off the event loop
        await asyncio.get_running_loop().run_in_executor(None, front.shutdown, True)

    app = FastAPI(title="apex_compile OpenAI-compatible server", lifespan=lifespan)
    app.state.engine, app.state.front, app.state.serving, app.state.metrics = engine, front, serving, metrics

    async def check_key(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        if header != f"Bearer {api_key}":
            raise APIError(401, "invalid or missing API key (send `Authorization: Bearer <key>`)",
                           "authentication_error", code="invalid_api_key")

    @app.exception_handler(APIError)
    async def api_error(_, error: APIError):
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, error: RequestValidationError):
        problems = error.errors()
        first = problems[0] if problems else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in problems)
        return APIError(400, message or "invalid request", param=param).response()

    @app.get("/health")
    async def health():
        if not front.is_running:
            return APIError(503, "the engine front is not running", "service_unavailable").response()
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(check_key)])
    async def models():
        return api.ModelList(data=[api.ModelCard(id=model_name, max_model_len=engine.max_model_len)])

    @app.post("/v1/completions", dependencies=[Depends(check_key)])
    async def completions(body: api.CompletionRequest, raw: Request):
        if body.echo:
            raise APIError(400, "`echo` is not supported by this server", param="echo")
        serving.check_model(body)
        return await serving.run(body, serving.completion_prompt(body), body.max_tokens, 16, raw, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(check_key)])
    async def chat_completions(body: api.ChatCompletionRequest, raw: Request):
        serving.check_model(body)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await serving.run(body, serving.chat_prompt(body), max_tokens, None, raw, chat=True)

    return app
