"""The front ingress of a several-model application: routes each request to its model's ingress.

The model is OpenAI's `model` field of the JSON body, else the `model` query parameter, else the
only model when there is one; an unknown model is a 404 naming it and the served models. `GET
/v1/models` lists every model (each model ingress's own entry) and `GET /v1/models/{model}` answers
one. `GET /viewer` is the denoising viewer of the model `?model=` names, else of the first, with a
picker of the others (deployments.viewer). `GET /health` without a model is the application's
readiness: 200 when every model's /health answers 200, else the status of the first that does not
(503 with `Retry-After` while one loads), with each model's answer; `/health?model=NAME` is that
model's. Everything else (completions, chat, SGLang's /generate, the RL control routes, ...) is the
model ingress's own answer, passed through unchanged.
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
from deployments.viewer import add_viewer_files, models_page

router_app = FastAPI(title="blockserve (several models)", docs_url=None, redoc_url=None, openapi_url=None)
add_viewer_files(router_app)  # the viewer page's files, the same for every model (before the catch-all route)
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


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        parsed = json.loads(body)
    except ValueError:
        return {"body": body.decode("utf-8", "replace")}
    return parsed if isinstance(parsed, dict) else {"body": parsed}


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

    async def _get(self, request: Request, handle: Any, path: str) -> tuple[int, bytes, dict[str, str]]:
        """A model ingress's answer to `GET path` (the request's headers): status, body, headers."""
        scope = forwarded_scope(request, method="GET", path=request.scope.get("root_path", "") + path,
                                query_string=b"")
        messages = [m async for m in handle.options(stream=True).forward.remote(scope, b"")]
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in messages[0].get("headers", [])}
        return messages[0]["status"], b"".join(m.get("body", b"") for m in messages[1:]), headers

    async def _model_entries(self, request: Request, handle: Any) -> tuple[Response | None, list[dict[str, Any]]]:
        """A model ingress's `/v1/models` entries, or its refusal (e.g. a wrong API key)."""
        status, body, _ = await self._get(request, handle, "/v1/models")
        if status != 200:
            return Response(body, status_code=status, headers={"content-type": "application/json"}), []
        return None, json.loads(body)["data"]

    @router_app.get("/health")
    async def health(self, request: Request) -> Response:
        if "model" in request.query_params or len(self.models) == 1:
            return await self.route(request, "health")
        answers = {name: await self._get(request, handle, "/health") for name, handle in self.models.items()}
        models = {name: {"status_code": status, **_json_object(body)} for name, (status, body, _) in answers.items()}
        waiting = [(name, status, headers) for name, (status, _, headers) in answers.items() if status != 200]
        if not waiting:
            return JSONResponse({"status": "ok", "models": models})
        name, status, headers = waiting[0]
        retry = {"Retry-After": headers["retry-after"]} if "retry-after" in headers else None
        return JSONResponse({"status": "not ready", "error": {"message": f"model {name!r} is not ready (its /health "
                             f"answers {status})", "type": "not_ready", "param": "model"}, "models": models},
                            status_code=status, headers=retry)

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

    @router_app.get("/viewer", include_in_schema=False)
    async def viewer(self, request: Request) -> Response:
        """The denoising viewer of the model `?model=` names, else of the first, with a picker of the others."""
        return models_page(request, list(self.models))

    @router_app.api_route("/{path:path}", methods=METHODS, include_in_schema=False)
    async def route(self, request: Request, path: str) -> Response:
        body = await request.body()
        try:
            handle = self._handle(requested_model(body, request))
        except ApiError as e:
            return error_response(e)
        return await self._forward(handle, forwarded_scope(request), body)
