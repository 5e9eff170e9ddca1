"""What closes local mode's API server to other users of the machine and to web pages (localcluster/guard.py,
localcluster/tls.py), without a server: the token file's format and its re-reading, who a request is, the
Host and body checks, owner-only files, and the certificate kubeconfigs trust."""

from __future__ import annotations

import os
import re
import socket
import ssl
import stat
import threading

import pytest

from neuronfleet.localcluster import guard, tls
from neuronfleet.localcluster.semantics import ApiError


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_the_token_file_reads_as_kube_apiservers_static_token_file():
    table = guard.parse_tokens(
        '# tokens\nt1,alice,uid-1\n\n t2, bob, uid-2, "dev,ops"\nt3,carol,uid-3,single\n'
    )
    assert table == {
        "t1": guard.User("alice", "uid-1"),
        "t2": guard.User("bob", "uid-2", ("dev", "ops")),
        "t3": guard.User("carol", "uid-3", ("single",)),
    }
    assert guard.parse_tokens(guard.format_tokens(table)) == table


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("t1,alice\n", "line 1: 2 column(s); each line is token,user,uid"),
        ("t1,alice,u\n,bob,u\n", "line 2: the token and the user name may not be empty"),
        ("t1,alice,u\nt1,bob,u\n", "line 2: the same token as an earlier line"),
    ],
)
def test_a_malformed_token_file_is_refused_naming_the_line(text, message):
    with pytest.raises(ValueError, match=re.escape(f"tokens.csv, {message}")):
        guard.parse_tokens(text, "tokens.csv")


def test_a_token_file_changed_while_it_is_read_rotates_the_token_at_once(tmp_path):
    path = tmp_path / "tokens.csv"
    admin = guard.set_token(path, guard.ADMIN)
    tokens = guard.Tokens(path)
    old = guard.set_token(path, "operator")
    assert tokens.user(old).name == "operator" and tokens.user(admin).name == guard.ADMIN
    new = guard.set_token(path, "operator")  # rotated: the same user, a new token, the old one gone
    assert tokens.user(old) is None and tokens.user(new) == guard.User("operator", "operator")
    assert tokens.user(admin).name == guard.ADMIN and tokens.token_of(guard.ADMIN) == admin
    path.write_text("not,enough\n")  # a broken file: the last table read stays in force
    assert tokens.user(new).name == "operator"
    path.unlink()
    assert tokens.user(new).name == "operator"
    guard.set_token(path, "operator", "chosen")
    assert tokens.user("chosen").name == "operator" and tokens.user(new) is None and mode(path) == 0o600


