"""Progress lines on stderr, so that stdout carries only the result JSON."""

from __future__ import annotations

import sys
import time


def log(*args: object) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}]", *args, file=sys.stderr, flush=True)
