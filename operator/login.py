"""The operator's login to the Kubernetes API, through the official async client (kubernetes_asyncio 36.1.0):
where the API server is, how it is trusted, and who the operator is. From an explicit kubeconfig, else
KUBECONFIG or ~/.kube/config, else the pod's service account. `kube.Kube` (the operator's requests), the
Lease's thread (`leader`) and kopf's own login (`kopf_login`) log in through one `Login`.

What kubernetes_asyncio does: the kubeconfig's files merged and its current context, cluster and user
(`KubeConfigMerger`, `KubeConfigLoader`: `token`, `tokenFile`, username and password,
`insecure-skip-tls-verify`, `tls-server-name`, `proxy-url`), the service account's host, token and CA
(`InClusterConfigLoader`), and every request (`ApiClient`, in `kube`). What is ours:
- `exec` users (client.authentication.k8s.io/v1 and v1beta1 ExecCredential): the plugin is run here, with the
  command line and environment the library's `ExecProvider` makes, within EXEC_TIMEOUT (its own `run` waits
  for ever and, when a plugin prints something that is not an ExecCredential, says nothing of what it
  printed: a `LoginError` here names the user and quotes the output). A relative command with a slash is
  taken from the kubeconfig's folder, as kubectl does (https://kubernetes.io/docs/reference/access-authn-authz/
  authentication/#configuration). The token is used until its expirationTimestamp (less EXPIRY_SKEW), then
  the plugin runs again.
- Certificates and keys are held in memory. The library writes a kubeconfig's `*-data` fields to temporary
  files that it removes only when the process exits normally (kube_config.py `_create_temp_file_with_content`,
  `atexit`); here those fields never reach it. A client's TLS context is made from files in a private
  temporary folder that is removed as soon as the context holds them (Python's ssl loads a certificate chain
  from files only); kopf gets the data itself (`kopf.ConnectionInfo.*_data`, which kopf handles alike).
- Tokens that live in files (the service account's, a kubeconfig's `tokenFile`) are read again every
  REREAD_SECONDS, as client-go does (k8s.io/client-go/transport/token_source.go: NewCachedFileTokenSource,
  one minute): the kubelet rotates a bound service-account token, and EKS refuses one older than 90 days.
  A request the API server answers with 401 logs in again at once (`Login.credentials(stale=...)`; `kube`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import dataclasses
import datetime
import json
import logging
import os
import re
import ssl
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kopf
import yaml
from kubernetes_asyncio.client import ApiClient, Configuration
from kubernetes_asyncio.config.config_exception import ConfigException
from kubernetes_asyncio.config.exec_provider import ExecProvider
from kubernetes_asyncio.config.incluster_config import InClusterConfigLoader
from kubernetes_asyncio.config.kube_config import (
    ENV_KUBECONFIG_PATH_SEPARATOR,
    KubeConfigLoader,
    KubeConfigMerger,
)

from neuronfleet import __version__

log = logging.getLogger(__name__)

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
EXEC_TIMEOUT = 60.0  # seconds an exec plugin may take (a cloud CLI that fetches a token over the network)
EXPIRY_SKEW = 30.0  # an exec token is replaced this many seconds before its expirationTimestamp
REREAD_SECONDS = 60.0  # a token from a file is read again this often
RETRY_SECONDS = 10.0  # after a due login failed (the last credentials are kept meanwhile)
QUOTED = 600  # characters of a plugin's output quoted in an error
EXEC_VERSIONS = ("client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1")
USER_AGENT = f"neuronfleet-operator/{__version__}"


class LoginError(ValueError):
    """The operator cannot log in: what is wrong, which kubeconfig user or service account, and, for an exec
    plugin, what it printed."""


@dataclass(frozen=True)
class Credentials:
    """What one login gave. `authorization` and `key` are secrets: never in a repr or a log."""

    server: str
    user: str  # for messages: 'kubeconfig user NAME' or 'the service account'
    authorization: str | None = field(default=None, repr=False)  # the Authorization header's value
    ca: bytes | None = None  # PEM; None: the system's trusted CAs
    certificate: bytes | None = None  # PEM, a client certificate (with `key`)
    key: bytes | None = field(default=None, repr=False)
    verify: bool = True
    tls_server_name: str | None = None
    proxy: str | None = None
    expires: datetime.datetime | None = None  # an exec token's expirationTimestamp
    due: float | None = None  # (monotonic) when to log in again though nothing was refused; None: never

    def transport(self) -> tuple:
        """What a connection is made with: a client made for other credentials with the same transport
        serves these too (only the Authorization header differs)."""
        return self.server, self.ca, self.certificate, self.key, self.verify, self.tls_server_name, self.proxy

    def api_client(self, connections: int) -> ApiClient:
        """The official client's ApiClient for these credentials' transport, at most `connections` at once;
        each request carries its own Authorization (`request_auth`). Call it on the loop that uses it."""
        config = Configuration(host=self.server)
        config.verify_ssl, config.tls_server_name = self.verify, self.tls_server_name
        config.proxy, config.connection_pool_maxsize = self.proxy, connections
        files = {"ssl_ca_cert": self.ca, "cert_file": self.certificate, "key_file": self.key}
        with tempfile.TemporaryDirectory(prefix="neuronfleet-tls-") as folder:  # (mode 0700; gone at once)
            for name, pem in files.items():
                if pem is not None:
                    path = Path(folder) / name
                    path.write_bytes(pem)
                    setattr(config, name, str(path))
            client = ApiClient(configuration=config)  # (its TLS context is made here, from the files)
        client.user_agent = USER_AGENT
        return client

    def request_auth(self) -> dict[str, str] | None:
        """The official client's per-request auth setting (ApiClient.call_api's `_request_auth`)."""
        if not self.authorization:
            return None
        return {"in": "header", "key": "Authorization", "value": self.authorization, "type": "api_key"}

    def connection_info(self, trust_env: bool = False) -> kopf.ConnectionInfo:
        """The same credentials for kopf's own requests (its watches and its handlers' API calls)."""
        scheme, _, token = (self.authorization or "").partition(" ")
        return kopf.ConnectionInfo(
            server=self.server,
            ca_data=self.ca,
            insecure=not self.verify,
            scheme=scheme or None,
            token=token or None,
            certificate_data=self.certificate,
            private_key_data=self.key,
            proxy_url=self.proxy,
            trust_env=trust_env,
            expiration=self.expires,
        )


class Login:
    """Where the operator's credentials come from, and the last ones it got. One `Login` may serve several
    event loops (the operator's, the Lease's thread): each loads on its own loop."""

    def __init__(
        self,
        kubeconfig: str | os.PathLike[str] | None = None,
        *,
        environ: Mapping[str, str] = os.environ,
        service_account: Path = SERVICE_ACCOUNT,
    ) -> None:
        """`kubeconfig`: a kubeconfig file; without it, KUBECONFIG (a list of files, as kubectl reads it),
        else ~/.kube/config, else the pod's service account (`service_account`, with KUBERNETES_SERVICE_HOST
        and _PORT). LoginError when none is there."""
        self.environ, self.service_account = environ, service_account
        self.kubeconfig: str | None = None  # the kubeconfig's files (the list separator between them)
        if kubeconfig is not None:
            if not Path(kubeconfig).is_file():
                raise LoginError(f"kubeconfig {os.fspath(kubeconfig)}: no such file")
            self.kubeconfig = str(Path(kubeconfig).resolve())
        elif any(Path(p).expanduser().is_file() for p in _listed(environ.get("KUBECONFIG", ""))):
            self.kubeconfig = environ["KUBECONFIG"]
        elif (default := Path(environ.get("HOME") or Path.home()) / ".kube" / "config").is_file():
            self.kubeconfig = str(default)
        elif not (environ.get("KUBERNETES_SERVICE_HOST") and (service_account / "token").is_file()):
            raise LoginError(
                "no kubeconfig (--kubeconfig, KUBECONFIG or ~/.kube/config) and not in a cluster (no "
                f"KUBERNETES_SERVICE_HOST, or no service-account token in {service_account})"
            )
        self._current: Credentials | None = None
        self._lock = threading.Lock()  # (_current and _loading, from several threads)
        self._loading: dict[asyncio.AbstractEventLoop, asyncio.Task[Credentials]] = {}

    def __repr__(self) -> str:
        return f"Login({self.describe()})"

    def describe(self) -> str:
        if self.kubeconfig:
            return f"kubeconfig {self.kubeconfig}"
        return f"service account {self.service_account}"

    async def credentials(self, stale: Credentials | None = None) -> Credentials:
        """The credentials to send a request with: the last ones, unless they are due (an exec token about
        to expire, a token file to read again) or are `stale` (the API server refused them: 401), when it
        logs in again (once, however many requests ask meanwhile). A due login that fails keeps the last
        credentials (a warning; tried again RETRY_SECONDS later); a first login, or one after a 401, that
        fails raises LoginError."""
        with self._lock:
            current = self._current
        due = current is not None and current.due is not None and time.monotonic() >= current.due
        if current is not None and current is not stale and not due:
            return current
        try:
            return await self.again()
        except LoginError as e:
            if current is None or current is stale:
                raise
            log.warning("logging in again failed (%s); the last credentials are kept meanwhile", e)
            kept = dataclasses.replace(current, due=time.monotonic() + RETRY_SECONDS)
            with self._lock:
                self._current = kept
            return kept

    async def again(self) -> Credentials:
        """Log in again now (once, however many ask meanwhile on this loop); what `credentials` gives from
        then on."""
        loop = asyncio.get_running_loop()
        with self._lock:
            task = self._loading.get(loop)
            if task is None or task.done():
                task = self._loading[loop] = loop.create_task(self.load(), name="login")
        credentials = await asyncio.shield(task)  # (a waiter cancelled leaves the login to the others)
        with self._lock:
            self._current = credentials
            if self._loading.get(loop) is task:
                del self._loading[loop]
        return credentials

    async def load(self) -> Credentials:
        """Log in now: read the kubeconfig or the service account's files again, run an exec plugin."""
        if self.kubeconfig is not None:
            return await self._from_kubeconfig(self.kubeconfig)
        return self._in_cluster()

    def _in_cluster(self) -> Credentials:
        config = Configuration()
        token, ca = self.service_account / "token", self.service_account / "ca.crt"
        environ = dict(self.environ)
        loader = InClusterConfigLoader(str(token), str(ca), try_refresh_token=False, environ=environ)
        try:
            loader.load_and_set(config)
            ca_pem = Path(config.ssl_ca_cert).read_bytes()
        except (ConfigException, OSError) as e:
            raise LoginError(f"the service account ({self.service_account}): {e}") from None
        return Credentials(
            server=config.host,
            user="the service account",
            authorization=_header(config),
            ca=ca_pem,
            due=time.monotonic() + REREAD_SECONDS,
        )

    async def _from_kubeconfig(self, paths: str) -> Credentials:
        try:
            merged = KubeConfigMerger(paths).config  # (the files read now: a tokenFile's change is seen)
            if merged is None:
                raise LoginError(f"kubeconfig {paths}: no such file")
            loader = KubeConfigLoader(config_dict=merged, config_base_path=None)
            context = (loader.current_context or {}).get("context") or {}
            user_name = context.get("user")
            who = f"kubeconfig user {user_name!r}" if user_name else "the kubeconfig's context (no user)"
            cluster = merged["clusters"].get_with_name(context["cluster"])["cluster"]
            user = merged["users"].get_with_name(user_name, safe=True) if user_name else None
            user = user["user"] if user is not None else None
        except LoginError:
            raise
        except (ConfigException, OSError, yaml.YAMLError, KeyError, TypeError, AttributeError) as e:
            raise LoginError(f"kubeconfig {paths}: {_without_values(e)}") from None
        if "server" not in cluster:
            raise LoginError(f"kubeconfig {paths}: the cluster {context['cluster']!r} names no server")
        # certificates and keys are taken out before the library sees them (it would write them to files)
        try:
            ca = _pem(cluster, "certificate-authority")
            certificate = _pem(user, "client-certificate") if user is not None else None
            key = _pem(user, "client-key") if user is not None else None
        except (OSError, binascii.Error, ValueError) as e:
            raise LoginError(f"kubeconfig {paths}, {who}: {e}") from None
        expires, from_file = None, False
        if user is not None and "exec" in user:
            status, expires = await run_exec(user, who)
            del user.value["exec"]
            if status.get("token"):
                user.value.pop("tokenFile", None)
                user.value["token"] = status["token"]
            else:
                certificate, key = status["clientCertificateData"].encode(), status["clientKeyData"].encode()
        elif user is not None:
            from_file = "tokenFile" in user and "token" not in user
        config = Configuration()
        try:
            await loader.load_and_set(config)
        except (ConfigException, OSError, ValueError) as e:
            raise LoginError(f"kubeconfig {paths}, {who}: {_without_values(e)}") from None
        if expires is not None:
            left = (expires - datetime.datetime.now(datetime.UTC)).total_seconds()
            due: float | None = time.monotonic() + max(left - EXPIRY_SKEW, 1.0)  # (at most once a second)
        else:
            due = time.monotonic() + REREAD_SECONDS if from_file else None
        return Credentials(
            server=config.host,
            user=who,
            authorization=_header(config),
            ca=ca,
            certificate=certificate,
            key=key,
            verify=bool(config.verify_ssl),
            tls_server_name=config.tls_server_name,
            proxy=config.proxy,
            expires=expires,
            due=due,
        )


