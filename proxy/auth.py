"""API keys with scopes (API.md, "Authentication and scopes").

The keys file (``FLEETCACHE_API_KEYS_FILE``) holds one key per line, hashes only::

    # NAME SCOPE[,SCOPE...] SHA256_HEX_OF_KEY
    dispatcher dispatch 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08

``Guard`` (pure ASGI, inside ``Admission``) answers before the route runs and before a byte
of the body is read: 401 ``authentication_error`` with ``WWW-Authenticate: Bearer`` for no
or an unknown key, 403 ``permission_error`` naming the scope for a key without it. Which
scopes open which route is ``SCOPES``, one row per route; an app route missing from it stops
the app from being built, so a new route is never open by accident.

Without a keys file the service is open (the embedded default) except the admin routes, which
need ``FLEETCACHE_ADMIN_TOKEN`` (403 while none is set). With one, that token is also one key
of scope ``admin``. The file is re-read when it changes (looked at no more than once a
second, so a revoked key stops working within a second); if it cannot be read any more,
every key is refused until it can (never open by accident). A key is checked against every
hash with ``hmac.compare_digest``; keys, hashes and bodies are never logged.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import logging
import os
import re
import secrets
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson
from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.errors import app_routes

log = logging.getLogger("fleetcache.proxy")

KNOWN_SCOPES = ("dispatch", "fleet", "warmup", "operator", "admin")
OPEN: frozenset[str] = frozenset()  # no key needed
ADMIN = frozenset({"admin"})
METRICS = "GET /metrics"  # open unless FLEETCACHE_METRICS_PUBLIC=false, then "operator"

# "METHOD /template" -> the scopes that open it ("admin" opens everything).
SCOPES: dict[str, frozenset[str]] = {
    "POST /v1/embeddings": frozenset({"dispatch"}),
    "POST /v1/features/embed": frozenset({"dispatch"}),
    "POST /v1/dispatch/recommend": frozenset({"dispatch"}),
    "GET /v1/fleet/drivers/{driver_id}": frozenset({"dispatch"}),
    "PATCH /v1/fleet/drivers/{driver_id}": frozenset({"dispatch", "fleet"}),
    "DELETE /v1/fleet/drivers/{driver_id}": frozenset({"fleet"}),
    "PUT /v1/fleet/drivers": frozenset({"fleet", "warmup"}),
    "PATCH /v1/fleet/positions": frozenset({"fleet"}),
    "POST /v1/warmup": frozenset({"warmup"}),
    "GET /v1/warmup": frozenset({"warmup", "operator"}),
    "GET /v1/warmup/{job_id}": frozenset({"warmup", "operator"}),
    "DELETE /v1/warmup/{job_id}": frozenset({"warmup"}),
    "POST /v1/coverage": frozenset({"warmup"}),
    "GET /v1/stats": frozenset({"operator"}),
    "DELETE /v1/cache/entities/{kind}/{entity_id}": ADMIN,
    "POST /v1/cache/drift": ADMIN,
    "GET /healthz": OPEN,
    "GET /readyz": OPEN,
    "GET /dashboard": OPEN,
    METRICS: OPEN,
}

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_HASH = re.compile(r"^[0-9a-fA-F]{64}$")  # as sha256sum writes it, or upper case


class KeysFileError(ValueError):
    """The keys file cannot be read, or a line of it is not ``NAME SCOPES SHA256``."""


@dataclass(frozen=True, slots=True)
class Key:
    name: str
    scopes: frozenset[str]
    digest: bytes  # sha256 of the key

    @property
    def lane(self) -> str:
        """Keys with the ``dispatch`` scope use the dispatch lane, all others warm-up's."""
        return "dispatch" if "dispatch" in self.scopes else "warmup"


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_scopes(text: str) -> frozenset[str]:
    scopes = frozenset(s.strip() for s in text.split(",") if s.strip())
    unknown = sorted(scopes - set(KNOWN_SCOPES))
    if unknown or not scopes:
        raise KeysFileError(
            f"unknown scope {', '.join(unknown) or '(none)'}: use {', '.join(KNOWN_SCOPES)}"
        )
    return scopes


