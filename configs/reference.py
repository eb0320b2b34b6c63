"""The reference table of every EngineConfig and GenerationConfig field, generated from the pydantic
models, and of the decoding knobs (which paradigms and rules read each, which are refused where),
generated from `configs.knobs`: `python -m configs.reference > docs/config-reference.md` (a test
checks it is current)."""

from __future__ import annotations

import types
import typing

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from configs import EngineConfig, GenerationConfig
from configs.knobs import ENGINE_WIDE_IGNORED, KNOBS, PARADIGMS, RULE_SPECS, Knob, RuleSpec

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


def _names(names) -> str:
    return ", ".join(f"`{n}`" for n in names)


def _refused_by(rule: RuleSpec) -> str:
    return ", ".join(["a sampling `temperature`"] * rule.greedy + [f"`{name}`" for name in rule.refuses])


def _refused_on(knob: Knob) -> str:
    return ", ".join(f"`{p}`" + (" (per request; engine-wide: ignored)" if p in ENGINE_WIDE_IGNORED else "")
                     for p in PARADIGMS if p not in knob.used_by)


def knob_tables() -> str:
    """Which paradigm reads which knob and rule, and where each knob is refused."""
    paradigms = ["| paradigm | meaning | unmasking rules |", "|---|---|---|"]
    paradigms += [f"| `{p}` | {_cell(doc)} | {_names(r.name for r in RULE_SPECS.values() if p in r.paradigms) or '-'} |"
                  for p, doc in PARADIGMS.items()]
    rules = ["| rule | paradigms | edits tokens | reveals | refuses (a 400 naming the field) |",
             "|---|---|---|---|---|"]
    rules += [f"| `{r.name}` | {_names(r.paradigms)} | {'yes' if r.edits else 'no'} | {_cell(r.doc)} | "
              f"{_refused_by(r) or '-'} |" for r in RULE_SPECS.values()]
    knobs = ["| knob | per request | read by (paradigms) | read by (rules) | refused on | under another rule |",
             "|---|---|---|---|---|---|"]
    knobs += [f"| `{k.name}` | {'yes' if k.per_request else 'engine-wide only'} | {_names(k.used_by)} | "
              f"{_names(k.rules) if k.rules else 'every rule'} | {_refused_on(k)} | "
              f"{'refused' if k.strict_rules else 'accepted'} |" for k in KNOBS.values()]
    return "\n".join(["## Decoding knobs", "",
                      "Each `dllm_*` field is declared once in `configs.knobs`; a model family decodes in one "
                      "paradigm (its registry row names it, and its `decoding_defaults` replace the defaults "
                      "below for the knobs it reads). A knob the model's paradigm does not read is refused: in a "
                      "request with a 400 naming the field, engine-wide at engine start when set to anything but "
                      "its default (an autoregressive engine logs them as ignored instead: one engine config is "
                      "written for whichever checkpoint a deployment serves). A knob read only by some unmasking "
                      "rules is refused in a request that decodes with another rule where the last column says "
                      "so; elsewhere it is the request's setting for whichever rule it decodes with.", "",
                      *paradigms, "", *rules, "", *knobs, ""])


def reference() -> str:
    parts = ["# Configuration reference", "",
             "Generated from the pydantic models by `python -m configs.reference > docs/config-reference.md`; "
             "do not edit by hand.", ""]
    for model, intro in ((EngineConfig, "One per engine replica: `EngineConfig(...)`, `engine:` in serve_config.yaml "
                          "and the presets, `--kebab-case` flags of `blockserve serve`."),
                         (GenerationConfig, "One per request: `GenerationConfig(...)` offline; the HTTP fields map "
                          "onto it as docs/api.md lists.")):
        parts += [f"## {model.__name__}", "", intro, "", " ".join((model.__doc__ or "").split()), "", table(model), ""]
    return "\n".join(parts) + "\n" + knob_tables()


if __name__ == "__main__":
    print(reference(), end="")
