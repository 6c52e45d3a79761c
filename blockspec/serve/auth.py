"""API keys: what a key may be, the tenant each key stands for, and the middleware that asks for one."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from starlette.datastructures import Headers

from blockspec.errors import BlockspecError
from blockspec.serve.schemas import APIError


def check_api_key(key: str | None, name: str = "the API key") -> None:
    """A key travels in an HTTP header: printable ASCII, not empty (None: no key). ``name``: where it came
    from, for the error (an option, a variable)."""
    if key is None:
        return
    if not key.strip():
        raise BlockspecError(f"{name} is empty: give a key, or leave it out to go without one")
    if not (key.isascii() and key.isprintable()):
        raise BlockspecError(f"{name} must be printable ASCII characters (the key travels in an HTTP header)")


def api_key_list(keys: str | Sequence[str] | None) -> list[str]:
    """One key, several, or none, each checked; duplicates dropped."""
    if keys is None:
        return []
    keys = [keys] if isinstance(keys, str) else list(keys)
    for key in keys:
        check_api_key(key)
    return list(dict.fromkeys(keys))


def tenant_of(key: str) -> str:
    """The name a key's requests share state under (the suffix store): a digest, so no key is kept in it."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class APIKeyGuard:
    """ASGI middleware refusing /v1 requests without ``Authorization: Bearer <key>`` for one of
    ``api_keys``, before their body is read (a client without a key learns nothing about its
    request). An accepted request carries its key's tenant in ``request.state.tenant``."""

    def __init__(self, app, api_keys: Sequence[str]):
        self.app = app
        self.tenants = [(key.encode(), tenant_of(key)) for key in api_keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            tenant = self._tenant(scope)
            if tenant is None:
                error = APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                 code="invalid_api_key")
                return await error.response()(scope, receive, send)
            scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)

    def _tenant(self, scope) -> str | None:
        scheme, _, given = Headers(scope=scope).get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return None
        given = given.strip().encode("utf-8", "replace")
        found = None
        for key, tenant in self.tenants:  # every key compared, in constant time each
            if hmac.compare_digest(given, key):
                found = tenant
        return found
