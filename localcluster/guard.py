"""Local mode closed to everyone but the user who runs it: who may talk to the emulated API server (a bearer
token, its own Host name, request bodies in the API's media types), and files only that user can read.

- `Tokens`: the bearer tokens the server accepts and the user each names, from a static token file in
  kube-apiserver's format (`--token-auth-file`: CSV lines `token,user,uid`, optionally a fourth column of
  comma-separated groups, quoted; https://kubernetes.io/docs/reference/access-authn-authz/authentication/
  #static-token-file, v1.32), or held in memory. Unlike kube-apiserver, which reads the file once at its
  start, the server reads it again whenever it changes, so a token is rotated or a user added while it runs
  by replacing the file (`set_token`): from the next request on the old token is refused.
- `authenticate`: a request with no token may read only what a real cluster opens to system:unauthenticated;
  anything else with no token, and any token not in the table, is 401 Unauthorized.
- `check_host`: the Host header must name the server itself: a web page whose own name its author re-points
  at 127.0.0.1 (DNS rebinding) reaches the port with that name in Host.
- `check_body_type`: a request body only in a media type the API server decodes: browsers send text/plain,
  form and multipart bodies without a CORS preflight.
- `write_private`, `private_folder`, `open_private`: files created 0600 and folders 0700 from the start (never
  created readable by others and narrowed after; only a folder an earlier version left open is narrowed).
"""

from __future__ import annotations

import csv
import fcntl
import hashlib
import io
import logging
import os
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from .semantics import ApiError

log = logging.getLogger(__name__)

ADMIN = "neuronfleet-admin"  # the user of the kubeconfig the API server writes (`neuronfleet up`'s)
ADMIN_GROUPS = ("system:masters",)  # (what a cluster's admin kubeconfig holds; nothing here reads groups)
ANONYMOUS = "system:anonymous"  # the user of a request without a token, as kube-apiserver names it
# What a real cluster lets system:unauthenticated GET: the default ClusterRole system:public-info-viewer
# (kubernetes plugin/pkg/auth/authorizer/rbac/bootstrappolicy/policy.go, v1.14 to v1.32). Everything else
# without a token is 401, as kube-apiserver answers where anonymous requests are limited to a list of paths
# (AuthenticationConfiguration `anonymous.conditions`, KEP-4633, beta in v1.32).
PUBLIC_PATHS = frozenset({"/healthz", "/livez", "/readyz", "/version", "/version/"})
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")

# The media types a body may have (k8s.io/apiserver pkg/endpoints/handlers: create and update decode JSON,
# YAML and protobuf, patch.go the four patch types; anything else is 415 UnsupportedMediaType with the
# message of handlers/negotiation/errors.go, v1.32).
OBJECT_TYPES = ("application/json", "application/yaml", "application/vnd.kubernetes.protobuf")
PATCH_TYPES = (
    "application/json-patch+json",
    "application/merge-patch+json",
    "application/strategic-merge-patch+json",
    "application/apply-patch+yaml",
)


@dataclass(frozen=True)
class User:
    """Who a token names: the audit log's user and the fault switches' filter."""

    name: str
    uid: str
    groups: tuple[str, ...] = ()


def new_token() -> str:
    """A fresh bearer token: 32 random bytes, URL-safe base64 (no comma or quote, so one CSV field)."""
    return secrets.token_urlsafe(32)


def parse_tokens(text: str, source: str = "the token file") -> dict[str, User]:
    """A token file's table (token -> user); ValueError naming the line for a malformed one. Blank lines and
    lines starting with # are skipped."""
    table: dict[str, User] = {}
    reader = csv.reader(io.StringIO(text), skipinitialspace=True)
    for record in reader:
        if not any(field.strip() for field in record) or record[0].lstrip().startswith("#"):
            continue
        where = f"{source}, line {reader.line_num}"
        if len(record) < 3:
            raise ValueError(
                f"{where}: {len(record)} column(s); each line is token,user,uid "
                f'optionally followed by "group1,group2"'
            )
        token, name, uid = (field.strip() for field in record[:3])
        if not token or not name:
            raise ValueError(f"{where}: the token and the user name may not be empty")
        if token in table:
            raise ValueError(f"{where}: the same token as an earlier line (each user needs its own)")
        groups = tuple(g.strip() for g in record[3].split(",") if g.strip()) if len(record) > 3 else ()
        table[token] = User(name, uid, groups)
    return table


