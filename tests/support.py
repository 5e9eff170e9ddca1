"""What the tests share: free ports, waiting on readiness and progress (never on a short fixed budget),
processes started and stopped with their output in a log file, `neuronfleet serve` servers and fleets of them,
HTTP reads of their endpoints, the real kubectl, tiny random Llama checkpoints, and the benchmarks' modules.

Waits hold on a loaded machine: `wait_until` keeps waiting while its `progress` moves (a process that uses
CPU time or writes its log), fails at once when the thing it waits on died (with its log's tail), and gives up
only after a generous ceiling."""

from __future__ import annotations

import contextlib
import http.client
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from neuronfleet.localcluster.ports import loopback_port

ROOT = Path(__file__).resolve().parent.parent
CEILING = 600.0  # the longest any single wait may take (under pytest's per-test timeout, 720 s)
PATIENCE = 120.0  # how long a wait with a progress signal tolerates no progress at all
HTTP_TIMEOUT = 120.0  # a read of /metrics, /health, /ready or a status endpoint on a loaded machine


def _libfabric_problem() -> str:
    try:
        from neuronfleet.runtime.kv.nixl_transfer import libfabric_problem
    except ImportError as e:
        return str(e)
    return libfabric_problem()


# the `efa` transport (NIXL over LIBFABRIC) runs where a libfabric that NIXL's plugin loads is installed
# (without EFA devices, over libfabric's tcp provider: docs/testing.md says how); elsewhere it is skipped
LIBFABRIC_HERE = pytest.mark.skipif(
    bool(_LIBFABRIC_PROBLEM := _libfabric_problem()), reason=f"no LIBFABRIC here: {_LIBFABRIC_PROBLEM[:200]}"
)
KUBECTL_HELP = (
    "kubectl is needed by the tests that drive the emulated API server and local mode, and is not on PATH. "
    "Install it from https://kubernetes.io/docs/tasks/tools/install-kubectl-linux/ (a single static binary, "
    "e.g. into /usr/bin/kubectl); Debian 12 has no kubectl package."
)


def bench_module(name: str):
    """bench/NAME.py as a module (the benchmarks are scripts, not a package; their neighbours importable while
    it loads, as when it runs)."""
    import importlib.util

    folder = str(ROOT / "bench")
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (its dataclasses look their module up)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(folder)
    return module


def free_port() -> int:
    """A loopback port for a server a test starts (local mode's pool: below the ephemeral range, this
    worker's share of it, conftest.py)."""
    return loopback_port()


# ---- waiting ----------------------------------------------------------------------------------------------


class Died(AssertionError):
    """What a progress signal raises when the thing waited on cannot make progress any more."""


def wait_until(
    predicate: Callable[[], Any],
    what: str,
    *,
    progress: Callable[[], Any] | None = None,
    patience: float = PATIENCE,
    ceiling: float = CEILING,
    interval: float = 0.1,
    diagnose: Callable[[], str] | None = None,
) -> Any:
    """Poll `predicate` until it returns something truthy, and return that. While `progress()` returns a
    changing value the wait goes on (up to `ceiling` seconds); with no change for `patience` seconds it fails.
    Without `progress`, the wait lasts up to `ceiling`. `progress` may raise `Died` to fail at once;
    `diagnose` adds context (e.g. logs) to the failure message."""
    started = time.monotonic()
    last_progress, last_value = started, progress() if progress else None
    while True:
        value = predicate()
        if value:
            return value
        now = time.monotonic()
        if progress is not None:
            current = progress()
            if current != last_value:
                last_progress, last_value = now, current
        stalled = progress is not None and now - last_progress > patience
        if stalled or now - started > ceiling:
            why = f"no progress for {patience:.0f} s" if stalled else f"still not there after {ceiling:.0f} s"
            pytest.fail(f"timed out waiting for {what} ({why})" + (f"\n{diagnose()}" if diagnose else ""))
        time.sleep(interval)


