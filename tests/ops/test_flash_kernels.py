"""CPU stand-ins for the two shipped FlashAttention varlen kernels, and the backend choice around them.

The CUDA kernels cannot run here, so each API shape gets a substitute with the upstream function's
exact parameter list (the backend picks its call by reading the signature) that enforces what the
real one checks -- the Python wrapper's asserts and the C++ `mha_varlen_fwd` TORCH_CHECKs, with
their messages -- plus what the kernel assumes without checking (lengths within `max_seqlen_*`,
`block_table` covering every key, no page id past the cache), then computes the attention with plain
torch in float32 and returns it in the input dtype. Tests here show each substitute refuses what
the real one refuses; tests/ops/test_flash_layout.py runs the flash backend through both against the
torch backend.

Under FakeTensorMode (tests/engine/test_device_placement.py) the substitutes run their checks -- devices,
dtypes, shapes -- and return an empty output, as there is no data to compute with.
"""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from ops import attention, flash_kernel
from ops.attention import FlashAttention, FlexAttention, TorchAttention, make_attention_backend
from ops.flash_kernel import (
    TORCH_PAGE_MULTIPLE,
    FlashKernel,
    aten_flash_varlen,
    find_flash_kernel,
    flash_unmet,
    key_lengths_argument,
)
from tests.support.flash_kernels import (
    BUNDLED,
    KERNELS,
    WHEEL,
    KernelCheckError,
    bundled_varlen_func,
    wheel_varlen_func,
)

# ---- the substitutes refuse what the real kernels refuse ----------------------------------------------------
PAGE, HEADS, KV_HEADS, DIM = 16, 4, 2, 8


def paged_inputs(dtype=torch.bfloat16, page=PAGE, dim=DIM, q_lens=(3, 1), k_lens=(20, 9), pages=6):
    """A small valid paged call: entries with q_lens queries and k_lens keys, page tables [[0, 1], [2, 3]]."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(q_lens), HEADS, dim, generator=g).to(dtype)
    k = torch.randn(pages, page, KV_HEADS, dim, generator=g).to(dtype)
    v = torch.randn(pages, page, KV_HEADS, dim, generator=g).to(dtype)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)
    table = torch.arange(2 * len(q_lens), dtype=torch.int32).view(len(q_lens), 2)
    return {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_k": cu_k, "seqused_k": torch.tensor(k_lens,
            dtype=torch.int32), "block_table": table, "max_seqlen_q": max(q_lens), "max_seqlen_k": max(k_lens)}


def call(kernel: FlashKernel, x: dict, **overrides):
    """Call a substitute the way FlashAttention does for that API shape, with some arguments replaced."""
    q = overrides.pop("q", x["q"])
    args = {"max_seqlen_q": x["max_seqlen_q"], "cu_seqlens_q": x["cu_seqlens_q"], "max_seqlen_k": x["max_seqlen_k"],
            "block_table": x["block_table"], "causal": True,
            kernel.key_lengths: x["seqused_k"] if kernel.key_lengths == "seqused_k" else x["cu_k"]}
    return kernel.fn(q, x["k"], x["v"], **{**args, **overrides})


def dense(x: dict) -> torch.Tensor:
    """The valid call of `paged_inputs`, by dense SDPA per entry (float32)."""
    outs = []
    for b in range(2):
        qs, qe = int(x["cu_seqlens_q"][b]), int(x["cu_seqlens_q"][b + 1])
        n_k = int(x["seqused_k"][b])
        keys = x["k"][x["block_table"][b].long()].flatten(0, 1)[:n_k].float()
        values = x["v"][x["block_table"][b].long()].flatten(0, 1)[:n_k].float()
        n_q = qe - qs
        mask = torch.arange(n_k)[None, :] <= (n_k - n_q + torch.arange(n_q))[:, None]
        o = F.scaled_dot_product_attention(x["q"][qs:qe].float().transpose(0, 1), keys.transpose(0, 1),
                                           values.transpose(0, 1), attn_mask=mask, enable_gqa=True)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("name", KERNELS)
def test_substitute_computes_paged_causal_attention(name):
    x = paged_inputs()
    got = call(KERNELS[name], x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), dense(x), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("change, message", [
    ({"dtype": torch.float32}, "only support fp16 and bf16"),
    ({"page": 8}, "block size must be divisible by 16"),
    ({"dim": 264}, "head dimension at most 256"),
])
def test_substitutes_refuse_dtype_page_size_head_dim(name, change, message):
    with pytest.raises(KernelCheckError, match=message):
        call(KERNELS[name], paged_inputs(**change))


def test_only_the_bundled_kernel_refuses_head_dim_not_multiple_of_8():
    with pytest.raises(KernelCheckError, match="multiple of 8"):
        call(BUNDLED, paged_inputs(dim=12))
    call(WHEEL, paged_inputs(dim=12))  # the 2.6 wheel pads it


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("field, bad, message", [
    ("block_table", lambda t: t.long(), "block_table must have dtype torch.int32"),
    ("block_table", lambda t: t.t().contiguous().t(), "block_table must have contiguous last dimension"),
    ("cu_seqlens_q", lambda t: t.long(), "cu_seqlens_q must have dtype int32"),
    ("q", lambda t: t.transpose(1, 2).contiguous().transpose(1, 2), "contiguous last dimension"),
    ("q", lambda t: t[:, :3], "must divide number of heads"),
    ("max_seqlen_q", lambda n: n - 1, "past max_seqlen_q"),
    ("max_seqlen_k", lambda n: n - 1, "past max_seqlen_k"),
    ("block_table", lambda t: t[:, :1], "block_table too narrow"),
    ("block_table", lambda t: t + 5, "page id outside the cache"),
])
def test_substitutes_refuse_bad_arguments(name, field, bad, message):
    x = paged_inputs()
    with pytest.raises(KernelCheckError, match=message):
        call(KERNELS[name], x, **{field: bad(x[field])})


def test_bundled_kernel_key_lengths_rules():
    """vllm's wrapper: seqused_k with block_table, never cu_seqlens_k alongside it."""
    x = paged_inputs()
    with pytest.raises(KernelCheckError, match="cannot be provided at the same time"):
        call(BUNDLED, x, cu_seqlens_k=x["cu_k"])
    with pytest.raises(KernelCheckError, match="seqused_k must be provided if block_table"):
        call(BUNDLED, x, seqused_k=None, cu_seqlens_k=x["cu_k"])
    with pytest.raises(KernelCheckError, match="seqused_k must have dtype int32"):
        call(BUNDLED, x, seqused_k=x["seqused_k"].long())


