"""The one stop rule: where a request's output ends, and why.

A `StopChecker` reads a request's generated tokens once each, in order, as they become final (AR:
as sampled; block diffusion: as the revealed prefix grows). For every token it decides, in this
order:

1. a stop id (after `min_new_tokens` tokens) ends the output *with* that token: finish "stop",
   `matched` = the id; its text is left out unless `include_stop_str_in_output`;
2. else the token's text is appended (engine.core.detokenizer), and a stop string that the new
   text completes (after `min_new_tokens` tokens) ends the output with that token: finish "stop",
   `matched` = the string; the text ends where the string starts (or after it, with
   `include_stop_str_in_output`);
3. else the `max_new_tokens`-th token ends the output: finish "length".

So the output always ends at the token that completes the first stop, and `token_ids`, `text`,
`step_map`, logprobs and `finish_reason` all describe the same prefix. The engine, the output
builder and the servers all read the decision from here. Work per token is constant: the decoder
is incremental, its text grows without being copied whole, and a stop string is searched for only in
the text the new token added, plus the `len(word) - 1` characters before it.

Without stop strings nothing decides on text, so the tokens read are detokenized only when the text
is read: a streamed request's next delta, the decision's end, a unary request's first and last
chunk. A request that waits for its whole result (an RL rollout, a unary HTTP call) then makes its
text in a few runs rather than once a step.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

from configs import GenerationConfig
from engine.core.detokenizer import IncrementalDetokenizer


@dataclass(frozen=True)
class StopDecision:
    num_tokens: int  # generated tokens in the output, the stopping token included
    reason: str  # "stop" | "length" | "read" (a typed read's template is final)
    matched: int | str | None  # the stop id or stop string; None for "length"


class StopChecker:
    """The stop rule for one request, over the text its detokenizer builds."""

    def __init__(self, tokenizer, params: GenerationConfig, stop_ids: frozenset[int]):
        self._params = params
        self._stop_ids = stop_ids
        self._words = list(params.stop_words or [])
        self._detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self._unread: list[int] = []  # tokens read whose text is not made yet (only without stop strings)
        #: `text[start:end]` up to `visible_end()` (which makes the text of every token read), read
        #: without joining the whole text when the range lies near its end
        self.text_between = self._detok.slice
        self.num_consumed = 0  # generated tokens read so far
        self.text_end: int | None = None  # where the output text ends, once decided
        self.decision: StopDecision | None = None
        self.hold_back = max((len(w) for w in self._words), default=1) - 1

    @property
    def text(self) -> str:
        """Text of the consumed tokens (without a stop id's text, unless asked)."""
        return self._text().text

    def consume(self, token_id: int) -> StopDecision | None:
        """Read the next final token; returns the decision once the output ends (then stop calling)."""
        assert self.decision is None, "the output already ended"
        p, detok = self._params, self._text()
        g = self.num_consumed
        self.num_consumed += 1
        may_stop = g >= p.min_new_tokens
        if may_stop and token_id in self._stop_ids:
            if p.include_stop_str_in_output:
                detok.add([token_id])
            detok.flush()
            return self._decide(g + 1, "stop", token_id, detok.length)
        old_len = detok.length
        ends = detok.add([token_id])
        if may_stop and self._words:
            hit = self._find_word(old_len, ends)
            if hit is not None:
                _, start, word = hit
                end = start + (len(word) if p.include_stop_str_in_output else 0)
                return self._decide(g + 1, "stop", word, end)
        if g + 1 >= p.max_new_tokens:
            return self._length_decision()
        return None

    def consume_final(self, tokens: list[int], offset: int, num_final: int) -> StopDecision | None:
        """Read the tokens that became final since the last call, `tokens[offset + num_consumed :
        offset + num_final]`, up to the decision (the tokens after it are never read). The decision is
        the one `consume` would reach token by token; past `min_new_tokens` the text of a run of tokens
        is added at once and searched for stop strings once."""
        if self.decision is not None or self.num_consumed >= num_final:
            return self.decision
        p = self._params
        if self.num_consumed < p.min_new_tokens:
            while self.decision is None and self.num_consumed < num_final:
                self.consume(tokens[offset + self.num_consumed])
            return self.decision
        first, limit = self.num_consumed, p.max_new_tokens
        end = num_final if num_final < limit else limit
        new = tokens[offset + first: offset + end]
        no_stop_id = self._stop_ids.isdisjoint(new)
        if no_stop_id and not self._words:  # the common step: nothing to decide on
            self._unread += new
            self.num_consumed = end
            return self._length_decision() if end >= limit else None
        stop_at = None
        if not no_stop_id:
            for i, token in enumerate(new):
                if token in self._stop_ids:
                    stop_at = i
                    break
        run = new[:stop_at]
        if self._words:
            old_len = self._detok.length
            ends = self._detok.add(run)
            hit = self._find_word(old_len, ends)
            if hit is not None:
                k, start, word = hit
                self.num_consumed = first + k + 1
                return self._decide(first + k + 1, "stop", word,
                                    start + (len(word) if p.include_stop_str_in_output else 0))
        else:  # nothing decides on the text: it is made when read
            self._unread += run
        self.num_consumed = first + len(run)
        if stop_at is not None:
            return self.consume(new[stop_at])  # the stop id ends the output (the per-token rule)
        return self._length_decision() if self.num_consumed >= limit else None

    def end_from_outside(self) -> None:
        """The request ends without a stop (abort / error): its text is everything consumed."""
        detok = self._text()
        detok.flush()
        self.text_end = detok.length

    def visible_end(self) -> int:
        """How much of `text` is safe to stream now: the output's text once decided; before that, all
        but the characters that could still turn out to start a stop string."""
        if self.text_end is not None:
            return self.text_end
        if self._unread:
            self._text()
        return max(0, self._detok.length - self.hold_back)

    # ---- internals ---------------------------------------------------------------------------
    def _text(self) -> IncrementalDetokenizer:
        """The detokenizer, with the text of every token read made."""
        if self._unread:
            self._detok.add(self._unread)
            self._unread = []
        return self._detok

    def _length_decision(self) -> StopDecision:
        """The output ends at its `max_new_tokens`-th token, read just now."""
        detok = self._text()
        detok.flush()
        return self._decide(self.num_consumed, "length", None, detok.length)

    def _decide(self, n: int, reason: str, matched: int | str | None, text_end: int) -> StopDecision:
        if reason == "length" and self._params.is_read:  # a read ends when its template's positions are final
            reason = "read"
        self.text_end = text_end
        self.decision = StopDecision(n, reason, matched)
        return self.decision

    def _find_word(self, old_len: int, ends: list[int]) -> tuple[int, int, str] | None:
        """The first stop string completed by a run of tokens (one or more) whose text began at `old_len`
        and reached `ends[k]` after its k-th token: (k, where the string starts, the string); earliest
        start wins among the strings the same token completes."""
        if not ends or ends[-1] == old_len:  # no text added (a split character held back): nothing completed
            return None
        first = max(0, old_len - self.hold_back)  # a string completed now starts after this
        text, best = self._detok.slice(first), None
        for word in self._words:
            start = text.find(word, max(0, old_len - len(word) + 1 - first))
            if start >= 0:
                start += first
                hit = (bisect_left(ends, start + len(word)), start, word)
                best = hit if best is None or hit < best else best
        return best
