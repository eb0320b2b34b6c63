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

The release's draft adapter (`linear_spec_lora/`, lora.py) is optional: `load_draft_lora` hooks it onto
every `o_proj`, and a forward runs it on the rows its `draft_rows` flags (LinearSpec's draft rows), the
plain weights everywhere else. The tensor-parallel split is the shared decoder's: the embedding and the
untied `diffusion_head` by vocabulary rows (the logits gathered), attention by heads, the MLP by
intermediate channels.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from engine.model.families.nemotron_labs_diffusion.config import NemotronLabsDiffusionSpec, llama_4_query_scale
from engine.model.families.nemotron_labs_diffusion.lora import ADAPTER_DIR, DraftAdapter, read_draft_lora
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

    has_draft_adapter = True  # linear_spec's drafts may run the release's draft adapter (load_draft_lora)

    def __init__(self, spec: ModelSpec, tp: TPContext | None = None):
        super().__init__(spec, tp)
        # the shared decoder registers `model` and `lm_head`: the same modules under the release's names
        self.encoder = self._modules.pop("model")
        self.diffusion_head = self._modules.pop("lm_head")
        extra: NemotronLabsDiffusionSpec = spec.extra
        self.query_beta, self.query_context = extra.llama_4_scaling_beta, extra.original_max_position_embeddings
        self.draft_adapter: DraftAdapter | None = None

    @property
    def model(self) -> nn.Module:
        """The decoder (embedding, layers, final norm), as the shared forward reads it."""
        return self.encoder

    @property
    def lm_head(self) -> nn.Linear:
        """The head, as the shared logits read it: the release's untied `diffusion_head`."""
        return self.diffusion_head

    def load_draft_lora(self, path: str | Path | None = None) -> None:
        """Hook the draft adapter in folder `path` (default: the checkpoint's `linear_spec_lora/`, the
        release's) onto every layer's `o_proj`, this rank's share in the dtype and on the device of the
        loaded weights; a second call replaces the first's. Call it after the weights are materialised."""
        spec, reference = self.spec, self.encoder.norm.weight
        if path is None:
            path = Path(spec.path) / ADAPTER_DIR
        lora = read_draft_lora(path, spec.num_hidden_layers, spec.num_attention_heads * spec.head_dim,
                               spec.hidden_size, self.tp).to(reference.device, reference.dtype)
        if self.draft_adapter is not None:
            self.draft_adapter.remove()
        self.draft_adapter = DraftAdapter(lora, [layer.self_attn.o_proj for layer in self.encoder.layers])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata, backend: AttentionBackend,
                draft_rows: torch.Tensor | None = None) -> torch.Tensor:
        """`draft_rows` [T] (bool): the rows that run the draft adapter (None: none do); a forward that
        flags rows on a network without an adapter is a ValueError."""
        if self.query_beta:
            backend = QueryScaledBackend(backend, llama_4_query_scale(positions, self.query_beta, self.query_context))
        if draft_rows is None:
            return super().forward(input_ids, positions, kv_caches, meta, backend)
        if self.draft_adapter is None:
            raise ValueError("draft_rows given, but no draft adapter is loaded (load_draft_lora)")
        with self.draft_adapter.rows(draft_rows):
            return super().forward(input_ids, positions, kv_caches, meta, backend)
