"""Train the two tiny default models shipped in `models/` on a corpus generated in code.

    python -m training.train_tiny --model sdar|qwen3|both --out models/ --minutes N --seed 0

* `models/sdar-tiny/`  -- SDAR block-diffusion model (block length B=4), masked-block objective.
* `models/qwen3-tiny/` -- Qwen3 autoregressive model, next-token objective.

Both are plain `transformers.Qwen3ForCausalLM` networks during training (SDAR uses Qwen3 layers and
Qwen3 tensor names); only config.json tells them apart on disk.

Corpus: short checkable tasks (multi-digit addition, counting, copying and reversing lists) plus
templated English sentences, each example `prompt + answer + <|endoftext|>`. Every example starts
at position 0 (documents are packed into rows with block-diagonal attention and position ids that
restart at 0), exactly as a prompt does at inference time.

SDAR objective (BD3-LM layout): the input is `concat(x_t, x_0)` with position ids `0..L-1` twice;
noisy block k attends to noisy block k and clean blocks < k, clean block k to clean blocks <= k.
Each block gets its own mask ratio t ~ U(0, 1]; answer positions (the padding `<|endoftext|>`s
included) are replaced by `<|MASK|>` with probability t; cross-entropy on masked positions of the
noisy half predicts the clean token at the same position (no shift). Each document is padded with
`<|endoftext|>` to a multiple of B, so the model learns that a block ends in `<|endoftext|>`s after
the answer and can unmask them all at once.

Reproducibility: the run is fully determined by `--seed` and the number of optimizer steps.
`--minutes` only picks that number (from the measured speed of the first steps); the chosen number
is printed and recorded in docs/training.md, and `--steps N` replays a run exactly.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file

from testing.tiny_checkpoint import build_byte_tokenizer, write_tokenizer

BLOCK = 4
NAMES = {"sdar": "sdar-tiny", "qwen3": "qwen3-tiny"}
ROOT = Path(__file__).resolve().parent.parent

# ----------------------------------------------------------------------------------------------
# Corpus
# ----------------------------------------------------------------------------------------------

ADJ = ["red", "big", "small", "old", "young", "quick", "lazy", "happy", "quiet", "brave", "green", "tall"]
NOUN = ["cat", "dog", "fox", "bird", "girl", "boy", "robot", "king", "fish", "horse", "teacher", "farmer"]
VERB = ["sees", "likes", "follows", "helps", "finds", "watches", "calls", "visits"]
PLACE = ["park", "river", "garden", "forest", "city", "school", "market", "house"]
LETTERS = "abcdefghijklmnopqrstuvwxyz"

# Sampling weights of the tasks.
TASKS = {"add": 0.50, "count": 0.20, "copy": 0.12, "reverse": 0.12, "sentence": 0.06}
# Operand digit counts of the training additions and their weights.
ADD_DIGITS = {1: 1, 2: 4}


def addition_example(a: int, b: int) -> tuple[str, str]:
    return f"{a}+{b}=", f"{a + b}"


def heldout_addition(n: int = 50, seed: int = 1234) -> list[tuple[int, int]]:
    """The held-out arithmetic prompts: `d`-digit + `d`-digit for the multi-digit `d` of
    `ADD_DIGITS`, in equal shares. Training never sees these pairs (in either order)."""
    rng = random.Random(seed)
    multi = [d for d in ADD_DIGITS if d >= 2]
    pairs: list[tuple[int, int]] = []
    while len(pairs) < n:
        digits = multi[len(pairs) * len(multi) // n]
        lo, hi = 10 ** (digits - 1), 10**digits - 1
        pair = (rng.randint(lo, hi), rng.randint(lo, hi))
        if pair not in pairs:
            pairs.append(pair)
    return pairs


def count_example(start: int, end: int) -> tuple[str, str]:
    return f"count {start} to {end} ->", f" [{','.join(str(i) for i in range(start, end + 1))}]"


def list_example(kind: str, items: list[str]) -> tuple[str, str]:
    """`copy [a,b,c] -> [a,b,c]`, `reverse [a,b,c] -> [c,b,a]`. Bracketed, comma-separated items
    without spaces are one token each (no BPE merge applies), so positions line up."""
    out = items if kind == "copy" else items[::-1]
    return f"{kind} [{','.join(items)}] ->", f" [{','.join(out)}]"


def _operand(rng: random.Random) -> int:
    digits = rng.choices(list(ADD_DIGITS), weights=list(ADD_DIGITS.values()))[0]
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def _items(rng: random.Random) -> list[str]:
    n = rng.randint(2, 8)
    pool = "0123456789" if rng.random() < 0.5 else LETTERS
    return [rng.choice(pool) for _ in range(n)]


class Corpus:
    """An endless, seeded stream of `(prompt, answer)` examples."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.exclude = {p for a, b in heldout_addition() for p in ((a, b), (b, a))}
        self.kinds = list(TASKS)
        self.weights = [TASKS[k] for k in self.kinds]

    def sample(self) -> tuple[str, str]:
        rng = self.rng
        kind = rng.choices(self.kinds, weights=self.weights)[0]
        if kind == "add":
            while True:
                a, b = _operand(rng), _operand(rng)
                if (a, b) not in self.exclude:
                    return addition_example(a, b)
        if kind == "count":
            start = rng.randint(0, 99)
            return count_example(start, start + rng.randint(1, 9))
        if kind in ("copy", "reverse"):
            return list_example(kind, _items(rng))
        subject = f"the {rng.choice(ADJ)} {rng.choice(NOUN)}"
        obj = f"the {rng.choice(ADJ)} {rng.choice(NOUN)}"
        if rng.random() < 0.5:
            return "", f"{subject} {rng.choice(VERB)} {obj}."
        return "", f"{subject} {rng.choice(VERB)} {obj} in the {rng.choice(PLACE)}."


