"""Local mode's commands (`neuronfleet up | down | status`): the whole fleet on this machine, no cluster.

`up` starts two processes and records them in the state folder: the emulated API server with the process
kubelet (`apiserver --kubelet-state`), with the NeuronModel CRD installed and a `local-models` claim in
namespace default that holds SmolLM2-135M-Instruct (the local samples' model), and the operator. It writes
`STATE/kubeconfig` and prints the kubectl commands to use. Local mode is closed to other users of the machine
and to web pages (docs/local-mode.md): the API server serves HTTPS with a certificate made for it (`tls`;
`STATE/apiserver.crt`, kept), each `up` makes a fresh bearer token (`STATE/tokens.csv`, the API server's
token file) that the kubeconfig holds with the CA and every request must carry, the state folder is 0700 and
every file in it that holds a secret (kubeconfig, tokens, objects.json, logs) 0600 from its creation, and
the processes `up` starts create their files owner-only (umask 077). The operator serves its wake endpoint
(for the front doors of models that scale to zero) on a free loopback port, which the routers, local
processes too, reach at `http://127.0.0.1:PORT`, and its Prometheus metrics on another (its URL in
`STATE/operator-metrics-url`); in the foreground, Ctrl-C, SIGTERM and SIGHUP stop it all. The kubelet's node
carries the labels and extended resources `up --node-label/--node-resource` name (`node_settings`), and the
operator reads what it offers (`--read-nodes`: a Neuron model's Schedulable condition). `down` stops what
`up` started (the kubelet stops every pod process) and deletes nothing else.
`status` lists models, pods and their log files. `show_compiles` is what `up` in the foreground shows while
models compile.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, TextIO

from neuronfleet.operator import crd, spec
from neuronfleet.operator import status as operator_status

from .guard import admin_table, format_tokens, open_private, private_folder, write_private
from .node_settings import NodeSettings
from .node_settings import node_settings as _node_settings
from .ports import loopback_port, pool
from .tls import Access

MODELS = f"/apis/{spec.GROUP}/{spec.VERSION}/{spec.PLURAL}"  # the NeuronModels of every namespace
COMPILE_RETRY = 2.0  # seconds before `show_compiles` watches the models again (starting, stopping)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # in the foreground, each stops the fleet as Ctrl-C does
MODEL_FILE = "smollm2-135m-instruct.gguf"  # on the local-models claim (crds/samples/*-local-cpu*.yaml)
TOKENS = "tokens.csv"  # in the state folder: the API server's token file (guard.Tokens)
UMASK = 0o077  # what the processes `up` starts (API server, kubelet, pods, operator) create is theirs only


class LocalError(RuntimeError):
    """Local mode cannot do what was asked; the message says why and what to do."""


def _pids(state: Path) -> dict[str, int]:
    path = state / "pids.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _request(api: Access, path: str, method: str = "GET", body: Any = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(api.url + path, data=data, method=method, headers=api.headers())
    with urllib.request.urlopen(req, timeout=10, context=api.context) as r:
        return json.loads(r.read())


def _api(state: Path) -> Access:
    """The running fleet's API server, as its kubeconfig reaches it (URL, CA, token)."""
    if not ((state / "url").is_file() and (state / "url").read_text().strip()):
        raise LocalError(f"no local fleet in {state}: run `neuronfleet up --state {state}` first")
    try:
        return Access.read(state / "kubeconfig")
    except (OSError, ValueError) as e:
        raise LocalError(f"the local fleet's kubeconfig cannot be read: {e}") from None