def test_wheel_kernel_has_no_seqused_k():
    x = paged_inputs()
    with pytest.raises(TypeError, match="seqused_k"):
        call(WHEEL, x, seqused_k=x["seqused_k"])
    with pytest.raises(TypeError, match="cu_seqlens_k"):
        WHEEL.fn(x["q"], x["k"], x["v"], cu_seqlens_q=x["cu_seqlens_q"], max_seqlen_q=3, max_seqlen_k=20,
                 block_table=x["block_table"])


def test_decode_fast_path_needs_one_query_per_entry():
    """max_seqlen_q == 1 with grouped heads: the kernel reshapes q to one row per entry."""
    x = paged_inputs(q_lens=(1, 1))
    call(BUNDLED, x)
    with pytest.raises(KernelCheckError, match="is invalid for input"):
        call(BUNDLED, x, q=torch.cat([x["q"], x["q"][:1]]))


# ---- which API shape, which backend ---------------------------------------------------------------------------
def test_api_shape_is_read_from_the_signature():
    assert key_lengths_argument(bundled_varlen_func) == "seqused_k"
    assert key_lengths_argument(wheel_varlen_func) == "cu_seqlens_k"


def _module(name: str, fn) -> types.ModuleType:
    module = types.ModuleType(name)
    module.flash_attn_varlen_func = fn
    return module


