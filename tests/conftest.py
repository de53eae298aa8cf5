"""Suite-wide settings. Tiny-model tests run single-threaded: OpenMP threads spinning on two
small cores made 30x slower decode of tiny models; real-model tests keep every core."""

from __future__ import annotations

import pytest
import torch

DEFAULT_THREADS = torch.get_num_threads()


@pytest.fixture(autouse=True)
def _threads(request):
    real = request.node.get_closest_marker("real") is not None
    torch.set_num_threads(DEFAULT_THREADS if real else 1)
    yield
    torch.set_num_threads(DEFAULT_THREADS)