def node_settings(labels: list[str], resources: list[str]) -> NodeSettings:
    """The local node's labels (`KEY=VALUE`) and extended resources (`NAME=COUNT`), or a LocalError saying
    what is wrong with one."""
    try:
        return _node_settings(labels, resources)
    except ValueError as e:
        raise LocalError(str(e)) from None


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def up(state: Path, detach: bool, say=print, node: NodeSettings | None = None) -> int:
    """Start the fleet, its node advertising what `node` says. In the foreground it runs until Ctrl-C,
    SIGTERM or SIGHUP (0), or until the API server or the operator exits (1), then stops everything it
    started, as `down` does; a failed start stops what it started too."""
    state = state.resolve()
    running = {name: pid for name, pid in _pids(state).items() if _alive(pid)}
    if running:
        raise LocalError(
            f"a local fleet already runs from {state} (pids {sorted(running.values())}); "
            f"`neuronfleet down --state {state}` stops it"
        )
    previous = {} if detach else {sig: signal.signal(sig, _interrupt) for sig in STOP_SIGNALS}
    try:
        try:
            _start(state, say, node or NodeSettings())
            if detach:
                return 0
            say("[up] running in the foreground; Ctrl-C (or SIGTERM, SIGHUP) stops everything")
            pids = _pids(state)
            while all(_alive(pid) for pid in pids.values()):
                for pid in pids.values():
                    _reap(pid)
                time.sleep(0.5)
            say("[up] a process of the fleet exited (see its log); stopping the rest")
            code = 1
        except KeyboardInterrupt as e:
            _hold(previous)  # before it says so: a second signal sent on reading "stopping" is ignored
            say(f"[up] {e.args[0] if e.args else 'SIGINT'}: stopping")
            code = 0
        except BaseException:
            _hold(previous)
            down(state, say)
            raise
        _hold(previous)
        down(state, say)
        return code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _hold(installed: dict) -> None:
    """Ignore further stop signals while stopping (a second one must not cut the clean-up short)."""
    for sig in installed:
        signal.signal(sig, signal.SIG_IGN)


def _start(state: Path, say, node: NodeSettings) -> None:
    """Start the API server with the process kubelet, install the CRD and the models' claim, start the
    operator; every pid goes to the state folder as soon as it exists."""
    started = time.monotonic()
    private_folder(state)
    private_folder(state / "logs")
    (state / "url").unlink(missing_ok=True)
    write_private(state / TOKENS, format_tokens(admin_table()))  # a fresh token: older kubeconfigs' are void
    say(f"[up] state folder {state}")
    api = subprocess.Popen(
        [
            sys.executable,
            "-P",
            "-m",
            "neuronfleet.localcluster.apiserver",
            "--kubeconfig",
            str(state / "kubeconfig"),
            "--token-auth-file",
            str(state / TOKENS),
            "--tls-cert-file",  # (made by the first `up`, kept: kubeconfigs copied since trust its CA)
            str(state / "apiserver.crt"),
            "--tls-private-key-file",
            str(state / "apiserver.key"),
            "--ready-file",
            str(state / "url"),
            "--kubelet-state",
            str(state / "node"),
            "--data-file",
            str(state / "objects.json"),  # `down` deletes nothing: the next `up` has every object again
            *(f"--node-label={k}={v}" for k, v in node.labels.items()),
            *(f"--node-resource={k}={v}" for k, v in node.resources.items()),
        ],
        stdout=open_private(state / "logs" / "apiserver.log"),  # (the child's, for its life)
        stderr=subprocess.STDOUT,
        start_new_session=True,
        umask=UMASK,
    )
    pids = {"apiserver": api.pid}
    (state / "pids.json").write_text(json.dumps(pids))
    deadline = time.monotonic() + 60
    while not ((state / "url").is_file() and (state / "url").read_text()):
        if api.poll() is not None or time.monotonic() > deadline:
            raise LocalError(f"the emulated API server did not start; see {state / 'logs' / 'apiserver.log'}")
        time.sleep(0.1)
    api = _api(state)
    say(f"[up] emulated API server and process kubelet on {api.url} ({time.monotonic() - started:.1f} s)")
    _install_crd(api)
    _pods_stopped(api)
    _local_models(api, state)
    say(f"[up] NeuronModel CRD installed; claim default/local-models holds {MODEL_FILE}")
    wake, metrics = _kept_port(state / "wake-port"), loopback_port()
    operator = subprocess.Popen(
        [
            shutil.which("neuronfleet") or str(Path(sys.executable).parent / "neuronfleet"),
            "operator",
            "--kubeconfig",
            str(state / "kubeconfig"),
            "--wake-port",
            str(wake),
            "--wake-host",
            "127.0.0.1",
            "--wake-url",
            f"http://127.0.0.1:{wake}",
            "--metrics-port",
            str(metrics),
            "--metrics-host",
            "127.0.0.1",
            "--standalone",
            "--all-namespaces",
            "--read-nodes",  # (what the node offers: a Neuron model's Schedulable condition)
        ],
        stdout=open_private(state / "logs" / "operator.log"),  # (the child's, for its life)
        stderr=subprocess.STDOUT,
        start_new_session=True,
        umask=UMASK,
    )
    pids["operator"] = operator.pid
    (state / "pids.json").write_text(json.dumps(pids))
    (state / "operator-metrics-url").write_text(f"http://127.0.0.1:{metrics}/metrics")
    say(
        f"[up] operator started (log {state / 'logs' / 'operator.log'}; metrics http://127.0.0.1:{metrics}/metrics)"
    )
    k = f"kubectl --kubeconfig {state / 'kubeconfig'} --cache-dir {state / 'kubectl-cache'}"
    say("[up] ready. Try:")
    say(f"  {k} apply -f crds/samples/smollm2-135m-local-cpu.yaml")
    say(f"  {k} get neuronmodels -w")
    say(f"  neuronfleet status --state {state}")


