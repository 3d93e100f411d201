"""Who may call what: the deployment's service token, client API keys and optional TLS files.

Two kinds of bearer credential travel in gRPC metadata as `authorization: Bearer <token>`:
- the **service token**, one per deployment, carried by every internal call (router -> P/D,
  P/D -> store, P -> D first token, Cancel) and used to sign worker registrations in Redis;
- **client API keys**, accepted by the router's client RPCs only. An API key on an internal RPC
  is PERMISSION_DENIED: a client key leaked from a laptop must not reach the store.

The secrets come from the environment (PDSERVE_SERVICE_TOKEN, PDSERVE_API_KEYS comma-separated)
or from files (--service-token-file, --api-keys-file, one key a line), never from a flag's value:
a flag is visible in `ps` to every user of the machine.

A service with no service token refuses to start (it must not silently run open), unless it is
given `--insecure`, which turns every check off and says so in a warning at start.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import grpc

from pdserve import config as config_mod
from pdserve.config import field

AUTH_HEADER = "authorization"
ENV_SERVICE_TOKEN = "PDSERVE_SERVICE_TOKEN"
ENV_API_KEYS = "PDSERVE_API_KEYS"
ENV_API_KEY = "PDSERVE_API_KEY"  # the one key a client (SDK, CLI) sends
# Calls no credential guards: a load balancer's or compose's health probe, and service discovery.
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


@dataclass(frozen=True)
class SecurityConfig:
    """The security flags every service takes (env PDSERVE_* or flags, like its own config)."""

    service_token_file: str = field("", "file holding the deployment's service token (else env "
                                        "PDSERVE_SERVICE_TOKEN)")
    api_keys_file: str = field("", "file of client API keys, one a line (else env PDSERVE_API_KEYS, "
                                   "comma-separated)")
    tls_cert: str = field("", "PEM certificate this service presents (TLS on its port; its client certificate "
                              "on internal calls when --tls-ca is given)")
    tls_key: str = field("", "PEM private key of --tls-cert")
    tls_ca: str = field("", "PEM CA that signs the deployment's certificates: internal services then require "
                            "client certificates (mTLS), and internal calls verify servers with it")
    insecure: bool = field(False, "serve with no credential checks at all (a warning at start): a sealed test "
                                  "network only")

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_ca and not self.tls_cert:
            raise ValueError("--tls-ca needs --tls-cert and --tls-key (the certificate internal calls present)")


@dataclass(frozen=True)
class TlsFiles:
    cert: bytes
    key: bytes
    ca: bytes | None
    cert_path: str = ""  # (the files they were read from: the HTTP server loads them itself)
    key_path: str = ""


class Caller(Enum):
    SERVICE = "service"
    CLIENT = "client"


def _read_secret(path: str, what: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"{what}: cannot read {path}: {e.strerror}") from None


@dataclass(frozen=True)
class Credentials:
    """This process's credentials: what its servers accept and what its channels carry."""

    service_token: str = ""
    api_keys: tuple[str, ...] = ()
    insecure: bool = False
    tls: TlsFiles | None = None

    def __repr__(self) -> str:  # never a secret in a log line or a traceback
        return (f"Credentials(service_token={'set' if self.service_token else 'unset'}, "
                f"api_keys={len(self.api_keys)}, insecure={self.insecure}, tls={self.tls is not None})")

    @classmethod
    def load(cls, cfg: SecurityConfig, env: Mapping[str, str] | None = None) -> Credentials:
        env = os.environ if env is None else env
        token = (_read_secret(cfg.service_token_file, "service token file") if cfg.service_token_file
                 else env.get(ENV_SERVICE_TOKEN, "").strip())
        if cfg.api_keys_file:
            keys = _read_secret(cfg.api_keys_file, "API keys file").splitlines()
        else:
            keys = env.get(ENV_API_KEYS, "").split(",")
        tls = None
        if cfg.tls_cert:
            tls = TlsFiles(Path(cfg.tls_cert).read_bytes(), Path(cfg.tls_key).read_bytes(),
                           Path(cfg.tls_ca).read_bytes() if cfg.tls_ca else None, cfg.tls_cert, cfg.tls_key)
        return cls(token, tuple(k.strip() for k in keys if k.strip()), cfg.insecure, tls)

    def refusal(self) -> str | None:
        """Why a service with these credentials must not start (None: it may)."""
        if self.service_token or self.insecure:
            return None
        return (f"no service token: set {ENV_SERVICE_TOKEN} or --service-token-file (the same token on every "
                "service of the deployment), or pass --insecure to run with no authentication")

    def caller(self, token: str) -> Caller | None:
        """Which kind of caller holds `token` (None: nobody we know). Constant-time comparisons,
        every key compared, so timing tells nothing about which key nearly matched."""
        given = token.encode()
        found = None
        if self.service_token and hmac.compare_digest(given, self.service_token.encode()):
            found = Caller.SERVICE
        for key in self.api_keys:
            if hmac.compare_digest(given, key.encode()) and found is None:
                found = Caller.CLIENT
        return found

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS for an internal channel (None: plaintext). With a CA, the server is verified with it
        and this service's certificate is presented (mTLS)."""
        if self.tls is None:
            return None
        if self.tls.ca is None:
            return grpc.ssl_channel_credentials()
        return grpc.ssl_channel_credentials(self.tls.ca, self.tls.key, self.tls.cert)

    def server_credentials(self, require_client_cert: bool) -> grpc.ServerCredentials | None:
        if self.tls is None:
            return None
        return grpc.ssl_server_credentials([(self.tls.key, self.tls.cert)], root_certificates=self.tls.ca,
                                           require_client_auth=require_client_cert and self.tls.ca is not None)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((AUTH_HEADER, f"Bearer {self.service_token}"),) if self.service_token else ()


