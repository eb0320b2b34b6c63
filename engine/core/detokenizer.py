"""Incremental detokenization: a request's text grown one final token at a time.

tokenizers' `DecodeStream` turns each new token into the text it adds, in constant work per token.
A token that ends inside a UTF-8 sequence adds nothing until the sequence completes; if the output
ends there, `flush` decodes the held-back tail with a few tokens of left context (sentencepiece-style
tokenizers drop a leading space at the start of a decode, so the tail alone would lose it).
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

_FLUSH_CONTEXT = 4  # tokens of left context decoded with a held-back tail


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool):
        self._tokenizer = tokenizer
        self._backend = tokenizer.backend_tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []  # every token added
        self._pending = 0  # trailing tokens whose text the stream still holds back
        self.text = ""

    def add(self, token_ids: list[int]) -> list[int]:
        """Add each token in turn; returns the text's length after each."""
        stream, backend, ends, text = self._stream, self._backend, [], self.text
        for token_id in token_ids:
            piece = stream.step(backend, token_id)
            if piece is None:  # an incomplete UTF-8 sequence: the stream waits for its next bytes
                self._pending += 1
            else:
                self._pending = 0
                text += piece
            ends += (len(text),)
        self.text = text
        self._ids += token_ids
        return ends

    def flush(self) -> None:
        """Decode what the stream still holds back (the text ends inside a UTF-8 sequence)."""
        if not self._pending:
            return
        tail = self._ids[-self._pending :]
        context = self._ids[-self._pending - _FLUSH_CONTEXT : -self._pending]
        before = self._tokenizer.decode(context, skip_special_tokens=self._skip, clean_up_tokenization_spaces=False)
        both = self._tokenizer.decode(context + tail, skip_special_tokens=self._skip,
                                      clean_up_tokenization_spaces=False)
        self.text += both[len(before):]
        self._pending = 0
