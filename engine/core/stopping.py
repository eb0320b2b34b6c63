"""The one stop rule: where a request's output ends, and why.

A `StopChecker` reads a request's generated tokens once each, in order, as they become final (AR:
as sampled; block diffusion: as the revealed prefix grows). For every token it decides, in this
order:

1. a stop id (after `min_new_tokens` tokens) ends the output *with* that token: finish "stop",
   `matched` = the id; its text is left out unless `include_stop_str_in_output`;
2. else the token's text is appended (incremental detokenisation), and a stop string that the new
   text completes (after `min_new_tokens` tokens) ends the output with that token: finish "stop",
   `matched` = the string; the text ends where the string starts (or after it, with
   `include_stop_str_in_output`);
3. else the `max_new_tokens`-th token ends the output: finish "length".

So the output always ends at the token that completes the first stop, and `token_ids`, `text`,
`step_map`, logprobs and `finish_reason` all describe the same prefix. The engine, the output
builder and the servers all read the decision from here. Work per token is constant: the decoder
is incremental (tokenizers' `DecodeStream`) and a stop string is searched for only in the text the
new token added, plus the `len(word) - 1` characters before it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers.decoders import DecodeStream

from configs import GenerationConfig

# Tokens of left context decoded with a tail when the stream is flushed (sentencepiece-style
# tokenizers drop a leading space at the start of a decode).
_FLUSH_CONTEXT = 4


@dataclass(frozen=True)
class StopDecision:
    num_tokens: int  # generated tokens in the output, the stopping token included
    reason: str  # "stop" | "length"
    matched: int | str | None  # the stop id or stop string; None for "length"


class StopChecker:
    """Incremental detokeniser + stop rule for one request."""

    def __init__(self, tokenizer, params: GenerationConfig, stop_ids: frozenset[int]):
        self._tokenizer = tokenizer
        self._backend = tokenizer.backend_tokenizer
        self._params = params
        self._stop_ids = stop_ids
        self._words = list(params.stop_words or [])
        self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self._ids: list[int] = []  # every token consumed
        self._pending = 0  # trailing consumed tokens whose text the stream still holds back
        self.text = ""  # text of the consumed tokens (without a stop id's text, unless asked)
        self.text_end: int | None = None  # where the output text ends, once decided
        self.decision: StopDecision | None = None
        self.hold_back = max((len(w) for w in self._words), default=1) - 1

    @property
    def num_consumed(self) -> int:
        return len(self._ids)

    def consume(self, token_id: int) -> StopDecision | None:
        """Read the next final token; returns the decision once the output ends (then stop calling)."""
        assert self.decision is None, "the output already ended"
        p = self._params
        g = len(self._ids)
        may_stop = g >= p.min_new_tokens
        if may_stop and token_id in self._stop_ids:
            if p.include_stop_str_in_output:
                self._ids.append(token_id)
                self._append(token_id)
                self._flush()
            else:
                self._flush()
                self._ids.append(token_id)
            return self._decide(g + 1, "stop", token_id, len(self.text))
        self._ids.append(token_id)
        old_len = len(self.text)
        self._append(token_id)
        if may_stop and self._words:
            hit = self._find_word(old_len)
            if hit is not None:
                start, word = hit
                end = start + (len(word) if p.include_stop_str_in_output else 0)
                return self._decide(g + 1, "stop", word, end)
        if g + 1 >= p.max_new_tokens:
            self._flush()
            return self._decide(g + 1, "length", None, len(self.text))
        return None

    def end_from_outside(self) -> None:
        """The request ends without a stop (abort / error): its text is everything consumed."""
        self._flush()
        self.text_end = len(self.text)

    def visible_end(self) -> int:
        """How much of `text` is safe to stream now: the output's text once decided; before that, all
        but the characters that could still turn out to start a stop string."""
        if self.text_end is not None:
            return self.text_end
        return max(0, len(self.text) - self.hold_back)

    # ---- internals ---------------------------------------------------------------------------
    def _decide(self, n: int, reason: str, matched: int | str | None, text_end: int) -> StopDecision:
        self.text_end = text_end
        self.decision = StopDecision(n, reason, matched)
        return self.decision

    def _append(self, token_id: int) -> None:
        piece = self._stream.step(self._backend, token_id)
        if piece is None:  # an incomplete UTF-8 sequence: the stream waits for its next bytes
            self._pending += 1
        else:
            self._pending = 0
            self.text += piece

    def _flush(self) -> None:
        """Decode what the stream still holds back (the output ends inside a UTF-8 sequence)."""
        if not self._pending:
            return
        tail = self._ids[-self._pending :]
        context = self._ids[-self._pending - _FLUSH_CONTEXT : -self._pending]
        skip = self._params.skip_special_tokens
        before = self._tokenizer.decode(context, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
        both = self._tokenizer.decode(context + tail, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
        self.text += both[len(before):]
        self._pending = 0

    def _find_word(self, old_len: int) -> tuple[int, str] | None:
        """The stop string the text added after `old_len` completes (earliest start wins)."""
        hits = []
        for w in self._words:
            i = self.text.find(w, max(0, old_len - len(w) + 1))
            if i >= 0:
                hits.append((i, w))
        return min(hits, default=None)
