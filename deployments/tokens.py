"""The text of single tokens for the ingress (logprob rows' text, echoed prompts); the tokenizer itself
is engine.tokenizer's, read the way the engine reads it."""

from __future__ import annotations

import functools
from typing import Any


class TokenText:
    """The text of one token id (special tokens included), cached."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._text = functools.lru_cache(maxsize=65536)(self._decode)

    def _decode(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def __call__(self, token_id: int) -> str:
        return self._text(token_id)
