"""Suite-wide settings. Tiny-model tests run single-threaded: OpenMP threads spinning on two
small cores made 30x slower decode of tiny models; real-model tests keep every core."""

from __future__ import annotations

import pytest
import torch

from native import pytest_configure, pytest_runtest_setup  # noqa: F401  (the TURNKV_REQUIRE_NATIVE switch)

DEFAULT_THREADS = torch.get_num_threads()
REAL_FILES = pytest.StashKey[set]()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # before -m deselects anything, so a file's thread count does not depend on the selection
    config.stash[REAL_FILES] = {str(item.path) for item in items if item.get_closest_marker("real")}


@pytest.fixture(autouse=True, scope="module")
def one_thread(request):
    """The tiny models a file builds once (module-scoped fixtures) are built single-threaded too;
    a file with real-model tests leaves that to each test."""
    if str(request.path) in request.config.stash.get(REAL_FILES, set()):
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _threads(request):
    real = request.node.get_closest_marker("real") is not None
    before = torch.get_num_threads()
    torch.set_num_threads(DEFAULT_THREADS if real else 1)
    yield
    torch.set_num_threads(before)
