"""The Nemotron-Labs-Diffusion network: the shared pre-norm decoder as the release names and scales it.

The layers are Ministral-3's, which the shared decoder computes when configured without q/k norm
and biases (config.py). Two things differ from `PreNormDecoderLM` as it is:

- names: the release keeps the decoder under `encoder.` and its one head, untied, as
  `diffusion_head.weight`, so the parameters carry those names (the checkpoint's names, as the
  loader wants them);
- Llama-4 query scaling: after the rotary embedding every query row is multiplied by a factor of
  its position (config.py), exactly 1 below the original context. The layers hand their queries to
  the attention backend; this network gives them a view of the backend that scales each query row
  first, so the shared attention sublayer stays as it is.

Which keys a row sees is the attention backend's business: causal rows, and the bidirectional rows of a
diffusion block's denoising pass, which the decoding strategy names per sequence
(engine.core.decoding.seeded_block).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.families.nemotron_labs_diffusion.config import NemotronLabsDiffusionSpec, llama_4_query_scale
from engine.model.layers.decoder import PreNormDecoderLM
from engine.model.layers.parallel import TPContext
from engine.model.spec import ModelSpec
from ops.attention import AttentionBackend, AttentionMetadata


class QueryScaledBackend:
    """An attention backend whose queries are multiplied, row by row, by `factor` [T] before it
    attends; preparing and attending are otherwise the wrapped backend's."""

    def __init__(self, backend: AttentionBackend, factor: torch.Tensor):
        self.backend, self.factor = backend, factor

    def prepare(self, meta: AttentionMetadata) -> None:
        self.backend.prepare(meta)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return self.backend.forward(q * self.factor.to(q.dtype)[:, None, None], k, v, k_cache, v_cache, meta, scale)


class NemotronLabsDiffusionLM(PreNormDecoderLM):
    """The shared pre-norm decoder under the release's names (`encoder`, `diffusion_head`), its
    queries scaled per position."""

    def __init__(self, spec: ModelSpec, tp: TPContext | None = None):
        super().__init__(spec, tp)
        # the shared decoder registers `model` and `lm_head`: the same modules under the release's names
        self.encoder = self._modules.pop("model")
        self.diffusion_head = self._modules.pop("lm_head")
        extra: NemotronLabsDiffusionSpec = spec.extra
        self.query_beta, self.query_context = extra.llama_4_scaling_beta, extra.original_max_position_embeddings

    @property
    def model(self) -> nn.Module:
        """The decoder (embedding, layers, final norm), as the shared forward reads it."""
        return self.encoder

    @property
    def lm_head(self) -> nn.Linear:
        """The head, as the shared logits read it: the release's untied `diffusion_head`."""
        return self.diffusion_head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata, backend: AttentionBackend
                ) -> torch.Tensor:
        if self.query_beta:
            backend = QueryScaledBackend(backend, llama_4_query_scale(positions, self.query_beta, self.query_context))
        return super().forward(input_ids, positions, kv_caches, meta, backend)
