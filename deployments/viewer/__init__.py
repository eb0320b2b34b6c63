"""The denoising viewer: `GET /viewer`, a static page (HTML, JS, CSS shipped in `static/`, no CDN)
that sends `/generate` requests with the step trace and draws each generated position as the step
that writes it arrives; it also opens saved traces (docs/viewer.md).

Only static files are served here, with what the page needs to know put into it: the decoding knobs
each paradigm reads (from `configs.knobs`, so that the page offers a model the knobs its paradigm
reads), and on an application of several models (deployments.llm) the models and the one the page
shows. The page itself talks to the ingress's own routes, so this module holds no model or engine
code. Like /docs, the page needs no API key; the page asks the user for one and sends it with its
requests.

On an application of several models the front ingress serves the page (`models_page`: the model of
`?model=`, else the first, with a picker of the others) and its files (`add_viewer_files`: they are
the same for every model); the page sends `?model=` with every request, its files included.
"""

from __future__ import annotations

import functools
import html
import json
import re
import urllib.parse
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, Response

from configs.knobs import KNOBS, PARADIGMS, Knob, rules_of
from deployments.errors import ApiError
from deployments.http import error_response

STATIC = Path(__file__).resolve().parent / "static"
ASSETS = frozenset(p.name for p in STATIC.iterdir() if p.suffix in (".js", ".css"))
_BASE = re.compile(r'<base href="[^"]*">')
_CONFIG = re.compile(r'(<script type="application/json" id="viewer-config">)[^<]*(</script>)')
_ASSET = re.compile(r'(href|src)="viewer/static/([\w.-]+)"')
_MODULE = '<script type="module"'
NO_CACHE = {"Cache-Control": "no-cache"}

def _input(knob: Knob, paradigm: str) -> dict[str, Any]:
    """How the page's input for `knob` takes its value: `kind` int, float, choice (with `choices`: for the
    unmasking rule, those of `paradigm`) or json (a value read as JSON where it parses, else as text), and
    `min` / `max` from its bounds."""
    choices, kind = knob.choices(paradigm), knob.value_type
    if choices is not None:
        return {"kind": "choice", "choices": choices}
    if kind in (int, float):
        bounds = knob.bounds
        low = bounds.get("ge", bounds.get("gt"))
        high = bounds.get("le", bounds.get("lt"))
        return {"kind": kind.__name__, **({"min": low} if low is not None else {}),
                **({"max": high} if high is not None else {})}
    return {"kind": "json"}


def offered(paradigm: str) -> list[Knob]:
    """The knobs the row offers a model of `paradigm`: the per-request knobs it reads, in the table's order,
    but those a request may only repeat (`fixed`: the block length, which the page's header shows)."""
    return [k for k in KNOBS.values() if paradigm in k.used_by and k.per_request and not k.fixed]


@functools.cache
def knob_table() -> dict[str, list[dict[str, Any]]]:
    """Per paradigm (`configs.knobs.PARADIGMS`), the knobs its row offers (`offered`): `name`, `label`,
    `doc`, `rules` (the rules of the paradigm that read it; None: all of them) and how its input takes a
    value (`_input`)."""
    table = {}
    for paradigm in PARADIGMS:
        rules = set(rules_of(paradigm))
        table[paradigm.value] = [
            {"name": k.name, "label": k.label, "doc": k.request_doc or k.doc,
             "rules": None if k.rules is None else [r for r in k.rules if r in rules], **_input(k, paradigm)}
            for k in offered(paradigm)]
    return table


def _script_json(value: Any) -> str:
    """JSON to put inside a <script> element (no `</script>` can end it early)."""
    return json.dumps(value).replace("<", "\\u003c")


def _page(root: str, models: list[str] | None = None, model: str | None = None, defaulted: bool = False) -> str:
    """index.html with its <base> at the application's root, so the page's relative URLs (its assets,
    /generate, /server_info) resolve under the route prefix the application is served at, and the page's
    configuration: the knob table and (several models) the models and the one shown, which every URL
    of the page then names, its files' (the module imports too, through an import map) included."""
    page = _BASE.sub(f'<base href="{root}/">', (STATIC / "index.html").read_text(), count=1)
    config = {"knobs": knob_table(), "models": models or [], "model": model, "defaulted": defaulted}
    page = _CONFIG.sub(lambda m: m[1] + _script_json(config) + m[2], page, count=1)
    if model is None:
        return page
    query = "?" + urllib.parse.urlencode({"model": model})
    page = _ASSET.sub(lambda m: f'{m[1]}="viewer/static/{m[2]}{html.escape(query)}"', page)
    imports = {f"{root}/viewer/static/{name}": f"{root}/viewer/static/{name}{query}"
               for name in sorted(ASSETS) if name.endswith(".js")}
    import_map = f'<script type="importmap">{_script_json({"imports": imports})}</script>\n'
    return page.replace(_MODULE, import_map + _MODULE, 1)


async def viewer_page(request: Request) -> HTMLResponse:
    """GET /viewer: the page (its query string may start a request; see docs/viewer.md)."""
    return HTMLResponse(_page(request.scope.get("root_path", "").rstrip("/")), headers=NO_CACHE)


def models_page(request: Request, models: list[str]) -> Response:
    """GET /viewer on an application of several models: the page of the model `?model=` names, else of the
    first (the page says so, and offers the others); an unknown model is a 404 naming the served ones."""
    model = request.query_params.get("model")
    if model is not None and model not in models:
        served = ", ".join(repr(m) for m in models)
        return error_response(ApiError(f"model {model!r} is not served here; the served models are {served}",
                                       "model", 404, "model_not_found"))
    root = request.scope.get("root_path", "").rstrip("/")
    return HTMLResponse(_page(root, models, model or models[0], defaulted=model is None), headers=NO_CACHE)


async def viewer_asset(request: Request) -> Response:
    """GET /viewer/static/{name}: one of the page's files (only those: no other path is served)."""
    name = request.path_params["name"]
    if name not in ASSETS:
        return error_response(ApiError(f"no such file: {name}", None, 404, "not_found"))
    return FileResponse(STATIC / name, headers=NO_CACHE)


def add_viewer_files(app: FastAPI) -> None:
    """Register the route of the page's files alone (an application of several models: its front ingress
    serves them, for whichever model the page shows)."""
    app.add_route("/viewer/static/{name}", viewer_asset, include_in_schema=False)


def add_viewer(app: FastAPI) -> None:
    """Register the viewer's routes (kept out of /openapi.json: they serve a page, not an API)."""
    app.add_route("/viewer", viewer_page, include_in_schema=False)
    add_viewer_files(app)
