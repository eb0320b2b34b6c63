"""Keeping the cyclic garbage collector off the heap a serving process starts with."""

from __future__ import annotations

import atexit
import gc


def freeze_startup_heap() -> None:
    """Collect, then exempt everything alive now from Python's cyclic garbage collector (`gc.freeze`,
    as vLLM's engine core process does). The heap a replica starts with -- torch, the model,
    the tokenizer: some 400k objects -- lives as long as the process; left in the collector's oldest
    generation it is re-scanned over and over as the step loop allocates, about a fifth of the host
    time of a step. Only for a process the engine owns (a Serve engine replica, a benchmark):
    `pipeline()` and `LLMEngine` never call it, because in a trainer's process an object frozen here
    that later became cyclic garbage would stay until `gc.unfreeze()`. Freed memory is still given
    back on release (engine.worker.runner.return_freed_memory collects with the heap unfrozen)."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once per process; at exit extension modules then see no leaks
    atexit.register(gc.unfreeze)