async def wait_until_async(predicate: Callable[[], Any], what: str, *, ceiling: float = CEILING) -> Any:
    """`wait_until` for tests inside an event loop (the loop keeps running while it waits)."""
    import asyncio

    started = time.monotonic()
    while not (value := predicate()):
        if time.monotonic() - started > ceiling:
            pytest.fail(f"timed out waiting for {what} (still not there after {ceiling:.0f} s)")
        await asyncio.sleep(0.01)
    return value


cpu_seconds = bench_module("machine").cpu_seconds  # CPU time a process used so far (bench/machine.py)


def tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


# ---- processes --------------------------------------------------------------------------------------------


class Process:
    """A subprocess whose stdout and stderr go to a log file (never a pipe nobody reads, which would block it
    once full)."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.args, self.log = args, log
        with log.open("w") as out:
            self.popen = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def output(self) -> str:
        return tail(self.log, 1 << 20)

    def died(self) -> str:
        return (
            f"{Path(self.args[0]).name} exited with {self.popen.returncode}; its log ends:\n{tail(self.log)}"
        )

    def progress(self) -> tuple[float, int]:
        """CPU time used and log bytes written: they move while the process works; `Died` once it exited."""
        if self.popen.poll() is not None:
            raise Died(self.died())
        return cpu_seconds(self.pid), self.log.stat().st_size if self.log.exists() else 0

    def wait_until(self, predicate: Callable[[], Any], what: str, **kw: Any) -> Any:
        """Wait for `predicate` while this process lives and makes progress."""
        return wait_until(predicate, what, progress=self.progress, diagnose=lambda: tail(self.log), **kw)

    def wait(self) -> int:
        """Its exit status, however long it takes while it works (then killed)."""
        try:
            exited = lambda: self.popen.poll() is not None  # noqa: E731
            wait_until(exited, f"{Path(self.args[0]).name} to exit", progress=self.cpu)
        finally:
            if self.popen.poll() is None:
                self.popen.kill()
        return self.popen.wait()

    def cpu(self) -> float:
        return cpu_seconds(self.pid)

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL, and reaped."""
        self.signal(signal.SIGKILL)
        self.popen.wait()

    def stop(self) -> int:
        """SIGTERM, and the exit status once it exits (SIGKILL when it stops progressing)."""
        self.signal(signal.SIGTERM)
        return self.wait()


# Tests that compare answers token for token across paths (a fleet or a handoff against one engine) run
# float32: bfloat16, what `--dtype auto` is on a CPU with native bfloat16, rounds differently for other row
# counts, and greedy tokens part after a dozen or so.
EXACT_DTYPE = "float32"
EXACT_DTYPE_OPTIONS = ("--dtype", EXACT_DTYPE)


def unified_reference(model_dir: Path):
    """One slot, every prompt prefilled whole, float32: the engine whose answers other paths must equal."""
    from neuronfleet.runtime.engine.config import RuntimeConfig
    from neuronfleet.runtime.engine.engine import Engine

    config = RuntimeConfig(slots=1, max_seq_len=256, prefix_reuse=False, dtype=EXACT_DTYPE)
    return Engine.from_model_dir(str(model_dir), config)


def neuronfleet_command() -> list[str]:
    """The command line a user types: `neuronfleet` from this environment, without the repository root on
    sys.path (-P; operator/ would shadow the standard library's)."""
    return [sys.executable, "-P", "-m", "neuronfleet.cli"]


_IMPORTS_REPORTER = """
import os, signal, sys, threading, time, urllib.request

from neuronfleet.cli import main

def report_once_serving():
    while True:
        try:
            with urllib.request.urlopen("http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(0.2)
    heavy = sorted(m for m in {modules!r} if m in sys.modules)
    print("IMPORTED", ",".join(heavy) or "-", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)

threading.Thread(target=report_once_serving, daemon=True).start()
sys.exit(main(sys.argv[1:]))
"""


