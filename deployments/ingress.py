"""The HTTP ingress and the handle API (docs/api.md): the protocols' routes assembled into one
Serve deployment, `Ingress`.

HTTP: SGLang's /generate (`sglang/`), OpenAI's /v1/* (`openai/`), the RL control routes (`rl/`),
/health and /metrics (`admin`), the denoising viewer page /viewer (`viewer/`). An ingress replica is
built from collaborators: one `EngineClient` (its calls into the engine replicas), one `HttpServing`
(API key, body limit, admission, the error answers) and one route group per protocol, each given
those two. Each group lists its routes (`ROUTES`) and this module adds them to the FastAPI app, as Ray
Serve LLM's `make_fastapi_ingress` does with its endpoint maps, each answered by the ingress method of
the route's `endpoint` name, which calls the group's method of that name. Bad input is a 4xx
`{"error": {"message", "type", "param"}}`, never a 5xx.

Handles (other Ray jobs): the methods each group lists in `HANDLES` are the ingress's own.
`generate(dict) -> dict` returns exactly the HTTP unary JSON, and `generate_stream(dict)` yields
exactly the SSE deltas; the RL control methods take the HTTP route's JSON as one dict; refusals come
back as the same error JSON.

The ingress loads no model code: what it needs of the model comes from the engine replicas
(`EngineServer.model_info`), and the tokenizer is read from the checkpoint's tokenizer files.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from deployments.admin import AdminRoutes, add_docs, openapi_schema
from deployments.decisions import DecisionRequest
from deployments.engine_client import EngineClient
from deployments.errors import ApiError
from deployments.http import DEFAULT_MAX_BODY_BYTES, RETRY_AFTER_S, HttpServing, RouteGroup, Slots, error_response
from deployments.metrics import IngressMetrics
from deployments.openai.protocol import ChatCompletionRequest, CompletionRequest
from deployments.openai.routes import OpenAIRoutes
from deployments.rl.routes import RLRoutes
from deployments.sglang.protocol import GenerateRequest, NativeGenerateRequest
from deployments.sglang.routes import SGLangRoutes
from deployments.single_machine import keep_replica_grpc_on_loopback
from deployments.tokens import TokenText
from deployments.viewer import add_viewer
from engine.delegation import Delegated
from engine.tokenizer import load_tokenizer

keep_replica_grpc_on_loopback()  # a replica on a loopback node listens on loopback only

# The route groups of an ingress replica, by the attribute that holds each
ROUTE_GROUPS: dict[str, type[RouteGroup]] = {"sglang": SGLangRoutes, "openai": OpenAIRoutes, "rl": RLRoutes,
                                             "admin": AdminRoutes}
REQUEST_MODELS = (GenerateRequest, NativeGenerateRequest, CompletionRequest, ChatCompletionRequest, DecisionRequest)

app = FastAPI(title="blockserve", version="0.1.0", docs_url=None, redoc_url=None, openapi_url="/openapi.json",
              description="Diffusion (SDAR, LLaDA2, Fast-dLLM v2, DiffusionGemma) and autoregressive "
                          "(Qwen3, Qwen3-MoE) inference: "
                          "SGLang-style /generate, OpenAI completions "
                          "and chat. Errors: `{\"error\": {\"message\", \"type\", \"param\"}}`.")


class IngressReplica:
    """One ingress replica: its engine client, its HTTP plumbing and its route groups; the methods
    FastAPI and the handles call are added below, from the groups. Serve deploys it as `Ingress`."""

    def __init__(self, engine: DeploymentHandle, model: str, served_model_name: str | None = None,
                 max_batch_size: int = 16, batch_wait_timeout_s: float = 0.005, api_key: str | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_concurrent_requests: int | None = None,
                 retry_after_s: int = RETRY_AFTER_S, incremental_streaming_output: bool = False,
                 enable_memory_saver: bool = False):
        name = served_model_name or model.rstrip("/").split("/")[-1]
        self.metrics = IngressMetrics(name, lambda: self.http.slots.in_flight)
        self.http = HttpServing(api_key or None, max_body_bytes,
                                Slots(max_concurrent_requests, self.metrics.rejected.inc), retry_after_s, self.metrics)
        self.client = EngineClient(engine, self.metrics, max_batch_size, batch_wait_timeout_s)
        tokenizer = load_tokenizer(model)
        token_text = TokenText(tokenizer)
        # SGLang's flags: /generate streams deltas instead of cumulative chunks; the memory saver as
        # /server_info reports it
        self.sglang = SGLangRoutes(self.client, self.http, name, app.version, token_text,
                                   incremental_streaming_output, enable_memory_saver)
        self.openai = OpenAIRoutes(self.client, self.http, name, model, tokenizer, token_text, int(time.time()))
        self.rl = RLRoutes(self.client, self.http)
        self.admin = AdminRoutes(self.client, self.http)


def _endpoint(held: str, name: str) -> Callable[..., Awaitable[Response]]:
    """The ingress method FastAPI calls for a route: the method `name` of the route group `held`.

    NOTE: `@serve.ingress(app)` binds the routes whose endpoints are methods of IngressReplica to the
    replica, and cloudpickles the app (with its routes) when the class is decorated, so every endpoint
    and handler must be importable by reference: these are attributes of IngressReplica under their
    own qualified names, the others module-level functions."""

    async def endpoint(self, request: Request) -> Response:
        return await getattr(getattr(self, held), name)(request)

    endpoint.__name__, endpoint.__qualname__ = name, f"{IngressReplica.__qualname__}.{name}"
    return endpoint


for _held, _group in ROUTE_GROUPS.items():
    for _route in _group.ROUTES:
        if not hasattr(IngressReplica, _route.endpoint):  # one endpoint may answer several paths
            setattr(IngressReplica, _route.endpoint, _endpoint(_held, _route.endpoint))
        app.add_api_route(_route.path, getattr(IngressReplica, _route.endpoint), methods=list(_route.methods),
                          **_route.options)
    for _name in _group.HANDLES:
        setattr(IngressReplica, _name, Delegated(_held, _name))
app.openapi = functools.partial(openapi_schema, app, REQUEST_MODELS)
add_docs(app)
add_viewer(app)


@app.exception_handler(StarletteHTTPException)
async def _http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request_error")
    # exc.headers carries the Allow header of a 405
    return error_response(ApiError(f"{request.method} {request.url.path}: {exc.detail}", None,
                                   exc.status_code, kind), headers=exc.headers)


Ingress = serve.deployment(name="Ingress", max_ongoing_requests=1024)(serve.ingress(app)(IngressReplica))
