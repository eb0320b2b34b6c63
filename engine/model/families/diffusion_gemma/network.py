"""The DiffusionGemma layer stack: Gemma-4 text layers (sliding and full attention of different head
sizes, a dense GeGLU MLP beside 128 routed GeGLU experts, a per-layer scalar), the self-conditioning
MLP of the canvas pass, a tied LM head with a final tanh softcap.

Parameter names equal the checkpoint's (`model.decoder.*`), so loading is a name lookup. The math
follows transformers' `DiffusionGemmaForBlockDiffusion` step for step, dtype casts included:
RMSNorm in float32 as x·(mean(x²)+ε)^-½·w (no 1+w; v-norm, the router's norm and the
self-conditioning output norm have no w), attention scaling 1.0, the router on the raw residual, the
experts' weighted outputs summed in float32 in top-k order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import CheckpointError
from engine.model.families.diffusion_gemma.attention import (
    CANVAS,
    GemmaAttentionBackend,
    GemmaAttentionMeta,
    GemmaPass,
    GemmaTorchAttention,
    gemma_attention,
)
from engine.model.families.diffusion_gemma.config import GemmaSpec, LayerGeometry
from engine.model.families.diffusion_gemma.flex_attention import GemmaFlexAttention
from engine.model.families.diffusion_gemma.kv_layout import KVLayout
from engine.model.families.diffusion_gemma.parallel import ExpertDownSplit, GateUpSplit
from engine.model.families.diffusion_gemma.triton_attention import GemmaTritonAttention
from engine.model.layers.parallel import TPContext, column_parallel, row_parallel
from ops.attention import flex_unmet, require_triton
from ops.grouped_gemm import group_ends, grouped_linear

ENCODER = "model.encoder.language_model."


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            h = h * self.weight.float()
        return h.type_as(x)


def rope_inv_freq(geo: LayerGeometry) -> torch.Tensor:
    """head_dim/2 frequencies: `rotated_pairs` of 1/θ^(2i/rope_dim) (÷ factor), the rest 0."""
    cpu = torch.device("cpu")  # a real table even while the network is built on the meta device
    rotated = 1.0 / (geo.rope_theta ** (torch.arange(0, 2 * geo.rotated_pairs, 2, dtype=torch.float, device=cpu)
                                        / geo.rope_dim))
    rest = torch.zeros(geo.head_dim // 2 - geo.rotated_pairs, device=cpu)
    return torch.cat([rotated, rest]) / geo.rope_factor


def _check_divisible(gemma: GemmaSpec, tp_size: int) -> None:
    """Heads, every layer's K/V heads and the MLP and expert widths must split evenly over the ranks."""
    sizes = {"num_attention_heads": gemma.num_attention_heads, "intermediate_size": gemma.intermediate_size,
             "moe_intermediate_size": gemma.moe_intermediate_size}
    sizes |= {f"layer {i} num_key_value_heads": g.num_kv_heads for i, g in enumerate(gemma.layers)}
    for name, size in sizes.items():
        if size % tp_size:
            raise CheckpointError(f"{name}={size} does not split over tp={tp_size} ranks; use a tp that divides it")


