"""Device placement of the attention ops and the model runner's forward, checked without a GPU.

Under `FakeTensorMode` a tensor made with `device="cuda"` is a fake CUDA tensor (shape, dtype and
device, no data) even on a CPU-only torch, and an op mixing it with a CPU tensor raises
`FakeTensorDeviceMismatchError` (or the op's own same-device check does), as CUDA would. So a
metadata tensor built on the host by mistake, or a cache left on the CPU, fails here instead of on
the first GPU run.

The fake-CUDA machinery (`fake_cuda`, a CUDA device guard on a CPU-only torch) is tests/support/fake_cuda.py's.

`ModelRunner.__init__` still cannot run under fake mode: a module whose parameters are fake tensors
is converted by `swap_tensors`, which fake mode's weak references refuse. So the runner is built for
real on the CPU from a tiny checkpoint, then given its model's module tree with fake CUDA bfloat16
parameters, fake CUDA KV caches and the backend `make_attention_backend` picks for CUDA; `ModelRunner.execute` -- its
tensor building, the model forward and the LM head on the sampled rows -- then runs under fake mode.
Scoring rows are left out: they read values back to the host (`tolist`), which fake tensors lack.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from configs import EngineConfig
from engine.model.checkpoint import load_model_spec
from engine.model.layers.decoder import PreNormDecoderLM
from engine.worker.forward_batch import ForwardBatch, page_table_array
from engine.worker.runner import ModelRunner
from ops import flash_kernel
from ops.attention import (
    AttentionMetadata,
    FlashAttention,
    FlexAttention,
    TorchAttention,
    TritonAttention,
    make_attention_backend,
    triton_paged,
    write_kv,
)
from tests.support import fake_cuda as fake_cuda_fixtures
from tests.support.flash_kernels import KERNELS

# the shared fixtures: fake mode for fake CUDA tensors, with a CUDA device guard for the session
fake_cuda, fake_cuda_guard = fake_cuda_fixtures.fake_cuda, fake_cuda_fixtures.fake_cuda_guard
CUDA = torch.device("cuda", 0)
BF16 = torch.bfloat16
PAGE, HEADS, KV_HEADS, DIM = 16, 4, 2, 8

# (tokens already cached, tokens fed now) per sequence
BATCHES = {
    "ar": ([(0, 21), (16, 8), (40, 1), (3, 1)], None),
    "dllm": ([(0, 32), (28, 8), (40, 4), (16, 4)], 4),
}
BACKENDS = ["torch", "flash-bundled", "flash-wheel", "flex", "triton"]


@pytest.fixture
def fake_mode(fake_cuda):
    with fake_cuda() as mode:
        yield mode


def backend_for(name: str, monkeypatch, head_dim: int = DIM):
    """The backend `make_attention_backend` picks for CUDA bf16 (flash through a kernel substitute)."""
    if name == "torch":
        return make_attention_backend("torch", CUDA, BF16, PAGE, head_dim)
    if name == "flex":  # eager: the compiled kernel needs triton and a real GPU
        # eager FlexAttention still goes through dynamo, which turns a softmax scale that changed since
        # an earlier test into a tensor read back with .item(): fake tensors have no value to read
        torch._dynamo.reset()
        return FlexAttention(compiled=False)
    if name == "triton":  # the kernel launch through a substitute: fake tensors hold no data to run on
        monkeypatch.setattr(triton_paged, "run_paged_attention", triton_launch_substitute)
        return TritonAttention(query_group=HEADS // KV_HEADS)
    monkeypatch.setattr(flash_kernel, "INSTALLED", KERNELS[name.removeprefix("flash-")])
    backend = make_attention_backend("flash", CUDA, BF16, PAGE, head_dim)
    assert isinstance(backend, FlashAttention)
    return backend


def triton_launch_substitute(q, k_cache, v_cache, page_tables, positions, tiles, scale, mode, dllm_block=1,
                             window=0):
    """What the Triton kernel's launch needs of its arguments, checked: every tensor on q's device,
    the metadata int64 and the tile arrays of one length (the grid); an output like q."""
    tensors = [k_cache, v_cache, page_tables, positions, *tiles.values()]
    if any(t.device != q.device for t in tensors):
        raise RuntimeError(f"the Triton kernel's arguments are on several devices: {[t.device for t in tensors]}")
    assert all(t.dtype == torch.long for t in (page_tables, positions, *tiles.values()))
    assert len({t.shape for t in tiles.values()}) == 1 and k_cache.dtype == q.dtype
    return torch.empty_like(q)


def batch_lists(shapes: list[tuple[int, int]]) -> dict:
    """Host-side lists of a forward over `shapes`, pages laid out one sequence after another."""
    tables, slots, positions, first_page = [], [], [], 0
    for cached, fed in shapes:
        n = -(-(cached + fed) // PAGE)
        table = list(range(first_page, first_page + n))
        first_page += n
        tables.append(table)
        positions += range(cached, cached + fed)
        slots += [table[p // PAGE] * PAGE + p % PAGE for p in range(cached, cached + fed)]
    width = max(len(t) for t in tables)
    return {"q_lens": [f for _, f in shapes], "kv_lens": [c + f for c, f in shapes], "positions": positions,
            "slot_mapping": slots, "page_tables": [t + [0] * (width - len(t)) for t in tables],
            "num_pages": first_page}


def on_cuda(value) -> list[str]:
    """Names of the tensors inside `value` (nested dicts/lists) that are not on CUDA."""
    if isinstance(value, torch.Tensor):
        return [] if value.device.type == "cuda" else [f"{value.device} {tuple(value.shape)}"]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list | tuple) else []
    return [bad for item in items for bad in on_cuda(item)]


def test_fake_mode_refuses_a_host_tensor_next_to_a_cuda_one(fake_mode):
    x = torch.empty(4, 3, device="cuda", dtype=BF16)
    assert x.device == CUDA and x.dtype == BF16
    with pytest.raises(FakeTensorDeviceMismatchError):
        x.index_select(0, torch.tensor([0, 1]))
    with pytest.raises(FakeTensorDeviceMismatchError):
        x + torch.zeros(4, 3, dtype=BF16)


# ---- attention ops ------------------------------------------------------------------------------------------
def attention_inputs(shapes, block_length, meta_device=CUDA):
    lists = batch_lists(shapes)
    total = len(lists["positions"])
    meta = AttentionMetadata(q_lens=lists["q_lens"], kv_lens=lists["kv_lens"],
                             positions=torch.tensor(lists["positions"], device=meta_device),
                             slot_mapping=torch.tensor(lists["slot_mapping"], device=meta_device),
                             page_tables=torch.tensor(lists["page_tables"], device=meta_device),
                             page_size=PAGE, dllm_block_length=block_length,
                             page_table_lists=[t[: -(-kv // PAGE)] for t, kv in zip(lists["page_tables"],
                                                                                      lists["kv_lens"], strict=True)])
    qkv = (torch.empty(total, HEADS, DIM, device=CUDA, dtype=BF16),
           torch.empty(total, KV_HEADS, DIM, device=CUDA, dtype=BF16),
           torch.empty(total, KV_HEADS, DIM, device=CUDA, dtype=BF16))
    caches = torch.zeros(2, lists["num_pages"], PAGE, KV_HEADS, DIM, device=CUDA, dtype=BF16).unbind(0)
    return meta, qkv, caches


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("batch", BATCHES)
def test_attention_stays_on_the_device(fake_mode, monkeypatch, backend_name, batch):
    shapes, block_length = BATCHES[batch]
    backend = backend_for(backend_name, monkeypatch)
    meta, (q, k, v), (k_cache, v_cache) = attention_inputs(shapes, block_length)
    backend.prepare(meta)
    assert on_cuda(meta.extra) == [], "everything prepare derives lives on the device"
    out = backend.forward(q, k, v, k_cache, v_cache, meta, DIM**-0.5)
    assert (out.device, out.dtype, tuple(out.shape)) == (CUDA, BF16, tuple(q.shape))


def test_torch_backend_keeps_buckets_on_the_device(fake_mode):
    """A decode batch with one long prefill splits into several padded buckets."""
    shapes = [(0, 48), *[(p, 1) for p in (3, 9, 17, 30, 5)]]
    meta, (q, k, v), caches = attention_inputs(shapes, None)
    backend = TorchAttention()
    backend.prepare(meta)
    assert len(meta.extra["buckets"]) > 1
    assert on_cuda(meta.extra) == []
    assert backend.forward(q, k, v, *caches, meta, DIM**-0.5).device == CUDA


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_attention_metadata_left_on_the_host_is_refused(fake_mode, monkeypatch, backend_name):
    shapes, block_length = BATCHES["dllm"]
    backend = backend_for(backend_name, monkeypatch)
    meta, (q, k, v), caches = attention_inputs(shapes, block_length, meta_device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match="device"):
        backend.prepare(meta)
        backend.forward(q, k, v, *caches, meta, DIM**-0.5)


def test_write_kv_on_the_device(fake_mode):
    k_cache, v_cache = torch.zeros(2, 3, PAGE, KV_HEADS, DIM, device=CUDA, dtype=BF16).unbind(0)
    k = torch.empty(5, KV_HEADS, DIM, device=CUDA, dtype=BF16)
    write_kv(k, k, k_cache, v_cache, torch.tensor([0, 7, 16, 17, 40], device=CUDA))
    with pytest.raises(RuntimeError, match="same device"):
        write_kv(k, k, k_cache, v_cache, torch.tensor([0, 7, 16, 17, 40]))


# ---- the model runner's forward -----------------------------------------------------------------------------------
def fake_cuda_model(spec) -> PreNormDecoderLM:
    """The model's module tree with every parameter a fresh fake CUDA bfloat16 tensor (under fake mode;
    assigned, as converting fake parameters with `Module.to` would swap them)."""
    with torch.device("meta"):
        model = PreNormDecoderLM(spec)
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            module._parameters[name] = nn.Parameter(torch.empty(param.shape, dtype=BF16, device=CUDA),
                                                    requires_grad=False)
    return model.eval()


@pytest.fixture(scope="module")
def cpu_runners(dllm_ckpt, ar_ckpt):
    """Real runners built on the CPU, one per paradigm; each test re-homes one onto fake CUDA."""
    config = EngineConfig(device="cpu", kv_block_size=PAGE, num_kv_blocks=8)
    return {name: ModelRunner(load_model_spec(path), config) for name, path in (("dllm", dllm_ckpt),
                                                                                  ("ar", ar_ckpt))}


def rehome_on_fake_cuda(runner: ModelRunner, backend, num_pages: int, cache_device: torch.device = CUDA) -> None:
    """Under fake mode: the runner's model, KV caches, device, dtype and backend as on a CUDA machine."""
    spec = runner.spec
    runner.device, runner.dtype, runner.backend = CUDA, BF16, backend
    runner.model = fake_cuda_model(spec)
    shape = (2, num_pages, PAGE, spec.num_key_value_heads, spec.head_dim)
    runner.kv_caches = [torch.zeros(shape, dtype=BF16, device=cache_device).unbind(0)
                        for _ in range(spec.num_hidden_layers)]


