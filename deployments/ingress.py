"""The HTTP ingress and the handle API (docs/api.md): the protocols' routes assembled into one
Serve deployment.

HTTP: SGLang's /generate (`sglang/`), OpenAI's /v1/* (`openai/`), the RL control routes (`rl/`),
/health and /metrics (`admin`), the denoising viewer page /viewer (`viewer/`). Each protocol's
routes mixin lists its routes (`ROUTES`), and this module adds them to the FastAPI app, as Ray Serve
LLM's `make_fastapi_ingress` does with its endpoint maps. Bad input is a 4xx
`{"error": {"message", "type", "param"}}`, never a 5xx.

Handles (other Ray jobs): `generate(dict) -> dict` returns exactly the HTTP unary JSON, and
`generate_stream(dict)` yields exactly the SSE deltas; the RL control methods take the HTTP route's
JSON as one dict; refusals come back as the same error JSON.

The ingress loads no model code: what it needs of the model comes from the engine replicas
(`EngineServer.model_info`), and the tokenizer is read from the checkpoint's tokenizer files.
"""

from __future__ import annotations

import functools
import time

from fastapi import FastAPI, Request
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from deployments.admin import AdminRoutes, add_docs, openapi_schema
from deployments.errors import ApiError
from deployments.http import DEFAULT_MAX_BODY_BYTES, RETRY_AFTER_S, Slots, error_response
from deployments.metrics import IngressMetrics
from deployments.openai.protocol import ChatCompletionRequest, CompletionRequest
from deployments.openai.routes import OpenAIRoutes
from deployments.rl.routes import RLRoutes
from deployments.sglang.protocol import GenerateRequest, NativeGenerateRequest
from deployments.sglang.routes import SGLangRoutes
from deployments.single_machine import keep_replica_grpc_on_loopback
from deployments.tokens import TokenText
from deployments.viewer import add_viewer
from engine.tokenizer import load_tokenizer

keep_replica_grpc_on_loopback()  # a replica on a loopback node listens on loopback only

ROUTE_MIXINS = (SGLangRoutes, OpenAIRoutes, RLRoutes, AdminRoutes)
REQUEST_MODELS = (GenerateRequest, NativeGenerateRequest, CompletionRequest, ChatCompletionRequest)

# NOTE: `@serve.ingress(app)` cloudpickles the app (with its routes) when the class is decorated, so
# every route endpoint and handler must be importable by reference: methods of the mixins above
# and module-level functions.
app = FastAPI(title="blockserve", version="0.1.0", docs_url=None, redoc_url=None, openapi_url="/openapi.json",
              description="Diffusion (SDAR, LLaDA2, Fast-dLLM v2, DiffusionGemma) and autoregressive "
                          "(Qwen3, Qwen3-MoE) inference: "
                          "SGLang-style /generate, OpenAI completions "
                          "and chat. Errors: `{\"error\": {\"message\", \"type\", \"param\"}}`.")
for _mixin in ROUTE_MIXINS:
    for _route in _mixin.ROUTES:
        app.add_api_route(_route.path, getattr(_mixin, _route.endpoint), methods=list(_route.methods),
                          **_route.options)
app.openapi = functools.partial(openapi_schema, app, REQUEST_MODELS)
add_docs(app)
add_viewer(app)


@app.exception_handler(StarletteHTTPException)
async def _http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request_error")
    # exc.headers carries the Allow header of a 405
    return error_response(ApiError(f"{request.method} {request.url.path}: {exc.detail}", None,
                                   exc.status_code, kind), headers=exc.headers)


@serve.deployment(max_ongoing_requests=1024)
@serve.ingress(app)
class Ingress(SGLangRoutes, OpenAIRoutes, RLRoutes, AdminRoutes):
    def __init__(self, engine, model: str, served_model_name: str | None = None, max_batch_size: int = 16,
                 batch_wait_timeout_s: float = 0.005, api_key: str | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_concurrent_requests: int | None = None,
                 retry_after_s: int = RETRY_AFTER_S, incremental_streaming_output: bool = False,
                 enable_memory_saver: bool = False):
        self.engine = engine
        self.model_path = model
        self.served_model_name = served_model_name or model.rstrip("/").split("/")[-1]
        self.api_key = api_key or None
        self.max_body_bytes = max_body_bytes
        self.retry_after_s = retry_after_s
        self.metrics = IngressMetrics(self.served_model_name, lambda: self.slots.in_flight)
        self.slots = Slots(max_concurrent_requests, self.metrics.rejected.inc)
        self.tokenizer = load_tokenizer(model)
        self.token_text = TokenText(self.tokenizer)
        self.created = int(time.time())
        self.version = app.version
        # SGLang's switch: /generate streams deltas instead of cumulative chunks
        self.incremental_streaming_output = incremental_streaming_output
        self.enable_memory_saver = enable_memory_saver  # SGLang's flag, as /server_info reports it
        self._init_engine_client(max_batch_size, batch_wait_timeout_s)
        self._init_control()
