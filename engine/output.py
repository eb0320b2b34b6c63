"""Per-request output assembly: incremental detokenisation, stop words, and OutputChunk deltas.

The engine tells the builder how many leading generated tokens are final (`num_visible`) and
whether the request is finished; the builder emits only what is new since its last chunk, so the
chunks of a request concatenate exactly to its Response.
"""

from __future__ import annotations

from engine.carrier import OutputChunk, StepEvent
from engine.sequence import Sequence


class OutputBuilder:
    def __init__(self, seq: Sequence, tokenizer, is_dllm: bool):
        self.seq = seq
        self.tokenizer = tokenizer
        self.is_dllm = is_dllm
        p = seq.params
        self.want_logprobs = p.logprobs is not None
        self.want_trace = is_dllm and p.return_step_trace
        self.stop_words = p.stop_words or []
        self.hold_back = max((len(w) for w in self.stop_words), default=1) - 1
        self.sent_tokens = 0
        self.sent_text = ""
        self.pending_trace: list[StepEvent] = []
        self.pending_input_rows: list[tuple[float, int]] = []
        self.pending_input_top: list[list[tuple[float, int]]] = []
        self.first = True

    # ---- inputs from the engine -------------------------------------------------------------
    def add_trace(self, event: StepEvent) -> None:
        if self.want_trace:
            self.pending_trace.append(event)

    def add_input_rows(self, values: list[float], targets: list[int], top: list | None) -> None:
        self.pending_input_rows += [(v, t) for v, t in zip(values, targets)]
        if top is not None:
            self.pending_input_top += [[(v, t) for v, t in row] for row in top]

    # ---- text -------------------------------------------------------------------------------
    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.seq.params.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _stop_word_match(self, text: str) -> tuple[int, str] | None:
        """(start, word) of the earliest stop word in `text` that ends after the first
        `min_new_tokens` tokens' text (stop words, like stop ids, cannot end a request earlier)."""
        min_new = self.seq.params.min_new_tokens
        gen = self.seq.tokens[self.seq.prompt_len :]
        if len(gen) < min_new:
            return None
        floor = len(self._decode(gen[:min_new])) if min_new else 0
        hits = []
        for w in self.stop_words:
            i = text.find(w, max(0, floor - len(w) + 1))
            if i >= 0:
                hits.append((i, w))
        return min(hits, default=None)

    def find_stop_word(self, num_visible: int) -> int | None:
        """If a stop word appears in the visible text, the number of tokens to keep (through the
        token that completes it); else None."""
        if not self.stop_words:
            return None
        gen = self.seq.tokens[self.seq.prompt_len : self.seq.prompt_len + num_visible]
        if self._stop_word_match(self._decode(gen)) is None:
            return None
        first = max(1, self.sent_tokens, self.seq.params.min_new_tokens)
        for n in range(first, len(gen) + 1):
            if self._stop_word_match(self._decode(gen[:n])) is not None:
                return n
        return len(gen)

    def _text_of(self, ids: list[int], finished: bool) -> str:
        p = self.seq.params
        if finished and self.seq.finish_reason == "stop" and ids and ids[-1] in self.seq.stop_ids:
            if not p.include_stop_str_in_output:
                ids = ids[:-1]
        text = self._decode(ids)
        match = self._stop_word_match(text) if self.stop_words else None
        if match is not None:
            start, word = match
            return text[: start + (len(word) if p.include_stop_str_in_output else 0)]
        if finished:
            return text
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its next bytes
            text = text.rstrip("\ufffd")
        return text[: max(len(self.sent_text), len(text) - self.hold_back)]

    # ---- chunk ------------------------------------------------------------------------------
    def build(self, num_visible: int, finished: bool) -> OutputChunk | None:
        seq = self.seq
        start, end = self.sent_tokens, num_visible
        new_ids = seq.tokens[seq.prompt_len + start : seq.prompt_len + end]
        text = self._text_of(seq.tokens[seq.prompt_len : seq.prompt_len + end], finished)
        delta = text[len(self.sent_text):] if text.startswith(self.sent_text) else ""
        has_news = new_ids or delta or self.pending_trace or finished
        prefill_done = seq.num_computed >= seq.score_end or finished
        if self.pending_input_rows and not prefill_done:
            has_news = False  # input rows travel together, once the prompt is fully scored
        if not has_news:
            return None
        chunk = OutputChunk(
            request_id=seq.request_id,
            text=delta,
            token_ids=new_ids,
            step_map=[int(s) for s in seq.out_steps[start:end]] if self.is_dllm else None,
            logprobs=list(seq.out_logprobs[start:end]) if self.want_logprobs else None,
            step_trace=self.pending_trace if self.want_trace else None,
            finish_reason=seq.finish_reason if finished else None,
            input_token_len=seq.prompt_len,
            generate_token_len=end,
        )
        if seq.wants_input_logprobs:
            first = self.first
            chunk.input_token_logprobs = self.pending_input_rows if first else []
            if seq.params.logprobs:
                chunk.input_top_logprobs = self.pending_input_top if first else []
            self.pending_input_rows, self.pending_input_top = [], []
        self.first = False
        self.pending_trace = []
        self.sent_tokens = end
        self.sent_text += delta
        return chunk
