"""The RL control routes: ONE table declares each control call once; from it come both the HTTP
route (`POST /<name>`, the JSON body as the payload) and the ingress handle method `<name>(dict)`
(the same payload as one dict), answering the same JSON (a refusal is `{"success": false,
"message", "error"}`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from deployments.engine_client import EngineClient
from deployments.errors import ApiError
from deployments.http import ENGINE_ERRORS, HttpServing, Route
from deployments.rl.control import ReplicaControl


@dataclass(frozen=True)
class ControlRoute:
    name: str  # SGLang's route and method name
    summary: str
    methods: tuple[str, ...] = ("POST",)
    body: bool = True  # whether the route reads a JSON body (those without one take none)


CONTROL_ROUTES = (
    ControlRoute("update_weights_from_disk", "RL: load a checkpoint on every replica"),
    ControlRoute("update_weights_from_tensor", "RL: handle only (tensors travel by Ray)"),
    ControlRoute("init_weights_update_group", "RL: join the trainer's broadcast group"),
    ControlRoute("update_weights_from_distributed", "RL: receive weights by broadcast"),
    ControlRoute("destroy_weights_update_group", "RL: leave the broadcast group"),
    ControlRoute("flush_cache", "RL: drop the prefix cache", ("GET", "POST"), body=False),
    ControlRoute("pause_generation", "RL: stop generating (abort | retract | in_place)"),
    ControlRoute("continue_generation", "RL: generate again after pause_generation", body=False),
    ControlRoute("release_memory_occupation", "RL: free weights and/or KV cache"),
    ControlRoute("resume_memory_occupation", "RL: restore weights and/or KV cache"),
)


class RLRoutes(HttpServing, EngineClient):
    """SGLang's RL control on every engine replica. `_init_control()` sets it up."""

    ROUTES = (
        # The control routes stay out of /openapi.json: they change the state of every replica (pause,
        # release, new weights), so schema-driven clients and fuzzers must not call them blindly.
        *(Route(f"/{r.name}", f"http_{r.name}", r.methods, dict(include_in_schema=False, summary=r.summary))
          for r in CONTROL_ROUTES),
        Route("/get_weight_version", "http_get_weight_version", ("GET",),
              dict(responses=ENGINE_ERRORS, summary="RL: the weights being served")),
    )

    def _init_control(self) -> None:
        self.control = ReplicaControl(self._broadcast, self._op_timeout_s)

    async def _op_timeout_s(self) -> float:
        return float((await self._engine_info()).weight_op_timeout_s)

    async def _control_route(self, request: Request, route: ControlRoute) -> Response:
        async def handler(payload: Any = None) -> Response:
            return JSONResponse(await self.control.run(route.name, payload))

        return await self._serve(request, f"/{route.name}", handler, body=route.body)

    async def _control_handle(self, name: str, body: dict[str, Any] | None) -> dict[str, Any]:
        self.metrics.request(f"handle:{name}", 0)
        try:
            return await self.control.run(name, body)
        except ApiError as e:
            return e.to_dict()

    async def http_get_weight_version(self, request: Request) -> Response:
        async def version() -> Response:
            return JSONResponse(await self.get_weight_version())

        return await self._serve(request, "/get_weight_version", version, body=False)

    async def get_weight_version(self, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """`{"weight_version"}` (a list when the replicas disagree, e.g. one restarted since an update).
        Takes the HTTP route's (empty) JSON like every control method."""
        return {"weight_version": await self._weight_version()}


def _add_control_methods(route: ControlRoute) -> None:
    """RLRoutes.http_<name> (the HTTP endpoint) and RLRoutes.<name> (the handle method) for one route,
    named as class attributes so that cloudpickle (the app travels to the ingress replicas by it)
    finds them by reference."""

    async def http_endpoint(self, request: Request) -> Response:
        return await self._control_route(request, route)

    async def handle_method(self, body: dict[str, Any] | None = None) -> dict[str, Any]:
        return await self._control_handle(route.name, body)

    handle_method.__doc__ = f"{route.summary}: the payload and answer of `POST /{route.name}`."
    for name, fn in ((f"http_{route.name}", http_endpoint), (route.name, handle_method)):
        fn.__name__, fn.__qualname__ = name, f"{RLRoutes.__qualname__}.{name}"
        setattr(RLRoutes, name, fn)


for _route in CONTROL_ROUTES:
    _add_control_methods(_route)