def parse_keys(text: str) -> list[Key]:
    """The file's keys; a bad line raises ``KeysFileError`` naming its number (not its text)."""
    keys: list[Key] = []
    names: set[str] = set()
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) != 3 or not _NAME.match(fields[0]) or not _HASH.match(fields[2]):
            raise KeysFileError(f"line {number}: expected 'NAME SCOPE[,SCOPE...] SHA256_HEX'")
        if fields[0] in names:
            raise KeysFileError(f"line {number}: the name {fields[0]!r} is used twice")
        try:
            scopes = parse_scopes(fields[1])
        except KeysFileError as exc:
            raise KeysFileError(f"line {number}: {exc}") from None
        names.add(fields[0])
        keys.append(Key(fields[0], scopes, bytes.fromhex(fields[2])))
    return keys


def read_keys(path: Path) -> list[Key]:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise KeysFileError(f"cannot read the keys file {path}: {exc.__class__.__name__}") from exc
    return parse_keys(text)


class KeyRing:
    """The keys of one file, re-read when its inode, size or mtime changes."""

    CHECK_EVERY_S = 1.0

    def __init__(self, path: Path, admin_token: str | None = None) -> None:
        self.path = path
        self._extra = [Key("admin-token", ADMIN, digest(admin_token))] if admin_token else []
        self._stamp = self._stat()
        self._keys = read_keys(path) + self._extra  # start-up: a bad file is an error
        self._checked = time.monotonic()

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._checked < self.CHECK_EVERY_S:
            return
        self._checked = now
        stamp = self._stat()
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            keys = read_keys(self.path)
        except KeysFileError as exc:
            log.error("API keys refused until the keys file is fixed: %s", exc)
            keys = []
        self._keys = keys + self._extra
        log.info("API keys reloaded: %d keys", len(self._keys))

    def find(self, key: str) -> Key | None:
        """The key's entry; every entry is compared, in constant time each."""
        self._refresh()
        given = digest(key)
        found = None
        for entry in self._keys:
            if hmac.compare_digest(given, entry.digest):
                found = entry
        return found

    def __len__(self) -> int:
        return len(self._keys)


def new_key() -> str:
    return "fc_" + secrets.token_urlsafe(32)


def write_keys_file(path: Path, lines: list[str]) -> None:
    """Replace the file in one rename (a server never reads half of it), mode 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as out:
            out.write("".join(f"{line}\n" for line in lines))
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def key_line(name: str, scopes: frozenset[str], key: str) -> str:
    ordered = ",".join(s for s in KNOWN_SCOPES if s in scopes)
    return f"{name} {ordered} {digest(key).hex()}"


@contextlib.contextmanager
def editing(path: Path) -> Iterator[list[str]]:
    """The keys file's lines, read under a lock (``PATH.lock`` beside it) held until the
    block has rewritten them: two ``keys`` commands at once each see the other's change (a
    revocation was written over by an add that had read the file before it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a", opener=_private) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield path.read_text().splitlines() if path.exists() else []


def _private(file: str, flags: int) -> int:
    return os.open(file, flags, 0o600)


def add_key(path: Path, name: str, scopes: frozenset[str]) -> str:
    """Append a new key's line; the key itself is returned (to be shown once) and not kept."""
    if not _NAME.match(name):
        raise KeysFileError("a key name is 1-64 characters of A-Z, a-z, 0-9, '_', '.', '-'")
    with editing(path) as lines:
        if any(key.name == name for key in parse_keys("\n".join(lines))):
            raise KeysFileError(f"a key named {name!r} exists: revoke it first")
        key = new_key()
        write_keys_file(path, [*lines, key_line(name, scopes, key)])
    return key


