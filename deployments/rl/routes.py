"""The RL control routes (the ingress's route group `RLRoutes`): from the table of control operations
(`deployments.rl.protocol.CONTROL_OPS`) come both the HTTP route of each (`POST /<name>`, the JSON
body as the payload) and its handle method `<name>(dict)` (the same payload as one dict), answering
the same JSON (a refusal is `{"success": false, "message", "error"}`)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from deployments.engine_client import EngineClient
from deployments.errors import ApiError
from deployments.http import ENGINE_ERRORS, HttpServing, Route
from deployments.rl.control import ReplicaControl
from deployments.rl.protocol import CONTROL_OPS, ControlOp


class RLRoutes:
    """SGLang's RL control on every engine replica (`control`), and the weights being served."""

    ROUTES = (
        # The control routes stay out of /openapi.json: they change the state of every replica (pause,
        # release, new weights), so schema-driven clients and fuzzers must not call them blindly.
        *(Route(f"/{op.name}", f"http_{op.name}", op.methods, dict(include_in_schema=False, summary=op.summary))
          for op in CONTROL_OPS.values()),
        Route("/get_weight_version", "http_get_weight_version", ("GET",),
              dict(responses=ENGINE_ERRORS, summary="RL: the weights being served")),
    )
    HANDLES = (*CONTROL_OPS, "get_weight_version")

    def __init__(self, client: EngineClient, http: HttpServing):
        self.client = client
        self.http = http
        self.control = ReplicaControl(client.broadcast, self._op_timeout_s)

    async def _op_timeout_s(self) -> float:
        return float((await self.client.info()).weight_op_timeout_s)

    async def _control_route(self, request: Request, op: ControlOp) -> Response:
        async def handler(payload: Any = None) -> Response:
            return JSONResponse(await self.control.run(op.name, payload))

        return await self.http.serve(request, f"/{op.name}", handler, body=op.body)

    async def _control_handle(self, name: str, body: dict[str, Any] | None) -> dict[str, Any]:
        self.http.metrics.request(f"handle:{name}", 0)
        try:
            return await self.control.run(name, body)
        except ApiError as e:
            return e.to_dict()

    async def http_get_weight_version(self, request: Request) -> Response:
        async def version() -> Response:
            return JSONResponse(await self.get_weight_version())

        return await self.http.serve(request, "/get_weight_version", version, body=False)

    async def get_weight_version(self, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """`{"weight_version"}` (a list when the replicas disagree, e.g. one restarted since an update).
        Takes the HTTP route's (empty) JSON like every control method."""
        return {"weight_version": await self.client.weight_version()}


def _add_control_methods(op: ControlOp) -> None:
    """RLRoutes.http_<name> (the HTTP route's answer) and RLRoutes.<name> (the handle method) for one
    control operation."""

    async def http_endpoint(self: RLRoutes, request: Request) -> Response:
        return await self._control_route(request, op)

    async def handle_method(self: RLRoutes, body: dict[str, Any] | None = None) -> dict[str, Any]:
        return await self._control_handle(op.name, body)

    handle_method.__doc__ = f"{op.summary}: the payload and answer of `POST /{op.name}`."
    for name, fn in ((f"http_{op.name}", http_endpoint), (op.name, handle_method)):
        fn.__name__, fn.__qualname__ = name, f"{RLRoutes.__qualname__}.{name}"
        setattr(RLRoutes, name, fn)


for _op in CONTROL_OPS.values():
    _add_control_methods(_op)