def test_users_added_at_once_are_all_kept(tmp_path):
    """Operators started together each add their user to the token file: none of the changes is lost."""
    path = tmp_path / "tokens.csv"
    given: dict[str, str] = {}

    def add(n: int) -> None:
        for round_ in range(5):
            given[f"user-{n}"] = guard.set_token(path, f"user-{n}", f"token-{n}-{round_}")

    threads = [threading.Thread(target=add, args=(n,)) for n in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    table = guard.parse_tokens(path.read_text())
    assert {u.name: t for t, u in table.items()} == given and len(given) == 16


def test_who_a_request_is_and_when_it_is_refused_401():
    tokens = guard.Tokens(table={"right": guard.User("alice", "1")})
    assert guard.authenticate("Bearer right", "/api/v1/pods", tokens).name == "alice"
    assert guard.authenticate("bearer  right ", "/api/v1/pods", tokens).name == "alice"  # scheme's case
    for path in sorted(guard.PUBLIC_PATHS):  # what a cluster opens to system:unauthenticated
        assert guard.authenticate(None, path, tokens).name == guard.ANONYMOUS
    refused = [
        (None, "/api/v1/pods"),
        ("Basic YTpi", "/apis/batch/v1/jobs"),  # another scheme: anonymous, so refused here
        ("Bearer wrong", "/api/v1/pods"),
        ("Bearer wrong", "/version"),  # a bad token is refused on a public path too
        ("Bearer ", "/healthz"),
        ("Bearer caf\udcc3\udca9", "/api"),  # bytes that are not ASCII, as aiohttp decodes them
        (None, "/api"),
        (None, "/healthz/etcd"),
    ]
    for authorization, path in refused:
        with pytest.raises(ApiError) as e:
            guard.authenticate(authorization, path, tokens)
        assert (e.value.code, e.value.reason) == (401, "Unauthorized"), (authorization, path)
        assert e.value.message.startswith("Unauthorized: ")


def test_only_the_servers_own_host_names_are_served():
    for host in ("127.0.0.1:6443", "localhost:6443", "LOCALHOST:6443", "[::1]:6443"):
        guard.check_host(host, 6443, "127.0.0.1")
    guard.check_host("192.0.2.7:6443", 6443, "192.0.2.7")  # the address it is bound to
    guard.check_host("[fd00::1]:6443", 6443, "fd00::1")
    for host in ("evil.example:6443", "evil.example", "127.0.0.1:6444", "127.0.0.1", "", None):
        with pytest.raises(ApiError) as e:
            guard.check_host(host, 6443, "127.0.0.1")
        assert (e.value.code, e.value.reason) == (421, "MisdirectedRequest")
        assert "127.0.0.1:6443" in e.value.message


ACCEPTED = [
    ("POST", "application/json"),
    ("PUT", "application/yaml; charset=utf-8"),
    ("POST", "application/vnd.kubernetes.protobuf"),
    ("DELETE", "Application/JSON"),
    ("PATCH", "application/merge-patch+json"),
    ("PATCH", "application/json-patch+json"),
    ("PATCH", "application/strategic-merge-patch+json"),
    ("PATCH", "application/apply-patch+yaml"),
    ("PUT", None),  # JSON, as kube-apiserver takes it (kubectl scale's PUT of /scale sends no Content-Type)
    ("POST", ""),
]
REFUSED = [
    ("POST", "text/plain"),  # what a browser posts without a CORS preflight
    ("POST", "text/plain;charset=UTF-8"),
    ("POST", "application/x-www-form-urlencoded"),
    ("PUT", "multipart/form-data"),
    ("PATCH", None),  # a patch says its type
    ("PATCH", "application/json"),  # not a patch type
    ("POST", "application/merge-patch+json"),  # a patch type where an object is due
]


def test_bodies_only_in_the_apis_media_types():
    for method, content_type in ACCEPTED:
        guard.check_body_type(method, content_type)
    for method, content_type in REFUSED:
        with pytest.raises(ApiError) as e:
            guard.check_body_type(method, content_type)
        assert (e.value.code, e.value.reason) == (415, "UnsupportedMediaType"), (method, content_type)
        assert e.value.message.startswith("the body of the request was in an unknown format")


def test_private_files_and_folders_are_owner_only_from_their_creation(tmp_path):
    folder = tmp_path / "state"
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o755)  # (as an earlier version left it)
    guard.private_folder(folder)
    assert mode(folder) == 0o700
    guard.private_folder(folder / "a" / "b")
    assert mode(folder / "a" / "b") == 0o700
    old_umask = os.umask(0)  # the most permissive umask: the modes must not come from it
    try:
        guard.write_private(folder / "secret", "s3cret")
        with guard.open_private(folder / "log") as f:
            f.write(b"line\n")
    finally:
        os.umask(old_umask)
    assert (folder / "secret").read_text() == "s3cret" and mode(folder / "secret") == 0o600
    assert mode(folder / "log") == 0o600
    (folder / "wide").write_text("old")
    os.chmod(folder / "wide", 0o644)
    guard.write_private(folder / "wide", b"new")  # replaced by a new file, not rewritten in the old one
    assert mode(folder / "wide") == 0o600 and (folder / "wide").read_bytes() == b"new"
    assert sorted(p.name for p in folder.iterdir()) == ["a", "log", "secret", "wide"]  # no partial left


def test_the_servers_certificate_is_verified_through_the_ca_its_kubeconfig_holds(tmp_path):
    """A TLS client that trusts the CA (as kubectl with the kubeconfig does) connects to 127.0.0.1 and
    localhost; one that trusts another server's CA does not, so it never sends its token there."""
    cert, key = tmp_path / "apiserver.crt", tmp_path / "apiserver.key"
    server_context, ca = tls.server_context(cert, key)
    assert mode(key) == 0o600 and ca == tls.ca_of(cert) and cert.read_bytes().count(b"BEGIN CERTIFICATE") == 2
    assert tls.server_context(cert, key)[1] == ca  # kept over a restart
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        for _ in range(3):
            conn, _ = listener.accept()
            try:
                with server_context.wrap_socket(conn, server_side=True) as tls_conn:
                    tls_conn.sendall(b"ok")
            except (ssl.SSLError, OSError):
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        for name in ("127.0.0.1", "localhost"):
            with (
                socket.create_connection(("127.0.0.1", port)) as raw,
                tls.client_context(ca).wrap_socket(raw, server_hostname=name) as conn,
            ):
                assert conn.recv(2) == b"ok"
        other = tls.server_context(None, None)[1]  # another server's CA
        with (
            socket.create_connection(("127.0.0.1", port)) as raw,
            pytest.raises(ssl.SSLCertVerificationError),
        ):
            tls.client_context(other).wrap_socket(raw, server_hostname="127.0.0.1")
    finally:
        thread.join(30)
        listener.close()


def test_a_kubeconfig_is_read_back_as_it_was_written(tmp_path):
    import yaml

    ca = tls.make()[0].split(tls.PEM_END)[1] + tls.PEM_END
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(tls.kubeconfig("https://127.0.0.1:1234", "tok", ca)))
    access = tls.Access.read(path)
    assert (access.url, access.token) == ("https://127.0.0.1:1234", "tok")
    assert isinstance(access.context, ssl.SSLContext) and access.headers()["Authorization"] == "Bearer tok"
    path.write_text("apiVersion: v1\nkind: Config\n")
    with pytest.raises(ValueError, match="holds no server and bearer token"):
        tls.Access.read(path)
