"""HTTP plumbing every route shares: the error response, the API key, the body size limit,
admission (generation requests in flight), Server-Sent Events (`HttpServing`, the ingress's one
instance every route group is given), and the route declaration the route groups list their routes
with for the ingress."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import weakref
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from pydantic import BaseModel
from ray.exceptions import TaskCancelledError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from deployments.errors import ApiError
from deployments.metrics import IngressMetrics

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 << 20
RETRY_AFTER_S = 1  # the Retry-After of 429 (ingress full) and 503 (engine replica failed / restarting)


@dataclass(frozen=True)
class Route:
    """One HTTP route of the ingress: `endpoint` names the method of the route group declaring it that
    answers it (`(request) -> Response`), and the ingress's method of the same name that FastAPI calls;
    `options` are FastAPI's `add_api_route` keywords."""

    path: str
    endpoint: str
    methods: tuple[str, ...] = ("POST",)
    options: Mapping[str, Any] = field(default_factory=dict)


class RouteGroup(Protocol):
    """A route group's class, as the ingress reads it: its HTTP routes (`ROUTES`) and the names of its
    methods the ingress offers as its own handle methods (`HANDLES`)."""

    ROUTES: ClassVar[tuple[Route, ...]]
    HANDLES: ClassVar[tuple[str, ...]]


# ---- OpenAPI ----------------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None


class ErrorResponse(BaseModel):
    """Every refusal: HTTP 4xx (or 5xx when the server failed) with this body."""

    error: ErrorDetail


ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text} for code, text in (
        (400, "invalid request (the field is named in `param`)"), (401, "missing or wrong API key"),
        (404, "unknown model"), (413, "body too large"), (429, "at max_concurrent_requests; see Retry-After"),
        (503, "engine replica unavailable; see Retry-After"))}
# The refusals of a route that answers from the engine replicas without a request body.
ENGINE_ERRORS: dict[int | str, dict[str, Any]] = {code: ERRORS[code] for code in (401, 429, 503)}


# The 200 answer of a route that streams when asked: JSON, or Server-Sent Events (`data: {json}` lines).
STREAMED: dict[int | str, dict[str, Any]] = {200: {"description": "the answer; with `stream: true`, Server-Sent "
                                                   "Events (`data: {json}` per chunk, then `data: [DONE]`)",
                                                   "content": {"application/json": {},
                                                               "text/event-stream": {"schema": {"type": "string"}}}}}


def request_body(*models: type[BaseModel]) -> dict[str, Any]:
    """An OpenAPI requestBody (for a route's `openapi_extra`) whose schema is one of `models`. The
    routes validate the raw body with these same models themselves (after the API key and the body
    size limit, with the project's 400 error shape), so the documented schema is the enforced one."""
    refs = [{"$ref": f"#/components/schemas/{m.__name__}"} for m in models]
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": refs[0] if len(refs) == 1 else {"anyOf": refs}}}}}


def generation_route(path: str, endpoint: str, summary: str, *models: type[BaseModel]) -> Route:
    """A POST route that generates: its body one of `models`, its answer JSON or SSE, the API's errors."""
    return Route(path, endpoint, options=dict(responses=ERRORS | STREAMED, openapi_extra=request_body(*models),
                                              summary=summary))


# ---- responses --------------------------------------------------------------------------------
def error_response(e: ApiError, retry_after_s: int = RETRY_AFTER_S,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    headers = dict(headers or {})
    if e.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    elif e.status in (429, 503):
        headers["Retry-After"] = str(math.ceil(e.retry_after_s if e.retry_after_s is not None else retry_after_s))
    return JSONResponse(e.to_dict(), status_code=e.status, headers=headers)


def engine_call_error(e: Exception) -> ApiError:
    """An exception from calling the engine deployment as the answer: Serve's queue for it is full
    (429), or no replica can take the call (503: failed, restarting, not scheduled yet)."""
    if isinstance(e, BackPressureError):
        return ApiError(f"the engine replicas' queues are full; retry later ({e})", None, 429, "rate_limit_exceeded")
    if isinstance(e, DeploymentUnavailableError):
        return ApiError(f"no engine replica is available: {e}", None, 503, "engine_unavailable")
    return ApiError(f"the engine replica failed: {type(e).__name__}: {e}", None, 503, "engine_unavailable")


class Slots:
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


class TrackedStreamingResponse(StreamingResponse):
    """A StreamingResponse that runs `on_close` once it is over, however it ends (sent, client gone,
    cancelled), so an admission slot held by a stream is always given back."""

    on_close: Callable[[], None] | None = None

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.on_close is not None:
                self.on_close()


def sse_response(events: AsyncIterator[Any]) -> StreamingResponse:
    """Server-Sent Events: one `data: {json}` per object, then `data: [DONE]`."""

    async def body() -> AsyncIterator[str]:
        try:
            async for obj in events:
                yield f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await events.aclose()

    return TrackedStreamingResponse(body(), media_type="text/event-stream",
                                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def json_roundtrip(body: Any) -> Any:
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


# ---- serving one route ------------------------------------------------------------------------
class HttpServing:
    """The ingress's request plumbing: the API key (None: off), the body size limit, admission
    (`slots`), the Retry-After of its 429 / 503 answers, and the count of every answer by route and
    status (`metrics`)."""

    def __init__(self, api_key: str | None, max_body_bytes: int, slots: Slots, retry_after_s: int,
                 metrics: IngressMetrics):
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.slots = slots
        self.retry_after_s = retry_after_s
        self.metrics = metrics

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

    async def serve(self, request: Request, route: str, handler: Callable, auth: bool = True,
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
            if release is not None and isinstance(response, TrackedStreamingResponse):
                response.on_close, release = release, None  # held until the stream is over ...
                weakref.finalize(response, response.on_close)  # ... or the response is dropped unsent
            return response
        except ApiError as e:
            status = e.status
            return error_response(e, self.retry_after_s)
        except (ClientDisconnect, TaskCancelledError):  # gone while sending its body: nobody to answer
            status = 499
            return Response(status_code=499)
        except asyncio.CancelledError:  # the client left (Serve cancels its request): nginx's 499
            status = 499
            raise
        except Exception as e:  # noqa: BLE001 - a bug, not bad input: 500 with the error shape
            log.exception("%s failed", route)
            return error_response(ApiError(f"internal error: {type(e).__name__}: {e}", None, 500, "internal_error"))
        finally:
            if release is not None:
                release()
            self.metrics.request(route, status)
