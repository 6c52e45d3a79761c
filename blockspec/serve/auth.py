"""API keys: what a key may be, and the middleware that asks for it."""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers

from blockspec.errors import BlockspecError
from blockspec.serve.schemas import APIError


def check_api_key(key: str | None) -> None:
    """A key travels in an HTTP header: printable ASCII, not empty (None: no key)."""
    if key is None:
        return
    if not key.strip():
        raise BlockspecError("the API key is empty: give a key, or none to serve without authentication")
    if not (key.isascii() and key.isprintable()):
        raise BlockspecError("the API key must be printable ASCII characters (it travels in an HTTP header)")


class APIKeyGuard:
    """ASGI middleware refusing /v1 requests without ``Authorization: Bearer <api_key>``, before their
    body is read (a client without the key learns nothing about its request)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1") and not self._authorized(scope):
            error = APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                             code="invalid_api_key")
            return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        scheme, _, given = Headers(scope=scope).get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode("utf-8", "replace"),
                                                                  self.api_key)
