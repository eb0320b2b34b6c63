"""One HTTP request passed whole from the application's front ingress to a model's ingress.

`ModelIngress` is the model's ordinary ingress (every route, protocol and error the single-model
application has) plus one handle method, `forward`, that runs a request through those routes and
streams back its ASGI messages; `ForwardedResponse` replays them to the client. Serve allows one HTTP
ingress per application, so a model's ingress is the ingress replica's class without Serve's HTTP
wrapper (`IngressReplica`): the routes of deployments.ingress's FastAPI app, called in-process, find it
as the replica's object. The request's body and headers pass unchanged, so answers (JSON, Server-Sent
Events, errors, status codes) are exactly the model's own.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from starlette.requests import Request
from starlette.responses import Response

from deployments.ingress import IngressReplica, app

# the parts of an HTTP request's ASGI scope a route reads
SCOPE_KEYS = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path", "root_path", "query_string",
              "headers", "client", "server")


def forwarded_scope(request: Request, **changes: Any) -> dict[str, Any]:
    """A request's ASGI scope as plain data (what crosses to another replica), with `changes`."""
    scope = {key: request.scope[key] for key in SCOPE_KEYS if key in request.scope}
    scope["headers"] = [(bytes(k), bytes(v)) for k, v in scope.get("headers", [])]
    return scope | changes


@serve.deployment(max_ongoing_requests=1024)
class ModelIngress(IngressReplica):
    """A model's ingress inside a several-model application."""

    async def forward(self, scope: dict[str, Any], body: bytes) -> AsyncIterator[dict[str, Any]]:
        """Run one request through this ingress's routes; yield its ASGI response messages."""
        messages: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        sent_body = False

        async def receive() -> dict[str, Any]:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # the client stays until this call is cancelled
            return {"type": "http.disconnect"}

        async def run() -> None:
            try:
                await app(scope, receive, messages.put)
            finally:
                messages.put_nowait(None)

        task = asyncio.ensure_future(run())
        try:
            while (message := await messages.get()) is not None:
                yield message
            await task  # raises what the app raised
        finally:
            task.cancel()


class ForwardedResponse(Response):
    """Replays a model ingress's ASGI messages (its status, headers and body, streamed as sent)."""

    def __init__(self, start: dict[str, Any], rest: Any):
        self.status_code = start["status"]
        self.start = start
        self.rest = rest
        self.background = None

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send(self.start)
            async for message in self.rest:
                await send(message)
        finally:
            self.rest.cancel()
