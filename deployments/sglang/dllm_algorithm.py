"""SGLang's block-diffusion server flags on `blockserve serve`: `--dllm-algorithm` and
`--dllm-algorithm-config FILE.yaml`, turned into the EngineConfig fields they mean.

- `LowConfidence`: `low_confidence_dynamic` with as many denoising steps as the block has positions
  (every masked position above the threshold, else the single most confident one).
- `JointThreshold`: `joint_threshold` (reveals and token edits).
- `JointThresholdInDel`: `joint_threshold_indel` (reveals, token edits, deletes and inserts; the
  checkpoint's `delete_token_id` / `split_token_id`).
- `Gemma4Renoise`: DiffusionGemma's renoising, the only way that model decodes (the flag names it;
  its settings come from the YAML file, else the checkpoint's generation_config.json).
- `FastDiffuser` / `LinearSpec`: Nemotron-Labs-Diffusion's block diffusion / self-speculation, as the
  engine's default `dllm_mode` (`diffusion` / `linear_spec`; a request's own `dllm_mode` still wins).

The YAML file holds SGLang's keys: `threshold`, `edit_threshold`, `max_post_edit_steps`,
`penalty_lambda`, `block_size`; for `Gemma4Renoise` `max_denoising_steps`,
`sampler_config.entropy_bound`, `temperature_schedule.t_min|t_max` and
`stopping_config.confidence_threshold|stability_threshold` (nested mappings, as SGLang reads them;
`t_min`, `t_max`, `confidence_threshold` and `stability_threshold` also at the top level, as SGLang
accepts them). A key the file leaves out takes SGLang's default for the named algorithm (`DEFAULTS`,
as SGLang's release reads its config: LowConfidence's threshold 0.95, JointThreshold's 0.5, ...), not
the model family's: the same launch command decodes as it does on SGLang. An engine setting given on
the same command line or in `--config` wins over both.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

from configs.knobs import upstream_names

# SGLang's algorithm -> the EngineConfig fields it means (none: the paradigm the model decodes with)
ALGORITHMS: dict[str, dict[str, str]] = {
    "LowConfidence": {"dllm_unmasking_strategy": "low_confidence_dynamic"},
    "JointThreshold": {"dllm_unmasking_strategy": "joint_threshold"},
    "JointThresholdInDel": {"dllm_unmasking_strategy": "joint_threshold_indel"},
    "Gemma4Renoise": {},
    "FastDiffuser": {"dllm_mode": "diffusion"},
    "LinearSpec": {"dllm_mode": "linear_spec"},
}
# SGLang's key (nested mappings joined with ".") -> the EngineConfig field (from the knob table)
CONFIG_KEYS = {key: knob for knob, key in upstream_names("sglang.algorithm").items()}
# the renoising keys SGLang also reads at the top level
CONFIG_KEYS |= {key.rsplit(".", 1)[1]: knob for key, knob in list(CONFIG_KEYS.items())
                if key.startswith(("temperature_schedule.", "stopping_config."))}
# SGLang's keys that change nothing computed (a lookup table of the same temperatures)
IGNORED_KEYS = ("use_temperature_table",)
# SGLang's defaults of each algorithm's keys (`algorithm_config.get(key, default)` in sglang's
# python/sglang/srt/dllm/algorithm/*.py, release 0.5.23): what its config file leaves out. Gemma4Renoise
# has none here: its settings come from the checkpoint's generation_config.json (docs/models.md).
DEFAULTS: dict[str, dict[str, object]] = {
    "LowConfidence": {"threshold": 0.95},
    "JointThreshold": {"threshold": 0.5, "edit_threshold": 0.0, "max_post_edit_steps": 16, "penalty_lambda": 0.0},
    "JointThresholdInDel": {"threshold": 0.5, "edit_threshold": 0.0, "max_post_edit_steps": 16},
    "Gemma4Renoise": {},
    "FastDiffuser": {},  # the checkpoint's (Nemotron-Labs-Diffusion reads no threshold unless one is set)
    "LinearSpec": {},  # threshold 0: one draft forward fills the block
}


def _flattened(data: dict, prefix: str = "") -> dict[str, object]:
    """Nested mappings as dotted keys: {"a": {"b": 1}} -> {"a.b": 1}."""
    out: dict[str, object] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out |= _flattened(value, f"{name}.")
        else:
            out[name] = value
    return out


def add_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("SGLang's block-diffusion flags")
    group.add_argument("--dllm-algorithm", dest="dllm_algorithm", choices=list(ALGORITHMS), default=None,
                       help="LowConfidence (low_confidence_dynamic, steps = block length), JointThreshold "
                       "(joint_threshold: reveals and token edits), JointThresholdInDel (joint_threshold_indel: "
                       "also deletes and inserts), Gemma4Renoise (DiffusionGemma's renoising), FastDiffuser or "
                       "LinearSpec (Nemotron-Labs-Diffusion's dllm_mode diffusion / linear_spec), with SGLang's "
                       "defaults for the keys its config leaves out")
    group.add_argument("--dllm-algorithm-config", dest="dllm_algorithm_config", type=Path, default=None,
                       help="YAML with SGLang's keys: " + ", ".join(CONFIG_KEYS))


def engine_fields(algorithm: str | None, config: Path | None) -> dict[str, Any]:
    """The EngineConfig fields the two flags set (SystemExit naming a bad key or file): the algorithm's
    rule, and SGLang's keys from the file over SGLang's defaults for the algorithm."""
    fields: dict[str, Any] = {}
    if algorithm is not None:
        fields |= ALGORITHMS[algorithm] | {CONFIG_KEYS[k]: v for k, v in DEFAULTS[algorithm].items()}
    if config is not None:
        try:
            data = yaml.safe_load(config.read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise SystemExit(f"blockserve serve: --dllm-algorithm-config {config}: {e}") from None
        if not isinstance(data, dict):
            raise SystemExit(f"blockserve serve: --dllm-algorithm-config {config} must be a mapping of "
                             f"{', '.join(CONFIG_KEYS)}")
        data = {k: v for k, v in _flattened(data).items() if k not in IGNORED_KEYS}
        unknown = sorted(set(data) - set(CONFIG_KEYS))
        if unknown:
            raise SystemExit(f"blockserve serve: --dllm-algorithm-config {config}: unknown key {unknown[0]!r} "
                             f"(known: {', '.join(CONFIG_KEYS)})")
        fields |= {CONFIG_KEYS[k]: v for k, v in data.items()}
    return fields


def apply(ns: argparse.Namespace, args: dict[str, Any]) -> None:
    """Put the flags' fields into `args["engine"]` under the engine fields already there (flags win)."""
    fields = engine_fields(ns.dllm_algorithm, ns.dllm_algorithm_config)
    if fields:
        args["engine"] = {**fields, **(args.get("engine") or {})}