def test_find_prefers_vllms_bundled_kernel_then_the_wheel(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    monkeypatch.setitem(sys.modules, "vllm_flash_attn", None)
    assert find_flash_kernel() is None
    monkeypatch.setitem(sys.modules, "vllm_flash_attn", _module("vllm_flash_attn", wheel_varlen_func))
    assert find_flash_kernel() == FlashKernel(wheel_varlen_func, "vllm_flash_attn", "cu_seqlens_k")
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn", _module("vllm.vllm_flash_attn", bundled_varlen_func))
    assert find_flash_kernel() == FlashKernel(bundled_varlen_func, "vllm.vllm_flash_attn", "seqused_k")


CUDA = torch.device("cuda")


def test_auto_picks_flash_when_every_condition_holds(monkeypatch, caplog):
    monkeypatch.setattr(flash_kernel, "INSTALLED", BUNDLED)
    with caplog.at_level(logging.INFO, logger="ops.attention"):
        backend = make_attention_backend("auto", CUDA, torch.bfloat16, 16, 128)
    assert isinstance(backend, FlashAttention) and backend.kernel is BUNDLED
    assert "flash (substitute for vllm.vllm_flash_attn, key lengths by seqused_k)" in caplog.text


@pytest.mark.parametrize("device, dtype, page, head_dim, reason", [
    (CUDA, torch.float32, 16, 128, "dtype is torch.float32"),
    (CUDA, torch.bfloat16, 4, 128, "kv_block_size is 4"),
    (CUDA, torch.float16, 16, 320, "head_dim is 320"),
    (CUDA, torch.float16, 16, 60, "head_dim is 60"),
    (torch.device("cpu"), torch.bfloat16, 16, 128, "device is cpu"),
])
def test_auto_falls_back_to_torch_and_says_why(monkeypatch, caplog, device, dtype, page, head_dim, reason):
    monkeypatch.setattr(flash_kernel, "INSTALLED", WHEEL)
    monkeypatch.setattr(flash_kernel, "TORCH_KERNEL", None)
    monkeypatch.setattr(attention.selection, "flex_unmet", lambda device: ["flex ruled out here"])
    with caplog.at_level(logging.INFO, logger="ops.attention"):
        backend = make_attention_backend("auto", device, dtype, page, head_dim)
    assert isinstance(backend, TorchAttention)
    assert "attention backend: torch" in caplog.text and reason in caplog.text
    with pytest.raises(ValueError, match=f"attention_backend='flash' cannot run: .*{reason}"):
        make_attention_backend("flash", device, dtype, page, head_dim)


def test_forced_flash_without_a_kernel_names_every_unmet_condition(monkeypatch):
    monkeypatch.setattr(flash_kernel, "INSTALLED", None)
    monkeypatch.setattr(flash_kernel, "TORCH_KERNEL", None)
    with pytest.raises(ValueError) as err:
        make_attention_backend("flash", torch.device("cpu"), torch.float32, 4, 512)
    text = str(err.value)
    for reason in ("no flash kernel installed", "device is cpu", "dtype is torch.float32", "kv_block_size is 4",
                   "head_dim is 512"):
        assert reason in text
    assert len(flash_unmet(None, torch.device("cpu"), torch.float32, 4, 512)) == 5


def test_torch_backend_is_always_available():
    assert isinstance(make_attention_backend("torch", CUDA, torch.float32, 4, 512), TorchAttention)


# ---- torch's own flash kernel and FlexAttention in the choice --------------------------------------------------
TORCH_OWN = FlashKernel(aten_flash_varlen, "substitute for torch.ops.aten._flash_attention_forward", "seqused_k",
                        TORCH_PAGE_MULTIPLE)


def test_torch_kernel_needs_pages_of_256_tokens(monkeypatch, caplog):
    monkeypatch.setattr(flash_kernel, "INSTALLED", None)
    monkeypatch.setattr(flash_kernel, "TORCH_KERNEL", TORCH_OWN)
    monkeypatch.setattr(attention.selection, "flex_unmet", lambda device: ["flex ruled out here"])
    backend = make_attention_backend("auto", CUDA, torch.bfloat16, 256, 128)
    assert isinstance(backend, FlashAttention) and backend.kernel is TORCH_OWN
    with caplog.at_level(logging.INFO, logger="ops.attention"):
        assert isinstance(make_attention_backend("auto", CUDA, torch.bfloat16, 16, 128), TorchAttention)
    assert "kv_block_size is 16, the paged kernel needs a multiple of 256" in caplog.text


def test_vllms_kernel_is_preferred_and_torchs_serves_where_it_cannot(monkeypatch):
    monkeypatch.setattr(flash_kernel, "INSTALLED", BUNDLED)
    monkeypatch.setattr(flash_kernel, "TORCH_KERNEL", TORCH_OWN)
    assert make_attention_backend("flash", CUDA, torch.bfloat16, 256, 128).kernel is BUNDLED
    monkeypatch.setattr(flash_kernel, "INSTALLED", FlashKernel(bundled_varlen_func, "a kernel wanting 512", "seqused_k",
                                                               512))
    assert make_attention_backend("flash", CUDA, torch.bfloat16, 256, 128).kernel is TORCH_OWN
    with pytest.raises(ValueError) as err:
        make_attention_backend("flash", CUDA, torch.bfloat16, 16, 128)
    assert "a kernel wanting 512: kv_block_size is 16" in str(err.value)
    assert "torch.ops.aten._flash_attention_forward: kv_block_size is 16" in str(err.value)


def test_torch_kernel_wrapper_passes_cumulative_key_counts_too(monkeypatch):
    """torch's operator shape-checks `cu_seqlens_k` even when `seqused_k` counts the keys."""
    calls = []

    def operator(q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug_mask, **kwargs):
        calls.append((cu_q.tolist(), cu_k.tolist(), max_q, max_k, dropout, causal, debug_mask, kwargs))
        return q * 2, None, None, None, None

    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", operator)
    q = torch.ones(4, 2, 8)
    seqused = torch.tensor([5, 17, 3], dtype=torch.int32)
    out = aten_flash_varlen(q, q, q, cu_seqlens_q=torch.tensor([0, 1, 3, 4], dtype=torch.int32), seqused_k=seqused,
                            block_table=torch.zeros(3, 2, dtype=torch.int32), max_seqlen_q=2, max_seqlen_k=17,
                            softmax_scale=0.5, causal=True)
    assert torch.equal(out, q * 2)
    (cu_q, cu_k, max_q, max_k, dropout, causal, debug_mask, kwargs), = calls
    assert (cu_q, cu_k, max_q, max_k, dropout, causal, debug_mask) == ([0, 1, 3, 4], [0, 5, 22, 25], 2, 17, 0.0,
                                                                       True, False)
    assert kwargs["scale"] == 0.5 and kwargs["seqused_k"] is seqused and kwargs["block_table"].shape == (3, 2)


def test_without_a_flash_kernel_auto_is_torch_and_flex_is_compiled_when_asked_for(monkeypatch, caplog):
    """On CUDA without a flash kernel `auto` stays on torch (compiled flex is not batch-invariant for
    seeded sampling on a GPU), and `flex` compiles the kernel."""
    monkeypatch.setattr(flash_kernel, "INSTALLED", None)
    monkeypatch.setattr(flash_kernel, "TORCH_KERNEL", None)
    monkeypatch.setattr(attention.selection, "flex_unmet", lambda device: [])
    monkeypatch.setattr(attention.flex, "flex_attention", lambda *a, **k: None)  # nothing to compile here
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **options: compiled.append(fn) or ("compiled", fn))
    with caplog.at_level(logging.INFO, logger="ops.attention"):
        assert isinstance(make_attention_backend("auto", CUDA, torch.bfloat16, 16, 128), TorchAttention)
    assert "attention backend: torch (flash not used: no flash kernel installed" in caplog.text
    assert "flex only when asked for" in caplog.text and not compiled
    backend = make_attention_backend("flex", CUDA, torch.bfloat16, 16, 128)
    assert isinstance(backend, FlexAttention) and backend.compiled and compiled == [attention.flex.flex_attention]


def test_on_the_cpu_auto_is_torch_and_flex_is_eager(monkeypatch, caplog):
    monkeypatch.setattr(flash_kernel, "INSTALLED", None)
    monkeypatch.setattr(flash_kernel, "TORCH_KERNEL", None)
    cpu = torch.device("cpu")
    with caplog.at_level(logging.INFO, logger="ops.attention"):
        assert isinstance(make_attention_backend("auto", cpu, torch.float32, 16, 128), TorchAttention)
    assert "attention backend: torch (flash not used: no flash kernel installed" in caplog.text
    flex = make_attention_backend("flex", cpu, torch.float32, 16, 128)
    assert isinstance(flex, FlexAttention) and not flex.compiled
