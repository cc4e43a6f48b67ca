"""API keys and the tenant cache salt derived from them.

With keys configured, every key is a tenant: its requests carry the salt
HMAC-SHA256(server secret, key), so they only match prefixes their own tenant computed and one
tenant can neither hit nor time another's cached prompt. A client's `cache_salt` is appended
(`tenant:client`), subdividing its own tenant only. The raw key never leaves this process, and
the secret is drawn at start-up (the cache does not outlive the process either).

Without keys there are no tenants and a client's `cache_salt` is used as is.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Sequence

from radixkv.server.errors import unauthorized


class Tenancy:
    def __init__(self, api_keys: Sequence[str], secret: bytes | None = None):
        self._keys = tuple(key.encode() for key in api_keys)
        self._secret = secret if secret is not None else os.urandom(32)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def tenant(self, authorization: str | None) -> str | None:
        """The tenant salt of a request's Authorization header (None without keys).

        Raises a 401 APIError when keys are configured and the header has none of them.
        """
        if not self._keys:
            return None
        if authorization is None:
            raise unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise unauthorized("malformed Authorization header: expected 'Bearer <key>'")
        key = token.strip().encode()
        # Compare against every key, so the time taken does not tell which one came close.
        matched = False
        for known in self._keys:
            matched |= hmac.compare_digest(key, known)
        if not matched:
            raise unauthorized("incorrect API key")
        return hmac.new(self._secret, key, hashlib.sha256).hexdigest()[:32]

    @staticmethod
    def cache_salt(tenant: str | None, client_salt: str | None) -> str | None:
        """The salt the engine keys a request's prefixes with."""
        if tenant is None:
            return client_salt
        return tenant if client_salt is None else f"{tenant}:{client_salt}"
