"""Every runtime module stays small enough to read in one sitting: at most 400 lines.

A module that grows past it holds more than one concept; split it along the seam (the step's sampling
out of the engine loop, a paradigm's request state out of its strategy) rather than packing lines."""

from __future__ import annotations

from tests.support.paths import ROOT

RUNTIME_PACKAGES = ("configs", "ops", "engine", "deployments")
MAX_LINES = 400


def test_no_runtime_module_is_longer_than_400_lines():
    long = {}
    for package in RUNTIME_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            lines = len(path.read_text().splitlines())
            if lines > MAX_LINES:
                long[str(path.relative_to(ROOT))] = lines
    assert not long, f"modules over {MAX_LINES} lines: {long}"