def _install_crd(api: Access) -> None:
    """The NeuronModel CRD of this version: created, or put in place of the one an earlier `up` installed
    (the API server keeps its objects over `down`)."""
    crds = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    wanted = crd.build_crd()
    try:
        _request(api, crds, "POST", wanted)
    except urllib.error.HTTPError as e:
        if e.code != 409:
            raise
        name = wanted["metadata"]["name"]
        held = _request(api, f"{crds}/{name}")
        wanted["metadata"]["resourceVersion"] = held["metadata"]["resourceVersion"]
        _request(api, f"{crds}/{name}", "PUT", wanted)


def _kept_port(kept: Path) -> int:
    """The port an earlier `up` used for this (`kept`), where it is free still, else a new one, kept: the
    wake endpoint's URL is in the routers' pod templates, so a new port at every `up` would roll them."""
    with contextlib.suppress(OSError, ValueError):
        port = int(kept.read_text())
        if port in pool():
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
            return port
    port = loopback_port()
    kept.write_text(str(port))
    return port


def _pods_stopped(api: Access) -> None:
    """The models an earlier `up` left: their pods stopped with it (a restart keeps no pod), and start again
    now, so no status may count them ready, nor a pod reached: written before the operator starts, its first
    pass sees a deploy, not a loss (`status.pods_stopped`)."""
    models = f"/apis/{spec.GROUP}/{spec.VERSION}/neuronmodels"
    for model in _request(api, models).get("items") or []:
        status = model.get("status") or {}
        stopped = operator_status.pods_stopped(status)
        if stopped == status:
            continue
        meta = model["metadata"]
        path = f"/apis/{spec.GROUP}/{spec.VERSION}/namespaces/{meta['namespace']}/neuronmodels/{meta['name']}"
        body = {**model, "status": stopped}
        with contextlib.suppress(urllib.error.HTTPError):  # (changed meanwhile: the operator recomputes it)
            _request(api, f"{path}/status", "PUT", body)


def _local_models(api: Access, state: Path) -> None:
    """The claim the local samples read their model from, holding the SmolLM2 GGUF file."""
    from neuronfleet.runtime.model.gguf_import import default_gguf_path

    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "local-models", "namespace": "default"},
        "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}},
    }
    try:
        _request(api, "/api/v1/namespaces/default/persistentvolumeclaims", "POST", claim)
    except urllib.error.HTTPError as e:
        if e.code != 409:
            raise
    folder = state / "node" / "volumes" / "default" / "local-models"
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / MODEL_FILE
    if not target.exists():
        target.symlink_to(default_gguf_path())


