"""The cluster suite's options and its cluster: a real one (`--kubeconfig K --sample FILE ...`: the chart is
installed first, unless `--no-chart`), else local mode (`neuronfleet up`, the cpu samples), which is how CI
runs the same tests.

    pytest tests/cluster --kubeconfig ~/.kube/config --sample crds/samples/llama-3.1-8b-vllm-inf2.yaml \\
        --chart-values my-values.yaml [--ready-timeout 7200] [--endpoint URL] [--no-chart]
    # vLLM prefill/decode on Trn2, the KV cache over NIXL on EFA, the router speaking the plugin's protocol:
    pytest tests/cluster --kubeconfig ~/.kube/config --chart-values my-values.yaml \
        --sample crds/samples/llama-3.3-70b-vllm-trn2-disaggregated.yaml
    # our runtime over TorchNeuron on Trn2 (experimental: what proves it; runtimeImages.neuron in the values)
    pytest tests/cluster --kubeconfig ~/.kube/config --chart-values my-values.yaml \
        --sample crds/samples/smollm2-1.7b-embedded-trn2.yaml

On a real cluster the chart is installed with `helm upgrade --install` when a `helm` binary is on PATH, else
rendered by Helm's own engine (helm-python-sdk, as tests/unit/test_chart.py does) and applied with kubectl;
it is uninstalled afterwards (its CRD stays, as Helm leaves a chart's crds/: deleting it would delete every
NeuronModel of the cluster). In local mode `neuronfleet up` is the installation (the CRD and the operator as
a process): the process kubelet cannot run the operator image's pod (it has no service-account credentials
for pods), so the chart itself is proven by tests/unit/test_chart.py there, not here.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from support import (
    CEILING,
    HTTP_TIMEOUT,
    ROOT,
    Kubectl,
    LocalCluster,
    Process,
    free_port,
    local_mode,
    wait_until,
)

from neuronfleet.operator import validation

CHART = ROOT / "charts" / "neuronfleet"
RELEASE, RELEASE_NAMESPACE = "neuronfleet", "neuronfleet-system"
LOCAL_SAMPLES = sorted((ROOT / "crds" / "samples").glob("*-local-cpu*.yaml"))
REAL_READY_TIMEOUT = 7200.0  # a first compile of a large model on Neuron takes most of an hour, or more
GONE_TIMEOUT = 900.0  # the garbage collector and the pods' grace periods (a real cluster)
# what the operator creates for a model, each labelled neuronfleet.dev/model=NAME (events aside)
CHILD_KINDS = (
    "deployments,services,jobs,pods,configmaps,secrets,persistentvolumeclaims,poddisruptionbudgets,"
    "networkpolicies"
)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("cluster", "neuronfleet's cluster suite (tests/cluster)")
    group.addoption("--kubeconfig", help="run tests/cluster against this cluster (default: local mode)")
    group.addoption(
        "--sample", action="append", default=[], help="a NeuronModel manifest to run (repeatable); "
        "default in local mode: the cpu samples; required with --kubeconfig",
    )  # fmt: skip
    group.addoption(
        "--ready-timeout", type=float, default=None,
        help=f"seconds a model may take to become Ready (default {REAL_READY_TIMEOUT:.0f} on a cluster, "
        f"{CEILING:.0f} in local mode)",
    )  # fmt: skip
    group.addoption("--chart-values", help="a values file for the chart (images, watch mode, ...)")
    group.addoption("--no-chart", action="store_true", help="the operator is installed already")
    group.addoption(
        "--endpoint", help="base URL that reaches the model's Service from here (an Ingress or a "
        "LoadBalancer); default: kubectl port-forward to it",
    )  # fmt: skip


@dataclass(frozen=True)
class Settings:
    kubeconfig: Path | None
    samples: list[Path]
    ready_timeout: float
    chart_values: Path | None
    install_chart: bool
    endpoint: str | None

    @property
    def local(self) -> bool:
        return self.kubeconfig is None


def settings(config: pytest.Config) -> Settings:
    """The options (registered only when pytest loads this file at start, i.e. when tests/cluster is named
    on the command line; a plain `pytest` of the whole tree runs local mode's defaults)."""

    def option(name: str, default=None):
        return config.getoption(name, default=default) or default

    kubeconfig = option("--kubeconfig")
    samples = [Path(s).resolve() for s in option("--sample", [])]
    if kubeconfig and not samples:
        raise pytest.UsageError("--kubeconfig needs --sample FILE (which NeuronModel to run there)")
    chart_values = option("--chart-values")
    return Settings(
        kubeconfig=Path(kubeconfig).expanduser().resolve() if kubeconfig else None,
        samples=samples or LOCAL_SAMPLES,
        ready_timeout=option("--ready-timeout") or (REAL_READY_TIMEOUT if kubeconfig else CEILING),
        chart_values=Path(chart_values).resolve() if chart_values else None,
        install_chart=not option("--no-chart", False),
        endpoint=option("--endpoint"),
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "sample" in metafunc.fixturenames:
        samples = settings(metafunc.config).samples
        metafunc.parametrize("sample", samples, ids=[p.name for p in samples])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test here may wait `--ready-timeout` for a compile, beyond pytest's per-test timeout (pyproject)."""
    here = Path(__file__).parent
    s = settings(config)
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.timeout(s.ready_timeout + GONE_TIMEOUT + CEILING))
            if s.local:
                item.add_marker(pytest.mark.real_model)


# ---- the cluster ------------------------------------------------------------------------------------------


class Cluster:
    """What the suite asks of a cluster: kubectl, waits, the model's endpoint and a pod's metrics."""

    local: bool

    def __init__(self, kubectl: Kubectl, ready_timeout: float) -> None:
        self.kubectl, self.ready_timeout = kubectl, ready_timeout

    def get(self, *args: str) -> dict:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def wait(self, what: str, check, ceiling: float) -> object:
        raise NotImplementedError

    def diagnose(self, namespace: str) -> str:
        run = self.kubectl("get", "events", "-n", namespace, "--sort-by=.lastTimestamp", check=False)
        return run.stdout[-4000:]

    @contextlib.contextmanager
    def endpoint(self, model: dict) -> Iterator[str]:
        raise NotImplementedError

    def pod_metrics(self, pod: dict, port: int) -> str:
        """A pod's /metrics (Prometheus text) on its container port `port`."""
        raise NotImplementedError

    def pod_metric(self, pod: dict, port: int, name: str, **labels: str) -> float:
        """One sample of a pod's /metrics, summed over the series matching `labels` (0 when none)."""
        from prometheus_client.parser import text_string_to_metric_families

        return sum(
            s.value
            for family in text_string_to_metric_families(self.pod_metrics(pod, port))
            for s in family.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )

    def leftovers(self, namespace: str, model: str) -> list[str]:
        """`Kind/name` of every object still carrying the model's label (what the operator made for it)."""
        found = self.get(CHILD_KINDS, "-n", namespace, "-l", f"neuronfleet.dev/model={model}")["items"]
        return [f"{o['kind']}/{o['metadata']['name']}" for o in found]


class LocalMode(Cluster):
    """`neuronfleet up` in a state folder: the model's endpoint is local (status.endpoint), each pod's
    ports are local ports (its EndpointSlices say which)."""

    local = True

    def __init__(self, state: Path, ready_timeout: float) -> None:
        self.fleet = LocalCluster(state)
        super().__init__(self.fleet.kubectl, ready_timeout)

    def wait(self, what: str, check, ceiling: float) -> object:
        return wait_until(
            check, what, progress=self.fleet.logged_bytes, diagnose=self.fleet.logs, interval=0.5,
            ceiling=ceiling,
        )  # fmt: skip

    def diagnose(self, namespace: str) -> str:
        return super().diagnose(namespace) + "\n" + self.fleet.logs()

    @contextlib.contextmanager
    def endpoint(self, model: dict) -> Iterator[str]:
        yield model["status"]["endpoint"]

    def pod_metrics(self, pod: dict, port: int) -> str:
        import urllib.request

        slices = self.get("endpointslices", "-n", pod["metadata"]["namespace"])["items"]
        for s in slices:
            if any((e.get("targetRef") or {}).get("name") == pod["metadata"]["name"] for e in s["endpoints"]):
                local_port = next(p["port"] for p in s["ports"] if p.get("name") == "http")
                url = f"http://{s['endpoints'][0]['addresses'][0]}:{local_port}/metrics"
                with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT) as r:
                    return r.read().decode()
        raise AssertionError(f"no EndpointSlice names pod {pod['metadata']['name']} (is it ready?)")