def forward_batch(paradigm: str) -> tuple[ForwardBatch, int]:
    """A prefill chunk next to decode rows (AR) or DLLM blocks next to a fused commit + next block."""
    shapes, _ = BATCHES[paradigm]
    lists = batch_lists(shapes)
    total = len(lists["positions"])
    last_rows = [sum(lists["q_lens"][: s + 1]) - 1 for s in range(len(shapes))]
    batch = ForwardBatch(input_ids=[7] * total, positions=lists["positions"], q_lens=lists["q_lens"],
                         kv_lens=lists["kv_lens"], slot_mapping=lists["slot_mapping"],
                         page_tables=page_table_array(lists["page_tables"]),
                         sample_rows=list(range(total)) if paradigm == "dllm" else last_rows)
    return batch, lists["num_pages"]


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("paradigm", ["dllm", "ar"])
def test_runner_forward_stays_on_the_device(cpu_runners, fake_cuda, monkeypatch, backend_name, paradigm):
    runner = cpu_runners[paradigm]
    batch, num_pages = forward_batch(paradigm)
    with fake_cuda():
        rehome_on_fake_cuda(runner, backend_for(backend_name, monkeypatch, runner.spec.head_dim), num_pages)
        runner.set_dllm_block_length(4 if paradigm == "dllm" else None)
        out = runner.execute(batch)
    assert (out.logits.device, out.logits.dtype) == (CUDA, torch.float32)
    assert tuple(out.logits.shape) == (len(batch.sample_rows), runner.spec.vocab_size)


