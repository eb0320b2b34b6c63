"""The ingress and the async engine are built from collaborators: the RL control operations are declared
once (`deployments.rl.protocol.CONTROL_OPS`), and each is an HTTP route of the ingress, a handle method
of it (its RL route group's), and a method of AsyncEngine (the RLControl it holds); the other handle
methods are their route groups' own, with their coroutine or async-generator nature (which Serve reads)."""

from __future__ import annotations

import inspect

from fastapi.routing import APIRoute

from deployments.http import Route
from deployments.ingress import ROUTE_GROUPS, IngressReplica, app
from deployments.rl.protocol import CONTROL_OPS
from engine.async_engine import AsyncEngine
from engine.delegation import Delegated
from engine.rl_control import RLControl


def _routes() -> set[tuple[str, str, str]]:
    """Every (method, path, endpoint name) of the ingress's app (Serve nests them in an included router)."""
    found: set[tuple[str, str, str]] = set()

    def walk(routes) -> None:
        for r in routes:
            if isinstance(r, APIRoute):
                found.update((m, r.path, r.name) for m in r.methods)
            for attr in ("original_router", "router"):
                sub = getattr(r, attr, None)
                if sub is not None and hasattr(sub, "routes"):
                    walk(sub.routes)

    walk(app.routes)
    return found


def test_every_control_operation_is_a_route_a_handle_method_and_an_engine_method():
    routes = _routes()
    for op in CONTROL_OPS.values():
        assert {(m, f"/{op.name}", f"http_{op.name}") for m in op.methods} <= routes, op.name
        assert vars(IngressReplica)[op.name].held == "rl", op.name
        delegated = vars(AsyncEngine)[op.name]
        assert isinstance(delegated, Delegated) and delegated.held == "control", op.name
        assert inspect.iscoroutinefunction(getattr(RLControl, op.name)), op.name


def test_every_group_route_and_handle_method_is_the_ingress_own(tiny_checkpoints):
    ingress = IngressReplica(None, str(tiny_checkpoints["qwen3"]))
    routes = _routes()
    for held, group in ROUTE_GROUPS.items():
        for route in group.ROUTES:
            assert isinstance(route, Route) and any(r[1:] == (route.path, route.endpoint) for r in routes), route
            assert inspect.iscoroutinefunction(getattr(IngressReplica, route.endpoint)), route.endpoint
        for name in group.HANDLES:
            method = getattr(ingress, name)  # the group's own bound method
            assert method.__self__ is getattr(ingress, held) and method.__func__ is getattr(group, name), name
    assert inspect.isasyncgenfunction(ingress.generate_stream)
    assert inspect.iscoroutinefunction(ingress.generate) and inspect.iscoroutinefunction(ingress.pause_generation)