def _listed(kubeconfig: str) -> list[str]:
    return [p for p in kubeconfig.split(ENV_KUBECONFIG_PATH_SEPARATOR) if p]


def _header(config: Configuration) -> str | None:
    value = (config.api_key.get("BearerToken") or "").strip()  # (a token file may end in a newline)
    return value or None


def _pem(node: Any, name: str) -> bytes | None:
    """The PEM of `name`-data (base64) or of the file `name` (relative to its kubeconfig's folder), the
    kubeconfig field taken out (the library prefers the data too)."""
    data, path = node.value.pop(f"{name}-data", None), node.value.pop(name, None)
    if data:
        try:
            return base64.b64decode(data, validate=True)
        except binascii.Error:
            raise ValueError(f"{name}-data is not base64") from None
    if path:
        base = Path(node.path).parent if node.path else Path.cwd()
        return (base / Path(path).expanduser()).read_bytes()
    return None


def _without_values(error: BaseException) -> str:
    """The library's message without the kubeconfig entries it quotes whole (they may hold tokens)."""
    return re.sub(r"\{.*\}", "{...}", str(error))


def _expiry(stamp: Any) -> datetime.datetime | None:
    """An ExecCredential's status.expirationTimestamp (RFC 3339), or None; ValueError when it is none."""
    if not stamp:
        return None
    at = datetime.datetime.fromisoformat(str(stamp))
    return at if at.tzinfo else at.replace(tzinfo=datetime.UTC)


