"""The front ingress of a several-model application: routes each request to its model's ingress.

The model is OpenAI's `model` field of the JSON body, else the `model` query parameter, else the
only model when there is one; an unknown model is a 404 naming it and the served models. `GET
/v1/models` lists every model (each model ingress's own entry) and `GET /v1/models/{model}` answers
one. Everything else (completions, chat, SGLang's /generate, the RL control routes, /health, ...)
is the model ingress's own answer, passed through unchanged.
"""

# No `from __future__ import annotations`: Serve pickles these route methods by value, and FastAPI
# must see their `Request` annotations as the class itself, not as a name to look up.
import json
from typing import Any

from fastapi import FastAPI, Request
from ray import serve
from starlette.responses import JSONResponse, Response

from deployments.errors import ApiError
from deployments.http import error_response
from deployments.llm.forwarding import ForwardedResponse, forwarded_scope

router_app = FastAPI(title="blockserve (several models)", docs_url=None, redoc_url=None, openapi_url=None)
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]


def requested_model(body: bytes, request: Request) -> str | None:
    """OpenAI's `model` of a JSON object body, else `?model=`."""
    try:
        parsed = json.loads(body) if body else None
    except ValueError:  # not JSON: the model ingress answers that
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("model"), str):
        return parsed["model"]
    return request.query_params.get("model")


@serve.deployment(max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0.25})
@serve.ingress(router_app)
class ModelRouter:
    def __init__(self, models: dict[str, Any]):
        self.models = models  # model id -> its ModelIngress handle

    def _handle(self, model: str | None) -> Any:
        if model is None and len(self.models) == 1:
            return next(iter(self.models.values()))
        served = ", ".join(repr(m) for m in self.models)
        if model is None:
            raise ApiError(f"this server serves several models ({served}): name one in the body's `model` field or "
                           "with ?model=", "model")
        if model not in self.models:
            raise ApiError(f"model {model!r} is not served here; the served models are {served}", "model", 404,
                           "model_not_found")
        return self.models[model]

    async def _forward(self, handle: Any, scope: dict[str, Any], body: bytes) -> ForwardedResponse:
        stream = handle.options(stream=True).forward.remote(scope, body)
        return ForwardedResponse(await stream.__anext__(), stream)

    async def _model_entries(self, request: Request, handle: Any) -> tuple[Response | None, list[dict[str, Any]]]:
        """A model ingress's `/v1/models` entries, or its refusal (e.g. a wrong API key)."""
        scope = forwarded_scope(request, method="GET", path=request.scope.get("root_path", "") + "/v1/models",
                                query_string=b"")
        messages = [m async for m in handle.options(stream=True).forward.remote(scope, b"")]
        status = messages[0]["status"]
        body = b"".join(m.get("body", b"") for m in messages[1:])
        if status != 200:
            return Response(body, status_code=status, headers={"content-type": "application/json"}), []
        return None, json.loads(body)["data"]

    @router_app.get("/v1/models")
    async def list_models(self, request: Request) -> Response:
        data = []
        for handle in self.models.values():
            refused, entries = await self._model_entries(request, handle)
            if refused is not None:
                return refused
            data += entries
        return JSONResponse({"object": "list", "data": data})

    @router_app.get("/v1/models/{model:path}")
    async def get_model(self, request: Request, model: str) -> Response:
        try:
            handle = self._handle(model)
        except ApiError as e:
            return error_response(e)
        refused, entries = await self._model_entries(request, handle)
        return refused if refused is not None else JSONResponse(entries[0])

    @router_app.api_route("/{path:path}", methods=METHODS, include_in_schema=False)
    async def route(self, request: Request, path: str) -> Response:
        body = await request.body()
        try:
            handle = self._handle(requested_model(body, request))
        except ApiError as e:
            return error_response(e)
        return await self._forward(handle, forwarded_scope(request), body)
