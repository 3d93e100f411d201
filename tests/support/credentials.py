"""The test session's credentials: set in os.environ before any process starts (conftest), so
every service a test starts inherits them (tests run with auth on) and in-process clients, the
SDK and internal channels alike, carry them."""

from __future__ import annotations

import os
import secrets

SERVICE_TOKEN = secrets.token_urlsafe(24)
API_KEY = secrets.token_urlsafe(24)


def install() -> None:
    os.environ.update({"PDSERVE_SERVICE_TOKEN": SERVICE_TOKEN, "PDSERVE_API_KEYS": API_KEY,
                       "PDSERVE_API_KEY": API_KEY})
    for name in ("PDSERVE_SERVICE_TOKEN_FILE", "PDSERVE_API_KEYS_FILE", "PDSERVE_INSECURE"):
        os.environ.pop(name, None)


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


SERVICE_METADATA = bearer(SERVICE_TOKEN)
