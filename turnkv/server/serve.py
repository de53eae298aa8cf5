"""``turnkv serve``: the listening socket (bound before the model loads), the engine loop on the
main thread and uvicorn on a thread of its own, until SIGINT / SIGTERM.

Before torch, the third-party modules the server and the load need (Starlette, pydantic,
uvicorn, jinja2, gguf-py: ~0.18 s CPU of pure Python on a 2-core Zen 2 once their extension
modules are in) are imported on a thread of their own while the main thread maps torch's C++
library with the GIL free (``launch.map_torch_library``, ~0.2 s CPU) and then imports torch,
without its Python meta kernels, which a thread imports once the server answers
(turnkv/torch_import.py); the thread is joined before the load. This package's own server modules (they need the engine) are
imported on a thread while the main thread loads the model, which imports none of them, so the
two threads do not wait on each other's module locks. While torch imports, a thread faults in the
memory the weights' tiles will be written to (turnkv/page_arena.py). The whole start-up runs with
Python's cyclic garbage collector off (``launch.gc_paused``)."""

from __future__ import annotations

import importlib
import signal
import socket
import sys
import threading

from .tenants import KeyRing
from .tools import chatml_tools_for

# the third-party modules ``serve`` needs (uvicorn's own start-up imports included; jinja2 and
# gguf-py for the load), imported on a thread while the main thread maps torch's C++ library
# without the GIL (``map_torch_library``); the main thread imports those that load shared libraries
# of their own first (``SERVER_EXTENSIONS``, numpy among them, which torch imports anyway): the
# dynamic loader maps one library at a time
SERVER_EXTENSIONS = ("pydantic_core", "ssl", "asyncio", "queue", "zoneinfo", "multiprocessing.synchronize", "markupsafe",
                     "numpy", "yaml", "sentencepiece", "csv")
SERVER_LIBRARIES = ("pydantic", "pydantic.main", "starlette.applications", "starlette.routing",
                    "starlette.responses", "starlette.requests", "starlette.concurrency", "uvicorn",
                    "uvicorn.config", "uvicorn.server", "uvicorn.lifespan.on", "uvicorn.protocols.http.h11_impl",
                    "anyio._backends._asyncio", "jinja2", "gguf")
# this package's, imported on a thread while the main thread loads the model (they need the engine)
HTTP_MODULES = ("turnkv.server.app", "turnkv.server.context", "turnkv.server.requests",
                "turnkv.server.slow_client_guard")