_configured: Credentials | None = None


def configure(creds: Credentials) -> Credentials:
    """Fix this process's credentials (a service does, from its flags, before any channel exists)."""
    global _configured
    _configured = creds
    return creds


def current() -> Credentials:
    """The configured credentials, else those the environment gives (a test process, a bench, a
    tool): read afresh, since such a process may set its environment after import."""
    return _configured if _configured is not None else Credentials.load(config_mod.load(SecurityConfig))


def bearer(metadata) -> str:
    """The bearer token in call metadata ('' when there is none)."""
    for key, value in metadata or ():
        if key == AUTH_HEADER and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return ""


def stack_secrets() -> dict[str, str]:
    """A fresh service token and one client API key for a stack this process starts (`pdserve
    up`, a bench), as the environment its processes inherit: never a command line, which `ps`
    shows to every user."""
    token, key = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    return {ENV_SERVICE_TOKEN: token, ENV_API_KEYS: key, ENV_API_KEY: key,
            "PDSERVE_SERVICE_TOKEN_FILE": "", "PDSERVE_API_KEYS_FILE": ""}


def ensure_stack_secrets() -> None:
    """Give this process (and what it starts) fresh credentials, unless it has a service token."""
    if not (os.environ.get(ENV_SERVICE_TOKEN) or os.environ.get("PDSERVE_SERVICE_TOKEN_FILE")):
        os.environ.update(stack_secrets())


def redact_url(url: str) -> str:
    """`url` with its password (redis://user:secret@host) masked, for logs and messages."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:***" if parts.username else ":***"
    host = parts.hostname or ""
    netloc = f"{user}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def write_stack_secrets(directory: str) -> str:
    """Make `directory`/service-token and `directory`/api-keys (mode 0600) unless they exist, and
    return the client key: how compose's one-shot `secrets` service shares one token between
    containers through a volume, with no manual step."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    fresh = stack_secrets()
    for name, value in (("service-token", fresh[ENV_SERVICE_TOKEN]), ("api-keys", fresh[ENV_API_KEYS])):
        path = root / name
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(value + "\n")
    return (root / "api-keys").read_text().split()[0]


if __name__ == "__main__":  # python -m pdserve.runtime.auth DIR (compose)
    import sys

    print(f"{ENV_API_KEY}={write_stack_secrets(sys.argv[1])}", flush=True)
