"""Admin routes (the ingress's route group `AdminRoutes`): /health, /metrics (Prometheus), the engine
stats handle method; and the OpenAPI document (FastAPI's, plus the request models the generation
routes validate themselves) and its Swagger UI at /docs, served from the files `swagger-ui-bundle`
ships (no CDN: it works offline)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import swagger_ui_bundle
from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse, Response

from deployments.engine_client import EngineClient
from deployments.http import ERRORS, HttpServing, Route
from deployments.wire import MetricFamilies


class AdminRoutes:
    """The ingress's health, metrics and engine stats."""

    ROUTES = (
        Route("/health", "http_health", ("GET",), dict(
            responses={503: {"description": "an engine replica is unhealthy, or none runs",
                             "content": {"application/json": {}}}},
            summary="200 when every engine replica is healthy, else 503")),
        # its refusals are JSON (the route's own answer is text, so FastAPI would document them as text)
        Route("/metrics", "http_metrics", ("GET",), dict(
            responses={401: {"description": ERRORS[401]["description"], "content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}},
            response_class=PlainTextResponse, summary="Prometheus metrics (text exposition)")),
    )
    HANDLES = ("engine_stats",)

    def __init__(self, client: EngineClient, http: HttpServing):
        self.client = client
        self.http = http

    async def http_health(self, request: Request) -> Response:
        async def health() -> Response:
            try:
                replicas = await self.client.broadcast("check_health")
            except Exception as e:  # noqa: BLE001 - any failure is "unhealthy"
                return JSONResponse({"status": "unhealthy", "error": f"{type(e).__name__}: {e}"}, status_code=503)
            if not replicas:
                return JSONResponse({"status": "unhealthy", "error": "no engine replica is running"}, status_code=503)
            return JSONResponse({"status": "ok", "engine_replicas": len(replicas)})

        return await self.http.serve(request, "/health", health, auth=False, body=False)

    async def http_metrics(self, request: Request) -> Response:
        async def metrics() -> Response:
            stats, families = await asyncio.gather(self.client.replica_stats(),
                                                   self.client.broadcast("metric_families", return_exceptions=True))
            by_replica = {f.replica: f.families for f in families if isinstance(f, MetricFamilies)}
            text = self.http.metrics.render(stats, by_replica)
            return Response(text, media_type=CONTENT_TYPE_LATEST)

        return await self.http.serve(request, "/metrics", metrics, body=False)

    # ---- handle API ------------------------------------------------------------------------
    async def engine_stats(self) -> list[dict[str, Any]]:
        """Per-replica engine stats (kv_pages_free, running, generated_tokens, ...), as JSON."""
        return [s.to_dict() for s in await self.client.broadcast("stats")]


def openapi_schema(app: FastAPI, request_models: tuple[type[BaseModel], ...]) -> dict[str, Any]:
    """FastAPI's schema plus the request models the routes name in their requestBody (they validate
    the raw body themselves, so FastAPI does not see the models)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        _, top = models_json_schema([(m, "validation") for m in request_models],
                                    ref_template="#/components/schemas/{model}")
        schema.setdefault("components", {}).setdefault("schemas", {}).update(top.get("$defs", {}))
        app.openapi_schema = schema
    return app.openapi_schema


SWAGGER_UI = Path(swagger_ui_bundle.swagger_ui_path)
SWAGGER_ASSETS = frozenset(p.name for p in SWAGGER_UI.iterdir() if p.suffix in (".js", ".css", ".png"))


async def swagger_ui(request: Request) -> HTMLResponse:
    """GET /docs: Swagger UI for /openapi.json (both under the application's route prefix)."""
    root = request.scope.get("root_path", "").rstrip("/")
    return get_swagger_ui_html(openapi_url=f"{root}/openapi.json", title="blockserve - Swagger UI",
                               swagger_js_url=f"{root}/docs/static/swagger-ui-bundle.js",
                               swagger_css_url=f"{root}/docs/static/swagger-ui.css",
                               swagger_favicon_url=f"{root}/docs/static/favicon-32x32.png")


async def swagger_asset(request: Request) -> Response:
    """GET /docs/static/{name}: one of the Swagger UI files (only those: no other path is served)."""
    name = request.path_params["name"]
    if name not in SWAGGER_ASSETS:
        return JSONResponse({"error": {"message": f"no such file: {name}", "type": "not_found", "param": None}},
                            status_code=404)
    return FileResponse(SWAGGER_UI / name)


def add_docs(app: FastAPI) -> None:
    """Swagger UI without a CDN. Like /openapi.json, it needs no API key (it holds no data)."""
    app.add_route("/docs", swagger_ui, include_in_schema=False)
    app.add_route("/docs/static/{name}", swagger_asset, include_in_schema=False)