def serve_and_report_imports(
    args: list[str], port: int, modules: tuple[str, ...]
) -> subprocess.CompletedProcess:
    """`neuronfleet ARGS` (a server on `port`) in a child process that, once its /health answers, prints which
    of `modules` it has imported (`IMPORTED a,b`, or `IMPORTED -` for none), then stops itself with SIGTERM
    (so its exit status is the drain's)."""
    script = _IMPORTS_REPORTER.format(port=port, modules=tuple(modules))
    return subprocess.run([sys.executable, "-P", "-c", script, *args], capture_output=True, text=True,
                          timeout=600)  # fmt: skip


# ---- HTTP -------------------------------------------------------------------------------------------------


def http_status(url: str, headers: dict | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=HTTP_TIMEOUT):
            return 200
    except urllib.error.HTTPError as e:
        return e.code


def get_json(url: str, headers: dict | None = None) -> Any:
    with urllib.request.urlopen(
        urllib.request.Request(url, headers=headers or {}), timeout=HTTP_TIMEOUT
    ) as r:
        return json.loads(r.read())


def post(base: str, path: str, body: bytes | dict, headers: dict | None = None):
    """(status, JSON body, headers) of a POST; errors are answers too."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        base + path, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=CEILING) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def metrics_text(base: str) -> str:
    with urllib.request.urlopen(base + "/metrics", timeout=HTTP_TIMEOUT) as r:
        return r.read().decode()


def metric(base: str, name: str, **labels: str) -> float:
    """One sample's value from /metrics, summed over the series matching `labels` (0 when none exists yet)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(metrics_text(base)):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


# ---- servers and fleets -----------------------------------------------------------------------------------


class Server(Process):
    """`neuronfleet serve` as a user starts it, on 127.0.0.1 and `port`."""

    def __init__(self, model_dir: Path | str, options: tuple[str, ...], port: int, log: Path) -> None:
        self.port, self.base = port, f"http://127.0.0.1:{port}"
        args = [*neuronfleet_command(), "serve", "--model", str(model_dir), "--port", str(port)]
        super().__init__([*args, "--served-model-name", "smollm2", *options], log)

    def ready(self) -> bool:
        try:
            return http_status(self.base + "/ready") == 200
        except OSError:  # not listening yet (the model is loading)
            return False

    def wait_ready(self) -> None:
        self.wait_until(self.ready, f"the server on port {self.port} to be ready")

    def stop_cleanly(self) -> None:
        """SIGTERM drains and exits 0 (a server the test killed with SIGKILL is let be)."""
        rc = self.stop()
        if rc != -signal.SIGKILL:
            assert rc == 0, self.output()


@contextlib.contextmanager
def running_server(model_dir, *options: str, port: int | None = None) -> Iterator[tuple[str, Server]]:
    """A ready server, yielded as (base URL, Server); SIGTERM stops it (exit 0), unless the test killed it."""
    with tempfile.TemporaryDirectory(prefix="neuronfleet-serve-") as logs:
        server = Server(model_dir, options, port or free_port(), Path(logs) / "serve.log")
        try:
            server.wait_ready()
            yield server.base, server
        finally:
            server.stop_cleanly()


class Fleet:
    """Named servers on fixed ports (a server restarts where its peers expect it), started, killed and
    restarted by name; closing stops them all."""

    def __init__(self, model_dir: Path | str, logs: Path, common: tuple[str, ...] = ()) -> None:
        self.model_dir, self.logs, self.common = model_dir, logs, common
        self.options: dict[str, tuple[int, tuple[str, ...]]] = {}
        self.servers: dict[str, Server] = {}
        self.stack = contextlib.ExitStack()

    def add(self, name: str, *options: str) -> str:
        """Declare a server (its port is chosen now) and return its URL; `start` runs it."""
        self.options[name] = (free_port(), options)
        return self.url(name)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.options[name][0]}"

    def start(self, *names: str) -> None:
        """Start the servers (all at once: they load their models in parallel); wait until they are ready."""
        for name in names:
            port, options = self.options[name]
            log = self.logs / f"{name}.log"
            if log.exists():
                log.rename(self.logs / f"{name}.{time.monotonic_ns()}.log")
            self.servers[name] = Server(self.model_dir, (*options, *self.common), port, log)
            self.stack.callback(self.servers[name].stop_cleanly)
        for name in names:
            self.servers[name].wait_ready()

    def kill(self, name: str) -> None:
        self.servers[name].kill()

    def metric(self, names: str | tuple[str, ...], sample: str, **labels: str) -> float:
        """A sample summed over servers (e.g. both decode pods)."""
        return sum(
            metric(self.url(n), sample, **labels) for n in ((names,) if isinstance(names, str) else names)
        )

    def close(self) -> None:
        self.stack.close()


