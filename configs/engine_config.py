"""Engine-wide settings: one EngineConfig per engine replica."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from configs.knobs import knob_model

LogprobsMode = Literal["raw_logits", "raw_logprobs", "processed_logits", "processed_logprobs"]


EngineKnobs = knob_model("EngineKnobs", "The engine-wide decoding knobs (`configs.knobs`).", per_request=False)


class EngineConfig(EngineKnobs):
    """How one engine replica runs. Every field is optional; defaults suit a CPU test machine.

    `num_kv_blocks` may be an int (pages) or a float in (0, 1] (fraction of free device memory on
    CUDA; on CPU a fraction of `cpu_kv_cache_bytes`).
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    tp: int = Field(1, ge=1, description="tensor-parallel size")
    max_batch_size: int = Field(64, ge=1, description="most sequences in one forward")
    max_model_len: int | None = Field(
        None, ge=1, description="most tokens (prompt + output) per sequence; default and upper bound: the "
        "checkpoint's max_position_embeddings"
    )
    kv_block_size: int = Field(16, ge=1, description="tokens per KV page")
    num_kv_blocks: int | float | None = Field(
        None, description="KV pages (int) or a memory fraction (float in (0, 1]); None = auto"
    )
    cpu_kv_cache_bytes: int = Field(
        2 << 30, ge=1, description="KV budget on CPU when num_kv_blocks is None or a fraction"
    )
    max_prefill_token_num: int = Field(
        2048, ge=1, description="chunked-prefill budget: most prompt tokens fed in one step"
    )
    enable_prefix_caching: bool = True
    logprobs_mode: LogprobsMode | None = Field(
        None, description="raw_* = from the model's logits; processed_* = from the distribution the sampler drew "
        "from (after penalties, temperature and top-k/top-p/min-p)"
    )
    logprobs_chunk_rows: int = Field(
        256, ge=1, description="rows per LM-head chunk when scoring: bounds logits memory"
    )
    attention_backend: Literal["auto", "torch", "flash", "flex", "triton"] = Field(
        "auto", description="auto = flash where a flash kernel can run, else torch (flex only when asked: "
        "faster at high concurrency on a GPU, but seeded sampling differs between batched and alone; triton, "
        "the project's own paged kernel and the one CUDA graphs replay, only when asked until a GPU run has "
        "checked it); a diffusion_gemma model: torch (flex or triton when asked, flash refused)"
    )
    cuda_graphs: bool = Field(
        True, description="replay a CUDA graph for every step up to 8192 tokens, keyed by its padded token count "
        "(CUDA, one GPU, the triton attention backend); a capture that fails switches them off, logged and "
        "reported by /get_server_info"
    )
    enable_torch_compile: bool = Field(
        False, description="compile the model's elementwise work (RMSNorm, rotary embedding, SiLU gate, residual "
        "adds) with torch.compile into fused kernels; the compile cache is kept between runs"
    )
    overlap_schedule: bool = Field(
        False, description="overlap host and device: the host prepares one half of the running requests' next "
        "step while the device runs the other half's (one GPU, CUDA; elsewhere the halves just run one after the "
        "other)"
    )

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        n = self.num_kv_blocks
        if isinstance(n, float) and not (0.0 < n <= 1.0):
            raise ValueError("num_kv_blocks: a float is a memory fraction and must be in (0, 1]")
        if isinstance(n, int) and not isinstance(n, bool) and n < 1:
            raise ValueError("num_kv_blocks: must be at least 1 page")
        return self
