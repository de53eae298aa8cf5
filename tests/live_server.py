"""An app served in-process by a real uvicorn on a free loopback port, for the server tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx
import uvicorn


@contextlib.contextmanager
def serving(app, backlog: int = 16):
    """Yields the server's URL once its /health answers; stops it on exit."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(backlog)
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    try:
        yield url
    finally:
        srv.should_exit = True
        thread.join(10)
        sock.close()
