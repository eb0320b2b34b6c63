"""Both executors implement the engine's `Executor` Protocol member for member, with its signatures,
and every member of the Protocol says what it does (a new executor is written against it)."""

from __future__ import annotations

import inspect

import pytest

from engine.executor.base import Executor
from engine.executor.local import LocalExecutor
from engine.executor.ray_tp import RayTPExecutor

MEMBERS = [n for n, v in vars(Executor).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))]


def test_the_protocol_documents_every_member():
    assert set(MEMBERS) == {"num_pages", "kv_groups", "set_dllm_block_length", "execute", "run_on_ranks", "describe",
                            "shutdown"}
    for name in MEMBERS:
        member = vars(Executor)[name]
        assert inspect.getdoc(member.fget if isinstance(member, property) else member), name


@pytest.mark.parametrize("cls", [LocalExecutor, RayTPExecutor])
def test_each_executor_has_every_member_with_the_protocol_signature(cls):
    for name in MEMBERS:
        want, have = vars(Executor)[name], getattr(cls, name, None)
        assert have is not None, f"{cls.__name__} lacks {name}"
        if isinstance(want, property):
            assert isinstance(have, property), f"{cls.__name__}.{name} must be a property"
            continue
        assert inspect.signature(have) == inspect.signature(want), f"{cls.__name__}.{name}"
