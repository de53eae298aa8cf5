"""Tests that need the native kernels (turnkv/kernels/csrc) skip where they are not built, so the
suite runs on a checkout without a compiler. Under TURNKV_REQUIRE_NATIVE=1 (as CI sets it) those
skips fail instead: a run cannot pass with the kernels silently missing.

``needs(available, what)`` marks a test or a module; ``missing(what)`` is the skip inside a test or
fixture. tests/conftest.py imports this module's hooks."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

ENV = "TURNKV_REQUIRE_NATIVE"
BUILD = "python -m turnkv.kernels.build"


def required() -> bool:
    return os.environ.get(ENV) == "1"


def missing(what: str) -> NoReturn:
    reason = f"{what} not built ({BUILD})"
    if required():
        pytest.fail(f"{reason}, and {ENV}=1 requires it", pytrace=False)
    pytest.skip(reason)


def needs(available: bool, what: str) -> pytest.MarkDecorator:
    return pytest.mark.native(available=bool(available), what=what)


def pytest_configure(config):
    config.addinivalue_line("markers", "native(available, what): needs a native kernel (tests/native.py)")


@pytest.hookimpl(tryfirst=True)   # before a skipif mark that would also cover a missing build
def pytest_runtest_setup(item):
    for mark in item.iter_markers("native"):
        if not mark.kwargs["available"]:
            missing(mark.kwargs["what"])