class RealCluster(Cluster):
    """A cluster reached through a kubeconfig: the endpoint through `kubectl port-forward` (or --endpoint),
    a pod's metrics through the API server's pod proxy."""

    local = False

    def __init__(self, kubectl: Kubectl, ready_timeout: float, endpoint: str | None, logs: Path) -> None:
        super().__init__(kubectl, ready_timeout)
        self.fixed_endpoint, self.logs = endpoint, logs

    def wait(self, what: str, check, ceiling: float) -> object:
        return wait_until(check, what, ceiling=ceiling, interval=10.0)

    @contextlib.contextmanager
    def endpoint(self, model: dict) -> Iterator[str]:
        if self.fixed_endpoint:
            yield self.fixed_endpoint.rstrip("/")
            return
        meta, port = model["metadata"], model["spec"].get("serving", {}).get("port", 8000)
        local = free_port()
        # https://kubernetes.io/docs/reference/kubectl/generated/kubectl_port-forward/ (kubectl 1.32):
        # "Forwarding from 127.0.0.1:LOCAL -> PORT" once it listens
        forward = Process(
            [*self.kubectl_args(), "port-forward", "-n", meta["namespace"], f"service/{meta['name']}",
             f"{local}:{port}"], self.logs / f"port-forward-{meta['name']}.log",
        )  # fmt: skip
        try:
            forward.wait_until(lambda: _listening(local), f"kubectl port-forward to service/{meta['name']}")
            yield f"http://127.0.0.1:{local}"
        finally:
            forward.stop()

    def kubectl_args(self) -> list[str]:
        return [shutil.which("kubectl") or "kubectl", "--kubeconfig", str(self.kubectl.kubeconfig),
                "--cache-dir", str(self.kubectl.cache_dir)]  # fmt: skip

    def pod_metrics(self, pod: dict, port: int) -> str:
        # the API server's proxy to a pod port: GET /api/v1/namespaces/NS/pods/NAME:PORT/proxy/PATH
        # (https://kubernetes.io/docs/tasks/access-application-cluster/access-cluster-services/)
        ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        return self.kubectl(
            "get", "--raw", f"/api/v1/namespaces/{ns}/pods/{name}:{port}/proxy/metrics"
        ).stdout


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


