"""`python -m bench.detokenize`: host time per output token of the engine's incremental detokenizer,
against tokenizers' `DecodeStream` stepped one token at a time into a growing string (what the engine
did before its table of whole pieces and its settled text) in the same run.

    PYTHONPATH=. python -m bench.detokenize [--tokens 20000] [--run 1]

Three token streams over the tiny byte-level tokenizer (`testing.tiny.tokenizer`): English text,
text with accented letters and emoji (multi-byte characters split across tokens), and uniformly
random ids (a random-weight model's output: about half of them parts of a character). Each is
timed over its first and its last 2,000 tokens, where a string that is copied whole on every append
shows. `--run N` adds the tokens N at a time (the baseline still steps its stream a token at a time): a
unary request's text is made when read, in runs. The engine's table is per tokenizer and fills as
tokens are first seen; each stream runs once untimed first, as a serving engine's table is warm after
its first requests. Prints JSON: µs per token, per stream and position, for both.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from tokenizers.decoders import DecodeStream

from engine.core.detokenizer import IncrementalDetokenizer
from testing.tiny.tokenizer import build_byte_tokenizer

WINDOW = 2000  # tokens timed at each position (a third of a shorter output)


def _window(tokens: int) -> int:
    return min(WINDOW, tokens // 3)


def _marks(ids: list[int]) -> tuple[int, int, int]:
    """Where the timed windows end: the first window, the start of the last one, the end."""
    return _window(len(ids)), len(ids) - _window(len(ids)), len(ids)


def _timed(ids: list[int], add_run, run: int) -> list[float]:
    """Seconds `add_run(ids[k: k + run])` took over each window of `ids` (`_marks`; a window ends with the
    run that reaches its mark)."""
    marks, ends = [], iter(_marks(ids))
    end = next(ends)
    t = time.perf_counter()
    for k in range(0, len(ids), run):
        add_run(ids[k: k + run])
        while k + run >= end:
            marks.append(time.perf_counter() - t)
            t = time.perf_counter()
            end = next(ends, len(ids) + run)
    return marks


def _stream_baseline(tokenizer, ids: list[int], run: int) -> list[float]:
    """DecodeStream.step per token, its pieces appended to a string another name also holds."""
    stream, backend, holder = DecodeStream(skip_special_tokens=True), tokenizer.backend_tokenizer, {"text": ""}

    def add_run(token_ids: list[int]) -> None:
        for token_id in token_ids:
            text = holder["text"]
            piece = stream.step(backend, token_id)
            if piece is not None:
                text += piece
            holder["text"] = text

    return _timed(ids, add_run, run)


def _engine(tokenizer, ids: list[int], run: int) -> list[float]:
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    return _timed(ids, detok.add, run)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=20000, help="output length (tokens) of each stream (at least 3)")
    ap.add_argument("--run", type=int, default=1,
                    help="tokens per add (default 1, a streamed step's; 128: a unary request's text made when read)")
    args = ap.parse_args(argv)
    if args.tokens < 3:
        ap.error("--tokens: at least 3 (a first, a middle and a last window)")
    tokenizer = build_byte_tokenizer()
    vocab = tokenizer.backend_tokenizer.get_vocab_size()
    rng = random.Random(0)

    def text_ids(sample: str) -> list[int]:
        ids = tokenizer.encode(sample, add_special_tokens=False)
        return (ids * (args.tokens // len(ids) + 1))[: args.tokens]

    streams = {
        "english": text_ids("The quick brown fox jumps over the lazy dog. Once upon a time, 12 + 30 = 42. "),
        "accented_emoji": text_ids("Grüße, €5 — naïve café 😀 "),
        "random_ids": [rng.randrange(vocab) for _ in range(args.tokens)],
    }
    out: dict = {"command": " ".join(["python -m bench.detokenize", *sys.argv[1:]]),
                 "tokens": args.tokens, "run": args.run, "window": _window(args.tokens), "streams": {}}
    for name, ids in streams.items():
        _engine(tokenizer, ids, 1)  # fills the tokenizer's table
        row = {}
        for side, run in (("decode_stream_baseline", _stream_baseline), ("engine", _engine)):
            first, _, last = run(tokenizer, ids, args.run)
            row[side] = {"us_per_token_first": round(1e6 * first / _window(len(ids)), 3),
                         "us_per_token_last": round(1e6 * last / _window(len(ids)), 3)}
        row["speedup_last"] = round(row["decode_stream_baseline"]["us_per_token_last"]
                                    / row["engine"]["us_per_token_last"], 2)
        out["streams"][name] = row
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