def listen_socket(host: str, port: int) -> socket.socket:
    """Bound and listening before the model loads: a port in use fails at once, and the address
    printed is the real one (``--port 0`` picks a free port)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


def check_limits(args) -> None:
    """ValueError naming the first flag out of range."""
    for name, value, low in (("--request-timeout", args.request_timeout, 0), ("--max-messages", args.max_messages, 0),
                             ("--max-connections", args.max_connections, 0),
                             ("--tenant-budget-mb", args.tenant_budget_mb, -1),
                             ("--header-timeout", args.header_timeout, 0), ("--body-timeout", args.body_timeout, 0),
                             ("--max-n", args.max_n, 0)):
        if value is not None and value <= low:
            raise ValueError(f"{name} must be {'>= 0' if low < 0 else '> 0'}, got {value}")


def import_in_background(names: tuple[str, ...]) -> threading.Thread:
    """A started thread importing ``names``; a failure is left for the main thread's own import of
    the module to raise."""

    def run() -> None:
        for name in names:
            try:
                importlib.import_module(name)
            except Exception:    # noqa: BLE001  (the main thread's import says why)
                return

    thread = threading.Thread(target=run, name="turnkv-imports", daemon=True)
    thread.start()
    return thread


def import_server_libraries() -> threading.Thread:
    """Before torch: the extension modules of ``SERVER_EXTENSIONS`` here, then a started thread
    importing ``SERVER_LIBRARIES`` (pure Python once those are in: ~0.18 s CPU on a 2-core Zen 2)
    while this thread maps torch's C++ library without the GIL (~0.2 s CPU), where both used to
    take the GIL in turn."""
    from ..launch import map_torch_library

    for name in SERVER_EXTENSIONS:
        try:
            importlib.import_module(name)
        except ImportError:
            pass    # only a head start: the module that needs it says why
    thread = import_in_background(SERVER_LIBRARIES)
    map_torch_library()
    return thread


def serve(args) -> int:
    from ..launch import gc_paused

    with gc_paused():      # the collector's passes over start-up's objects would take the GIL
        started = start(args)
    if started is None:
        return 2
    app, server, sock, keys = started
    with sock:
        run(app, server, sock, keys)
    return 0


def start(args):
    """The socket, the model, the app and uvicorn's server, ready to ``run``; None (the reason
    printed) where the port cannot be had."""
    from ..page_arena import reserve
    from ..torch_import import import_lean

    libraries = import_server_libraries()
    reserve(args.model, args.weights)     # the tiles' pages faulted in beside torch's import
    import_lean()     # torch without its Python meta kernels: they come in once the server answers
    from ..engine.engine import Engine  # noqa: F401  (the engine: before the HTTP imports' thread)
    from ..launch import engine_from, print_banner, sampling_from

    libraries.join()

    defaults = sampling_from(args)
    defaults.validate()
    try:
        sock = listen_socket(args.host, args.port)
    except OSError as err:
        print(f"turnkv: error: cannot listen on {args.host}:{args.port}: {err}", file=sys.stderr)
        return None
    check_limits(args)
    try:
        keys = KeyRing(args.api_key, args.api_keys, args.admin_key)    # a bad key file fails before the load
        imports = import_in_background(HTTP_MODULES)
        engine = engine_from(args, huge_pages_now=False)     # the move starts once the server answers
        imports.join()
        import uvicorn

        from .app import create_app
        from .context import ServerConfig
        from .requests import warm_up
        from .slow_client_guard import GuardedH11
        if not args.chat_template:   # a ChatML template without tools: the shipped one that renders alike
            engine.tokenizer = chatml_tools_for(engine.tokenizer) or engine.tokenizer
        print_banner(engine, args.cache_budget_mb, args.prompt_cache)
        config = ServerConfig(keys=keys, defaults=defaults, max_messages=args.max_messages, max_n=args.max_n,
                              request_timeout_s=args.request_timeout, body_timeout_s=args.body_timeout)
        protocol = type("GuardedH11", (GuardedH11,), {"header_timeout_s": args.header_timeout})
        app = create_app(engine, config, engine_thread=False)
        warm_up(engine)
        url = address(sock)
        print(f"turnkv: serving {engine.name} at {url} (OpenAI base URL {url}/v1"
              f"{', API key required' if keys.configured else ''})", file=sys.stderr, flush=True)
        # ws="none": no endpoint takes WebSockets, and uvicorn then does not import a WebSocket library
        server = uvicorn.Server(uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=5, http=protocol,
                                               ws="none", limit_concurrency=args.max_connections,
                                               timeout_keep_alive=5))
    except BaseException:
        sock.close()
        raise
    return app, server, sock, keys


def once_answering(answering, stop: threading.Event, job, name: str) -> threading.Thread | None:
    """A started daemon thread that runs ``job`` once ``answering()``, or ends at ``stop``; None
    for no ``job``."""
    if job is None:
        return None

    def wait_then_run() -> None:
        while not answering():
            if stop.wait(0.02):
                return
        job()

    thread = threading.Thread(target=wait_then_run, name=name, daemon=True)
    thread.start()
    return thread


def huge_pages(engine):
    """The GGUF weights' move to huge pages (``collapse``) where the banner said it would happen,
    else None: kernel work (it copies every 2 MiB of the weights) that the first answer need not
    wait for, on a 2-core machine it took the core the start-up's last steps ran on."""
    if not getattr(engine, "weight_pages", ""):
        return None
    from ..kernels.weight_memory import collapse
    return collapse


def torch_meta_kernels():
    """The import of torch's Python meta kernels that the start-up left out (``torch_import``),
    else None: ~0.3 s of GIL-held CPU that the first answer need not wait for."""
    from ..torch_import import complete, deferred
    return complete if deferred() else None


def run(app, server, sock: socket.socket, keys: KeyRing) -> None:
    """The engine steps on the main thread, which loaded the model: a second thread running
    OpenMP work would start a second team beside the main thread's, and with more OpenMP threads
    than cores libgomp stops spinning between parallel regions (each kernel call then waits on a
    futex wake-up): measured 2x slower decode. HTTP runs on its own thread, and so does the
    grammar engine's vocabulary view, built once the server answers (it holds the GIL for
    0.3-0.8 s on a 128k vocabulary, which the first answer need not wait for), and so do the
    GGUF weights' move to huge pages (``huge_pages``) and the import of torch's Python meta
    kernels (``torch_meta_kernels``)."""
    from .requests import grammar_warm_up_thread

    stop = threading.Event()

    def http() -> None:
        try:
            server.run(sockets=[sock])
        finally:
            stop.set()

    def shut_down(signum, frame) -> None:
        server.should_exit = True
        stop.set()

    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, lambda signum, frame: keys.reload_quietly())
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, shut_down)
    thread = threading.Thread(target=http, name="turnkv-http")
    thread.start()
    once_answering(lambda: server.started, stop, huge_pages(app.state.engine), name="turnkv-weights-to-huge-pages")
    once_answering(lambda: server.started, stop, torch_meta_kernels(), name="turnkv-torch-meta-kernels")
    grammar_warm_up_thread(app.state.engine, lambda: server.started, stop)
    if app.state.engine.idle_check:     # auto's check (docs/speculative.md): idle, once the server answers
        app.state.engine.idle_check = lambda: server.started
    app.state.worker.run(stop)
    server.should_exit = True
    thread.join(10)