def _rope_key(geo: LayerGeometry) -> tuple:
    return geo.head_dim, geo.rope_theta, geo.rotated_pairs, geo.rope_dim, geo.rope_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotate-half over the whole head: x [T, heads, D], cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class GeGLU(nn.Module):
    """gate/up column-parallel, down row-parallel (its output all-reduced)."""

    def __init__(self, hidden: int, inner: int, tp: TPContext):
        super().__init__()
        self.tp = tp
        self.gate_proj = column_parallel(nn.Linear(hidden, inner // tp.size, bias=False), tp)
        self.up_proj = column_parallel(nn.Linear(hidden, inner // tp.size, bias=False), tp)
        self.down_proj = row_parallel(nn.Linear(inner // tp.size, hidden, bias=False), tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x)))


class GemmaAttention(nn.Module):
    def __init__(self, spec: GemmaSpec, geo: LayerGeometry, tp: TPContext):
        super().__init__()
        self.geo, self.head_dim, self.tp = geo, geo.head_dim, tp
        h, heads, kv = spec.hidden_size, spec.num_attention_heads // tp.size, geo.num_kv_heads // tp.size
        self.q_proj = column_parallel(nn.Linear(h, heads * geo.head_dim, bias=False), tp)
        self.k_proj = column_parallel(nn.Linear(h, kv * geo.head_dim, bias=False), tp)
        self.v_proj = column_parallel(nn.Linear(h, kv * geo.head_dim, bias=False), tp) if geo.has_v_proj else None
        self.o_proj = row_parallel(nn.Linear(heads * geo.head_dim, h, bias=False), tp)
        self.q_norm = GemmaRMSNorm(geo.head_dim, spec.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(geo.head_dim, spec.rms_norm_eps)
        self.v_norm = GemmaRMSNorm(geo.head_dim, spec.rms_norm_eps, with_scale=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: tuple[torch.Tensor, ...],
                meta: GemmaAttentionMeta) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        q = apply_rope(self.q_norm(self.q_proj(x).view(t, -1, d)), cos, sin)
        k_raw = self.k_proj(x).view(t, -1, d)
        v = self.v_norm(self.v_proj(x).view(t, -1, d) if self.v_proj is not None else k_raw)
        k = apply_rope(self.k_norm(k_raw), cos, sin)
        out = gemma_attention(q, k, v, cache[0], cache[1], meta, self.geo.kind)
        return self.tp.all_reduce(self.o_proj(out.reshape(t, -1)))


class GemmaRouter(nn.Module):
    def __init__(self, spec: GemmaSpec):
        super().__init__()
        self.top_k, self.root = spec.top_k_experts, spec.hidden_size**-0.5
        self.norm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps, with_scale=False)
        self.proj = nn.Linear(spec.hidden_size, spec.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(spec.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(spec.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.softmax(self.proj(self.norm(x) * self.scale * self.root), dim=-1, dtype=torch.float32)
        weights, index = torch.topk(probs, k=self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[index], index


class GemmaExperts(nn.Module):
    """Routed GeGLU experts stacked as the checkpoint stores them: gate_up [E, 2I, H] (gate first),
    down [E, H, I]."""

    def __init__(self, spec: GemmaSpec, tp: TPContext):
        super().__init__()
        e, h, i = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size // tp.size
        self.tp = tp
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.weight_loaders = {"gate_up_proj": GateUpSplit(tp), "down_proj": ExpertDownSplit(tp)}

    def forward(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        t, k = index.shape
        flat = index.reshape(-1)
        # the (token, slot) pairs grouped by expert, each group in pair order (a stable sort)
        order = torch.sort(flat, stable=True).indices
        ends = group_ends(flat, self.gate_up_proj.shape[0])
        gate, up = grouped_linear(x[order // k], self.gate_up_proj, ends).chunk(2, dim=-1)
        pair_out = x.new_empty(t * k, x.shape[-1])
        pair_out[order] = grouped_linear(F.gelu(gate, approximate="tanh") * up, self.down_proj, ends)
        weighted = pair_out * weights.reshape(-1, 1).to(pair_out.dtype)
        return self.tp.all_reduce(weighted.float().view(t, k, -1).sum(dim=1)).to(x.dtype)


class GemmaLayer(nn.Module):
    def __init__(self, spec: GemmaSpec, geo: LayerGeometry, tp: TPContext):
        super().__init__()
        h, eps = spec.hidden_size, spec.rms_norm_eps
        self.self_attn = GemmaAttention(spec, geo, tp)
        self.mlp = GeGLU(h, spec.intermediate_size, tp)
        self.router = GemmaRouter(spec)
        self.experts = GemmaExperts(spec, tp)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "post_feedforward_layernorm_1",
                     "pre_feedforward_layernorm_2", "post_feedforward_layernorm_2"):
            setattr(self, name, GemmaRMSNorm(h, eps))
        self.layer_scalar = nn.Parameter(torch.ones(1))

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: tuple[torch.Tensor, ...],
                meta: GemmaAttentionMeta) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), cos, sin, cache, meta))
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(h)))
        weights, index = self.router(h)
        routed = self.post_feedforward_layernorm_2(self.experts(self.pre_feedforward_layernorm_2(h), weights, index))
        h = h + self.post_feedforward_layernorm(dense + routed)
        return h * self.layer_scalar


class SelfConditioning(GeGLU):
    """The canvas pass's input: post_norm(embeds + GeGLU(pre_norm(soft)))."""

    def __init__(self, spec: GemmaSpec, tp: TPContext):
        super().__init__(spec.hidden_size, spec.intermediate_size, tp)
        self.pre_norm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_norm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps, with_scale=False)

    def condition(self, embeds: torch.Tensor, soft: torch.Tensor | None) -> torch.Tensor:
        """No soft embedding (a canvas's first step) adds exactly 0: GeGLU(pre_norm(0)) = 0."""
        if soft is not None:
            embeds = embeds + self(self.pre_norm(soft))
        return self.post_norm(embeds)


class GemmaDecoder(nn.Module):
    def __init__(self, spec: GemmaSpec, tp: TPContext):
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)  # replicated, as the LM head
        self.layers = nn.ModuleList(GemmaLayer(spec, geo, tp) for geo in spec.layers)
        self.norm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_conditioning = SelfConditioning(spec, tp)


class EncoderScalars(nn.Module):
    """The text encoder's `layer_scalar`s, which transformers does not tie to the decoder's: read so
    that `check_loaded` can refuse a checkpoint whose two copies differ."""

    def __init__(self, n: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Module() for _ in range(n))
        for layer in self.layers:
            layer.layer_scalar = nn.Parameter(torch.ones(1))


class DiffusionGemmaNetwork(nn.Module):
    """forward: final hidden states of every fed row (encoder and canvas passes together);
    `logits`: softcapped float32 vocabulary rows of the hidden rows asked for.

    Built from a GemmaSpec, or from the engine's ModelSpec carrying one in `extra`."""

    checks_loaded = True  # engine.model.interfaces: encoder and decoder tensors that must agree
    has_layer_groups = True  # sliding and full layers in K/V pools of their own, run as encoder / canvas passes

    def __init__(self, spec, tp=None):
        super().__init__()
        gemma = spec if isinstance(spec, GemmaSpec) else spec.extra
        tp = tp or TPContext()
        _check_divisible(gemma, tp.size)
        self.spec, self.gemma, self.tp, self.moe_stats = spec, gemma, tp, None
        self.model = nn.Module()
        self.model.decoder = GemmaDecoder(gemma, tp)
        self.model.encoder = nn.Module()
        self.model.encoder.language_model = EncoderScalars(gemma.num_hidden_layers)
        # one rotary table per distinct recipe (in practice one for each layer kind)
        self.rope_keys = [_rope_key(geo) for geo in gemma.layers]
        self.inv_freqs = {key: rope_inv_freq(geo) for key, geo in zip(self.rope_keys, gemma.layers, strict=True)}

    @property
    def embed_tokens(self) -> nn.Embedding:
        """The input embedding, which is also the LM head."""
        return self.model.decoder.embed_tokens

    def ignores_tensor(self, name: str) -> bool:
        """Tensors a checkpoint holds that are never read: the vision tower, `embed_vision`, the tied
        LM head, and the text encoder's tied duplicates of the decoder's tensors."""
        if name.startswith(("model.encoder.vision_tower.", "model.encoder.embed_vision.", "lm_head.")):
            return True
        return name.startswith(ENCODER) and not name.endswith(".layer_scalar")

    def check_loaded(self) -> None:
        """Refuse unequal encoder and decoder layer scalars, naming both."""
        for i, (enc, dec) in enumerate(zip(self.model.encoder.language_model.layers, self.model.decoder.layers,
                                           strict=True)):
            if not torch.equal(enc.layer_scalar, dec.layer_scalar):
                raise CheckpointError(
                    f"{ENCODER}layers.{i}.layer_scalar = {enc.layer_scalar.tolist()} differs from "
                    f"model.decoder.layers.{i}.layer_scalar = {dec.layer_scalar.tolist()}: encoder and "
                    "decoder share their layers, so their layer scalars must be equal")

    def materialize(self, device: torch.device, dtype: torch.dtype) -> DiffusionGemmaNetwork:
        """Allocate every parameter (uninitialised) in `dtype` on `device`."""
        self.to(dtype=dtype).to_empty(device=device)
        return self

    def use_compiled_elementwise(self) -> DiffusionGemmaNetwork:
        """No compiled elementwise path yet: the layers stay eager."""
        return self

    def kv_layout(self, page_size: int, tp_size: int) -> KVLayout:
        """The page geometry of the two layer groups (the runner sizes and allocates the caches by it)."""
        return KVLayout(self.gemma, page_size, tp_size)

    @staticmethod
    def attention_backend(spec, name: str, device: torch.device) -> GemmaAttentionBackend:
        """The backend for `EngineConfig.attention_backend` (chosen before the weights load): `torch` (the
        reference) and `auto` the torch reference; `flex` FlexAttention (compiled where it can serve,
        eager elsewhere); `triton` the project's paged kernel in its passes mode (CUDA; the CPU only under
        Triton's interpreter). `flash` is refused: no installed flash kernel takes a canvas pass
        (bidirectional among its queries, over committed keys it does not write) or the full layers'
        head size."""
        gemma = spec if isinstance(spec, GemmaSpec) else spec.extra
        if name == "flash":
            head_dims = sorted({geo.head_dim for geo in gemma.layers})
            raise ValueError("attention_backend='flash' cannot run a diffusion_gemma model: its canvas pass "
                             "attends bidirectionally over keys it does not write, and its layers have "
                             f"head_dim {head_dims}, which no flash kernel here takes; use attention_backend="
                             "'flex', 'torch' or 'auto'")
        if name == "flex":
            return GemmaFlexAttention(compiled=not flex_unmet(device), dynamic=True)
        if name == "triton":
            require_triton(device)
            return GemmaTritonAttention(gemma)
        return GemmaTorchAttention()

    def pass_metadata(self, kinds: list[str], starts: list[int], q_lens: list[int],
                      page_tables: dict[str, list[list[int]]], soft: list[torch.Tensor | None], page_size: int,
                      device: torch.device, backend: GemmaAttentionBackend | None = None) -> GemmaAttentionMeta:
        """The attention metadata of one forward of encoder / canvas passes (one per sequence); `backend`
        None: the torch reference."""
        passes = [GemmaPass(kind, start, n, {g: tables[s] for g, tables in page_tables.items()}, soft[s])
                  for s, (kind, start, n) in enumerate(zip(kinds, starts, q_lens, strict=True))]
        return GemmaAttentionMeta(passes, page_size, self.gemma.sliding_window, device, backend)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        weight = self.model.decoder.embed_tokens.weight
        return F.embedding(ids, weight) * torch.tensor(self.gemma.hidden_size**0.5).to(weight.dtype)

    def soft_embedding(self, processed_logits: torch.Tensor) -> torch.Tensor:
        """The self-conditioning input of a canvas step: softmax of the previous step's processed
        logits (cast to the weights' dtype, softmax in float32) @ embedding, × √H."""
        weight = self.model.decoder.embed_tokens.weight
        probs = processed_logits.to(weight.dtype).softmax(dim=-1, dtype=torch.float32).to(weight.dtype)
        return (probs @ weight) * torch.tensor(self.gemma.hidden_size**0.5).to(weight.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, ...]],
                meta: GemmaAttentionMeta) -> torch.Tensor:
        """Final hidden states of every fed row; attention through `meta.backend`."""
        decoder = self.model.decoder
        h = self.embed(input_ids)
        row = 0
        for p in meta.passes:
            if p.kind == CANVAS:
                rows = slice(row, row + p.q_len)
                h[rows] = decoder.self_conditioning.condition(h[rows], p.soft_embedding)
            row += p.q_len
        meta.prepare()
        angles = {}
        for key, inv in self.inv_freqs.items():  # as transformers: float32 angles, cos/sin in h's dtype
            freqs = positions.float()[:, None] * inv.to(positions.device)[None, :]
            emb = torch.cat([freqs, freqs], dim=-1)
            angles[key] = (emb.cos().to(h.dtype), emb.sin().to(h.dtype))
        for key, layer, cache in zip(self.rope_keys, decoder.layers, kv_caches, strict=True):
            h = layer(h, *angles[key], cache, meta)
        return decoder.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = F.linear(hidden, self.model.decoder.embed_tokens.weight).float()
        cap = self.gemma.final_logit_softcapping
        return out if cap is None else torch.tanh(out / cap) * cap
