"""A seeded-block request's settings and decoding state (`engine.core.decoding.seeded_block`): its mode
and threshold, its open block, and how its tokens are drawn -- the argmax, or at a temperature from
the request's own generator in the release's order. Owned by the seeded-block strategy; nothing
outside it reads them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.core.decoding.base import Speculation


@dataclass(frozen=True)
class SeededSettings:
    """A request's mode, its diffusion threshold (None: the step's quota, one position per pass), and
    whether it sets typed decisions (a `linear_spec` request then decodes as `ar`)."""

    mode: str
    threshold: float | None
    typed: bool = False

    @property
    def autoregressive(self) -> bool:
        """The request decodes token by token: `ar`, or `linear_spec` with typed decisions -- its output
        is `ar`'s by definition, and a forced token or an allowed set is one `ar` takes as it is."""
        return self.mode == "ar" or self.mode == "linear_spec" and self.typed


@dataclass
class SeededState:
    """A diffusion-mode request's open block and how its tokens are drawn."""

    block_length: int
    threshold: float | None
    temperature: float  # 0: argmax
    generator: torch.Generator | None  # the request's draws (temperature > 0)
    start: int  # the open block's first position (while `seeding`: the next block's)
    speculating: bool = False  # linear_spec: blocks are drafted and verified, not denoised
    seeding: bool = True  # the next forward is causal up to `start`; its last row draws the seed
    verifying: bool = False  # linear_spec: the next forward verifies the drafted block (causal)
    masked: list[int] = field(default_factory=list)  # the open block's positions holding the mask id
    num_masked_at_start: int = 0  # the open block's masks when it opened (the passes' quota spreads them)
    passes: int = 0  # denoising passes of the open block
    # a read (typed decisions): its passes in the block holding the template's last slot (None: not that
    # block), where the template ends, and whether its positions are all written
    read_steps: int | None = None
    read_end: int = 0
    read_complete: bool = False
    speculation: Speculation | None = None  # linear_spec: what its outputs report (forwards, acceptance lengths)

    @property
    def end(self) -> int:
        return self.start + self.block_length

    @property
    def block_done(self) -> bool:
        """The open block is denoised: no mask left, or its B passes spent."""
        return not self.seeding and (not self.masked or self.passes >= self.block_length)

    @property
    def bidirectional(self) -> bool:
        """The next forward is a denoising or drafting pass (the others are causal)."""
        return not self.seeding and not self.verifying

    def draw(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(one token per row: the argmax, or one multinomial draw over all the rows from softmax(l / T);
        the distribution they were drawn from), as the release draws."""
        if not self.temperature:
            return logits.argmax(-1), torch.softmax(logits, -1)
        probs = torch.softmax(logits / self.temperature, -1)
        return torch.multinomial(probs.to(self.generator.device), 1, generator=self.generator)[:, 0], probs

    def candidates(self, logits: torch.Tensor, offsets: list[int]) -> torch.Tensor:
        """Per masked row its candidate: the argmax, or at temperature T the argmax of
        exp(l) / (-ln u)^T in float64 with u drawn for every position of the block."""
        if not self.temperature:
            return logits.argmax(-1)
        noise = torch.rand((self.block_length, logits.shape[-1]), dtype=torch.float64, generator=self.generator,
                           device=self.generator.device)[offsets].to(logits.device)
        return (logits.double().exp() / (-torch.log(noise)) ** self.temperature).argmax(-1)
