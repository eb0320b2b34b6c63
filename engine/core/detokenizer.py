"""Incremental detokenization: a request's text grown one final token at a time.

tokenizers' `DecodeStream` turns each new token into the text it adds, in constant work per token.
A token that ends inside a UTF-8 sequence adds nothing until the sequence completes; if the output
ends there, `flush` decodes the held-back tail with a few tokens of left context (sentencepiece-style
tokenizers drop a leading space at the start of a decode, so the tail alone would lose it).

A byte-level tokenizer (the `ByteLevel` decoder of Qwen, SDAR, LLaDA2 and GPT-2-style vocabularies)
decodes a run of tokens as the concatenation of their bytes. So while the text ends on a whole
character, a token whose bytes are whole characters by themselves adds exactly its own text: that
text is looked up in a table of the tokenizer's (filled as tokens are first seen) instead of asking
the stream, which costs about a microsecond a token. A token that is not whole by itself (part of a
multi-byte character) goes to a stream started at the character boundary, which holds it back as
the stream always did until the character completes; then the table takes over again. Any other
decoder (sentencepiece's, whose decode of a lone token drops its leading space) always uses the
stream.

The text is kept as settled pieces plus a recent tail, so that adding a token copies only the tail,
not the whole text: a Python string grown with `+=` while another name holds it is copied whole each
time, which made a 100k-character output's next token cost twice its first. The readers of the step
(the stop-string search, the next output delta) read near the end, from the tail; the whole text is
joined only when asked for.
"""

from __future__ import annotations

from weakref import WeakKeyDictionary

from tokenizers.decoders import ByteLevel, DecodeStream

_FLUSH_CONTEXT = 4  # tokens of left context decoded with a held-back tail
_TAIL_MAX = 1024  # characters the recent tail grows to before it settles up to _TAIL_KEEP before the
_TAIL_KEEP = 256  # text that the last `add` began at


_UNSEEN = object()
_TABLES: WeakKeyDictionary = WeakKeyDictionary()  # tokenizer -> {skip_special_tokens: its table}


def _whole_pieces(tokenizer, skip_special_tokens: bool) -> dict[int, str | None] | None:
    """The table of a byte-level tokenizer (None for any other decoder), one per tokenizer and setting,
    shared by its requests: token id -> its text when its bytes are whole characters by themselves,
    None when they are not; filled by `_piece`."""
    if type(tokenizer.backend_tokenizer.decoder) is not ByteLevel:
        return None
    return _TABLES.setdefault(tokenizer, {}).setdefault(skip_special_tokens, {})


def _piece(table: dict[int, str | None], backend, skip: bool, token_id: int) -> str | None:
    """The table's entry for `token_id`, decoded once: its text, or None when that text is not whole (a
    replacement character marks bytes that need their neighbours)."""
    text = backend.decode([token_id], skip_special_tokens=skip)
    piece = table[token_id] = None if "\ufffd" in text else text
    return piece


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool):
        self._tokenizer = tokenizer
        self._backend = tokenizer.backend_tokenizer
        self._skip = skip_special_tokens
        self._pieces = _whole_pieces(tokenizer, skip_special_tokens)
        # the stream: always without a table; with one, only while a character is incomplete
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) if self._pieces is None else None
        self._ids: list[int] = []  # every token added
        self._pending = 0  # trailing tokens whose text the stream still holds back
        self._settled: list[str] = []  # the text is "".join(_settled) + _tail
        self._settled_len = 0
        self._tail = ""
        self.length = 0  # characters of text

    @property
    def text(self) -> str:
        """The whole text so far (joined when read: the step itself reads `slice` near the end)."""
        return "".join(self._settled) + self._tail if self._settled else self._tail

    def slice(self, start: int, end: int | None = None) -> str:
        """`text[start:end]` for 0 <= start <= end <= length, read from the tail when it lies there."""
        if start >= self._settled_len:
            base = self._settled_len
            return self._tail[start - base:] if end is None else self._tail[start - base: end - base]
        return self.text[start:end]

    def add(self, token_ids: list[int]) -> list[int]:
        """Add each token in turn; returns the text's length after each."""
        backend, pieces, ends, tail, old = self._backend, self._pieces, [], self._tail, self.length
        length = old
        for token_id in token_ids:
            stream = self._stream
            if stream is None:  # at a character boundary, with a table
                piece = pieces.get(token_id, _UNSEEN)
                if piece is _UNSEEN:
                    piece = _piece(pieces, backend, self._skip, token_id)
                if piece is None:  # not whole by itself: a stream from here to the character's end
                    stream = self._stream = DecodeStream(skip_special_tokens=self._skip)
            if stream is not None:
                piece = stream.step(backend, token_id)
                if piece is not None and pieces is not None:
                    self._stream = None  # the text ends on a whole character again: the table from here
            if piece is None:  # an incomplete UTF-8 sequence: the stream waits for its next bytes
                self._pending += 1
            else:
                self._pending = 0
                tail += piece  # copies the tail only
                length += len(piece)
            ends += (length,)
        self._tail, self.length = tail, length
        if len(tail) > _TAIL_MAX:
            self._settle(old - _TAIL_KEEP)
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
        added = both[len(before):]
        self._tail += added
        self.length += len(added)
        self._pending = 0

    def _settle(self, upto: int) -> None:
        """Move the text before `upto` from the tail to the settled pieces (the readers of a step start
        past it: the stop-string search and the next delta read from the text before the step on)."""
        cut = upto - self._settled_len
        if cut > 0:
            self._settled.append(self._tail[:cut])
            self._settled_len = upto
            self._tail = self._tail[cut:]