# ---- the chart on a real cluster --------------------------------------------------------------------------


@contextlib.contextmanager
def chart_installed(kubectl: Kubectl, values_file: Path | None, logs: Path) -> Iterator[None]:
    """The chart as its README says: `helm upgrade --install` when helm is here, else Helm's engine renders
    it and kubectl applies its crds/ and templates; then the operator's rollout; uninstalled afterwards."""
    values = yaml.safe_load(values_file.read_text()) if values_file else {}
    helm = shutil.which("helm")
    base = ["--kubeconfig", str(kubectl.kubeconfig)]
    if helm:
        args = [
            helm,
            "upgrade",
            "--install",
            RELEASE,
            str(CHART),
            "-n",
            RELEASE_NAMESPACE,
            "--create-namespace",
        ]
        args += [*base, "--wait", "--timeout", "15m", *(["-f", str(values_file)] if values_file else [])]
        subprocess.run(args, check=True, timeout=1200)
    else:
        for crd in sorted((CHART / "crds").glob("*.yaml")):
            kubectl("apply", "--server-side", "-f", str(crd))
            name = yaml.safe_load(crd.read_text())["metadata"]["name"]
            kubectl("wait", "--for", "condition=Established", f"crd/{name}", "--timeout=5m")
        if kubectl("get", "namespace", RELEASE_NAMESPACE, check=False).returncode != 0:
            kubectl("create", "namespace", RELEASE_NAMESPACE)
        kubectl("apply", "-n", RELEASE_NAMESPACE, "-f", "-", stdin=rendered_chart(values))
    deployment = f"deployment/{RELEASE}"  # the chart's fullname for release `neuronfleet`
    kubectl("rollout", "status", "-n", RELEASE_NAMESPACE, deployment, "--timeout=15m")
    try:
        yield
    finally:
        if helm:
            subprocess.run(
                [helm, "uninstall", RELEASE, "-n", RELEASE_NAMESPACE, *base, "--wait"], timeout=900
            )
        else:
            kubectl("delete", "-n", RELEASE_NAMESPACE, "--ignore-not-found", "--wait", "-f", "-",
                    stdin=rendered_chart(values), check=False)  # fmt: skip