def down(state: Path, say=print) -> int:
    state = state.resolve()
    pids = _pids(state)
    if not pids:
        say(f"[down] nothing runs from {state}")
        return 0
    for name in ("operator", "apiserver"):  # the operator first; the API server's kubelet stops the pods
        pid = pids.get(name)
        if pid is None or not _alive(pid):
            continue
        os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while _alive(pid) and time.monotonic() < deadline:
            _reap(pid)
            time.sleep(0.1)
        if _alive(pid):
            os.killpg(pid, signal.SIGKILL)
            _reap(pid)
        say(f"[down] {name} (pid {pid}) stopped")
    (state / "pids.json").unlink(missing_ok=True)
    (state / "url").unlink(missing_ok=True)
    (state / "operator-metrics-url").unlink(missing_ok=True)
    return 0


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def status(state: Path, say=print) -> int:
    state = state.resolve()
    api = _api(state)
    models = _request(api, MODELS)["items"]
    pods = _request(api, "/api/v1/pods")["items"]
    say(f"local fleet in {state}: API server {api.url}, kubeconfig {state / 'kubeconfig'}")
    say("models:")
    for m in models:
        s = m.get("status") or {}
        name = f"{m['metadata']['namespace']}/{m['metadata']['name']}"
        say(f"  {name}: {s.get('phase', '-')} {s.get('endpoint', '')}")
    say("pods:")
    for p in pods:
        s = p.get("status") or {}
        c = (s.get("containerStatuses") or [{}])[0]
        name = f"{p['metadata']['namespace']}_{p['metadata']['name']}"
        ready, restarts = c.get("ready", False), c.get("restartCount", 0)
        # one CRI log file per container instance (kubectl logs reads them)
        log_file = state / "node" / "logs" / f"{name}_{p['metadata']['uid']}"
        say(f"  {name}: {s.get('phase', '-')} ready={ready} restarts={restarts} logs {log_file}")
    return 0


def show_compiles(state: Path, stream: TextIO, stopped: threading.Event | None = None) -> None:
    """Each compiling model's status.compileProgress (what the operator read from its compile pod's log) as a
    bar on a terminal, else a plain line per change, until `stopped` is set (checked between watches). It
    follows a watch of the NeuronModels, so every progress the operator wrote is shown, however often."""
    from neuronfleet.contract import CompileProgress
    from neuronfleet.runtime.progress import Console

    shown: dict[str, tuple[Console, dict]] = {}

    def show(name: str, progress: dict) -> None:
        console, before = shown.get(name) or (Console(stream, plain_interval=0, label=name), {})
        if progress and progress != before:
            console.show(CompileProgress.model_validate(progress), final=False)
        elif before and not progress:  # compiled, failed or deleted: the bar's line ends
            console.show(CompileProgress.model_validate(before), final=True)
        shown[name] = console, progress

    stopped = stopped or threading.Event()
    while not stopped.is_set():
        try:
            api = _api(state)
        except LocalError:  # not started yet, or stopping
            stopped.wait(COMPILE_RETRY)
            continue
        # without a resourceVersion a watch first lists every model as ADDED: one that changed while no watch
        # was open is shown from its current status
        watch = urllib.request.Request(
            f"{api.url}{MODELS}?watch=true&timeoutSeconds=60", headers=api.headers()
        )
        try:
            with urllib.request.urlopen(watch, timeout=90, context=api.context) as events:
                for line in events:
                    event = json.loads(line)
                    if event["type"] == "ERROR":  # (none comes without a resourceVersion) list again
                        stopped.wait(COMPILE_RETRY)
                        break
                    if stopped.is_set():
                        break
                    model = event["object"]
                    name = f"{model['metadata']['namespace']}/{model['metadata']['name']}"
                    status = {} if event["type"] == "DELETED" else model.get("status") or {}
                    show(name, status.get("compileProgress") or {})
        except (OSError, ValueError):  # starting or stopping
            stopped.wait(COMPILE_RETRY)
