"""API keys, tenants and the admin: who a request is, and what it may see.

* No key configured: one anonymous tenant ("") that may do everything (a local server).
* ``--api-key K``: one key, tenant "default". Unless an ``--admin-key`` is also given, it is the
  admin too (a single-tenant server: flushing "everything" flushes only its own entries anyway).
* ``--api-keys FILE``: one ``key tenant`` pair per line (``#`` comments, blank lines ignored),
  re-read on SIGHUP. Each tenant is its own prompt-cache namespace, budget share, flush scope and
  stats view; several keys may name one tenant (key rotation), and then share it.
* ``--admin-key A``: may flush every tenant's entries, read global stats and /metrics.

Keys are compared in constant time; a tenant's name never reaches the cache (namespaces hold a
hash of it), only the admin's stats.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("turnkv.server")

ANONYMOUS, DEFAULT_TENANT, ADMIN_TENANT = "", "default", "admin"


class KeyFileError(ValueError):
    """The --api-keys file cannot be read or has a malformed line."""


@dataclass(frozen=True)
class Principal:
    """Who sent a request: ``tenant`` names its namespace and budget; ``admin`` may act on all."""

    tenant: str
    admin: bool


def read_key_file(path: str | Path) -> dict[str, str]:
    """``{key: tenant}`` from a file of ``key tenant`` lines."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise KeyFileError(f"cannot read the API key file {path}: {err}") from None
    keys: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise KeyFileError(f"{path}:{n}: expected 'KEY TENANT', got {len(parts)} field(s)")
        key, tenant = parts
        if key in keys and keys[key] != tenant:
            raise KeyFileError(f"{path}:{n}: a key is listed twice with different tenants")
        keys[key] = tenant
    if not keys:
        raise KeyFileError(f"the API key file {path} holds no keys")
    return keys


class KeyRing:
    def __init__(self, api_key: str | None = None, key_file: str | Path | None = None,
                 admin_key: str | None = None):
        self.api_key, self.key_file, self.admin_key = api_key, key_file, admin_key
        self._lock = threading.Lock()
        self._keys: dict[bytes, str] = {}
        self.reload()

    @property
    def configured(self) -> bool:
        return bool(self.api_key or self.key_file or self.admin_key)

    def reload(self) -> int:
        """(Re-)read the key file; on error the old keys stay (logged). Returns the key count."""
        keys: dict[str, str] = {}
        if self.api_key:
            keys[self.api_key] = DEFAULT_TENANT
        if self.key_file is not None:
            keys.update(read_key_file(self.key_file))
        with self._lock:
            self._keys = {k.encode("utf-8"): t for k, t in keys.items()}
            return len(self._keys)

    def reload_quietly(self) -> None:
        """SIGHUP: a broken file keeps the old keys and says why in the log."""
        try:
            n = self.reload()
            log.warning("API keys reloaded: %d key(s)", n)
        except KeyFileError as err:
            log.error("API keys NOT reloaded, the old ones stay: %s", err)

    def identify(self, token: str | None) -> Principal | None:
        """The principal a bearer token stands for; None when the token is wrong or missing (and
        keys are configured)."""
        if not self.configured:
            return Principal(ANONYMOUS, admin=True)
        if not token:
            return None
        raw = token.encode("utf-8", "surrogatepass")
        if self.admin_key and hmac.compare_digest(raw, self.admin_key.encode("utf-8")):
            return Principal(ADMIN_TENANT, admin=True)
        with self._lock:
            keys = list(self._keys.items())
        tenant = None
        for key, name in keys:       # every key compared: the time does not say which one matched
            if hmac.compare_digest(raw, key):
                tenant = name
        if tenant is None:
            return None
        single = self.admin_key is None and self.key_file is None
        return Principal(tenant, admin=single)


def tenant_key(tenant: str | None, cache_salt: str | None) -> str:
    """The prompt-cache namespace of a request: "" for the anonymous, salt-free tenant.

    Hashed so neither the tenant's name nor the salt is kept in the cache's memory."""
    if not tenant and not cache_salt:
        return ""
    material = json.dumps({"tenant": tenant or "", "cache_salt": cache_salt or ""}, sort_keys=True)
    return hashlib.sha256(material.encode("utf-8", "surrogatepass")).hexdigest()[:32]