def rendered_chart(values: dict) -> str:
    """The chart's templates rendered by Helm's engine for release `neuronfleet` (a YAML stream)."""
    import helm_python as helm  # helm-python-sdk, installed by scripts/setup.sh

    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values, name=RELEASE, namespace=RELEASE_NAMESPACE, is_install=True)
    docs = [
        doc
        for path, text in sorted(manifests.items())
        if path.endswith((".yaml", ".yml"))
        for doc in yaml.safe_load_all(text)
        if doc
    ]
    # in the order Helm installs the chart's kinds (helm/helm@release-3.0:pkg/releaseutil/kind_sorter.go,
    # InstallOrder): the ServiceAccount and its RBAC before the Deployment whose pods use them
    order = [
        "PodDisruptionBudget",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
    ]
    order += ["Service", "Deployment"]
    return yaml.safe_dump_all(
        sorted(docs, key=lambda d: order.index(d["kind"]) if d["kind"] in order else 99)
    )


# ---- fixtures ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def cluster_settings(request: pytest.FixtureRequest) -> Settings:
    return settings(request.config)


@pytest.fixture(scope="module")
def cluster(cluster_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The cluster for this module's tests (local mode: stopped right after them, not left idle beside the
    rest of a full run)."""
    s = cluster_settings
    state = tmp_path_factory.mktemp("cluster")
    if s.local:
        with local_mode(state, lambda folder: LocalMode(folder, s.ready_timeout)) as cluster:
            yield cluster
        return
    assert s.kubeconfig is not None
    kubectl = Kubectl(s.kubeconfig, state / "kubectl-cache")
    real = RealCluster(kubectl, s.ready_timeout, s.endpoint, state)
    with chart_installed(kubectl, s.chart_values, state) if s.install_chart else contextlib.nullcontext():
        yield real


@pytest.fixture()
def applied(cluster: Cluster, sample: Path) -> Iterator[dict]:
    """The sample, checked as `neuronfleet validate` does (the operator would refuse it too) and applied in
    its namespace (created if missing); deleted afterwards whatever happened (a failed run must not leave
    Neuron nodes busy)."""
    obj = yaml.safe_load(sample.read_text())
    report = validation.check(obj)
    assert report.ok, f"{sample.name} is refused: {report.errors}"
    if cluster.local and obj["spec"]["neuron"]["instanceType"] != "cpu":
        pytest.fail(f"{sample.name}: local mode serves instanceType cpu only; give --kubeconfig of a cluster "
                    f"with {obj['spec']['neuron']['instanceType']} nodes")  # fmt: skip
    obj["metadata"].setdefault("namespace", "default")
    namespace, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
    if cluster.kubectl("get", "namespace", namespace, check=False).returncode != 0:
        cluster.kubectl("create", "namespace", namespace)
    ref = (obj["spec"].get("model") or {}).get("secretRef")
    if ref and cluster.kubectl("get", "secret", ref["name"], "-n", namespace, check=False).returncode != 0:
        pytest.fail(
            f"{sample.name} reads the model's token from Secret {namespace}/{ref['name']}, which does not "
            f"exist: kubectl -n {namespace} create secret generic {ref['name']} "
            f"--from-literal={ref.get('key', 'token')}=$HF_TOKEN"
        )
    cluster.kubectl("apply", "-n", namespace, "-f", str(sample))
    try:
        yield obj
    finally:
        cluster.kubectl("delete", "neuronmodel", name, "-n", namespace, "--ignore-not-found", "--wait=false",
                        check=False)  # fmt: skip
