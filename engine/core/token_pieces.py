"""What each token of a byte-level tokenizer adds to a text, looked up instead of decoded.

A byte-level tokenizer (the `ByteLevel` decoder: Qwen's, SDAR's, LLaDA2's, GPT-2's) decodes a run of
tokens to the UTF-8 decode (invalid bytes replaced) of the concatenation of their bytes, and each
vocabulary token's bytes are its characters read through the byte alphabet (`ByteLevel.alphabet()`:
one printable character per byte). So a token's contribution to a text is known once per token:
its text, where its bytes are whole characters by themselves, or else its bytes, which a text holds
until the characters they begin complete. `TokenPieces` is that table for one tokenizer, filled as
tokens are first seen and shared by the tokenizer's requests (`pieces_of`).

A token whose bytes are not whole and cannot be read through the alphabet (a character outside it,
which an added token may hold) has no entry of bytes: the detokenizer decodes its run with the
tokenizer itself.
"""

from __future__ import annotations

from weakref import WeakKeyDictionary

from tokenizers.decoders import ByteLevel

#: a token's entry: its text (whole characters), its bytes (part of a character), or None (neither known)
Piece = str | bytes | None


def _byte_of_symbol() -> dict[str, int]:
    """The byte alphabet read backwards: GPT-2's printable character of each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(rest)}


_BYTE_OF = _byte_of_symbol()


class TokenPieces:
    def __init__(self, backend, skip_special_tokens: bool):
        self._backend = backend
        self._skip = skip_special_tokens
        #: token id -> its `Piece`; read directly on the hot path, `fill` on a miss
        self.entries: dict[int, Piece] = {}

    def fill(self, token_id: int) -> Piece:
        """Decode `token_id` alone once and record its entry: its text when that has no replacement
        character (its bytes are whole characters), else its bytes read from the vocabulary when they
        decode to that same text, else None."""
        text = self._backend.decode([token_id], skip_special_tokens=self._skip)
        entry: Piece = text
        if "\ufffd" in text:
            entry = None
            token = self._backend.id_to_token(token_id)
            if token is not None and all(c in _BYTE_OF for c in token):
                raw = bytes(_BYTE_OF[c] for c in token)
                entry = raw if raw.decode("utf-8", "replace") == text else None
        self.entries[token_id] = entry
        return entry


_TABLES: WeakKeyDictionary = WeakKeyDictionary()  # tokenizer -> {skip_special_tokens: its TokenPieces}


def pieces_of(tokenizer, skip_special_tokens: bool) -> TokenPieces | None:
    """The shared table of a byte-level tokenizer for this setting (None for any other decoder)."""
    backend = tokenizer.backend_tokenizer
    if type(backend.decoder) is not ByteLevel:
        return None
    tables = _TABLES.setdefault(tokenizer, {})
    if skip_special_tokens not in tables:
        tables[skip_special_tokens] = TokenPieces(backend, skip_special_tokens)
    return tables[skip_special_tokens]