def _quote(output: bytes) -> str:
    text = output.decode("utf-8", "replace").strip()
    return repr(text if len(text) <= QUOTED else text[:QUOTED] + "...")


def _redacted(stdout: bytes) -> bytes:
    """A plugin's stdout with the secrets of an ExecCredential (token, key) blanked, where it is JSON."""
    try:
        data = json.loads(stdout)
    except ValueError:
        return stdout
    if isinstance(data, dict) and isinstance(data.get("status"), dict):
        for secret in ("token", "clientKeyData"):
            if secret in data["status"]:
                data["status"][secret] = "<redacted>"
    return json.dumps(data).encode()


async def run_exec(user: Any, who: str) -> tuple[dict[str, Any], datetime.datetime | None]:
    """Run the kubeconfig user's exec plugin: the status of the ExecCredential it printed (a token, or a
    client certificate and key) and when it expires (None: when the API server refuses it). LoginError
    naming the user and quoting the output when the plugin cannot be started, exits non-zero, takes longer
    than EXEC_TIMEOUT or prints something else."""
    try:
        provider = ExecProvider(user["exec"])  # (checks command, apiVersion, args and env; makes the env)
    except (ConfigException, KeyError, TypeError) as e:
        raise LoginError(f"the exec section of {who}: {_without_values(e)}") from None
    if provider.api_version not in EXEC_VERSIONS:
        raise LoginError(
            f"the exec section of {who}: apiVersion {provider.api_version!r}; expected one of "
            + ", ".join(EXEC_VERSIONS)
        )
    command = provider.args[0]
    if os.sep in command and not os.path.isabs(command) and user.path:
        command = str(Path(user.path).parent / command)
    info = {"apiVersion": provider.api_version, "kind": "ExecCredential", "spec": {"interactive": False}}
    env = {**provider.env, "KUBERNETES_EXEC_INFO": json.dumps(info)}
    what = f"the exec plugin of {who} ({command})"
    try:
        process = await asyncio.create_subprocess_exec(
            command, *provider.args[1:], env=env, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
    except OSError as e:
        raise LoginError(f"{what} could not be started: {e.strerror or e}") from None
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(), EXEC_TIMEOUT)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
        raise LoginError(f"{what} printed no credential within {EXEC_TIMEOUT:g} s") from None

    def failed(why: str) -> LoginError:
        printed = f"stdout {_quote(_redacted(stdout))}, stderr {_quote(stderr)}"
        return LoginError(f"{what} {why}; it printed: {printed}")

    if process.returncode != 0:
        raise failed(f"exited with status {process.returncode}")
    try:
        credential = json.loads(stdout)
    except ValueError:
        raise failed("printed no JSON ExecCredential") from None
    if not isinstance(credential, dict) or credential.get("kind") != "ExecCredential":
        raise failed("printed JSON that is not an ExecCredential")
    if credential.get("apiVersion") != provider.api_version:
        raise failed(f"answered in apiVersion {credential.get('apiVersion')!r}, not {provider.api_version!r}")
    status = credential.get("status")
    if not isinstance(status, dict):
        raise failed("printed an ExecCredential without a status")
    try:
        expires = _expiry(status.get("expirationTimestamp"))
    except ValueError:
        raise failed("gave a status.expirationTimestamp that is not an RFC 3339 time") from None
    if isinstance(status.get("token"), str) and status["token"]:
        return status, expires
    if isinstance(status.get("clientCertificateData"), str) and isinstance(status.get("clientKeyData"), str):
        return status, expires
    raise failed(
        "printed an ExecCredential with no status.token, nor clientCertificateData and clientKeyData"
    )


