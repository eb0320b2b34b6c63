"""The reference table of every EngineConfig and GenerationConfig field, generated from the pydantic
models: `python -m configs.reference > docs/config-reference.md` (a test checks it is current)."""

from __future__ import annotations

import types
import typing

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from configs import EngineConfig, GenerationConfig

_BOUNDS = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<", "min_length": "min length", "max_length": "max length"}


def type_name(annotation: typing.Any) -> str:
    """A field's type as a reader writes it: `int | None`, `"cpu" | "cuda"`, `list[str]`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(f'"{v}"' if isinstance(v, str) else repr(v) for v in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', origin)}[{', '.join(type_name(a) for a in args)}]"
    return "None" if annotation is type(None) else getattr(annotation, "__name__", str(annotation))


def _bounds(info: FieldInfo) -> str:
    out = []
    for meta in info.metadata:
        out += [f"{sign} {getattr(meta, key)}" for key, sign in _BOUNDS.items() if getattr(meta, key, None) is not None]
    return ", ".join(out)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(model: type[BaseModel]) -> str:
    rows = ["| field | type | default | bounds | meaning |", "|---|---|---|---|---|"]
    for name, info in model.model_fields.items():
        default = info.get_default(call_default_factory=True)
        rows.append(f"| `{name}` | {_cell(type_name(info.annotation))} | `{default!r}` | {_bounds(info)} | "
                    f"{_cell(info.description or '')} |")
    return "\n".join(rows)


def reference() -> str:
    parts = ["# Configuration reference", "",
             "Generated from the pydantic models by `python -m configs.reference > docs/config-reference.md`; "
             "do not edit by hand.", ""]
    for model, intro in ((EngineConfig, "One per engine replica: `EngineConfig(...)`, `engine:` in serve_config.yaml "
                          "and the presets, `--kebab-case` flags of `blockserve serve`."),
                         (GenerationConfig, "One per request: `GenerationConfig(...)` offline; the HTTP fields map "
                          "onto it as docs/api.md lists.")):
        parts += [f"## {model.__name__}", "", intro, "", " ".join((model.__doc__ or "").split()), "", table(model), ""]
    return "\n".join(parts)


if __name__ == "__main__":
    print(reference(), end="")
