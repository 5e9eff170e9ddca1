"""How the operator logs in (operator/login.py) and sends its requests (operator/kube.py, through the official
client), against the emulated API server, which takes bearer tokens from its token file (a user's token
rotated with guard.set_token is refused from then on): a kubeconfig user whose token an exec plugin prints
(and prints again once it expires), exec plugins that fail or print garbage (the start-up check names the
user and quotes what they printed, and `neuronfleet operator` exits with it), a tokenFile user and the
pod's service account whose token files are rotated while the client runs (a 401 logs in again; a token
file is read again every minute), client certificates that leave no file behind, and kopf's login from the
same credentials."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import aiohttp
import pytest
import yaml
from support import HTTP_TIMEOUT, OperatorCluster, neuronfleet_command

from neuronfleet.localcluster import tls
from neuronfleet.localcluster.guard import set_token, write_private
from neuronfleet.operator import kube, login

DEADLINE = 120.0  # seconds, for what a loaded machine may take
CONFIG_MAP = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"namespace": "default"}}

# an exec plugin: prints an ExecCredential with the token in argv[1]'s file, valid for argv[3] seconds, and
# counts its runs in argv[2]; it checks what kubectl gives a plugin (KUBERNETES_EXEC_INFO, the env entries)
PLUGIN = textwrap.dedent("""
    import datetime, json, os, sys
    info = json.loads(os.environ["KUBERNETES_EXEC_INFO"])
    assert info["kind"] == "ExecCredential" and os.environ["CLUSTER_NAME"] == "local", info
    with open(sys.argv[2], "a") as runs:
        runs.write("ran\\n")
    expires = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=float(sys.argv[3]))
    status = {"token": open(sys.argv[1]).read().strip(),
              "expirationTimestamp": expires.strftime("%Y-%m-%dT%H:%M:%SZ")}
    print(json.dumps({"apiVersion": info["apiVersion"], "kind": "ExecCredential", "status": status}))
