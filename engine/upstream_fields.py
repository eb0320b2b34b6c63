"""What the adapters for other engines' APIs (engine.lmdeploy, engine.jetengine) share: their
settings keep the other engine's names, so a refusal must name the caller's field, and a field for
a feature this engine lacks is accepted only at the value that asks for nothing."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)

HALF_DTYPES = ("float16", "bfloat16")


def refuse_unsupported(config: Any, unsupported: Mapping[str, Any]) -> None:
    """Each field named in `unsupported` (a feature this engine lacks) may only keep that value."""
    for name, default in unsupported.items():
        value = getattr(config, name)
        if value != default:
            raise ValueError(f"{type(config).__name__}.{name}={value!r} is not supported by this engine; "
                             f"leave it at {default!r}")


def validated(model: type[M], values: dict[str, Any], owner: str, names: Mapping[str, str]) -> M:
    """`model(**values)`; a refusal names `owner`'s field (`names`: this engine's name -> the caller's)."""
    try:
        return model(**values)
    except ValidationError as e:
        problems = [f"{owner}.{names.get(str(err['loc'][0]), err['loc'][0])}: {err['msg']}" if err["loc"]
                    else f"{owner}: {err['msg']}" for err in e.errors()]
        raise ValueError("; ".join(problems)) from None


def engine_dtype(dtype: str, on_cuda: bool) -> str:
    """The caller's dtype as EngineConfig's: a half dtype off CUDA runs in float32 (with one warning)."""
    if dtype in HALF_DTYPES and not on_cuda:
        warnings.warn(f"dtype={dtype!r}: half precision does not run on CPU here; running in float32", stacklevel=3)
        return "float32"
    return dtype