def format_tokens(table: dict[str, User]) -> str:
    """The token file's text for `table` (what `parse_tokens` reads back)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for token, user in table.items():
        writer.writerow([token, user.name, user.uid, *([",".join(user.groups)] if user.groups else [])])
    return out.getvalue()


def admin_table() -> dict[str, User]:
    """A table of one fresh token, for ADMIN."""
    return {new_token(): User(ADMIN, ADMIN, ADMIN_GROUPS)}


def set_token(path: Path, name: str, token: str | None = None) -> str:
    """Give user `name` a new token in the token file at `path` (a fresh one unless given), its old one
    dropped, every other line kept; the file is replaced whole, so a server reading it sees the old table or
    the new one, and changes are made one at a time (a lock beside it), so none is lost. Returns the token."""
    with open_private(path.with_name(f".{path.name}.lock")) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (released as the file closes)
        table = parse_tokens(path.read_text(), str(path)) if path.exists() else {}
        kept = {t: u for t, u in table.items() if u.name != name}
        uid = next((u.uid for u in table.values() if u.name == name), name)
        token = token or new_token()
        write_private(path, format_tokens({**kept, token: User(name, uid)}))
    return token


def _digest(token: str) -> bytes:
    # (looked up by digest: comparing the digests' bytes tells nothing about a token's prefix; header
    # values come decoded with surrogateescape, as aiohttp reads them, so any bytes hash)
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


class Tokens:
    """The bearer tokens a server accepts: a token file's, read again whenever it changes (its inode, size or
    modification time), or `table` held in memory. A file that cannot be read or parsed at the start raises;
    later, the last table read stays in force and the error is logged (replace the file whole, as `set_token`
    does)."""

    def __init__(self, path: Path | None = None, table: dict[str, User] | None = None) -> None:
        self.path = path
        self._stamp: tuple[int, int, int] | None = None
        self._set(table or {})
        if path is not None:
            self._set(parse_tokens(path.read_text(), str(path)))
            self._stamp = self._stat()

    def _set(self, table: dict[str, User]) -> None:
        self.table = dict(table)
        self._by_digest = {_digest(t): u for t, u in table.items()}

    def _stat(self) -> tuple[int, int, int]:
        st = os.stat(self.path)
        return st.st_ino, st.st_size, st.st_mtime_ns

    def _refresh(self) -> None:
        if self.path is None:
            return
        try:
            stamp = self._stat()
            if stamp == self._stamp:
                return
            table = parse_tokens(self.path.read_text(), str(self.path))
        except (OSError, ValueError) as e:
            if self._stamp is not None:  # (logged once per failure, not per request)
                log.error("the token file cannot be read; the tokens read before stay in force: %s", e)
            self._stamp = None
            return
        self._set(table)
        self._stamp = stamp

    def user(self, token: str) -> User | None:
        """The user `token` names, None for a token not in the table."""
        self._refresh()
        return self._by_digest.get(_digest(token))

    def token_of(self, name: str) -> str | None:
        """The token of user `name` (the kubeconfig's), None if the table has none."""
        self._refresh()
        return next((t for t, u in self.table.items() if u.name == name), None)


def unauthorized(why: str) -> ApiError:
    # kube-apiserver's answer (k8s.io/apiserver pkg/endpoints/filters/authentication.go `Unauthorized`:
    # apierrors.NewUnauthorized, reason Unauthorized, code 401), with what would be right said after it
    return ApiError(401, "Unauthorized", f"Unauthorized: {why}")


def authenticate(authorization: str | None, path: str, tokens: Tokens) -> User:
    """The user a request is, from its Authorization header; ApiError 401 for a token not in the table (on any
    path, as kube-apiserver refuses a bad token rather than taking the request as anonymous) and for a
    request with no bearer token to anything but PUBLIC_PATHS."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer":  # (no header, or another scheme: not a bearer token, so anonymous)
        if path in PUBLIC_PATHS:
            return User(ANONYMOUS, "")
        raise unauthorized(
            "this API server takes requests with a bearer token only (the one in the kubeconfig that "
            "`neuronfleet up` wrote: kubectl --kubeconfig STATE/kubeconfig)"
        )
    user = tokens.user(token.strip())
    if user is None:
        raise unauthorized("the bearer token is not one this API server accepts (an old kubeconfig?)")
    return user


def check_host(host: str | None, port: int, bound: str) -> None:
    """ApiError 421 Misdirected Request (RFC 9110 section 15.5.20) unless the Host header names this server:
    127.0.0.1, localhost, [::1] or the address it is bound to, with its port."""
    wanted = {f"{name}:{port}" for name in (*LOOPBACK_NAMES, f"[{bound}]" if ":" in bound else bound)}
    if (host or "").strip().lower() not in wanted:
        raise ApiError(
            421, "MisdirectedRequest",
            f"the Host header {host!r} does not name this API server: it answers to "
            f"{', '.join(sorted(wanted))} only (a page of another site that resolves to this machine is "
            "refused)",
        )  # fmt: skip


def media_type(content_type: str | None) -> str:
    """A Content-Type's media type, lower case, without its parameters."""
    return (content_type or "").split(";")[0].strip().lower()


def check_body_type(method: str, content_type: str | None) -> None:
    """ApiError 415 for a body whose media type the API server does not decode: a PATCH takes PATCH_TYPES,
    every other method OBJECT_TYPES or none at all, read as JSON (kube-apiserver's negotiation takes an empty
    Content-Type as its first type, JSON: handlers/negotiation/negotiate.go, v1.32; kubectl scale's PUT of
    /scale sends none). A browser can send such a body only from a page, which holds no token."""
    patch = method.upper() == "PATCH"
    accepted = PATCH_TYPES if patch else OBJECT_TYPES
    if media_type(content_type) not in accepted and (patch or media_type(content_type)):
        said = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
        raise ApiError(
            415, "UnsupportedMediaType",
            f"the body of the request was in an unknown format ({said}) - accepted media types include: "
            f"{', '.join(accepted)}",
        )  # fmt: skip


# ---- files only their owner reads ----


def private_folder(path: Path) -> Path:
    """`path` as a folder only its owner may enter (0700; its parents made as usual): created so, or narrowed
    if it exists (an earlier version made it readable to all; what it holds is then out of others' reach)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def write_private(path: Path, data: str | bytes) -> None:
    """Replace `path` whole with `data`, readable and writable by its owner only: written to a new file beside
    it (mode 0600 from its creation), flushed to disk, then renamed over it."""
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")  # (0600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise


def open_private(path: Path, mode: str = "ab") -> IO:
    """`open(path, mode)` where a file it creates is 0600 (logs that may hold what a Secret gave a pod)."""
    return open(path, mode, opener=lambda p, flags: os.open(p, flags, 0o600))
