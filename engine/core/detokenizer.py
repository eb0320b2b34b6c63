"""Incremental detokenization: a request's text grown one final token at a time.

tokenizers' `DecodeStream` turns each new token into the text it adds, in constant work per token.
A token that ends inside a UTF-8 sequence adds nothing until the sequence completes; if the output
ends there, `flush` decodes the held-back tail with a few tokens of left context (sentencepiece-style
tokenizers drop a leading space at the start of a decode, so the tail alone would lose it).

With a byte-level tokenizer the stream is not needed: a token's text, or its bytes when they are
part of a character, come from the tokenizer's table (`engine.core.token_pieces`), the bytes of a
split character are held until it completes, and the text added is what the stream would add (the
decode of the held bytes, once it ends on a whole character). A token the table has no bytes for
starts a stream over the run held since the last whole character. Any other decoder (sentencepiece's,
whose decode of a lone token drops its leading space) always uses the stream.

The text is kept as settled pieces plus a recent tail, so that adding a token copies only the tail,
not the whole text: a Python string grown with `+=` while another name holds it is copied whole each
time, which made a 100k-character output's next token cost twice its first. The readers of the step
(the stop-string search, the next output delta) read near the end, from the tail; the whole text is
joined only when asked for.
"""

from __future__ import annotations

from itertools import accumulate

from tokenizers.decoders import DecodeStream

from engine.core.token_pieces import pieces_of

_FLUSH_CONTEXT = 4  # tokens of left context decoded with a held-back tail
_TAIL_MAX = 1024  # characters the recent tail grows to before it settles up to _TAIL_KEEP before the
_TAIL_KEEP = 256  # text that the last `add` began at
_UNSEEN = object()
_RUN_IN_C = 16  # tokens from which a run of whole characters is looked up in C (per token: 75 ns, not 190;
# a few tokens cost more that way than in the loop)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool):
        self._tokenizer = tokenizer
        self._backend = tokenizer.backend_tokenizer
        self._skip = skip_special_tokens
        self._pieces = pieces_of(tokenizer, skip_special_tokens)
        # the stream: always without a table; with one, only for a run the table has no bytes for
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) if self._pieces is None else None
        self._held: bytes | None = None  # with a table: the bytes of a character not complete yet
        self._held_ids: list[int] = []  # and their tokens
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
        if len(token_ids) >= _RUN_IN_C and self._held is None and self._stream is None and self._pieces is not None:
            ends = self._add_looked_up(token_ids)  # a long run (a text made when read), most often whole
            if ends is not None:  # characters after whole characters
                return ends
        backend, ends, tail, old = self._backend, [], self._tail, self.length
        entries = self._pieces.entries if self._pieces is not None else None
        length = old
        for token_id in token_ids:
            stream = self._stream
            if stream is None:
                entry = entries.get(token_id, _UNSEEN)
                if entry is _UNSEEN:
                    entry = self._pieces.fill(token_id)
                if self._held is None and entry.__class__ is str:  # whole characters after whole characters
                    piece = entry
                elif entry is None:  # no bytes of its own: a stream from the last whole character
                    stream = self._stream = self._stream_from_boundary()
                else:
                    piece = self._hold(token_id, entry.encode() if entry.__class__ is str else entry)
            if stream is not None:
                piece = stream.step(backend, token_id)
                if piece is not None and entries is not None:
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

    def _add_looked_up(self, token_ids: list[int]) -> list[int] | None:
        """`add` for a run of whole characters whose pieces the table holds, looked up in C; None (nothing
        added) when a token is not one: not seen yet, part of a character, or without bytes of its own."""
        try:
            pieces = list(map(self._pieces.entries.__getitem__, token_ids))
            added = "".join(pieces)  # a part of a character (bytes) or a token without bytes (None) raises
        except (KeyError, TypeError):
            return None
        old = self.length
        ends = list(accumulate(map(len, pieces), initial=old))[1:]
        # the same bookkeeping as the end of `add`, which keeps its own copy inline: a call there would
        # cost a token added alone (a streamed step's) some 80 ns, a seventh of its time
        self._pending = 0
        self._tail, self.length = self._tail + added, ends[-1]
        if len(self._tail) > _TAIL_MAX:
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

    def _hold(self, token_id: int, raw: bytes) -> str | None:
        """Add a token's bytes to those held: the text they make once it ends on a whole character (the
        held bytes then let go), else None (held)."""
        held = raw if self._held is None else self._held + raw
        text = held.decode("utf-8", "replace")
        if text and not text.endswith("\ufffd"):
            self._held = None
            self._held_ids.clear()
            return text
        self._held = held
        self._held_ids.append(token_id)
        return None

    def _stream_from_boundary(self) -> DecodeStream:
        """A stream that has read the tokens held since the last whole character (it holds them too)."""
        stream = DecodeStream(skip_special_tokens=self._skip)
        for token_id in self._held_ids:
            stream.step(self._backend, token_id)
        self._held = None
        self._held_ids.clear()
        return stream

    def _settle(self, upto: int) -> None:
        """Move the text before `upto` from the tail to the settled pieces (the readers of a step start
        past it: the stop-string search and the next delta read from the text before the step on)."""
        cut = upto - self._settled_len
        if cut > 0:
            self._settled.append(self._tail[:cut])
            self._settled_len = upto
            self._tail = self._tail[cut:]
