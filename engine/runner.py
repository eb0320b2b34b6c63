"""The model runner: owns one model shard and its KV cache, turns a ForwardBatch into logits.

`ForwardBatch` and `ForwardOutput` are plain data so the same batch can be sent to every
tensor-parallel worker. Only rows whose logits are used reach the LM head: `sample_rows`
(positions to sample or unmask) return full logits rows; `score_rows` (input-token scoring) are
projected in chunks of `logprobs_chunk_rows` and reduced to (value, top-k) right away, so scoring
never holds (tokens x vocab) logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from configs import EngineConfig
from engine.checkpoint import ModelSpec, iter_weights
from engine.model import Qwen3ForCausalLM, TPContext
from ops.attention import AttentionMetadata, make_attention_backend
from ops.cpu_linear import convert_for_cpu


@dataclass
class ForwardBatch:
    input_ids: list[int]
    positions: list[int]
    q_lens: list[int]
    kv_lens: list[int]
    slot_mapping: list[int]
    page_tables: list[list[int]]
    sample_rows: list[int] = field(default_factory=list)
    score_rows: list[int] = field(default_factory=list)
    score_targets: list[int] = field(default_factory=list)
    score_top_k: int = 0


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [len(sample_rows), vocab] float32
    score_values: list[float] = field(default_factory=list)
    score_top: list[list[tuple[float, int]]] | None = None


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but CUDA is not available; use device='cpu' or 'auto'")
    return torch.device(config.device)


def resolve_dtype(config: EngineConfig, device: torch.device, spec: ModelSpec | None = None) -> torch.dtype:
    """`auto`: float32 on CPU; on CUDA the checkpoint's `torch_dtype` (bfloat16 when it names none)."""
    if config.dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        return getattr(torch, spec.torch_dtype) if spec is not None and spec.torch_dtype else torch.bfloat16
    return getattr(torch, config.dtype)


def build_model(spec: ModelSpec, device: torch.device, dtype: torch.dtype, tp: TPContext | None) -> Qwen3ForCausalLM:
    """The model shard in `dtype` on `device`, loaded from the checkpoint: built on the meta device
    (no random init), allocated once, then filled with this rank's slices read from the
    memory-mapped safetensors files."""
    with torch.device("meta"):
        model = Qwen3ForCausalLM(spec, tp)
    model.materialize(device, dtype)
    model.load_weights(iter_weights(spec.path))
    return model.eval()


def page_bytes(spec: ModelSpec, page_size: int, dtype: torch.dtype, tp_size: int) -> int:
    """Bytes one KV page takes on one shard (K and V, every layer)."""
    per_token = 2 * spec.num_hidden_layers * (spec.num_key_value_heads // tp_size) * spec.head_dim
    return per_token * page_size * torch.empty((), dtype=dtype).element_size()


def num_kv_pages(spec: ModelSpec, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> int:
    """Pages to allocate: an explicit count, or a share of memory (CUDA free memory / CPU budget)."""
    n = config.num_kv_blocks
    if isinstance(n, int) and not isinstance(n, bool):
        return n
    fraction = 0.9 if n is None else float(n)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * fraction)
    else:
        budget = int(config.cpu_kv_cache_bytes * (1.0 if n is None else fraction))
    pages = budget // page_bytes(spec, config.kv_block_size, dtype, config.tp)
    max_useful = config.max_batch_size * -(-(config.max_model_len + 64) // config.kv_block_size)
    return max(1, min(pages, max_useful))


def log_softmax_(x: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim written over `x` (same values as `x.log_softmax(-1)`): no second
    rows x vocab tensor to allocate and fault in."""
    if not hasattr(torch, "_log_softmax"):
        return x.log_softmax(-1)
    with torch.inference_mode():
        return torch._log_softmax(x, -1, False, out=x)


class ModelRunner:
    def __init__(self, spec: ModelSpec, config: EngineConfig, tp: TPContext | None = None):
        self.spec, self.config = spec, config
        self.device = resolve_device(config)
        self.dtype = resolve_dtype(config, self.device, spec)
        self.backend = make_attention_backend(config.attention_backend, self.device, self.dtype,
                                              config.kv_block_size, spec.head_dim)
        self.dllm_block_length = None
        torch.manual_seed(config.seed)
        self.model = build_model(spec, self.device, self.dtype, tp)
        self.num_pages = num_kv_pages(spec, config, self.device, self.dtype)
        kvh = spec.num_key_value_heads // (tp.size if tp else 1)
        shape = (2, self.num_pages, config.kv_block_size, kvh, spec.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.dtype, device=self.device).unbind(0)
            for _ in range(spec.num_hidden_layers)
        ]
        self.num_forwards = 0
        if self.device.type == "cpu":
            convert_for_cpu(self.model, shared=(self.model.model.embed_tokens.weight,))

    def set_dllm_block_length(self, block_length: int | None) -> None:
        self.dllm_block_length = block_length

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> ForwardOutput:
        width = max(len(t) for t in batch.page_tables)
        tables = self._tensor([t + [0] * (width - len(t)) for t in batch.page_tables])
        tables = tables.view(len(batch.page_tables), width)
        meta = AttentionMetadata(
            q_lens=batch.q_lens,
            kv_lens=batch.kv_lens,
            positions=self._tensor(batch.positions),
            slot_mapping=self._tensor(batch.slot_mapping),
            page_tables=tables,
            page_size=self.config.kv_block_size,
            dllm_block_length=self.dllm_block_length,
        )
        hidden = self.model(self._tensor(batch.input_ids), meta.positions, self.kv_caches, meta, self.backend)
        self.num_forwards += 1
        logits = self.model.logits(hidden[self._tensor(batch.sample_rows)])
        out = ForwardOutput(logits=logits)
        if batch.score_rows:
            self._score(hidden, batch, out)
        return out

    def _score(self, hidden: torch.Tensor, batch: ForwardBatch, out: ForwardOutput) -> None:
        raw = self.config.logprobs_mode == "raw_logits"
        k = batch.score_top_k
        out.score_top = [] if k > 0 else None
        step = self.config.logprobs_chunk_rows
        for i in range(0, len(batch.score_rows), step):
            rows = self._tensor(batch.score_rows[i : i + step])
            values = self.model.logits(hidden[rows])
            if not raw:
                values = log_softmax_(values) if self.device.type == "cpu" else values.log_softmax(-1)
            targets = self._tensor(batch.score_targets[i : i + step])
            out.score_values += values.gather(1, targets[:, None])[:, 0].tolist()
            if k > 0:
                top_v, top_i = values.topk(k, dim=-1)
                out.score_top += [list(zip(v, t)) for v, t in zip(top_v.tolist(), top_i.tolist())]
            del values
