"""Where the repository and the venv's commands are: the tests read the repository's files and run its
commands as a user types them, from the repository root with the venv's executables."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root (tests/support/paths.py)
BIN = Path(sys.executable).parent  # the venv's executables
BLOCKSERVE = BIN / "blockserve"  # the console script the install makes
