"""A tiny Nemotron-Labs-Diffusion trained so that its diffusion drafts agree with its autoregressive tokens.

Random weights almost never draft what they then decode autoregressively, so LinearSpec accepts about
one token per verify on them and nothing can be learnt about its speed. `write_drafting_nemotron` trains
the tiny checkpoint for a few hundred CPU steps on a toy language -- sequences that repeat a random
motif of `PERIOD` tokens -- with the release's two objectives on one set of weights:

- autoregressive: next-token cross-entropy under the causal mask;
- diffusion: a block of B positions at a random offset, its first token (the seed) kept and a random
  fraction of the others replaced by the mask token, predicted at their own rows under the release's
  block mask (the block bidirectional, its prefix causal: `loop_mask`).

Given a periodic prompt, the trained model continues the motif in both modes, so each verify accepts
(nearly) the whole drafted block: a checkpoint on which LinearSpec's acceptance is that of a trained
model, for `python -m bench.nemotron`'s comparison with `ar`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from testing.references.nemotron_labs_diffusion import loop_mask
from testing.tiny.nemotron_labs_diffusion import load_ministral3, to_released_names, write_tiny_nemotron_labs_diffusion

PERIOD = 3  # the toy language's motif length
MOTIF_IDS = (40, 120)  # motif tokens are drawn from [40, 120): ordinary byte tokens
LENGTH = 96  # training sequence length: the positions the bench decodes at
BATCH = 32  # sequences per training step


def periodic(n: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """`n` sequences of `length` tokens, each a random motif of PERIOD tokens repeated."""
    motifs = torch.randint(*MOTIF_IDS, (n, PERIOD), generator=generator)
    return motifs.repeat(1, -(-length // PERIOD))[:, :length]


def write_drafting_nemotron(path: str | Path, *, steps: int = 300, seed: int = 0, lr: float = 3e-3,
                            batch: int = BATCH, length: int = LENGTH, **shape) -> Path:
    """Write the tiny checkpoint (`shape`: `write_tiny_nemotron_labs_diffusion`'s arguments) to `path`,
    train it `steps` steps of AdamW on both objectives (batches of `batch` sequences of `length` tokens)
    and save the trained weights in its place; returns `path`."""
    path = write_tiny_nemotron_labs_diffusion(path, seed=seed, **shape)
    cfg = json.loads((path / "config.json").read_text())
    mask_id, b = cfg["mask_token_id"], cfg["block_size"]
    model = load_ministral3(path).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = periodic(batch, length, generator)
        logits = model(input_ids=tokens, use_cache=False).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        start = int(torch.randint(PERIOD * 2, length - b + 1, (1,), generator=generator))
        noisy = tokens[:, : start + b].clone()
        hidden = torch.rand((batch, b), generator=generator) < torch.rand((batch, 1), generator=generator)
        hidden[:, 0] = False  # the seed is given
        if hidden.any():
            block = noisy[:, start:]
            block[hidden] = mask_id
            mask = loop_mask(start + b, start, True, torch.float32)
            rows = model(input_ids=noisy, attention_mask=mask, position_ids=torch.arange(start + b)[None],
                         use_cache=False).logits[:, start:]
            loss = loss + F.cross_entropy(rows[hidden], tokens[:, start: start + b][hidden])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if "rotary_emb" not in k}
    save_file(to_released_names(state), str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
