"""`Delegated`: a method of an object's collaborator, offered as the object's own.

An object built from collaborators (the async engine and the RL control it holds, the ingress and its
route groups) keeps its public methods where its callers know them: `owner.<name>` is the bound method
`owner.<held>.<name>` itself, with its signature, its docstring and its coroutine or async-generator
nature (which Ray Serve reads when a handle calls it). Light: the ingress uses it too.
"""

from __future__ import annotations

from typing import Any


class Delegated:
    """A class attribute: `owner.<name>` is `owner.<held>.<name>` (`name`: the attribute's own name
    when not given)."""

    def __init__(self, held: str, name: str | None = None):
        self.held = held
        self.name = name

    def __set_name__(self, owner: type, name: str) -> None:
        if self.name is None:
            self.name = name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(getattr(obj, self.held), self.name)