def test_runner_with_a_host_kv_cache_is_refused(cpu_runners, fake_cuda, monkeypatch):
    runner = cpu_runners["ar"]
    batch, num_pages = forward_batch("ar")
    with fake_cuda():
        rehome_on_fake_cuda(runner, backend_for("torch", monkeypatch), num_pages,
                            cache_device=torch.device("cpu"))
        runner.set_dllm_block_length(None)
        with pytest.raises(RuntimeError, match="device"):  # the paged KV write meets the host cache
            runner.execute(batch)


# ---- no host transfer inside the model's forward -----------------------------------------------------------------
class TransferRecorder(TorchDispatchMode):
    """Every op that moves data between the host and the (fake) CUDA device: an op with a host tensor
    among its inputs and a CUDA tensor among its outputs (an upload, e.g. `torch.tensor(list,
    device="cuda")`), the reverse (a download), or a CUDA value read by the host (`.item()`,
    `.tolist()`: `_local_scalar_dense`). Each would make the host wait for the device on a GPU.
    FlexAttention's operator passes through too (its inputs and outputs are checked like any op's), and
    the mode lets dynamo trace eager FlexAttention's wrapper (the ops it runs still come through here)."""

    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self):
        super().__init__()
        self.transfers: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func is torch.ops.aten._local_scalar_dense.default and inputs[0].device.type == "cuda":
            self.transfers.append(f"{func}: a device value read by the host")
        out = func(*args, **kwargs)
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        devices_in, devices_out = {t.device.type for t in inputs}, {t.device.type for t in outputs}
        if "cpu" in devices_in and "cuda" in devices_out:
            self.transfers.append(f"{func}: host -> device")
        if "cuda" in devices_in and "cpu" in devices_out:
            self.transfers.append(f"{func}: device -> host")
        return out


