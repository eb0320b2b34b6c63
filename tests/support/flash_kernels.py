"""CPU stand-ins for the two shipped FlashAttention varlen kernels (`KERNELS`), for the tests of the flash
backend on a machine without CUDA.

The CUDA kernels cannot run here, so each API shape gets a substitute with the upstream function's
exact parameter list (the backend picks its call by reading the signature) that enforces what the
real one checks -- the Python wrapper's asserts and the C++ `mha_varlen_fwd` TORCH_CHECKs, with
their messages -- plus what the kernel assumes without checking (lengths within `max_seqlen_*`,
`block_table` covering every key, no page id past the cache), then computes the attention with plain
torch in float32 and returns it in the input dtype. tests/ops/test_flash_kernels.py shows each
substitute refuses what the real one refuses; tests/ops/test_flash_layout.py runs the flash backend
through both against the torch backend.

Under FakeTensorMode (tests/engine/test_device_placement.py) the substitutes run their checks --
devices, dtypes, shapes -- and return an empty output, as there is no data to compute with.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ops.flash_kernel import FlashKernel


class KernelCheckError(RuntimeError):
    """What the real kernel raises (RuntimeError from TORCH_CHECK, AssertionError from the wrapper)."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise KernelCheckError(message)


def _varlen_fwd_checks(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q, num_heads_k,
                       head_size_multiple_of_8: bool) -> None:
    """The TORCH_CHECKs of FlashAttention-2's C++ `mha_varlen_fwd`, in its order (paged KV case)."""
    _check(q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only support fp16 and bf16 data type")
    _check(k.dtype == q.dtype, "query and key must have the same dtype")
    _check(v.dtype == q.dtype, "query and value must have the same dtype")
    _check(cu_seqlens_q.dtype == torch.int32, "cu_seqlens_q must have dtype int32")
    _check(cu_seqlens_k.dtype == torch.int32, "cu_seqlens_k must have dtype int32")
    for name, t in (("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _check(t.device == q.device, f"{name} must be on the same device as q (CHECK_DEVICE)")
    _check(block_table is not None, "these tests always read keys through block_table (paged KV)")
    _check(block_table.device == q.device, "block_table must be on the same device as q (CHECK_DEVICE)")
    _check(block_table.dtype == torch.int32, "block_table must have dtype torch.int32")
    _check(block_table.stride(-1) == 1, "block_table must have contiguous last dimension")
    for t in (q, k, v):
        _check(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    _check(cu_seqlens_q.is_contiguous() and cu_seqlens_k.is_contiguous(), "cu_seqlens must be contiguous")
    batch_size = cu_seqlens_q.numel() - 1
    _check(q.dim() == 3 and k.dim() == 4 and v.dim() == 4, "q [total_q, H, D]; paged k/v [pages, page, KVH, D]")
    num_heads, head_size = q.shape[1], q.shape[2]
    _check(k.shape[1] % 16 == 0, "Paged KV cache block size must be divisible by 16")
    _check(batch_size > 0, "batch size must be positive")
    _check(head_size <= 256, "FlashAttention forward only supports head dimension at most 256")
    if head_size_multiple_of_8:
        _check(head_size % 8 == 0, "query, key, value, and out_ must have a head_size that is a multiple of 8")
    _check(num_heads % num_heads_k == 0, "Number of heads in key/value must divide number of heads in query")
    if max_seqlen_q == 1 and num_heads > num_heads_k and head_size % 8 == 0:
        # the decode fast path reshapes q to [batch, KVH, groups, D]: one query per entry, exactly
        _check(q.shape[0] == batch_size, f"shape '[{batch_size}, ...]' is invalid for input of size {q.numel()}")
    pages, page_size = k.shape[0], k.shape[1]
    _check(tuple(k.shape) == (pages, page_size, num_heads_k, head_size), "k must have shape (pages, page, KVH, D)")
    _check(tuple(v.shape) == tuple(k.shape), "v must have the shape of k")
    _check(block_table.dim() == 2 and block_table.shape[0] == batch_size, "block_table must be [batch, pages]")
    _check(tuple(cu_seqlens_q.shape) == (batch_size + 1,), "cu_seqlens_q must have shape (batch + 1)")
    _check(tuple(cu_seqlens_k.shape) == (batch_size + 1,), "cu_seqlens_k must have shape (batch + 1)")
    if seqused_k is not None:
        _check(seqused_k.dtype == torch.int32, "seqused_k must have dtype int32")
        _check(seqused_k.device == q.device, "seqused_k must be on CUDA device")
        _check(seqused_k.is_contiguous(), "seqused_k must be contiguous")
        _check(tuple(seqused_k.shape) == (batch_size,), "seqused_k must have shape (batch)")


def _attention(q, k, v, cu_seqlens_q, key_counts, block_table, max_seqlen_q, max_seqlen_k, softmax_scale,
               causal) -> torch.Tensor:
    """What the kernel computes, in float32: entry b's queries against its first key_counts[b] keys
    read through block_table; causal aligned bottom-right; query head h reads K/V head h // groups."""
    if isinstance(q, FakeTensor):
        return torch.empty_like(q)
    page_size, groups = k.shape[1], q.shape[1] // k.shape[2]
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    starts = cu_seqlens_q.tolist()
    out = torch.zeros(q.shape, dtype=torch.float32)
    for b, n_k in enumerate(key_counts):
        q_start, q_end = starts[b], starts[b + 1]
        n_q = q_end - q_start
        _check(0 <= n_q <= max_seqlen_q, f"entry {b}: {n_q} queries past max_seqlen_q={max_seqlen_q}")
        _check(0 <= n_k <= max_seqlen_k, f"entry {b}: {n_k} keys past max_seqlen_k={max_seqlen_k}")
        _check(-(-n_k // page_size) <= block_table.shape[1], f"entry {b}: block_table too narrow for {n_k} keys")
        pages = block_table[b, : -(-n_k // page_size)].long()
        _check(bool((pages >= 0).all() and (pages < k.shape[0]).all()), f"entry {b}: page id outside the cache")
        keys = k[pages].flatten(0, 1)[:n_k].float().repeat_interleave(groups, 1)
        values = v[pages].flatten(0, 1)[:n_k].float().repeat_interleave(groups, 1)
        mask = torch.ones(n_q, n_k, dtype=torch.bool)
        if causal and max_seqlen_q > 1:  # the kernel drops causal when max_seqlen_q == 1
            mask = torch.arange(n_k)[None, :] <= (n_k - n_q + torch.arange(n_q))[:, None]
        scores = torch.einsum("qhd,khd->hqk", q[q_start:q_end].float(), keys) * scale
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1).nan_to_num(0.0)  # all-masked row -> 0
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, values)
    return out.to(q.dtype)


def bundled_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None, seqused_k=None,
                        q_v=None, dropout_p=0.0, softmax_scale=None, causal=False, window_size=None, softcap=0.0,
                        alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None,
                        return_softmax_lse=False, out=None, scheduler_metadata=None, q_descale=None,
                        k_descale=None, v_descale=None, num_splits=0, fa_version=2):
    """Stands in for vllm's `vllm.vllm_flash_attn.flash_attn_interface.flash_attn_varlen_func`
    (FA2 path; the leading parameters of its signature, same names, order and defaults)."""
    _check(cu_seqlens_k is not None or seqused_k is not None, "cu_seqlens_k or seqused_k must be provided")
    _check(cu_seqlens_k is None or seqused_k is None, "cu_seqlens_k and seqused_k cannot be provided at the same time")
    _check(block_table is None or seqused_k is not None, "seqused_k must be provided if block_table is provided")
    _check(fa_version == 2 and out is None and not return_softmax_lse, "only the FA2 forward is stood in for")
    dummy_cu_seqlens_k = torch.empty_like(cu_seqlens_q)  # what the wrapper hands the C++ kernel
    _varlen_fwd_checks(q, k, v, cu_seqlens_q, dummy_cu_seqlens_k if cu_seqlens_k is None else cu_seqlens_k,
                       seqused_k, block_table, max_seqlen_q, k.shape[2], head_size_multiple_of_8=True)
    key_counts = [] if isinstance(seqused_k, FakeTensor) else seqused_k.tolist()
    return _attention(q, k, v, cu_seqlens_q, key_counts, block_table, max_seqlen_q, max_seqlen_k, softmax_scale,
                      causal)


def wheel_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                      softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                      deterministic=False, return_attn_probs=False, block_table=None, *, out=None):
    """Stands in for the standalone wheel's `vllm_flash_attn.flash_attn_interface.flash_attn_varlen_func`
    (vllm-flash-attn 2.6.2; same signature). Its C++ pads a head_size that is not a multiple of 8
    instead of refusing it; its wrapper passes no `seqused_k`, so cu_seqlens_k counts the keys."""
    _check(out is None and not return_attn_probs, "only the plain forward is stood in for")
    _varlen_fwd_checks(q, k, v, cu_seqlens_q, cu_seqlens_k, None, block_table, max_seqlen_q, k.shape[2],
                       head_size_multiple_of_8=False)
    if isinstance(cu_seqlens_k, FakeTensor):
        key_counts = []
    else:
        cu = cu_seqlens_k.tolist()
        key_counts = [cu[b + 1] - cu[b] for b in range(len(cu) - 1)]
    return _attention(q, k, v, cu_seqlens_q, key_counts, block_table, max_seqlen_q, max_seqlen_k, softmax_scale,
                      causal)


BUNDLED = FlashKernel(bundled_varlen_func, "substitute for vllm.vllm_flash_attn", "seqused_k")
WHEEL = FlashKernel(wheel_varlen_func, "substitute for vllm_flash_attn 2.6.2", "cu_seqlens_k")
KERNELS = {"bundled": BUNDLED, "wheel": WHEEL}
