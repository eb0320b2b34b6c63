"""The serving process's heap policy (`engine.heap`), in a fresh interpreter (it changes the process's
garbage collector): the startup heap frozen, the youngest generation collected every
`STEP_LOOP_GC_THRESHOLD` allocations, and a release collecting cyclic garbage with the heap refrozen."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import gc, weakref
import torch
from engine.heap import STEP_LOOP_GC_THRESHOLD, freeze_startup_heap, return_freed_memory

default = gc.get_threshold()
freeze_startup_heap()
assert gc.get_freeze_count() > 0
assert gc.get_threshold() == (STEP_LOOP_GC_THRESHOLD, *default[1:]), gc.get_threshold()

class Node:
    pass

a, b = Node(), Node()
a.other, b.other = b, a  # a cycle: only the cyclic collector frees it
gone = weakref.ref(a)
del a, b
return_freed_memory(torch.device("cpu"))
assert gone() is None
assert gc.get_freeze_count() > 0
print("ok")
"""


def test_heap_policy_of_an_engine_process():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
