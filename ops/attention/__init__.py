"""Paged KV write and paged attention over variable-length batches.

A batch is a flat list of query tokens from several sequences (prefill chunks, DLLM blocks and AR
decode rows mixed). Each sequence's keys live in fixed-size pages of the KV cache, named by its
page table. Two masks exist:

* causal (AR): query at position p sees keys at positions <= p;
* block-causal (DLLM, block length B): query at p sees keys at positions j with j // B <= p // B.

Besides either, a forward may name sequences whose rows are bidirectional
(`AttentionMetadata.bidirectional`): every row of such a sequence sees every key it holds (a block
denoised over its causal prefix, beside causal rows of other sequences). Every backend computes it.

Backends:

* `TorchAttention` -- the reference: gathers each sequence's keys into a padded tensor and runs
  `scaled_dot_product_attention` with an explicit mask. Runs everywhere.
* `FlashAttention` -- the FlashAttention-2 paged varlen kernel (`ops.flash_kernel`: vllm's bundled
  copy, the standalone vllm-flash-attn wheel, or torch's own `aten._flash_attention_forward`) reading
  the paged cache through `block_table`. Block-causal attention is expressed without a custom mask:
  every DLLM block of queries becomes its own varlen entry that sees keys up to its block end,
  non-causally.
* `TritonAttention` -- the project's own Triton kernel (`ops.attention.triton_paged`): one launch per
  layer over (tiles of one sequence's query rows, K/V heads), the query heads of a K/V head packed in
  one tile, K/V read through the page table in place; causal, block-causal, bidirectional and
  sliding-window rows. Its grid is fixed by the step's padded token count, so CUDA graphs replay it
  for any step. Tested on the CPU under Triton's interpreter.
* `FlexAttention` -- `torch.nn.attention.flex_attention` over the whole cache in place, with a
  `BlockMask` built from the page tables (which pages each 16-query tile may read) and a mask that
  maps a physical key slot back to its position in the query's sequence. Native GQA, no gather.
  Compiled on CUDA; eager (the dense reference implementation) elsewhere, which is how it is tested.

Per-step metadata is derived on the host: `plan` turns the batch's lists into int arrays and host
scalars without touching the device, the model runner uploads those with the rest of the step in
one copy (`meta.planned`), and `prepare` only slices and combines device tensors. A caller that
skips `plan` (tests, benchmarks) gets it done inside `prepare`, at the cost of extra copies.

`make_attention_backend` picks one from the config and the settings the kernels depend on.
"""

from ops.attention.base import AttentionBackend, AttentionMetadata, StepPlan, planned, table_lists, write_kv
from ops.attention.flash import FlashAttention, usable_flash_kernel
from ops.attention.flex import FLEX_TILE, FlexAttention, flex_attention_fn, flex_unmet
from ops.attention.selection import make_attention_backend
from ops.attention.torch_reference import TorchAttention, sdpa_heads_folded
from ops.attention.triton_backend import TritonAttention, require_triton, triton_unmet

__all__ = ["FLEX_TILE", "AttentionBackend", "AttentionMetadata", "FlashAttention", "FlexAttention", "StepPlan",
           "TorchAttention", "TritonAttention", "flex_attention_fn", "flex_unmet", "make_attention_backend", "planned",
           "require_triton", "sdpa_heads_folded", "table_lists", "triton_unmet", "usable_flash_kernel", "write_kv"]