def revoke_key(path: Path, name: str) -> None:
    with editing(path) as lines:
        kept = [line for line in lines if line.split()[:1] != [name]]
        if len(kept) == len(lines):
            raise KeysFileError(f"no key named {name!r}")
        write_keys_file(path, kept)


def _error(type: str, message: str) -> bytes:
    return orjson.dumps({"error": {"type": type, "message": message, "param": "Authorization"}})


def route_rows(app: FastAPI) -> list[tuple[APIRoute, str]]:
    """Each route with its ``SCOPES`` row; a route without one is an error (fail closed)."""
    routes = [r for r in app_routes(app) if isinstance(r, APIRoute)]
    rows = [
        (r, f"{m} {r.path_format}") for r in routes for m in sorted((r.methods or set()) - {"HEAD"})
    ]
    missing = [row for _, row in rows if row not in SCOPES]
    if missing:
        raise RuntimeError(f"routes without a row in proxy.auth.SCOPES: {missing}")
    return rows


def bearer(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, given = value.decode("latin-1").partition(" ")
            return given.strip() if scheme.lower() == "bearer" and given.strip() else None
    return None


class Guard:
    """Pure ASGI: finds the route's row in ``SCOPES`` and checks the request's key against it.
    With keys on, the key's lane goes to the route in ``scope["state"]["lane"]``."""

    def __init__(
        self,
        app: ASGIApp,
        fastapi: FastAPI,
        ring: KeyRing | None,
        admin_token: str | None,
        metrics_public: bool,
    ) -> None:
        self.app = app
        self.fastapi = fastapi
        self.ring = ring
        self.admin_token = admin_token
        self.metrics_scopes = OPEN if metrics_public else frozenset({"operator"})
        self.rows = route_rows(fastapi)

    def needed(self, method: str, path: str) -> frozenset[str] | None:
        """The scopes that open ``METHOD path``; None: no route (the router answers)."""
        method = "GET" if method == "HEAD" else method
        for route, row in self.rows:
            if row.startswith(method + " ") and route.path_regex.match(path):
                if row != METRICS:
                    return SCOPES[row]
                # closed metrics without keys: no operator key exists, the admin token opens
                return ADMIN if self.ring is None and self.metrics_scopes else self.metrics_scopes
        return None

    def _refusal(self, scope: Scope, needed: frozenset[str]) -> tuple[int, bytes] | None:
        given = bearer(scope)
        if self.ring is None:  # open mode: only the admin routes are closed
            if needed != ADMIN:
                return None
            if not self.admin_token:
                return 403, _error(
                    "permission_error",
                    "admin routes are disabled: set FLEETCACHE_ADMIN_TOKEN to enable them",
                )
            if given is not None and hmac.compare_digest(digest(given), digest(self.admin_token)):
                return None
            return 401, _error(
                "authentication_error",
                "admin routes need the header 'Authorization: Bearer <FLEETCACHE_ADMIN_TOKEN>'",
            )
        if not needed:
            return None
        key = None if given is None else self.ring.find(given)
        if key is None:
            what = "no API key" if given is None else "an unknown API key"
            return 401, _error(
                "authentication_error",
                f"{what}: send the header 'Authorization: Bearer KEY' with a key of this service",
            )
        if not key.scopes & (needed | ADMIN):
            scopes = " or ".join(f"'{s}'" for s in sorted(needed))
            return 403, _error(
                "permission_error",
                f"the key {key.name!r} lacks the scope {scopes} that "
                f"{scope['method']} {scope['path']} needs",
            )
        scope.setdefault("state", {})["lane"] = key.lane
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (
            self.ring is None
            and not scope["path"].startswith("/v1/cache/")
            and (scope["path"] != "/metrics" or not self.metrics_scopes)
        ):
            await self.app(scope, receive, send)
            return
        needed = self.needed(scope["method"], scope["path"])
        refusal = None if needed is None else self._refusal(scope, needed)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        status, body = refusal
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
