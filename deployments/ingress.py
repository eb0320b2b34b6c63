"""The HTTP ingress and the handle API (docs/api.md).

HTTP: POST /generate, /v1/completions, /v1/chat/completions (unary or SSE), GET /v1/models, /health,
/metrics. Unary requests go through `@serve.batch` into one `EngineServer.generate_batch` call;
streams go through `EngineServer.generate_stream` (handle with `stream=True`), one per request, and
are cancelled when the client goes away (which aborts the request in the engine and frees its KV
pages). Bad input is a 4xx `{"error": {"message", "type", "param"}}`, never a 5xx.

Handles (other Ray jobs): `generate(dict) -> dict` returns exactly the HTTP unary JSON, and
`generate_stream(dict)` yields exactly the SSE deltas; refusals come back as the same error JSON.
"""


import asyncio
import functools
import hmac
import json
import logging
import math
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.exceptions import TaskCancelledError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from deployments.metrics import IngressMetrics
from deployments.schemas import (
    CONTROL_REQUESTS,
    ApiError,
    ChatCompletionRequest,
    ChoiceFormatter,
    CompletionRequest,
    ControlError,
    EngineRequest,
    ErrorResponse,
    GenerateRequest,
    NativeGenerateRequest,
    OpenAIFormatter,
    chat_to_engine,
    completion_to_engine,
    generate_body,
    generate_plan,
    is_error_item,
    new_request_id,
    parse,
    request_body,
    request_components,
)
from engine.model.checkpoint import load_model_spec, load_tokenizer
from engine.worker.update_group import WEIGHT_OP_TIMEOUT_S

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 << 20

# NOTE: `@serve.ingress(app)` cloudpickles the app (with the route methods) when the class is
# decorated, so everything the routes use must be defined above the class.
app = FastAPI(title="blockserve", version="0.1.0", docs_url="/docs", redoc_url=None, openapi_url="/openapi.json",
              description="Block-diffusion (SDAR) and Qwen3 inference: SGLang-style /generate, OpenAI completions "
                          "and chat. Errors: `{\"error\": {\"message\", \"type\", \"param\"}}`.")
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text} for code, text in (
        (400, "invalid request (the field is named in `param`)"), (401, "missing or wrong API key"),
        (404, "unknown model"), (413, "body too large"), (429, "at max_concurrent_requests; see Retry-After"),
        (503, "engine replica unavailable; see Retry-After"))}


def _openapi() -> dict[str, Any]:
    """FastAPI's schema plus the request models the routes name in their requestBody."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        schema.setdefault("components", {}).setdefault("schemas", {}).update(request_components())
        app.openapi_schema = schema
    return app.openapi_schema


app.openapi = _openapi


RETRY_AFTER_S = 1  # the Retry-After of 429 (ingress full) and 503 (engine replica failed / restarting)
ENGINE_CHECK_INTERVAL_S = 1.0  # how often the ingress re-checks that an engine replica runs


# A control broadcast may wait for the trainer (a weight broadcast, a group rendezvous) as long as the engine does.
CONTROL_TIMEOUT_S = WEIGHT_OP_TIMEOUT_S + 60.0
WEIGHT_SOURCES = {"update_weights_from_disk": "disk", "update_weights_from_tensor": "tensor",
                  "update_weights_from_distributed": "distributed"}


def _error_response(e: ApiError, retry_after_s: int = RETRY_AFTER_S,
                    headers: Mapping[str, str] | None = None) -> JSONResponse:
    headers = dict(headers or {})
    if e.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    elif e.status in (429, 503):
        headers["Retry-After"] = str(math.ceil(e.retry_after_s if e.retry_after_s is not None else retry_after_s))
    return JSONResponse(e.to_dict(), status_code=e.status, headers=headers)


class _Slots:
    """Admission control: at most `limit` generation requests in flight in this ingress replica
    (a stream counts until its last byte is sent or its client leaves). None = no limit."""

    def __init__(self, limit: int | None, on_refused: Callable[[], None]):
        self.limit = limit
        self.in_flight = 0
        self.on_refused = on_refused

    def acquire(self) -> Callable[[], None]:
        if self.limit is not None and self.in_flight >= self.limit:
            self.on_refused()
            raise ApiError(f"the server is at its limit of {self.limit} concurrent requests; retry later", None,
                           429, "rate_limit_exceeded")
        self.in_flight += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.in_flight -= 1

        return release


class _TrackedStreamingResponse(StreamingResponse):
    """A StreamingResponse that runs `on_close` once it is over, however it ends (sent, client gone,
    cancelled), so an admission slot held by a stream is always given back."""

    on_close: Callable[[], None] | None = None

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.on_close is not None:
                self.on_close()


@app.exception_handler(StarletteHTTPException)
async def _http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request_error")
    # exc.headers carries the Allow header of a 405
    return _error_response(ApiError(f"{request.method} {request.url.path}: {exc.detail}", None,
                                    exc.status_code, kind), headers=exc.headers)


def _engine_call_error(e: Exception) -> ApiError:
    """An exception from calling the engine deployment as the answer: Serve's queue for it is full
    (429), or no replica can take the call (503: failed, restarting, not scheduled yet)."""
    if isinstance(e, BackPressureError):
        return ApiError(f"the engine replicas' queues are full; retry later ({e})", None, 429, "rate_limit_exceeded")
    if isinstance(e, DeploymentUnavailableError):
        return ApiError(f"no engine replica is available: {e}", None, 503, "engine_unavailable")
    return ApiError(f"the engine replica failed: {type(e).__name__}: {e}", None, 503, "engine_unavailable")


def _failed(answer: Any) -> dict[str, Any] | None:
    """A replica's control answer if it failed (an exception from the broadcast counts), else None."""
    if isinstance(answer, BaseException):
        return {"success": False, "message": f"{type(answer).__name__}: {answer}", "rank": "?", "refused": False}
    return None if answer.get("success") else answer


