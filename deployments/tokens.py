"""The ingress's tokenizer: the checkpoint's fast tokenizer, read the way the engine reads it
(`tokenizer.json` + `tokenizer_config.json`, local files only, no code from the checkpoint) but
without the engine's model code, for chat templates, echoed prompts and the text of single tokens."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from deployments.errors import ApiError


def load_tokenizer(path: str | Path) -> Any:
    """`PreTrainedTokenizerFast` directly: AutoTokenizer would consult config.json, whose `sdar`
    model_type transformers does not know."""
    from transformers import PreTrainedTokenizerFast

    root = Path(path)
    if not (root / "tokenizer.json").is_file():
        raise ApiError(f"{root} has no tokenizer.json (a fast tokenizer file is required)", None, 500,
                       "internal_error")
    return PreTrainedTokenizerFast.from_pretrained(str(root), local_files_only=True)


class TokenText:
    """The text of one token id (special tokens included), cached."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._text = functools.lru_cache(maxsize=65536)(self._decode)

    def _decode(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def __call__(self, token_id: int) -> str:
        return self._text(token_id)
