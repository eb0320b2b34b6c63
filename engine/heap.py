"""The serving process's heap: the cyclic garbage collector kept off what the process starts with and
run less often on what a step makes, and freed memory handed back."""

from __future__ import annotations

import atexit
import ctypes
import gc

import torch

#: allocations between two collections of the youngest generation in a process the engine owns
#: (Python's default is 700)
STEP_LOOP_GC_THRESHOLD = 50_000


def freeze_startup_heap() -> None:
    """Collect, then exempt everything alive now from Python's cyclic garbage collector (`gc.freeze`,
    as vLLM's engine core process does), and collect the youngest generation every
    `STEP_LOOP_GC_THRESHOLD` allocations instead of every 700. The heap a replica starts with --
    torch, the model, the tokenizer: some 400k objects -- lives as long as the process; left in the
    collector's oldest generation it is re-scanned over and over as the step loop allocates, about a
    fifth of the host time of a step. The step itself makes a few hundred short-lived objects per
    sequence (its plan, picks, chunks), so at the default threshold a step at 128 concurrent ran
    dozens of collections, which each also scanned what the running requests keep: about a tenth of
    the host time of a block-diffusion step; garbage cycles (rare here) now wait for a later
    collection. Only for a process the engine owns (a Serve engine replica, a benchmark):
    `pipeline()` and `LLMEngine` never call it, because in a trainer's process an object frozen here
    that later became cyclic garbage would stay until `gc.unfreeze()`. Freed memory is still given
    back on release (`return_freed_memory` collects with the heap unfrozen)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(STEP_LOOP_GC_THRESHOLD, *gc.get_threshold()[1:])
    atexit.unregister(gc.unfreeze)  # once per process; at exit extension modules then see no leaks
    atexit.register(gc.unfreeze)


def return_freed_memory(device: torch.device) -> None:
    """Hand freed memory back: CUDA's cached blocks, and on CPU glibc's free heap pages (large
    tensors are mmap'ed and go back on free; smaller ones may sit in malloc arenas until trimmed).
    A heap frozen by `freeze_startup_heap` is collected too, then frozen again."""
    frozen = gc.get_freeze_count() > 0
    if frozen:
        gc.unfreeze()
    gc.collect()
    if frozen:
        gc.freeze()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the allocator keeps what it keeps
        pass