def _refusal_message(what: str, failed: list[dict[str, Any]]) -> str:
    return f"{what}: " + "; ".join(f"replica {a.get('rank', '?')}: {a['message']}" for a in failed)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _error_result(request_id: str, message: str, last: dict[str, Any] | None) -> dict[str, Any]:
    """A final result dict for a stream the engine side could not finish (replica died)."""
    return {"request_id": request_id, "text": "", "token_ids": [], "finish_reason": "error", "error": message,
            "input_token_len": (last or {}).get("input_token_len", 0),
            "generate_token_len": (last or {}).get("generate_token_len", 0)}


def _json_roundtrip(body: Any) -> Any:
    """A handle request as it would arrive over HTTP (tuples become lists, numpy scalars and arrays
    numbers and lists), so that it validates exactly like the same JSON body."""

    def default(o: Any) -> Any:
        if hasattr(o, "tolist"):
            return o.tolist()
        raise TypeError(f"{type(o).__name__} is not JSON serializable")

    try:
        return json.loads(json.dumps(body, default=default))
    except (TypeError, ValueError) as e:
        raise ApiError(f"the request is not JSON-serializable: {e}") from None


async def _merge(streams: list[AsyncIterator[dict[str, Any]]]) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """Interleave several requests' deltas as (index, delta), each as soon as it arrives. Closing the
    merged iterator closes (and so cancels) every stream."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue[tuple[int, dict[str, Any] | None]] = asyncio.Queue()

    async def pump(i: int, it: AsyncIterator[dict[str, Any]]) -> None:
        try:
            async for out in it:
                await queue.put((i, out))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(streams)]
    try:
        open_streams = len(tasks)
        while open_streams:
            i, out = await queue.get()
            if out is None:
                open_streams -= 1
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for it in streams:
            await it.aclose()


def _indexed(body: dict[str, Any], index: int, as_list: bool) -> dict[str, Any]:
    """A /generate body as an entry of a list answer (a batch or n > 1) carries its `index`."""
    return body | {"index": index} if as_list else body


def _streamed(body: Any, stream: bool) -> Any:
    """A handle's body with `stream` set by the method called (a non-object is refused later)."""
    return body | {"stream": stream} if isinstance(body, dict) else body