# ---- kubectl ----------------------------------------------------------------------------------------------


def kubectl_path() -> str:
    """The real kubectl; a test that needs it fails (not skips) when it is missing, saying how to get it."""
    path = shutil.which("kubectl")
    if path is None:
        pytest.fail(KUBECTL_HELP)
    return path


class Kubectl:
    """kubectl against one kubeconfig, with its own cache directory (never the user's home)."""

    def __init__(self, kubeconfig: Path, cache_dir: Path) -> None:
        self.kubeconfig, self.cache_dir = kubeconfig, cache_dir

    def __call__(
        self, *args: str, stdin: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess:
        cmd = [
            kubectl_path(),
            "--kubeconfig",
            str(self.kubeconfig),
            "--cache-dir",
            str(self.cache_dir),
            *args,
        ]
        run = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=CEILING)
        if check and run.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {run.stderr}")
        return run

    def get(self, *args: str) -> dict | None:
        """The object(s) as JSON, or None when kubectl cannot get them."""
        run = self("get", *args, "-o", "json", check=False)
        return json.loads(run.stdout) if run.returncode == 0 else None


class ApiServer:
    """The emulated Kubernetes API server as a process, serving HTTPS; `kubectl` is pointed at it. Its state
    (the kubeconfig, the token file, the certificate, kubectl's cache, the log) lives in `state`; a server
    started again in the same state keeps its tokens and certificate. For raw HTTP: `context` (the TLS context
    that trusts its CA), `token` (the kubeconfig's, the admin's) and `headers()`, which carry it."""

    def __init__(self, state: Path, *extra: str) -> None:
        from neuronfleet.localcluster.tls import Access

        self.state, self.tokens = state, state / "tokens.csv"
        args = [sys.executable, "-P", "-m", "neuronfleet.localcluster.apiserver"]
        args += ["--kubeconfig", str(state / "kubeconfig"), "--token-auth-file", str(self.tokens)]
        args += [
            "--tls-cert-file",
            str(state / "apiserver.crt"),
            "--tls-private-key-file",
            str(state / "apiserver.key"),
        ]
        args += ["--ready-file", str(state / "url"), *extra]
        self.process = Process(args, state / "apiserver.log")
        url_file = state / "url"
        self.url: str = self.process.wait_until(
            lambda: url_file.exists() and url_file.read_text(), "the API server to serve"
        )
        self.access = Access.read(state / "kubeconfig")
        self.token, self.context = self.access.token, self.access.context
        self.kubectl = Kubectl(state / "kubeconfig", state / "cache")

    def headers(self, content_type: str | None = "application/json") -> dict[str, str]:
        """The admin's Authorization header (and a Content-Type) for a raw HTTP request."""
        return self.access.headers(content_type)

    def kubeconfig_for(self, user: str) -> Path:
        """STATE/USER-kubeconfig: the kubeconfig with a token the server's token file now gives `user` (the
        audit log's user for its calls; a token it held before is refused from now on)."""
        import yaml

        from neuronfleet.localcluster.guard import set_token, write_private

        config = yaml.safe_load((self.state / "kubeconfig").read_text())
        config["users"][0]["user"]["token"] = set_token(self.tokens, user)
        path = self.state / f"{user}-kubeconfig"
        write_private(path, yaml.safe_dump(config))
        return path

    def stop(self) -> None:
        self.process.stop()


OPERATOR_USER = "neuronfleet-operator"  # the user of the operator's kubeconfig: its calls in the audit log


