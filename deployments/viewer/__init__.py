"""The denoising viewer: `GET /viewer`, a static page (HTML, JS, CSS shipped in `static/`, no CDN)
that sends `/generate` requests with the step trace and draws each generated position as the step
that writes it arrives; it also opens saved traces (docs/viewer.md).

Only static files are served here: the page itself talks to the ingress's own routes, so this
module holds no model or engine code. Like /docs, the page needs no API key; the page asks the user
for one and sends it with its requests."""

from __future__ import annotations

import re
from pathlib import Path

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, Response

from deployments.errors import ApiError
from deployments.http import error_response

STATIC = Path(__file__).resolve().parent / "static"
ASSETS = frozenset(p.name for p in STATIC.iterdir() if p.suffix in (".js", ".css"))
_BASE = re.compile(r'<base href="[^"]*">')


def _page(root: str) -> str:
    """index.html with its <base> at the application's root, so the page's relative URLs (its
    assets, /generate, /server_info) resolve under the route prefix the application is served at."""
    return _BASE.sub(f'<base href="{root}/">', (STATIC / "index.html").read_text(), count=1)


async def viewer_page(request: Request) -> HTMLResponse:
    """GET /viewer: the page (its query string may start a request; see docs/viewer.md)."""
    return HTMLResponse(_page(request.scope.get("root_path", "").rstrip("/")),
                        headers={"Cache-Control": "no-cache"})


async def viewer_asset(request: Request) -> Response:
    """GET /viewer/static/{name}: one of the page's files (only those: no other path is served)."""
    name = request.path_params["name"]
    if name not in ASSETS:
        return error_response(ApiError(f"no such file: {name}", None, 404, "not_found"))
    return FileResponse(STATIC / name, headers={"Cache-Control": "no-cache"})


def add_viewer(app: FastAPI) -> None:
    """Register the viewer's routes (kept out of /openapi.json: they serve a page, not an API)."""
    app.add_route("/viewer", viewer_page, include_in_schema=False)
    app.add_route("/viewer/static/{name}", viewer_asset, include_in_schema=False)
