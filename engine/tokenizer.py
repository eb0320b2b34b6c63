"""The checkpoint's tokenizer, in a leaf module: the engine and the ingress (which loads no model
code) read it the same way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.errors import CheckpointError


def load_tokenizer(path: str | Path) -> Any:
    """The checkpoint's fast tokenizer (tokenizer.json + tokenizer_config.json), local files only.

    Loaded as `PreTrainedTokenizerFast` directly: AutoTokenizer would consult config.json, whose
    `sdar` model_type transformers does not know, and it never runs code from the checkpoint.
    """
    from transformers import PreTrainedTokenizerFast

    root = Path(path)
    if not (root / "tokenizer.json").is_file():
        raise CheckpointError(f"{root} has no tokenizer.json (a fast tokenizer file is required)")
    return PreTrainedTokenizerFast.from_pretrained(str(root), local_files_only=True)