class OperatorCluster:
    """The emulated API server with the CRD installed and an audit log, kubectl, and a kubeconfig for
    operators run against it as their own user (so that the audit log tells their calls from kubectl's)."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self.api = ApiServer(state, "--audit-log", str(state / "audit.jsonl"))
        self.kubectl = self.api.kubectl
        self.kubectl("apply", "-f", str(ROOT / "crds" / "neuronfleet.dev_neuronmodels.yaml"))
        self.operators: list[Process] = []

    def start_operator(
        self, *flags: str, user: str = OPERATOR_USER, env: dict[str, str] | None = None
    ) -> Process:
        """An operator process (standalone, verbose, `flags` added) against this API server as `user` (its
        token's user; also its pod name, which its leader election identity starts with), with `env` over this
        process's environment, logging to operator-N.log in the state folder; `stop()` stops it."""
        kubeconfig = self.state / f"{user}-kubeconfig"
        if not kubeconfig.exists():
            kubeconfig = self.api.kubeconfig_for(user)
        args = [*neuronfleet_command(), "operator", "--kubeconfig", str(kubeconfig)]
        args += ["--standalone", "--verbose"]
        env = {**os.environ, **(env or {}), "POD_NAME": user}
        log = self.state / f"operator-{len(self.operators)}.log"
        self.operators.append(Process([*args, *flags], log, env))
        return self.operators[-1]

    def audit(self) -> list[dict]:
        """Every call in the audit log, in the order the API server answered them (watches as they began)."""
        return [json.loads(x) for x in (self.state / "audit.jsonl").read_text().splitlines()]

    def stop(self) -> None:
        """Stop the operators still running, then the API server."""
        for proc in self.operators:
            if proc.poll() is None:
                proc.stop()
        self.api.stop()

    def call(self, method: str, path: str, body: dict | None = None, content_type: str = "application/json"):
        """One API request as JSON: the answer's body, or None for 404."""
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            self.api.url + path, data=data, method=method, headers=self.api.headers(content_type)
        )
        try:
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT, context=self.api.context) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise


class LocalCluster:
    """A local cluster started with `neuronfleet up --state STATE`: kubectl against it, and waits that last
    while it makes progress (its logs grow: the API server, operator, kubelet and pods all log there)."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self.kubectl = Kubectl(state / "kubeconfig", state / "kc")

    def get(self, *args: str) -> dict:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def logged_bytes(self) -> int:
        return sum(p.stat().st_size for p in (self.state / "logs").glob("*.log"))

    def logs(self) -> str:
        return "\n".join(p.read_text()[-3000:] for p in (self.state / "logs").glob("*.log"))

    def wait(self, what: str, check):
        return wait_until(check, what, progress=self.logged_bytes, diagnose=self.logs, interval=0.5)

    def pid_file(self, pod: dict) -> Path:
        """The file the process kubelet keeps a pod's process id in."""
        (found,) = self.state.rglob(f"{pod['metadata']['namespace']}_{pod['metadata']['name']}/pid")
        return found

    def pod_url(self, pod: dict) -> str:
        """Where a running pod's server listens (the `--port` its process was given)."""
        command = Path(f"/proc/{int(self.pid_file(pod).read_text())}/cmdline").read_bytes().split(b"\0")
        return f"http://127.0.0.1:{command[command.index(b'--port') + 1].decode()}"


