"""The engine settings a GPU run varies for the model parts: the attention backend, the KV page size,
CUDA graphs, and any EngineConfig field through `--set FIELD=VALUE`."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from configs import EngineConfig


@dataclass(frozen=True)
class EngineChoice:
    """The engine settings a GPU run varies for the model parts; `overrides` are applied last."""

    attention: str = "auto"
    kv_block_size: int = 16
    cuda_graphs: bool = True
    overrides: dict[str, Any] = field(default_factory=dict)

    def config(self, **fields: Any) -> EngineConfig:
        """A part's EngineConfig: its own `fields`, then this choice's settings, then the overrides."""
        return EngineConfig(**{**fields, "attention_backend": self.attention, "kv_block_size": self.kv_block_size,
                               "cuda_graphs": self.cuda_graphs, **self.overrides})


def parse_override(text: str) -> tuple[str, Any]:
    """`FIELD=VALUE` -> (field, value): the value read as JSON (`true`, `4096`, `0.5`, `null`), else as the
    string itself (`flex`); checked against EngineConfig's field alone, so a typo fails before any part runs."""
    name, sep, raw = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r}: expected FIELD=VALUE")
    if name not in EngineConfig.model_fields:
        raise argparse.ArgumentTypeError(f"unknown EngineConfig field {name!r} (fields: "
                                         f"{', '.join(EngineConfig.model_fields)})")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    try:
        EngineConfig(**{name: value})
    except ValidationError as exc:
        raise argparse.ArgumentTypeError(f"{name}={raw!r}: {exc.errors()[0]['msg']}") from None
    return name, value