@serve.deployment(max_ongoing_requests=1024)
@serve.ingress(app)
class Ingress:
    def __init__(self, engine, model: str, served_model_name: str | None = None, max_model_len: int | None = None,
                 max_batch_size: int = 16, batch_wait_timeout_s: float = 0.005, api_key: str | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_concurrent_requests: int | None = None,
                 retry_after_s: int = RETRY_AFTER_S):
        self.engine = engine
        self.model_path = model
        self.served_model_name = served_model_name or model.rstrip("/").split("/")[-1]
        spec = load_model_spec(model)
        self.max_model_len = max_model_len or spec.max_position_embeddings  # the engine's default too
        self.api_key = api_key or None
        self.max_body_bytes = max_body_bytes
        self.metrics = IngressMetrics(self.served_model_name, lambda: self.slots.in_flight)
        self.slots = _Slots(max_concurrent_requests, self.metrics.rejected.inc)
        self.retry_after_s = retry_after_s
        self.tokenizer = load_tokenizer(model)
        self.is_dllm = spec.is_dllm
        self._token_text = functools.lru_cache(maxsize=65536)(self._decode_token)
        self.created = int(time.time())
        self._control_lock = asyncio.Lock()  # one RL control operation at a time (per ingress replica)
        self._engine_seen_at = 0.0  # when an engine replica was last seen running
        self._batched_generate.set_max_batch_size(max_batch_size)
        self._batched_generate.set_batch_wait_timeout_s(batch_wait_timeout_s)

    # ---- engine calls ----------------------------------------------------------------------
    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.005, max_concurrent_batches=64)
    async def _batched_generate(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        self.metrics.batches.inc()
        self.metrics.batched.inc(len(requests))
        try:
            return await self.engine.generate_batch.remote(requests)
        except Exception as e:  # full, died or unreachable: every request in the batch fails
            if not isinstance(e, BackPressureError):
                log.exception("generate_batch failed")
            return [_engine_call_error(e).to_item()] * len(requests)

    def _count(self, out: dict[str, Any]) -> None:
        if out.get("finish_reason") is not None:
            self.metrics.prompt_tokens.inc(out.get("input_token_len", 0))
            self.metrics.generation_tokens.inc(out.get("generate_token_len", 0))

    async def _require_engine(self) -> None:
        """503 at once while no engine replica runs (one that cannot be scheduled, or all being
        replaced): Serve's router would otherwise hold the request until one starts. Looked up at
        most once a second."""
        if time.monotonic() - self._engine_seen_at < ENGINE_CHECK_INTERVAL_S:
            return
        try:
            answers = await self._broadcast("check_health", return_exceptions=True)
        except DeploymentUnavailableError:  # Serve's word for "no replica of it runs"
            answers = []
        if not answers:
            raise ApiError("no engine replica is running (starting, being replaced, or waiting for resources: "
                           "see `serve status`)", None, 503, "engine_unavailable")
        self._engine_seen_at = time.monotonic()

    async def _unary(self, req: EngineRequest) -> dict[str, Any]:
        """The folded result dict of one request; ApiError for refusals and engine failures (503: the
        engine replica failed under the request; Serve replaces it, so a retry is the remedy)."""
        await self._require_engine()
        out = await self._batched_generate(req.model_dump())
        if is_error_item(out):
            raise ApiError.from_item(out)
        self._count(out)
        if out.get("finish_reason") == "error":
            raise ApiError(f"the engine failed this request: {out.get('error')}", None, 503, "engine_unavailable")
        return out

    async def _stream(self, req: EngineRequest) -> AsyncIterator[dict[str, Any]]:
        """The request's result-dict deltas. Refusals raise ApiError here, before anything is sent;
        a failure later ends the stream with a finish_reason "error" delta. Closing the iterator
        (client disconnect, cancellation) cancels the engine-side stream."""
        await self._require_engine()
        gen = self.engine.options(stream=True).generate_stream.remote(req.model_dump())
        try:
            first = await gen.__anext__()
        except StopAsyncIteration:
            raise ApiError("the engine ended the request without a result", None, 500, "internal_error") from None
        except asyncio.CancelledError:  # the client left before the first delta
            gen.cancel()
            raise
        except Exception as e:
            raise _engine_call_error(e) from None
        if is_error_item(first):
            raise ApiError.from_item(first)

        async def deltas() -> AsyncIterator[dict[str, Any]]:
            last = first
            try:
                yield first
                if first.get("finish_reason") is None:
                    async for item in gen:
                        last = item
                        yield item
            except Exception as e:  # noqa: BLE001 - the replica died mid-stream
                log.exception("stream %s failed", req.request_id)
                last = _error_result(req.request_id, f"the engine replica failed: {type(e).__name__}: {e}", last)
                yield last
            finally:
                if last.get("finish_reason") is None:
                    gen.cancel()
                self._count(last)

        return deltas()

    async def _streams(self, reqs: list[EngineRequest]) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        """Several requests streamed together as (index, delta); a refusal of any raises ApiError
        before anything is sent (and closes the others)."""
        started = await asyncio.gather(*(self._stream(r) for r in reqs), return_exceptions=True)
        failed = [e for e in started if isinstance(e, BaseException)]
        if failed:
            for it in started:
                if not isinstance(it, BaseException):
                    await it.aclose()
            raise failed[0]
        return _merge(started)

    async def _unaries(self, reqs: list[EngineRequest]) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(self._unary(r) for r in reqs)))

    async def _generate(self, body: Any) -> tuple[bool, Any]:
        """Any /generate body (flat or SGLang-native): (streamed?, the answer JSON or an iterator of
        delta bodies). A batch or n > 1 answers a list in order, each entry with its `index`; streamed,
        the deltas of all of them interleave, each with its `index`."""
        groups, as_list, stream = generate_plan(body)
        reqs = [r for group in groups for r in group]
        params = [r.generation_config() for r in reqs]
        if not stream:
            outs = await self._unaries(reqs)
            bodies = [_indexed(generate_body(o, p), i, as_list) for i, (o, p) in enumerate(zip(outs, params))]
            return False, bodies if as_list else bodies[0]
        merged = await self._streams(reqs)

        async def deltas() -> AsyncIterator[dict[str, Any]]:
            try:
                async for i, out in merged:
                    yield _indexed(generate_body(out, params[i]), i, as_list)
            finally:
                await merged.aclose()

        return True, deltas()

    # ---- HTTP plumbing ---------------------------------------------------------------------
    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise ApiError("missing or invalid API key: send 'Authorization: Bearer <key>'", None, 401,
                           "authentication_error")

    async def _read_json(self, request: Request) -> Any:
        limit = self.max_body_bytes
        length = request.headers.get("content-length", "")
        too_big = ApiError(f"the request body exceeds the limit of {limit} bytes", None, 413, "request_too_large")
        if length.isdigit() and int(length) > limit:
            raise too_big
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise too_big
        try:
            return json.loads(bytes(body))
        except ValueError as e:  # JSONDecodeError and invalid UTF-8 alike
            raise ApiError(f"the request body is not valid JSON: {e}") from None
        except RecursionError:
            raise ApiError("the request body is nested too deeply to be a request") from None

    async def _serve(self, request: Request, route: str, handler: Callable, auth: bool = True,
                     body: bool = True, limited: bool = False) -> Response:
        """Run one route: API key, admission (generation routes), body, handler; every failure
        becomes the error JSON."""
        status = 500
        release = None
        try:
            if auth:
                self._authorize(request)
            if limited:
                release = self.slots.acquire()
            response = await handler(await self._read_json(request)) if body else await handler()
            status = response.status_code
            if release is not None and isinstance(response, _TrackedStreamingResponse):
                response.on_close, release = release, None  # held until the stream is over ...
                weakref.finalize(response, response.on_close)  # ... or the response is dropped unsent
            return response
        except ApiError as e:
            status = e.status
            return _error_response(e, self.retry_after_s)
        except (ClientDisconnect, TaskCancelledError):  # gone while sending its body: nobody to answer
            status = 499
            return Response(status_code=499)
        except asyncio.CancelledError:  # the client left (Serve cancels its request): nginx's 499
            status = 499
            raise
        except Exception as e:  # noqa: BLE001 - a bug, not bad input: 500 with the error shape
            log.exception("%s failed", route)
            return _error_response(ApiError(f"internal error: {type(e).__name__}: {e}", None, 500, "internal_error"))
        finally:
            if release is not None:
                release()
            self.metrics.request(route, status)

    def _sse_response(self, events: AsyncIterator[Any]) -> StreamingResponse:
        """Server-Sent Events: one `data: {json}` per object, then `data: [DONE]`."""

        async def body() -> AsyncIterator[str]:
            try:
                async for obj in events:
                    yield _sse(obj)
                yield "data: [DONE]\n\n"
            finally:
                await events.aclose()

        return _TrackedStreamingResponse(body(), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    # ---- routes ------------------------------------------------------------------------------
    @app.post("/generate", responses=ERRORS, openapi_extra=request_body(GenerateRequest, NativeGenerateRequest),
              summary="Generate (SGLang-style: the flat body or SGLang's native one; SSE when stream)")
    async def http_generate(self, request: Request):
        return await self._serve(request, "/generate", self._generate_route, limited=True)

    async def _generate_route(self, body: Any) -> Response:
        stream, answer = await self._generate(body)
        return self._sse_response(answer) if stream else JSONResponse(answer)

    @app.post("/v1/completions", responses=ERRORS, openapi_extra=request_body(CompletionRequest),
              summary="OpenAI completions (echo, logprobs, list prompts, n)")
    async def http_completions(self, request: Request):
        return await self._serve(request, "/v1/completions", self._completions_route, limited=True)

    async def _completions_route(self, body: Any) -> Response:
        req = parse(CompletionRequest, body)
        plan = completion_to_engine(req, self.served_model_name, self.tokenizer, self.is_dllm)
        reqs = [r for _, group in plan for r in group]
        echoes = [echo for echo, group in plan for _ in group]
        choices = [ChoiceFormatter("completion", i, req.logprobs, self._token_text, echo)
                   for i, echo in enumerate(echoes)]
        return await self._openai("completion", reqs, choices, req.n, req.stream, req.stream_options)

    @app.post("/v1/chat/completions", responses=ERRORS, openapi_extra=request_body(ChatCompletionRequest),
              summary="OpenAI chat completions")
    async def http_chat(self, request: Request):
        return await self._serve(request, "/v1/chat/completions", self._chat_route, limited=True)

    async def _chat_route(self, body: Any) -> Response:
        req = parse(ChatCompletionRequest, body)
        reqs = chat_to_engine(req, self.served_model_name, self.tokenizer, self.max_model_len)
        k = (req.top_logprobs or 0) if req.logprobs else None
        choices = [ChoiceFormatter("chat", i, k, self._token_text) for i in range(len(reqs))]
        return await self._openai("chat", reqs, choices, req.n, req.stream, req.stream_options)

    async def _openai(self, kind: str, reqs: list[EngineRequest], choices: list[ChoiceFormatter], n: int,
                      stream: bool, stream_options) -> Response:
        fmt = OpenAIFormatter(kind, self.served_model_name, new_request_id("cmpl" if kind == "completion" else
                                                                           "chatcmpl"),
                              choices, n, include_usage=bool(stream_options and stream_options.include_usage))
        if not stream:
            return JSONResponse(fmt.full(await self._unaries(reqs)))
        merged = await self._streams(reqs)

        async def chunks() -> AsyncIterator[dict[str, Any]]:
            try:
                async for i, out in merged:
                    for chunk in fmt.chunks(i, out):
                        yield chunk
            finally:
                await merged.aclose()

        return self._sse_response(chunks())

    @app.get("/v1/models", responses={401: ERRORS[401]}, summary="The served model")
    async def http_models(self, request: Request):
        async def models() -> Response:
            return JSONResponse({"object": "list", "data": [{
                "id": self.served_model_name, "object": "model", "created": self.created, "owned_by": "blockserve",
                "root": self.model_path, "max_model_len": self.max_model_len,
                "weight_version": (await self.get_weight_version())["weight_version"]}]})

        return await self._serve(request, "/v1/models", models, body=False)

    @app.get("/health", summary="200 when every engine replica is healthy, else 503")
    async def http_health(self, request: Request):
        async def health() -> Response:
            try:
                replicas = await self._broadcast("check_health")
            except Exception as e:  # noqa: BLE001 - any failure is "unhealthy"
                return JSONResponse({"status": "unhealthy", "error": f"{type(e).__name__}: {e}"}, status_code=503)
            if not replicas:
                return JSONResponse({"status": "unhealthy", "error": "no engine replica is running"}, status_code=503)
            return JSONResponse({"status": "ok", "engine_replicas": len(replicas)})

        return await self._serve(request, "/health", health, auth=False, body=False)

    @app.get("/metrics", responses={401: ERRORS[401]}, response_class=PlainTextResponse,
             summary="Prometheus metrics (text exposition)")
    async def http_metrics(self, request: Request):
        async def metrics() -> Response:
            stats, families = await asyncio.gather(self._broadcast("stats", return_exceptions=True),
                                                   self._broadcast("metric_families", return_exceptions=True))
            by_replica = {f["replica"]: f["families"] for f in families if isinstance(f, dict)}
            text = self.metrics.render([s for s in stats if isinstance(s, dict)], by_replica)
            return Response(text, media_type=CONTENT_TYPE_LATEST)

        return await self._serve(request, "/metrics", metrics, body=False)

    async def _broadcast(self, method: str, *args: Any, timeout_s: float = 10.0,
                         return_exceptions: bool = False) -> list[Any]:
        """Call `method(*args)` on every running EngineServer replica (Serve's `broadcast`)."""
        return await self.engine.broadcast(method, *args).results_async(timeout_s=timeout_s,
                                                                         return_exceptions=return_exceptions)

    # ---- RL control -----------------------------------------------------------------------------
    async def _control(self, name: str, body: Any) -> dict[str, Any]:
        """Run one RL control call (SGLang's name and payload) on every engine replica: its answer
        `{"success": true, "message", ...}`, or ControlError. Calls run one at a time."""
        try:
            req = parse(CONTROL_REQUESTS[name], {} if body is None else body)
            async with self._control_lock:
                if name in WEIGHT_SOURCES:
                    return await self._update_weights(WEIGHT_SOURCES[name], req)
                if name == "init_weights_update_group":
                    return await self._init_group(req)
                return await self._broadcast_control(name, req.model_dump())
        except ApiError as e:
            raise ControlError(e.message, e.param, e.status, e.type, e.retry_after_s) from None

    async def _broadcast_control(self, name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        answers = await self._broadcast("control", name, kwargs, timeout_s=CONTROL_TIMEOUT_S, return_exceptions=True)
        if not answers:
            raise ApiError("no engine replica is running", None, 503, "engine_unavailable")
        failed = [a for a in map(_failed, answers) if a is not None]
        if failed:
            status = 400 if all(a.get("refused") for a in failed) else 500
            raise ApiError(_refusal_message(f"{name} failed on {len(failed)} of {len(answers)} engine replicas",
                                            failed), None, status, "control_failed")
        out: dict[str, Any] = {"success": True, "message": f"{answers[0]['message']} ({len(answers)} replicas)",
                               "num_replicas": len(answers)}
        if name == "pause_generation":
            out["requests"] = sum(a.get("requests", 0) for a in answers)
        return out

    async def _init_group(self, req) -> dict[str, Any]:
        """Every replica joins the trainer's group; replica r's TP ranks at rank_offset + r * tp + tp_rank."""
        stats = await self._broadcast("stats", timeout_s=CONTROL_TIMEOUT_S)
        if not stats:
            raise ApiError("no engine replica is running", None, 503, "engine_unavailable")
        replicas, tp = len(stats), stats[0]["tp"]
        if req.world_size != req.rank_offset + replicas * tp:
            raise ApiError(f"world_size={req.world_size}: {replicas} engine replicas of tp={tp} join at ranks "
                           f"{req.rank_offset}..{req.rank_offset + replicas * tp - 1}, so the group's world_size is "
                           f"rank_offset + replicas * tp = {req.rank_offset + replicas * tp}", "world_size")
        answers = await self._broadcast("init_weights_update_group", req.master_address, req.master_port,
                                        req.rank_offset, req.world_size, req.group_name, req.backend,
                                        timeout_s=CONTROL_TIMEOUT_S, return_exceptions=True)
        failed = [a for a in map(_failed, answers) if a is not None]
        if failed:
            raise ApiError(_refusal_message("init_weights_update_group failed", failed), None,
                           400 if all(a.get("refused") for a in failed) else 500, "control_failed")
        ranks = sorted(r for a in answers for r in a["ranks"])
        return {"success": True, "message": f"joined weight update group {req.group_name!r} at ranks {ranks}",
                "ranks": ranks, "num_replicas": len(answers)}

    async def _update_weights(self, kind: str, req) -> dict[str, Any]:
        """All or nothing across replicas: stage on every replica; commit on every replica only if all
        staged, else discard everywhere and answer 400 naming the refusal. A broadcast source is
        received by every replica either way (the trainer's collective completes)."""
        if kind == "tensor":
            if req.serialized_named_tensors is not None or req.named_tensors is None:
                raise ApiError("update_weights_from_tensor takes `named_tensors` ([[name, torch.Tensor], ...]) "
                               "through the Serve handle: serve.get_app_handle(app).update_weights_from_tensor"
                               ".remote({...}); serialized (pickled) tensors over HTTP are not accepted",
                               "named_tensors")
            payload = {"named_tensors": req.named_tensors, "load_format": req.load_format}
        else:
            payload = req.model_dump(exclude={"weight_version"})
        update_id = uuid.uuid4().hex
        staged = await self._broadcast("stage_weights", update_id, kind, payload, timeout_s=CONTROL_TIMEOUT_S,
                                       return_exceptions=True)
        if not staged:
            raise ApiError("no engine replica is running", None, 503, "engine_unavailable")
        refused = [a for a in map(_failed, staged) if a is not None]
        if refused:
            await self._broadcast("discard_weights", update_id, timeout_s=CONTROL_TIMEOUT_S, return_exceptions=True)
            raise ApiError(_refusal_message(f"weight update refused ({len(refused)} of {len(staged)} engine "
                                            "replicas); every replica keeps its weights", refused), None, 400,
                           "weight_update_refused")
        committed = await self._broadcast("commit_weights", update_id, req.weight_version,
                                          timeout_s=CONTROL_TIMEOUT_S, return_exceptions=True)
        failed = [a for a in map(_failed, committed) if a is not None]
        if failed:  # past the point of no return: say exactly where the new weights are not
            raise ApiError(_refusal_message(f"weight update committed on {len(committed) - len(failed)} of "
                                            f"{len(committed)} engine replicas only", failed), None, 500,
                           "internal_error")
        versions = sorted({a["weight_version"] for a in committed})
        version = versions[0] if len(versions) == 1 else versions
        return {"success": True, "message": f"weights updated to version {version!r} on {len(committed)} replicas",
                "weight_version": version, "num_replicas": len(committed)}

    # The control routes stay out of /openapi.json: they change the state of every replica (pause,
    # release, new weights), so schema-driven clients and fuzzers must not call them blindly.
    async def _control_route(self, request: Request, name: str, body: bool = True) -> Response:
        async def handler(payload: Any = None) -> Response:
            return JSONResponse(await self._control(name, payload))

        return await self._serve(request, f"/{name}", handler, body=body)

    @app.post("/update_weights_from_disk", include_in_schema=False, summary="RL: load a checkpoint on every replica")
    async def http_update_weights_from_disk(self, request: Request):
        return await self._control_route(request, "update_weights_from_disk")

    @app.post("/update_weights_from_tensor", include_in_schema=False, summary="RL: handle only (tensors travel by Ray)")
    async def http_update_weights_from_tensor(self, request: Request):
        return await self._control_route(request, "update_weights_from_tensor")

    @app.post("/init_weights_update_group", include_in_schema=False, summary="RL: join the trainer's broadcast group")
    async def http_init_weights_update_group(self, request: Request):
        return await self._control_route(request, "init_weights_update_group")

    @app.post("/update_weights_from_distributed", include_in_schema=False, summary="RL: receive weights by broadcast")
    async def http_update_weights_from_distributed(self, request: Request):
        return await self._control_route(request, "update_weights_from_distributed")

    @app.post("/destroy_weights_update_group", include_in_schema=False, summary="RL: leave the broadcast group")
    async def http_destroy_weights_update_group(self, request: Request):
        return await self._control_route(request, "destroy_weights_update_group")

    @app.api_route("/flush_cache", methods=["GET", "POST"], include_in_schema=False,
                   summary="RL: drop the prefix cache")
    async def http_flush_cache(self, request: Request):
        return await self._control_route(request, "flush_cache", body=False)

    @app.post("/pause_generation", include_in_schema=False, summary="RL: stop generating (abort | retract | in_place)")
    async def http_pause_generation(self, request: Request):
        return await self._control_route(request, "pause_generation")

    @app.post("/continue_generation", include_in_schema=False, summary="RL: generate again after pause_generation")
    async def http_continue_generation(self, request: Request):
        return await self._control_route(request, "continue_generation", body=False)

    @app.post("/release_memory_occupation", include_in_schema=False, summary="RL: free weights and/or KV cache")
    async def http_release_memory_occupation(self, request: Request):
        return await self._control_route(request, "release_memory_occupation")

    @app.post("/resume_memory_occupation", include_in_schema=False, summary="RL: restore weights and/or KV cache")
    async def http_resume_memory_occupation(self, request: Request):
        return await self._control_route(request, "resume_memory_occupation")

    @app.get("/get_weight_version", responses={401: ERRORS[401]}, summary="RL: the weights being served")
    async def http_get_weight_version(self, request: Request):
        async def version() -> Response:
            return JSONResponse(await self.get_weight_version())

        return await self._serve(request, "/get_weight_version", version, body=False)

    # ---- handle API (other Ray jobs) -------------------------------------------------------
    async def generate(self, body: dict[str, Any]) -> dict[str, Any] | list[dict[str, Any]]:
        """Same JSON as the HTTP unary /generate (a list for a batch or n > 1; the error JSON for
        refusals, including `rate_limit_exceeded` when this ingress replica is at
        max_concurrent_requests). `stream` in the body is ignored: use generate_stream."""
        release = None
        try:
            release = self.slots.acquire()
            _, answer = await self._generate(_streamed(_json_roundtrip(body), False))
            return answer
        except ApiError as e:
            return e.to_dict()
        finally:
            if release is not None:
                release()
            self.metrics.request("handle:generate", 0)

    async def generate_stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Same deltas as the SSE /generate stream (one error JSON for refusals)."""
        self.metrics.request("handle:generate_stream", 0)
        try:
            release = self.slots.acquire()
        except ApiError as e:
            yield e.to_dict()
            return
        try:
            try:
                _, deltas = await self._generate(_streamed(_json_roundtrip(body), True))
            except ApiError as e:
                yield e.to_dict()
                return
            try:
                async for out in deltas:
                    yield out
            finally:
                await deltas.aclose()
        finally:
            release()

    async def engine_stats(self) -> list[dict[str, Any]]:
        """Per-replica engine stats (kv_pages_free, running, generated_tokens, ...)."""
        return await self._broadcast("stats")

    async def _control_handle(self, name: str, body: dict[str, Any] | None) -> dict[str, Any]:
        self.metrics.request(f"handle:{name}", 0)
        try:
            return await self._control(name, body)
        except ApiError as e:
            return e.to_dict()

    # RL control: the HTTP routes' payloads and answers (a refusal is `{"success": false, "message", "error"}`)
    async def update_weights_from_disk(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._control_handle("update_weights_from_disk", body)

    async def update_weights_from_tensor(self, body: dict[str, Any]) -> dict[str, Any]:
        """`{"named_tensors": [[name, torch.Tensor], ...], "weight_version"?, "load_format"?}`."""
        return await self._control_handle("update_weights_from_tensor", body)

    async def init_weights_update_group(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._control_handle("init_weights_update_group", body)

    async def update_weights_from_distributed(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._control_handle("update_weights_from_distributed", body)

    async def destroy_weights_update_group(self, body: dict[str, Any] | None = None) -> dict[str, Any]:
        return await self._control_handle("destroy_weights_update_group", body)

    async def flush_cache(self, body: dict[str, Any] | None = None) -> dict[str, Any]:
        return await self._control_handle("flush_cache", body)

    async def pause_generation(self, body: dict[str, Any] | None = None) -> dict[str, Any]:
        return await self._control_handle("pause_generation", body)

    async def continue_generation(self, body: dict[str, Any] | None = None) -> dict[str, Any]:
        return await self._control_handle("continue_generation", body)

    async def release_memory_occupation(self, body: dict[str, Any] | None = None) -> dict[str, Any]:
        return await self._control_handle("release_memory_occupation", body)

    async def resume_memory_occupation(self, body: dict[str, Any] | None = None) -> dict[str, Any]:
        return await self._control_handle("resume_memory_occupation", body)

    async def get_weight_version(self) -> dict[str, Any]:
        """`{"weight_version"}` (a list when the replicas disagree, e.g. one restarted since an update)."""
        stats = await self._broadcast("stats", return_exceptions=True)
        versions = sorted({s["weight_version"] for s in stats if isinstance(s, dict)})
        return {"weight_version": versions[0] if len(versions) == 1 else versions or None}
