"""A fixture (loaded by tests/conftest.py through `pytest_plugins`) for modules of tiny forwards."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module: tiny forwards run far faster on one thread than on two contended
    ones (a module asks for it with `pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
