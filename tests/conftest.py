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


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """``tiny_pair(build)``: ``build(tmp_path)``'s (turnkv model, transformers model), built once per
    run, so a family's own file and the contract table (tests/test_family_contract.py) share it."""
    built = {}

    def get(build):
        key = f"{build.__module__}.{build.__name__}"
        if key not in built:
            built[key] = build(tmp_path_factory.mktemp(build.__name__))
        return built[key]

    return get


@pytest.fixture(scope="module")
def pair(request, tiny_pair):
    """A family file's (turnkv model, transformers model): what its module's ``tiny(tmp_path)`` builds."""
    return tiny_pair(request.module.tiny)