# ----------------------------------------------------------------------------------------------
# Batches: documents packed into rows, each document restarting at position 0
# ----------------------------------------------------------------------------------------------


@dataclass
class Batch:
    ids: torch.Tensor  # [N, L] clean tokens
    pos: torch.Tensor  # [N, L] position inside the document
    doc: torch.Tensor  # [N, L] document index inside the row (-1 = row padding)
    answer: torch.Tensor  # [N, L] bool: position belongs to the answer (or its eos padding)
    real: torch.Tensor  # [N, L] bool: a real token (not padding after the document's first eos)


class Packer:
    def __init__(self, corpus: Corpus, tok, row_len: int, rows: int, pad_to: int) -> None:
        self.corpus, self.tok, self.row_len, self.rows, self.pad_to = corpus, tok, row_len, rows, pad_to
        self.eos = tok.convert_tokens_to_ids("<|endoftext|>")
        self.pending: tuple[list[int], int] | None = None

    def _doc(self) -> tuple[list[int], int]:
        prompt, answer = self.corpus.sample()
        p = self.tok(prompt, add_special_tokens=False).input_ids if prompt else []
        a = self.tok(answer, add_special_tokens=False).input_ids + [self.eos]
        return p + a, len(p)

    def next(self) -> Batch:
        n, length = self.rows, self.row_len
        ids = torch.full((n, length), self.eos, dtype=torch.long)
        pos = torch.zeros((n, length), dtype=torch.long)
        doc = torch.full((n, length), -1, dtype=torch.long)
        answer = torch.zeros((n, length), dtype=torch.bool)
        real = torch.zeros((n, length), dtype=torch.bool)
        for r in range(n):
            off, d = 0, 0
            while True:
                toks, plen = self.pending or self._doc()
                self.pending = None
                span = -(-len(toks) // self.pad_to) * self.pad_to
                if span > length:
                    raise ValueError(f"example of {len(toks)} tokens does not fit a row of {length}")
                if off + span > length:
                    self.pending = (toks, plen)
                    break
                ids[r, off : off + len(toks)] = torch.tensor(toks)
                pos[r, off : off + span] = torch.arange(span)
                doc[r, off : off + span] = d
                answer[r, off + plen : off + span] = True
                real[r, off : off + len(toks)] = True
                off, d = off + span, d + 1
        return Batch(ids, pos, doc, answer, real)


NEG = torch.finfo(torch.float32).min


def sdar_training_mask(doc: torch.Tensor, block: int, copies: int = 1) -> torch.Tensor:
    """Additive [N, 1, (C+1)L, (C+1)L] mask for `concat(x_t^1, ..., x_t^C, x_0)`. Documents start at
    multiples of `block`, so row-global block indices coincide with in-document ones."""
    n, length = doc.shape
    blk = torch.arange(length) // block
    same_doc = (doc[:, :, None] == doc[:, None, :]) & (doc[:, :, None] >= 0)  # [N, L, L]
    eq = (blk[:, None] == blk[None, :])[None]
    lt = (blk[None, :] < blk[:, None])[None]
    nn_ = same_doc & eq  # noisy -> the same noisy copy: its own block
    nc = same_doc & lt  # noisy -> clean: earlier blocks
    cc = same_doc & (eq | lt)  # clean -> clean: block-causal
    none = torch.zeros_like(nn_)  # clean -> noisy, noisy -> another noisy copy: never
    rows = [torch.cat([nn_ if c == j else none for j in range(copies)] + [nc], 2) for c in range(copies)]
    rows.append(torch.cat([none] * copies + [cc], 2))
    allowed = torch.cat(rows, 1)
    # Row padding (doc == -1) sees nothing; let every query see itself so no softmax row is empty.
    allowed |= torch.eye((copies + 1) * length, dtype=torch.bool)[None]
    return torch.zeros(allowed.shape, dtype=torch.float32).masked_fill(~allowed, NEG)[:, None]


def causal_doc_mask(doc: torch.Tensor) -> torch.Tensor:
    """Additive [N, 1, L, L] causal mask restricted to each document."""
    n, length = doc.shape
    i = torch.arange(length)
    allowed = (doc[:, :, None] == doc[:, None, :]) & (i[None, :] <= i[:, None])[None]
    allowed |= torch.eye(length, dtype=torch.bool)[None]
    return torch.zeros(allowed.shape, dtype=torch.float32).masked_fill(~allowed, NEG)[:, None]


def sdar_loss(model, batch: Batch, mask_id: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """Masked-block loss with two complementary noisy copies: per block a ratio t ~ U(0, 1], copy 1
    masks each answer position with probability t, copy 2 masks exactly the answer positions that
    copy 1 kept, so every answer token is predicted once per example (antithetic sampling of t)."""
    n, length = batch.ids.shape
    t = torch.rand((n, length // BLOCK), generator=gen).clamp_min(1e-3).repeat_interleave(BLOCK, 1)
    first = (torch.rand((n, length), generator=gen) < t) & batch.answer
    masks = [first, batch.answer & ~first]
    noisy = [torch.where(m, torch.full_like(batch.ids, mask_id), batch.ids) for m in masks]
    hidden = model.model(
        input_ids=torch.cat([*noisy, batch.ids], 1),
        attention_mask=sdar_training_mask(batch.doc, BLOCK, len(masks)),
        position_ids=batch.pos.repeat(1, len(masks) + 1),
    ).last_hidden_state
    hid = torch.cat([hidden[:, c * length : (c + 1) * length][m] for c, m in enumerate(masks)])
    target = torch.cat([batch.ids[m] for m in masks])
    return F.cross_entropy(model.lm_head(hid), target), int(target.numel())


def ar_loss(model, batch: Batch) -> tuple[torch.Tensor, int]:
    labels = batch.ids[:, 1:].masked_fill(~batch.real[:, 1:], -100)
    # Never predict across documents: the label must belong to the same document.
    labels = labels.masked_fill(batch.doc[:, 1:] != batch.doc[:, :-1], -100)
    hidden = model.model(
        input_ids=batch.ids, attention_mask=causal_doc_mask(batch.doc), position_ids=batch.pos
    ).last_hidden_state[:, :-1]
    keep = labels != -100
    logits = model.lm_head(hidden[keep])
    return F.cross_entropy(logits, labels[keep]), int(keep.sum())


# ----------------------------------------------------------------------------------------------
# Model, checkpoint
# ----------------------------------------------------------------------------------------------

MODEL_SIZE = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=1024,
)
ROPE_THETA = 10000.0


def special_ids(tok) -> dict[str, int]:
    return {t: tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>")}


def build_model(tok, seed: int) -> transformers.Qwen3ForCausalLM:
    sp = special_ids(tok)
    config = transformers.Qwen3Config(
        vocab_size=-(-len(tok) // 64) * 64,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        tie_word_embeddings=False,
        eos_token_id=sp["<|endoftext|>"],
        pad_token_id=sp["<|endoftext|>"],
        bos_token_id=None,
        attn_implementation="sdpa",
        **MODEL_SIZE,
    )
    torch.manual_seed(seed)
    return transformers.Qwen3ForCausalLM(config).to(torch.float32)


def save_checkpoint(model, tok, kind: str, path: Path) -> None:
    """Write the real on-disk format: config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json, generation_config.json."""
    path.mkdir(parents=True, exist_ok=True)
    sp = special_ids(tok)
    c = model.config
    cfg = {
        "architectures": ["SDARForCausalLM" if kind == "sdar" else "Qwen3ForCausalLM"],
        "model_type": kind,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": sp["<|endoftext|>"],
        "pad_token_id": sp["<|endoftext|>"],
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "hidden_size": c.hidden_size,
        "initializer_range": c.initializer_range,
        "intermediate_size": c.intermediate_size,
        "max_position_embeddings": c.max_position_embeddings,
        "max_window_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_hidden_layers": c.num_hidden_layers,
        "num_key_value_heads": c.num_key_value_heads,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": ROPE_THETA,
        "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA},
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "dtype": "float32",
        "transformers_version": transformers.__version__,
        "use_cache": True,
        "vocab_size": c.vocab_size,
    }
    if kind == "sdar":
        cfg["block_size"] = BLOCK
        cfg["mask_token_id"] = sp["<|MASK|>"]
    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen = {
        "bos_token_id": None,
        "eos_token_id": [sp["<|im_end|>"], sp["<|endoftext|>"]],
        "pad_token_id": sp["<|endoftext|>"],
        "do_sample": False,
        "transformers_version": transformers.__version__,
    }
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "model.safetensors").chmod(0o644)  # safetensors writes 0600
    write_tokenizer(tok, path, c.max_position_embeddings)


# ----------------------------------------------------------------------------------------------
# Training loop
# ----------------------------------------------------------------------------------------------

ROWS = 16
ROW_LEN = 64
LR = 4e-3
WARMUP = 100
CALIBRATION_STEPS = 30


def lr_at(step: int, total: int) -> float:
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    progress = (step - WARMUP) / max(1, total - WARMUP)
    return LR * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(kind: str, out: Path, minutes: float, steps: int | None, seed: int) -> dict:
    torch.set_num_threads(1)
    tok = build_byte_tokenizer()
    mask_id = special_ids(tok)["<|MASK|>"]
    model = build_model(tok, seed)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LR,
        betas=(0.9, 0.98),
        eps=1e-8,
    )
    packer = Packer(Corpus(seed), tok, ROW_LEN, ROWS, BLOCK)
    gen = torch.Generator().manual_seed(seed)
    total = steps
    log: list[dict] = []
    t0, cpu0 = time.perf_counter(), time.process_time()
    ema, step = None, 0
    print(f"[{kind}] {n_params / 1e6:.2f}M parameters, rows {ROWS}x{ROW_LEN}", flush=True)
    while total is None or step < total:
        if total is None and step == CALIBRATION_STEPS:
            per_step = (time.perf_counter() - t0) / CALIBRATION_STEPS
            total = max(CALIBRATION_STEPS + 1, int(minutes * 60 / per_step))
            print(f"[{kind}] {per_step * 1000:.0f} ms/step -> {total} steps for {minutes} min", flush=True)
        lr = lr_at(step, total or 10**9)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = packer.next()
        loss, _ = sdar_loss(model, batch, mask_id, gen) if kind == "sdar" else ar_loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        value = float(loss.detach())
        ema = value if ema is None else 0.98 * ema + 0.02 * value
        step += 1
        if step % 25 == 0 or step == total:
            elapsed = time.perf_counter() - t0
            log.append({"step": step, "loss": value, "ema": ema, "lr": lr, "seconds": round(elapsed, 1)})
            if step % 250 == 0 or step == total:
                print(f"[{kind}] step {step}/{total} loss {ema:.4f} lr {lr:.2e} {elapsed:.0f}s", flush=True)
    seconds = time.perf_counter() - t0
    cpu_seconds = time.process_time() - cpu0
    model.eval()
    path = out / NAMES[kind]
    save_checkpoint(model, tok, kind, path)
    info = {
        "kind": kind,
        "steps": step,
        "seconds": round(seconds, 1),
        "cpu_seconds": round(cpu_seconds, 1),
        "seed": seed,
        "parameters": n_params,
        "rows": ROWS,
        "row_len": ROW_LEN,
        "final_loss_ema": ema,
        "log": log,
    }
    (path / "training_log.json").write_text(json.dumps(info, indent=1) + "\n")
    print(
        f"[{kind}] done: {step} steps in {seconds:.0f}s ({cpu_seconds:.0f}s CPU), loss {ema:.4f} -> {path}", flush=True
    )
    return info


# ----------------------------------------------------------------------------------------------
# Report: loss plot + docs/training.md
# ----------------------------------------------------------------------------------------------


def plot(out: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for kind, name in NAMES.items():
        f = out / name / "training_log.json"
        if not f.exists():
            continue
        info = json.loads(f.read_text())
        steps = [r["step"] for r in info["log"]]
        label = "SDAR masked-block CE" if kind == "sdar" else "Qwen3 next-token CE"
        ax.plot(steps, [r["loss"] for r in info["log"]], alpha=0.25, lw=0.8)
        ax.plot(
            steps, [r["ema"] for r in info["log"]], lw=1.6, label=f"{name}: {label}", color=ax.lines[-1].get_color()
        )
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title("tiny default models: training loss (faint: per step, bold: EMA)")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["sdar", "qwen3", "both"], default="both")
    ap.add_argument("--out", type=Path, default=ROOT / "models")
    ap.add_argument("--minutes", type=float, default=10.0, help="training time per model")
    ap.add_argument("--steps", type=int, default=None, help="exact optimizer steps (overrides --minutes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--docs", type=Path, default=ROOT / "docs", help="where training_loss.png / training.md go")
    ap.add_argument("--no-eval", action="store_true", help="skip the held-out evaluation and docs")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    kinds = ["sdar", "qwen3"] if args.model == "both" else [args.model]
    for kind in kinds:
        train(kind, args.out, args.minutes, args.steps, args.seed)
    if args.no_eval:
        plot(args.out, args.docs / "training_loss.png")
    else:
        from training.evaluate import evaluate_all, write_report

        write_report(args.out, args.docs, evaluate_all(args.out))


if __name__ == "__main__":
    main()
