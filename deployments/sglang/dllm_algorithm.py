"""SGLang's block-diffusion server flags on `blockserve serve`: `--dllm-algorithm` and
`--dllm-algorithm-config FILE.yaml`, turned into the EngineConfig fields they mean.

- `LowConfidence`: `low_confidence_dynamic` with as many denoising steps as the block has positions
  (every masked position above the threshold, else the single most confident one).
- `JointThreshold`: `joint_threshold` (reveals and token edits).

The YAML file holds SGLang's keys: `threshold`, `edit_threshold`, `max_post_edit_steps`,
`penalty_lambda`, `block_size`. An engine flag given on the same command line wins over both.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

from configs.knobs import upstream_names

ALGORITHMS = {"LowConfidence": "low_confidence_dynamic", "JointThreshold": "joint_threshold"}
# SGLang's key -> the EngineConfig field (from the knob table)
CONFIG_KEYS = {key: knob for knob, key in upstream_names("sglang.algorithm").items()}


def add_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("SGLang's block-diffusion flags")
    group.add_argument("--dllm-algorithm", dest="dllm_algorithm", choices=list(ALGORITHMS), default=None,
                       help="LowConfidence (low_confidence_dynamic, steps = block length) or JointThreshold "
                       "(joint_threshold: reveals and token edits)")
    group.add_argument("--dllm-algorithm-config", dest="dllm_algorithm_config", type=Path, default=None,
                       help="YAML with SGLang's keys: " + ", ".join(CONFIG_KEYS))


def engine_fields(algorithm: str | None, config: Path | None) -> dict[str, Any]:
    """The EngineConfig fields the two flags set (SystemExit naming a bad key or file)."""
    fields: dict[str, Any] = {}
    if algorithm is not None:
        fields["dllm_unmasking_strategy"] = ALGORITHMS[algorithm]
    if config is not None:
        try:
            data = yaml.safe_load(config.read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise SystemExit(f"blockserve serve: --dllm-algorithm-config {config}: {e}") from None
        if not isinstance(data, dict):
            raise SystemExit(f"blockserve serve: --dllm-algorithm-config {config} must be a mapping of "
                             f"{', '.join(CONFIG_KEYS)}")
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