def record_forward_transfers(runner: ModelRunner, monkeypatch) -> TransferRecorder:
    """Record the transfers of every later `runner.model.forward` (only those: the runner's own upload
    before it is the step's one copy)."""
    recorder, forward = TransferRecorder(), runner.model.forward

    def recorded(*args, **kwargs):
        with recorder:
            return forward(*args, **kwargs)

    monkeypatch.setattr(runner.model, "forward", recorded)
    return recorder


def test_transfer_recorder_sees_uploads_and_reads(fake_mode):
    recorder = TransferRecorder()
    with recorder:
        x = torch.tensor([1, 2, 3], device=CUDA)
        (x + 1).cpu()
        with pytest.raises(RuntimeError):  # fake tensors hold no value; the read is recorded first
            x.sum().item()
    assert recorder.transfers == ["aten._to_copy.default: host -> device", "aten._to_copy.default: device -> host",
                                  "aten._local_scalar_dense.default: a device value read by the host"]


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("paradigm", ["dllm", "ar"])
def test_runner_forward_makes_no_host_transfer(cpu_runners, fake_cuda, monkeypatch, backend_name, paradigm):
    """The step's metadata goes up in one copy before `model.forward`; inside it (embedding, attention
    with its metadata prepared beforehand, every layer) nothing crosses between host and device."""
    runner = cpu_runners[paradigm]
    batch, num_pages = forward_batch(paradigm)
    with fake_cuda():
        rehome_on_fake_cuda(runner, backend_for(backend_name, monkeypatch, runner.spec.head_dim), num_pages)
        runner.set_dllm_block_length(4 if paradigm == "dllm" else None)
        runner.execute(batch)  # the first forward moves the rotary frequencies to the device, once
        recorder = record_forward_transfers(runner, monkeypatch)
        uploads = runner.uploader.uploads
        runner.execute(batch)
    assert recorder.transfers == []
    assert runner.uploader.uploads == uploads + 1, "one host->device copy per step"


def test_attention_prepared_inside_the_forward_is_caught(cpu_runners, fake_cuda, monkeypatch):
    """The check fails where it should: the reference backend prepared inside `model.forward` (as
    before the runner prepared it) uploads its bucket metadata there."""
    runner = cpu_runners["ar"]
    batch, num_pages = forward_batch("ar")
    with fake_cuda():
        rehome_on_fake_cuda(runner, backend_for("torch", monkeypatch), num_pages)
        runner.set_dllm_block_length(None)
        runner.execute(batch)
        recorder = record_forward_transfers(runner, monkeypatch)
        monkeypatch.setattr(runner.backend, "prepare", lambda meta: None)  # the model prepares instead
        monkeypatch.setattr(runner.model, "forward", functools.partial(prepare_then, runner.model.forward,
                                                                         TorchAttention()))
        runner.execute(batch)
    assert recorder.transfers and all("host -> device" in t for t in recorder.transfers)


def prepare_then(forward, backend, input_ids, positions, kv_caches, meta, _):
    """`forward` with `backend` prepared inside it, as the model does for a caller that did not."""
    meta.extra = None
    return forward(input_ids, positions, kv_caches, meta, backend)
