"""What the server's parts share: its settings (``ServerConfig``) and, once the app is built, the
engine, its worker and the metrics (``ServerContext``) that every route module registers against."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..engine.sampling import SamplingParams
from . import logprobs as lp_format
from .metrics import ServerMetrics
from .tenants import KeyRing
from .worker import EngineWorker

MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_MESSAGES = 2048
DEFAULT_MAX_N = 16
DEFAULT_MAX_CONNECTIONS = 1024
BODY_TIMEOUT_S = 30.0         # a client has this long to send a body (headers: slow_client_guard.GuardedH11)


@dataclass
class ServerConfig:
    keys: KeyRing = field(default_factory=KeyRing)
    defaults: SamplingParams = field(default_factory=SamplingParams)   # the CLI's sampling flags
    max_body_bytes: int = MAX_BODY_BYTES
    max_messages: int = DEFAULT_MAX_MESSAGES
    request_timeout_s: float | None = None     # None: no deadline
    body_timeout_s: float = BODY_TIMEOUT_S
    max_n: int = DEFAULT_MAX_N                 # choices per request (--max-n)


@dataclass
class ServerContext:
    engine: object
    config: ServerConfig
    worker: EngineWorker
    metrics: ServerMetrics
    cache_enabled: bool
    started: int                               # when the app was built (/v1/models "created")
    token_names: lp_format.TokenText           # logprobs name tokens through this cache