def run_neuronfleet(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`neuronfleet ARGS` as a user runs it (the installed console script), its output captured."""
    cli = str(Path(sys.executable).parent / "neuronfleet")
    return subprocess.run([cli, *args], capture_output=True, text=True, timeout=CEILING, env=env)


# the builtin autoscaler decides every 2 s in the tests' local clusters (the operator's setting; 15 s by
# default): timing behaviour is proven in the decision's simulator, the tests need only see it act
AUTOSCALE_INTERVAL = {"NEURONFLEET_AUTOSCALE_INTERVAL_SECONDS": "2"}


@contextlib.contextmanager
def local_mode(state: Path, make: Callable[[Path], Any] = LocalCluster, env: dict[str, str] | None = None):
    """`neuronfleet up --detach` in `state` (its operator deciding every AUTOSCALE_INTERVAL), the cluster as
    `make(state)` gives it, then `neuronfleet down` (each checked)."""
    env = {**(os.environ if env is None else env), **AUTOSCALE_INTERVAL}
    run = run_neuronfleet("up", "--state", str(state), "--detach", env=env)
    assert run.returncode == 0, run.stderr + run.stdout
    try:
        yield make(state)
    finally:
        down = run_neuronfleet("down", "--state", str(state), env=env)
        assert down.returncode == 0, down.stdout + down.stderr


# ---- models -----------------------------------------------------------------------------------------------


def make_tiny_llama(out: Path, seed: int = 0, architecture: str = "llama", **overrides) -> Path:
    """A tiny random Llama (or Mistral) checkpoint saved by transformers as safetensors."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
    }[architecture]
    settings = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**settings)).eval()
    with torch.no_grad():  # larger weights than the default init so that logits differ clearly
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(out)
    return out