_operator: Login | None = None
_operator_lock = threading.Lock()


def operator_login(kubeconfig: str | os.PathLike[str] | None = None) -> Login:
    """The operator process's one login, made on the first call (from `kubeconfig`, else as `Login` finds
    one): its `kube.Kube`, its Lease's thread and kopf (`kopf_login`) all log in through it. A later call that
    names another kubeconfig is a LoginError."""
    global _operator
    with _operator_lock:
        if _operator is None:
            _operator = Login(kubeconfig)
        elif kubeconfig is not None and _operator.kubeconfig != str(Path(kubeconfig).resolve()):
            raise LoginError(f"the operator logs in with {_operator.describe()}, not kubeconfig {kubeconfig}")
        return _operator


def kopf_login_with(login: Login) -> Callable[..., Awaitable[kopf.ConnectionInfo]]:
    """A kopf login handler (register it with `kopf.on.login()`) logging in with `login`, again on every call
    (kopf calls it at start, after the API server refused its credentials with 401, and once an exec token
    has expired: `expiration`), so kopf's watches and `kube.Kube` use the same credentials."""

    async def kopf_login(**kwargs: Any) -> kopf.ConnectionInfo:
        credentials = await login.again()
        settings = kwargs.get("settings")
        trust_env = bool(settings.networking.trust_env) if settings is not None else False
        return credentials.connection_info(trust_env)

    return kopf_login


async def kopf_login(**kwargs: Any) -> kopf.ConnectionInfo:
    """kopf's login handler with the operator process's login (`operator_login()`)."""
    return await kopf_login_with(operator_login())(**kwargs)


def verify(kubeconfig: str | os.PathLike[str] | None = None) -> None:
    """The start-up check: log in once as the operator will (without it, from KUBECONFIG, ~/.kube/config or
    the service account), which reads the kubeconfig and runs its exec plugin; LoginError (a ValueError)
    saying what is wrong: the kubeconfig user, and what a failed exec plugin printed. Sends no request (an
    API server that is down at start is waited for, not an error); the CA, certificate and key must load."""

    async def check() -> None:
        credentials = await Login(kubeconfig).load()
        try:
            client = credentials.api_client(1)
        except (ssl.SSLError, OSError, ValueError) as e:
            raise LoginError(f"{credentials.user}: its CA, certificate or key do not load: {e}") from None
        await client.close()

    asyncio.run(check())