""")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    api = OperatorCluster(tmp_path_factory.mktemp("login"))
    yield api
    api.stop()


def kubeconfig(cluster: OperatorCluster, path: Path, user_name: str, user: dict) -> Path:
    """The emulated server's kubeconfig with `user` (its entry) as the current context's user."""
    config = yaml.safe_load((cluster.state / "kubeconfig").read_text())
    config["users"] = [{"name": user_name, "user": user}]
    for context in config["contexts"]:
        context["context"]["user"] = user_name
    write_private(path, yaml.safe_dump(config))
    return path


def exec_user(*args: str, api_version: str = "client.authentication.k8s.io/v1") -> dict:
    env = [{"name": "CLUSTER_NAME", "value": "local"}]
    return {"exec": {"apiVersion": api_version, "command": sys.executable, "args": list(args), "env": env}}


def audit_users(cluster: OperatorCluster) -> set[str]:
    return {call["user"] for call in cluster.audit()}


def refused(cluster: OperatorCluster, token: str) -> bool:
    """The API server answers a request with this token 401."""
    request = urllib.request.Request(
        cluster.api.url + "/api/v1/namespaces/default/configmaps",
        headers={"Authorization": f"Bearer {token}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT, context=cluster.api.context):
            return False
    except urllib.error.HTTPError as e:
        return e.code == 401


async def reads_and_writes(client: kube.Kube, name: str) -> None:
    """A create, a read, a patch and a list through `client`: each answered as the API server holds it."""
    made = await client.create({**CONFIG_MAP, "metadata": {**CONFIG_MAP["metadata"], "name": name}})
    assert made["metadata"]["name"] == name
    assert (await client.get("ConfigMap", "default", name))["metadata"]["uid"] == made["metadata"]["uid"]
    patched = await client.patch("ConfigMap", "default", name, {"data": {"checked": "yes"}})
    assert patched["data"] == {"checked": "yes"}
    items, version = await client.list_all("ConfigMap", "default", "")
    assert name in {i["metadata"]["name"] for i in items} and version


def test_an_exec_plugin_user_logs_in_and_its_token_is_renewed_when_it_expires(cluster, tmp_path):
    """The plugin's token (valid 31 s: login.EXPIRY_SKEW before that, it is due) serves reads and writes; once
    due, the next request runs the plugin again, though the API server refused nothing."""
    token_file, runs = tmp_path / "token", tmp_path / "runs"
    write_private(token_file, set_token(cluster.api.tokens, "exec-user"))
    (tmp_path / "plugin.py").write_text(PLUGIN)
    lifetime = str(login.EXPIRY_SKEW + 1)
    user = exec_user(str(tmp_path / "plugin.py"), str(token_file), str(runs), lifetime)
    path = kubeconfig(cluster, tmp_path / "kubeconfig", "exec-user", user)

    async def scenario() -> None:
        client = kube.Kube(kube.load_credentials(str(path)))
        try:
            await reads_and_writes(client, "from-exec")
            assert runs.read_text().count("ran") == 1  # one login served every request
            started = time.monotonic()
            while runs.read_text().count("ran") < 2:  # (due a second after the first run)
                assert time.monotonic() - started < DEADLINE, "the exec plugin never ran again"
                assert await client.get("ConfigMap", "default", "from-exec", live=True)
                await asyncio.sleep(0.1)
            assert await client.get("ConfigMap", "default", "from-exec", live=True)
        finally:
            await client.close()

    asyncio.run(scenario())
    assert "exec-user" in audit_users(cluster)


@pytest.mark.parametrize(
    ("script", "printed"),
    [
        ("import sys; print('partial'); sys.stderr.write('boom: no credentials for role x'); sys.exit(3)",
         ["exited with status 3", "boom: no credentials for role x", "'partial'"]),
        ("print('<html>503 Service Unavailable</html>')",
         ["printed no JSON ExecCredential", "<html>503 Service Unavailable</html>"]),
        ("import json; print(json.dumps({'apiVersion': 'client.authentication.k8s.io/v1', 'kind': "
         "'ExecCredential', 'status': {'token': 'sekret-token', 'expirationTimestamp': 'soon'}}))",
         ["status.expirationTimestamp that is not an RFC 3339 time", '"expirationTimestamp": "soon"']),
        ("import json; print(json.dumps({'apiVersion': 'client.authentication.k8s.io/v1beta1', 'kind': "
         "'ExecCredential', 'status': {'token': 'sekret-token'}}))",
         ["answered in apiVersion 'client.authentication.k8s.io/v1beta1'", '"token": "<redacted>"']),
    ],
    ids=["exits-non-zero", "prints-garbage", "bad-expiry", "wrong-version"],
)  # fmt: skip
def test_a_failing_exec_plugin_is_named_with_what_it_printed(cluster, tmp_path, script, printed):
    path = kubeconfig(cluster, tmp_path / "kubeconfig", "eks-admin", exec_user("-c", script))
    with pytest.raises(login.LoginError) as refusal:
        login.verify(str(path))
    message = str(refusal.value)
    assert "kubeconfig user 'eks-admin'" in message and sys.executable in message, message
    assert all(part in message for part in printed), message
    assert "sekret-token" not in message  # (a token it printed is never quoted)


def test_the_operator_exits_at_start_when_its_exec_plugin_fails(cluster, tmp_path):
    """neuronfleet/cli.py `_cmd_operator` calls `login.verify` before it starts kopf."""
    script = "import sys; sys.stderr.write('token expired: run aws sso login'); sys.exit(1)"
    path = kubeconfig(cluster, tmp_path / "kubeconfig", "eks-admin", exec_user("-c", script))
    run = subprocess.run(
        [*neuronfleet_command(), "operator", "--kubeconfig", str(path)],
        capture_output=True, text=True, timeout=DEADLINE,
    )  # fmt: skip
    assert run.returncode != 0
    assert "kubeconfig user 'eks-admin'" in run.stderr and "token expired: run aws sso login" in run.stderr


def test_bad_kubeconfigs_are_refused_saying_what_is_wrong(cluster, tmp_path):
    with pytest.raises(login.LoginError, match="no such file"):
        login.verify(str(tmp_path / "missing"))
    missing = {"apiVersion": "client.authentication.k8s.io/v1", "command": str(tmp_path / "nowhere")}
    unknown = exec_user("-c", "", api_version="client.authentication.k8s.io/v2")
    not_base64 = {"token": "t", "client-certificate-data": "eA==", "client-key-data": "%"}
    cases = {
        "a plugin that is not there": ({"exec": missing}, "could not be started"),
        "an unknown exec apiVersion": (unknown, "expected one of client.authentication.k8s.io/v1"),
        "a tokenFile that is not there": ({"tokenFile": str(tmp_path / "no-token")}, "no-token"),
        "a key that is not base64": (not_base64, "client-key-data is not base64"),
    }
    for case, (user, expected) in cases.items():
        path = kubeconfig(cluster, tmp_path / "kubeconfig", "someone", user)
        with pytest.raises(login.LoginError) as refusal:
            login.verify(str(path))
        assert "'someone'" in str(refusal.value) and expected in str(refusal.value), (case, refusal.value)


def test_a_rotated_token_file_keeps_the_client_working(cluster, tmp_path):
    """A tokenFile user (the path relative to the kubeconfig's folder): the API server rotates the user's
    token and the file gets the new one; the client's next request is refused with the old token, logs in
    again and goes on, with no restart."""
    token_file = tmp_path / "operator-token"
    old = set_token(cluster.api.tokens, "token-file-user")
    write_private(token_file, old + "\n")
    path = kubeconfig(cluster, tmp_path / "kubeconfig", "token-file-user", {"tokenFile": "operator-token"})

    async def scenario() -> None:
        client = kube.Kube(kube.load_credentials(str(path)))
        try:
            await reads_and_writes(client, "before-rotation")
            write_private(
                token_file, set_token(cluster.api.tokens, "token-file-user")
            )  # (the kubelet's write)
            assert refused(cluster, old)
            await reads_and_writes(client, "after-rotation")
        finally:
            await client.close()

    asyncio.run(scenario())


def test_the_service_accounts_rotated_token_is_read_again(cluster, tmp_path, monkeypatch):
    """In a pod (KUBERNETES_SERVICE_HOST and _PORT, the service account's token and ca.crt, here in a folder
    of the test's): the token rotated by the API server is read again after the 401; a new token in the file
    is used within login.REREAD_SECONDS (shortened here) though the old one was not refused."""
    account = tmp_path / "serviceaccount"
    account.mkdir()
    config = yaml.safe_load((cluster.state / "kubeconfig").read_text())
    (account / "ca.crt").write_bytes(
        base64.b64decode(config["clusters"][0]["cluster"]["certificate-authority-data"])
    )
    old = set_token(cluster.api.tokens, "service-account")
    write_private(account / "token", old)
    url = urllib.parse.urlsplit(cluster.api.url)
    environ = {"KUBERNETES_SERVICE_HOST": url.hostname, "KUBERNETES_SERVICE_PORT": str(url.port),
               "HOME": str(tmp_path)}  # fmt: skip
    in_pod = login.Login(environ=environ, service_account=account)
    assert in_pod.kubeconfig is None  # (no kubeconfig in this HOME, none named)

    async def rotated() -> None:
        client = kube.Kube(in_pod)
        try:
            await reads_and_writes(client, "in-cluster")
            write_private(account / "token", set_token(cluster.api.tokens, "service-account"))
            assert refused(cluster, old)
            assert await client.get("ConfigMap", "default", "in-cluster", live=True)
        finally:
            await client.close()

    asyncio.run(rotated())
    monkeypatch.setattr(login, "REREAD_SECONDS", 0.5)
    in_pod = login.Login(environ=environ, service_account=account)

    async def reread() -> None:
        client = kube.Kube(in_pod)
        try:
            assert await client.get("ConfigMap", "default", "in-cluster", live=True)
            write_private(account / "token", set_token(cluster.api.tokens, "service-account-next"))
            started = time.monotonic()  # (the old token still works: only reading the file again changes it)
            while "service-account-next" not in audit_users(cluster):
                assert time.monotonic() - started < DEADLINE, "the token file was not read again"
                assert await client.get("ConfigMap", "default", "in-cluster", live=True)
                await asyncio.sleep(0.1)
        finally:
            await client.close()

    asyncio.run(reread())


def test_client_certificates_leave_no_file_behind(cluster, tmp_path, monkeypatch):
    """A user with client-certificate-data and client-key-data (and a token: the emulated server checks
    tokens only): the client and kopf's connection info work, and no temporary file is left, not even while
    the client runs (the official client's loader would write the data to files kept until the process
    exits)."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    chain, key = tls.make()
    certificate = chain.split(tls.PEM_END)[0] + tls.PEM_END
    user = {"token": set_token(cluster.api.tokens, "cert-user"),
            "client-certificate-data": base64.b64encode(certificate).decode(),
            "client-key-data": base64.b64encode(key).decode()}  # fmt: skip
    path = kubeconfig(cluster, tmp_path / "kubeconfig", "cert-user", user)
    login.verify(str(path))  # (the certificate and the key load: they are a pair)

    async def scenario() -> None:
        client = kube.Kube(kube.load_credentials(str(path)))
        try:
            await reads_and_writes(client, "with-certificate")
            assert list(temporary.iterdir()) == []
        finally:
            await client.close()
        info = (await login.Login(path).load()).connection_info()  # what kopf gets: data, no paths
        assert info.certificate_data == certificate and info.private_key_data == key and not info.ca_path
        context = info.as_ssl_context()  # (kopf's own: its brief files are its own and gone at once)
        async with (
            aiohttp.ClientSession(headers=info.as_http_headers()) as session,
            session.get(
                f"{info.server}/api/v1/namespaces/default/configmaps/with-certificate", ssl=context
            ) as r,
        ):
            assert r.status == 200 and (await r.json())["metadata"]["name"] == "with-certificate"

    asyncio.run(scenario())
    assert list(temporary.iterdir()) == []
    other_key = tls.make()[1]  # a certificate with another key's pair: refused at start
    mismatched = {**user, "client-key-data": base64.b64encode(other_key).decode()}
    path = kubeconfig(cluster, tmp_path / "kubeconfig", "cert-user", mismatched)
    with pytest.raises(login.LoginError, match="'cert-user'"):
        login.verify(str(path))
    assert list(temporary.iterdir()) == []


def test_kopfs_login_handler_gives_the_operators_credentials(cluster, tmp_path):
    """`login.kopf_login` in a process of its own (the operator's one login, from KUBECONFIG here): kopf's
    connection info with the server, its CA and the user's bearer token."""
    token = set_token(cluster.api.tokens, "kopf-user")
    path = kubeconfig(cluster, tmp_path / "kubeconfig", "kopf-user", {"token": token})
    probe = (
        "import asyncio, json; from neuronfleet.operator import login; "
        "info = asyncio.run(login.kopf_login()); "
        "print(json.dumps([info.server, info.scheme, info.token, bool(info.ca_data), info.insecure]))"
    )
    run = subprocess.run([sys.executable, "-P", "-c", probe], capture_output=True, text=True,
                         timeout=DEADLINE, env={**os.environ, "KUBECONFIG": str(path)})  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == [cluster.api.url.rstrip("/"), "Bearer", token, True, False]


def test_credentials_never_show_their_secrets():
    credentials = login.Credentials("https://k", "kubeconfig user 'u'", "Bearer sekret", key=b"PRIVATE KEY")
    assert "sekret" not in repr(credentials) and "PRIVATE" not in repr(credentials)
