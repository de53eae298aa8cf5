"""Who sent a request: the API key in its Authorization header (or the x-api-key header Anthropic's
clients send), mapped to a tenant (tenants.py)."""

from __future__ import annotations

from starlette.requests import Request

from .schemas import AUTHENTICATION, RequestError
from .tenants import KeyRing, Principal


def authorize(request: Request, keys: KeyRing) -> Principal:
    """Who sent the request (the anonymous admin when the server has no keys); 401 otherwise."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    token = token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key")
    principal = keys.identify(token)
    if principal is None:
        raise RequestError("Incorrect or missing API key: send it as 'Authorization: Bearer <key>' or "
                           "'x-api-key: <key>'",
                           status=401, type=AUTHENTICATION, code="invalid_api_key")
    return principal


def require_admin(principal: Principal, what: str) -> None:
    if not principal.admin:
        raise RequestError(f"{what} needs the admin key (--admin-key)", status=403, type="permission_error",
                           code="admin_required")