def chat(endpoint: str, model: str, tokens: int, timeout: float = HTTP_TIMEOUT) -> tuple[int, str]:
    """One chat completion ("Tell me a story", `tokens` at most) at an OpenAI endpoint: (status, its text)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me a story"}],
        "max_tokens": tokens,
    }
    req = urllib.request.Request(
        endpoint + "/v1/chat/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, json.loads(r.read())["choices"][0]["message"]["content"]


class KeptAlive:
    """A plain HTTP/1.1 client on one kept-alive connection, as a client library without retries is: the
    connection is reused for every request and opened again only after an answer said `Connection: close`
    (http.client does that); a connection the server cut without saying so fails the request."""

    def __init__(self, endpoint: str, timeout: float) -> None:
        url = urllib.parse.urlsplit(endpoint)
        self.connection = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
        self.connections = 0  # how many it opened

    def post(self, path: str, body: dict) -> tuple[int, dict]:
        if self.connection.sock is None:
            self.connections += 1
        self.connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = self.connection.getresponse()
        return response.status, json.loads(response.read())

    def close(self) -> None:
        self.connection.close()


class ChatLoad:
    """`workers` threads each sending chat requests one after the other until stopped (no retry): counts
    the answers and keeps every failure as the client saw it (any exception, or a status other than 200). A
    request may wait up to CEILING: answered late is answered, a lost one is the failure.

    Each worker is one of `clients`, in turn: "urllib" (a new connection per request), "openai" (the official
    client, one per worker, reused, `max_retries=0`: its pool keeps connections alive) or "kept-alive" (one
    HTTP/1.1 connection, `KeptAlive`), or several joined by "+" (one worker whose clients take turns).
    `pause`: seconds a worker waits after each answer (a light load)."""

    def __init__(
        self, endpoint: str, model: str, workers: int, tokens: int = 16,
        clients: tuple[str, ...] = ("urllib",), pause: float = 0.0,
    ) -> None:  # fmt: skip
        self.endpoint, self.model, self.tokens, self.stop = endpoint, model, tokens, threading.Event()
        self.pause = pause
        self.answered, self.failed, self._lock = 0, [], threading.Lock()
        self.by_client: dict[str, int] = {}
        kinds = [clients[i % len(clients)] for i in range(workers)]
        self.threads = [threading.Thread(target=self._work, args=(k,), daemon=True) for k in kinds]

    def _one(self, kind: str) -> Callable[[], None]:
        messages = [{"role": "user", "content": "Tell me a story"}]
        if kind == "urllib":
            return lambda: chat(self.endpoint, self.model, self.tokens, CEILING)
        if kind == "openai":
            from openai import OpenAI

            client = OpenAI(base_url=self.endpoint + "/v1", api_key="none", max_retries=0, timeout=CEILING)
            return lambda: client.chat.completions.create(
                model=self.model, messages=messages, max_tokens=self.tokens
            )
        if kind == "kept-alive":
            client = KeptAlive(self.endpoint, CEILING)
            body = {"model": self.model, "messages": messages, "max_tokens": self.tokens}

            def one() -> None:
                status, answer = client.post("/v1/chat/completions", body)
                if status != 200:
                    raise AssertionError(f"answered {status}: {answer}")

            return one
        if "+" in kind:  # one worker, its clients taking turns (one request at a time in all)
            clients, turn = [self._one(k) for k in kind.split("+")], itertools.count()
            return lambda: clients[next(turn) % len(clients)]()
        raise ValueError(kind)

    def _work(self, kind: str) -> None:
        one = self._one(kind)
        while not self.stop.is_set():
            try:
                one()
                with self._lock:
                    self.answered += 1
                    self.by_client[kind] = self.by_client.get(kind, 0) + 1
                self.stop.wait(self.pause)
            except Exception as e:  # every failure is kept and reported, with an HTTP error's body
                said = e.read()[:300] if isinstance(e, urllib.error.HTTPError) else b""
                with self._lock:
                    self.failed.append(f"{kind}: {e!r} {said.decode(errors='replace')}".strip())
                time.sleep(0.2)  # (a client that failed once may fail at once again: no busy loop)

    def __enter__(self) -> ChatLoad:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=CEILING + 10)


def finish_compile(kubectl, job: str) -> None:
    """What the Job controller and kubelet leave of a compile that succeeded, where no kubelet runs: its
    pod's termination message (the artifacts' manifest) and the Job's Complete condition."""
    template = kubectl.get("job", job)["spec"]["template"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{job}-x1", "labels": {**template["metadata"]["labels"], "job-name": job}},
        "spec": {"restartPolicy": "Never", "containers": [{"name": "compile", "image": "runtime"}]},
    }
    kubectl("apply", "-f", "-", stdin=json.dumps(pod))
    terminated = {"exitCode": 0, "reason": "Completed", "message": json.dumps({"bytes": 1})}
    status = {
        "phase": "Succeeded",
        "containerStatuses": [{"name": "compile", "state": {"terminated": terminated}}],
    }
    kubectl("patch", "pod", f"{job}-x1", "--subresource", "status", "--type", "merge", "-p",
            json.dumps({"status": status}))  # fmt: skip
    done = {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True", "reason": "Emulated"}]}
    kubectl(
        "patch", "job", job, "--subresource", "status", "--type", "merge", "-p", json.dumps({"status": done})
    )


@contextlib.asynccontextmanager
async def kopf_watching(observed: Any, kubeconfig: Path, namespaces: list[str]):
    """kopf in this event loop, keeping `observed` (operator/watching.py) as the operator's replicas do,
    logged in with `kubeconfig`; stopped on leaving."""
    import asyncio

    import kopf

    from neuronfleet.operator import handlers, login

    registry, settings = handlers.watching_parts(observed, False, login.Login(kubeconfig))
    stop = asyncio.Event()
    task = asyncio.create_task(
        kopf.operator(
            registry=registry, settings=settings, namespaces=namespaces, standalone=True, stop_flag=stop
        )
    )
    try:
        yield
    finally:
        stop.set()
        await task


CITY_QUESTION = "Paris: its name, country and population in millions, as JSON."


def structured_outputs_round(base: str, model: str = "smollm2") -> dict[str, Any]:
    """Structured outputs as a client of `base` (an OpenAI endpoint) uses them, through the official `openai`
    client, greedy: its parse helper's object from a pydantic model, a streamed `json_object` answer, a
    completion under a schema (`extra_body`: the SDK's completions take no response_format), and a schema the
    server cannot follow refused with a 400 naming the field. Returns what came back, for comparisons."""
    from openai import BadRequestError, OpenAI
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=20)
        country: str = Field(max_length=20)
        population_millions: int = Field(ge=0, le=100)

    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    ask = {"model": model, "temperature": 0, "max_tokens": 80}
    parsed = client.chat.completions.parse(
        messages=[{"role": "user", "content": CITY_QUESTION}], response_format=City, **ask
    )
    city = parsed.choices[0].message.parsed
    assert isinstance(city, City) and parsed.choices[0].finish_reason == "stop", parsed
    paris = {"messages": [{"role": "user", "content": "A JSON object about Paris."}],
             "response_format": {"type": "json_object"}, **ask}  # fmt: skip
    chunks = [c for c in client.chat.completions.create(stream=True, **paris) if c.choices]
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    whole = client.chat.completions.create(**paris).choices[0]
    assert streamed == whole.message.content and chunks[-1].choices[0].finish_reason == whole.finish_reason, (
        streamed,
        chunks[-1].choices[0].finish_reason,
        whole,
    )
    if whole.finish_reason == "stop":  # (any object may run past max_tokens: then it is cut, not whole JSON)
        assert isinstance(json.loads(streamed), dict), streamed
    else:
        assert streamed.startswith("{"), streamed
    age = {"type": "integer", "minimum": 0, "maximum": 120}
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": age},
              "required": ["name", "age"]}  # fmt: skip
    completion = client.completions.create(
        prompt="A person, as JSON:", extra_body={"response_format": {"type": "json_schema", "json_schema": {
            "name": "person", "schema": person}}}, **ask,
    )  # fmt: skip
    answer = json.loads(completion.choices[0].text)
    assert set(answer) == {"name", "age"} and 0 <= answer["age"] <= 120, answer
    with pytest.raises(BadRequestError, match="Invalid type: bad") as refused:
        client.chat.completions.create(
            messages=[{"role": "user", "content": "x"}], **ask,
            response_format={"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "bad"}}},
        )  # fmt: skip
    assert refused.value.body["param"] == "response_format.json_schema.schema", refused.value.body
    return {"city": city.model_dump(), "streamed": streamed, "person": answer}


TOOLS = [
    {"type": "function", "function": {"name": name, "description": f"The {what} in a city now",
     "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                    "required": ["city"], "additionalProperties": False}}}
    for name, what in (("get_weather", "weather"), ("get_time", "time"))
]  # fmt: skip


def tool_call_round(base: str, model: str = "smollm2") -> dict[str, Any]:
    """A tool-call round trip as a client of `base` makes it through the official `openai` client, greedy, on
    a model whose template takes tools (`smollm2_tools_dir`): `required` (one call: `parallel_tool_calls`
    false) gives a call to one of the tools with arguments of its schema, parsed into the client's types; a
    named function streamed gives the same call as whole; the call's result sent back (the assistant's
    `tool_calls`, a `tool` message) gets a final answer, whole and streamed alike. Returns what came back."""
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    ask = {"model": model, "temperature": 0, "max_tokens": 80, "tools": TOOLS}
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = client.chat.completions.create(
        messages=question, tool_choice="required", parallel_tool_calls=False, **ask
    ).choices[0]
    assert forced.finish_reason == "tool_calls" and forced.message.content is None, forced
    (call,) = forced.message.tool_calls
    assert call.function.name in ("get_weather", "get_time") and set(json.loads(call.function.arguments)) == {
        "city"
    }
    named = {"type": "function", "function": {"name": "get_time"}}
    whole = (
        client.chat.completions.create(messages=question, tool_choice=named, **ask)
        .choices[0]
        .message.tool_calls
    )
    streamed, reasons = [], []
    for chunk in client.chat.completions.create(messages=question, tool_choice=named, stream=True, **ask):
        for choice in chunk.choices:
            streamed += choice.delta.tool_calls or []
            reasons.append(choice.finish_reason)
    assert (
        [(c.function.name, c.function.arguments) for c in streamed]
        == [(c.function.name, c.function.arguments) for c in whole]
        and {c.function.name for c in whole} == {"get_time"}
        and reasons[-1] == "tool_calls"
    ), (streamed, whole)
    result = {
        "role": "tool",
        "tool_call_id": call.id,
        "content": json.dumps({"temperature_c": 18, "sky": "grey"}),
    }
    history = [*question, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}, result]
    final = client.chat.completions.create(messages=history, **ask).choices[0]
    assert final.finish_reason == "stop" and final.message.content, final
    stream = client.chat.completions.create(messages=history, stream=True, **ask)
    parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(parts) == final.message.content
    return {"call": (call.function.name, call.function.arguments), "final": final.message.content}
