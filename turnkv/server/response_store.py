"""Stored responses (``store: true``), per tenant, for ``previous_response_id`` and
``GET/DELETE /v1/responses/{id}``: each keeps the response body and the whole conversation it ended
(instructions excluded, as OpenAI does), so the next turn renders the same tokens a client resending
the history would, and the prompt cache restores them.

Bounded per tenant, least recently used first out: at most ``MAX_RESPONSES`` responses and
``MAX_CHARS`` characters of conversation text (a response counts its whole conversation, so a long
session's early turns go first). A tenant sees only its own ids: another tenant's id is as unknown
as one never issued."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

MAX_RESPONSES = 256
MAX_CHARS = 64 * 1024 * 1024


@dataclass(frozen=True)
class Stored:
    response: dict           # the response body as it was returned
    messages: tuple          # the conversation: chat messages, the reply's own included
    chars: int


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_chars: int = MAX_CHARS):
        self.max_responses, self.max_chars = max_responses, max_chars
        self._lock = threading.Lock()
        self._tenants: dict[str, OrderedDict[str, Stored]] = {}
        self._chars: dict[str, int] = {}

    def put(self, tenant: str, response: dict, messages: list[dict]) -> None:
        chars = len(json.dumps(messages, ensure_ascii=False)) + len(json.dumps(response, ensure_ascii=False))
        entry = Stored(response, tuple(messages), chars)
        with self._lock:
            entries = self._tenants.setdefault(tenant, OrderedDict())
            entries[response["id"]] = entry
            self._chars[tenant] = self._chars.get(tenant, 0) + chars
            while entries and (len(entries) > self.max_responses or self._chars[tenant] > self.max_chars):
                _, old = entries.popitem(last=False)
                self._chars[tenant] -= old.chars

    def get(self, tenant: str, rid: str) -> Stored | None:
        with self._lock:
            entries = self._tenants.get(tenant)
            entry = entries.get(rid) if entries is not None else None
            if entry is not None:
                entries.move_to_end(rid)
            return entry

    def delete(self, tenant: str, rid: str) -> bool:
        with self._lock:
            entries = self._tenants.get(tenant)
            entry = entries.pop(rid, None) if entries is not None else None
            if entry is not None:
                self._chars[tenant] -= entry.chars
            return entry is not None
