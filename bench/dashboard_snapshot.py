"""The chart's Grafana dashboard drawn from live local-mode data, through a real Prometheus.

Grafana is not installable here; Prometheus is (Debian's `prometheus` package, 2.42: `apt-get install -y
prometheus`; for this script only, never for CI). The script starts local mode (`neuronfleet up --detach` in
a temporary state folder, pods with --threads torch threads), starts Prometheus on a loopback port with a
scrape interval of --scrape seconds, scraping what the chart's PodMonitor and ServiceMonitor would: every
serving pod's `http` port (found in the EndpointSlices, rewritten into a file_sd file as pods come and go,
with the pod's namespace and its neuronfleet.dev/role label as `namespace` and `role`) and the operator's
metrics port (honor_labels, as the chart's ServiceMonitor). It then `kubectl apply`s the disaggregated local
sample (crds/samples/smollm2-135m-local-cpu-disaggregated.yaml: prefill, decode and router pods), waits until
it is Ready, and drives streamed chat requests at its endpoint: idle, --clients clients back to back (every
other request repeats a question already asked, for the prefix cache), idle again. Then it evaluates every
panel's queries (but the Neuron hardware row's: local mode runs no Neuron exporter) of
charts/neuronfleet/dashboards/neuronfleet.json over the whole run through Prometheus'
HTTP API (/api/v1/query_range; $namespace and $model set to the sample's, $__rate_interval to 4 scrape
intervals as Grafana sets it, $__range to the run's length) and draws them as a grid of panels, in the
dashboard's order, titles and legends, into bench/results/dashboard.png (and the raw series into
bench/results/dashboard.json).

    bash bench/setup_llamacpp.sh   # the benchmarks' own environment (matplotlib), once
    apt-get install -y prometheus  # Prometheus 2.42 (Debian 12)
    bench/.venv-llamacpp/bin/python bench/dashboard_snapshot.py [--clients 4 --load 150]

Not a test: the values depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from local_mode import RESULTS, ROOT, LocalMode, neuronfleet, start_main
from prompts import QUESTIONS

SAMPLE = ROOT / "crds" / "samples" / "smollm2-135m-local-cpu-disaggregated.yaml"
MODEL, NAMESPACE = "smollm2-pd", "default"
DASHBOARD = ROOT / "charts" / "neuronfleet" / "dashboards" / "neuronfleet.json"
NEURON_ROW = "Neuron hardware"  # its panels read the Neuron exporter, which local mode does not run


# ---- Prometheus -----------------------------------------------------------------------------------------


def targets(local: LocalMode) -> list[dict]:
    """file_sd groups: each serving pod's `http` address, labelled as the chart's PodMonitor labels it."""
    pods = {p["metadata"]["name"]: p for p in local.get("pods", "-A", "-l", "neuronfleet.dev/model")["items"]}
    out = []
    for s in local.get("endpointslices", "-A")["items"]:
        port = next((p["port"] for p in s.get("ports") or [] if p.get("name") == "http"), None)
        for e in s.get("endpoints") or []:
            pod = pods.get((e.get("targetRef") or {}).get("name"))
            if port is None or pod is None:
                continue
            labels = pod["metadata"]["labels"]
            if labels.get("neuronfleet.dev/role") not in ("unified", "prefill", "decode", "router"):
                continue
            out.append(
                {
                    "targets": [f"{e['addresses'][0]}:{port}"],
                    "labels": {
                        "namespace": pod["metadata"]["namespace"],
                        "pod": pod["metadata"]["name"],
                        "role": labels["neuronfleet.dev/role"],
                        "neuronmodel": labels["neuronfleet.dev/model"],
                    },
                }
            )
    return sorted({json.dumps(t, sort_keys=True): t for t in out}.values(), key=json.dumps)


def start_prometheus(work: Path, operator_url: str, scrape: float, port: int) -> subprocess.Popen:
    binary = shutil.which("prometheus")
    if binary is None:
        sys.exit("prometheus is missing: apt-get install -y prometheus (Debian 12: 2.42)")
    operator = urllib.parse.urlsplit(operator_url)
    (work / "pods.json").write_text("[]")
    config = {
        "global": {"scrape_interval": f"{scrape}s", "evaluation_interval": f"{scrape}s"},
        "scrape_configs": [
            {
                "job_name": "neuronfleet-models",
                "file_sd_configs": [{"files": [str(work / "pods.json")], "refresh_interval": "5s"}],
            },
            {
                "job_name": "neuronfleet-operator",
                "honor_labels": True,
                "static_configs": [{"targets": [operator.netloc]}],
            },
        ],
    }
    (work / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    log = open(work / "prometheus.log", "wb")  # noqa: SIM115 (the child's, for its life)
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={work / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--storage.tsdb.retention.time=1d",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2)
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"prometheus did not start; see {work / 'prometheus.log'}")
            time.sleep(0.5)


def query_range(port: int, expr: str, start: float, end: float, step: float) -> list[dict]:
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/query_range?{params}", timeout=60) as r:
        body = json.loads(r.read())
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body}")
    return body["data"]["result"]


def grafana(expr: str, rate_interval: str, range_: str) -> str:
    """The query as Grafana sends it: the dashboard's variables set to the sample's model."""
    for name, value in (
        ("$__rate_interval", rate_interval),
        ("$__range", range_),
        ("$namespace", NAMESPACE),
        ("$model", MODEL),
    ):
        expr = expr.replace(name, value)
    return expr


def legend(fmt: str, metric: dict) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m.group(1), ""), fmt) or json.dumps(metric)


# ---- load -----------------------------------------------------------------------------------------------


class Load:
    """`clients` threads sending streamed chat requests back to back until stopped."""

    def __init__(self, endpoint: str, clients: int, max_tokens: int) -> None:
        self.endpoint, self.max_tokens = endpoint, max_tokens
        self.stop, self.lock = threading.Event(), threading.Lock()
        self.answered = self.failed = 0
        self.threads = [threading.Thread(target=self.client, args=(i,), daemon=True) for i in range(clients)]

    def client(self, seed: int) -> None:
        rng = random.Random(seed)
        asked: list[str] = []
        while not self.stop.is_set():
            question = rng.choice(asked) if asked and rng.random() < 0.5 else rng.choice(QUESTIONS)
            asked.append(question)
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": question}],
                "stream": True,
                "max_tokens": self.max_tokens,
            }
            req = urllib.request.Request(
                self.endpoint + "/v1/chat/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(req, timeout=300) as r:
                    for _ in r:
                        pass
                with self.lock:
                    self.answered += 1
            except OSError:
                with self.lock:
                    self.failed += 1
                time.sleep(1)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=300)


# ---- the picture ----------------------------------------------------------------------------------------

UNITS = {
    "s": "seconds",
    "reqps": "requests/s",
    "ops": "per second",
    "percentunit": "share (0-1)",
    "short": "",
}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = result["panels"]
    cols = 3
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, 3.1 * rows), squeeze=False)
    t0 = result["start"]
    for ax, panel in zip(axes.flat, panels, strict=False):
        for series in panel["series"]:
            xs = [(t - t0) / 60 for t, _ in series["values"]]
            ax.plot(xs, [v for _, v in series["values"]], label=series["legend"], linewidth=1.2)
        ax.set_title(f"{panel['row']}: {panel['title']}", fontsize=10)
        ax.set_ylabel(UNITS.get(panel["unit"], panel["unit"]), fontsize=8)
        ax.tick_params(labelsize=7)
        ax.set_xlim(0, (result["end"] - t0) / 60)
        ax.set_ylim(0, 1.05) if panel["unit"] == "percentunit" else ax.set_ylim(bottom=0)
        for name, start, end in result["phases"]:
            if name == "load":
                ax.axvspan((start - t0) / 60, (end - t0) / 60, color="0.93", zorder=0)
        if panel["series"]:
            ax.legend(fontsize=6, loc="upper left")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="0.5")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("minutes since the model was applied (grey: the load)", fontsize=8)
    fig.suptitle(
        "neuronfleet dashboard (charts/neuronfleet/dashboards/neuronfleet.json), every panel's queries "
        f"through Prometheus {result['prometheus']} over live local-mode data: {MODEL} (disaggregated), "
        f"{result['clients']} clients, {result['answered']} answered, {result['failed']} failed",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=90)


# ---- run ------------------------------------------------------------------------------------------------


def wait(what: str, check, timeout: float) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(1)
    raise TimeoutError(f"{what}: not after {timeout:.0f} s")


def run(args, local: LocalMode, work: Path) -> dict:
    port = int(args.prometheus_port)
    prometheus = start_prometheus(
        work, (local.state / "operator-metrics-url").read_text().strip(), args.scrape, port
    )
    stop = threading.Event()

    def discover() -> None:  # what Prometheus' Kubernetes discovery does for the PodMonitor
        while not stop.is_set():
            try:
                text = json.dumps(targets(local))
                if (work / "pods.json").read_text() != text:
                    (work / "pods.json.tmp").write_text(text)
                    (work / "pods.json.tmp").rename(work / "pods.json")
            except (subprocess.CalledProcessError, OSError) as e:
                print(f"discovery: {e}", file=sys.stderr)
            stop.wait(3)

    threading.Thread(target=discover, daemon=True).start()
    try:
        start = time.time()
        local.kubectl("apply", "-f", str(SAMPLE))
        wait(
            "Ready",
            lambda: (local.get("nm", MODEL).get("status") or {}).get("phase") == "Ready",
            args.ready_timeout,
        )
        endpoint = local.get("nm", MODEL)["status"]["endpoint"]
        phases = []
        t = time.time()
        time.sleep(args.idle)
        phases.append(("idle", t, time.time()))
        t = time.time()
        with Load(endpoint, args.clients, args.max_tokens) as load:
            time.sleep(args.load)
        phases.append(("load", t, time.time()))
        t = time.time()
        time.sleep(args.idle)
        phases.append(("idle", t, time.time()))
        end = time.time()
        time.sleep(2 * args.scrape)  # the last scrape in
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/status/buildinfo", timeout=10) as r:
            version = json.loads(r.read())["data"]["version"]
        rate_interval = f"{max(4 * args.scrape, 2 * args.scrape)}s"  # Grafana: max(4 * scrape, step + scrape)
        range_ = f"{round(end - start)}s"
        dashboard = json.loads(DASHBOARD.read_text())
        panels, row = [], ""
        for panel in dashboard["panels"]:
            if panel["type"] == "row":
                row = panel["title"]
                continue
            if row == NEURON_ROW:  # the Neuron exporter's metrics: local mode runs no Neuron hardware
                continue
            series = []
            for target in panel["targets"]:
                expr = grafana(target["expr"], rate_interval, range_)
                for s in query_range(port, expr, start, end, args.step):
                    values = [
                        (float(x), float(v)) for x, v in s["values"] if v not in ("NaN", "+Inf", "-Inf")
                    ]
                    series.append(
                        {
                            "legend": legend(target.get("legendFormat", ""), s["metric"]),
                            "query": expr,
                            "values": values,
                        }
                    )
            panels.append(
                {
                    "row": row,
                    "title": panel["title"],
                    "unit": panel["fieldConfig"]["defaults"]["unit"],
                    "series": series,
                }
            )
        return {
            "start": start,
            "end": end,
            "phases": phases,
            "prometheus": version,
            "clients": args.clients,
            "answered": load.answered,
            "failed": load.failed,
            "scrape_seconds": args.scrape,
            "rate_interval": rate_interval,
            "panels": panels,
        }
    finally:
        stop.set()
        prometheus.terminate()
        prometheus.wait(timeout=60)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--load", type=float, default=150, help="seconds of load")
    p.add_argument("--idle", type=float, default=30, help="seconds without load before and after")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--scrape", type=float, default=2, help="Prometheus' scrape interval, seconds")
    p.add_argument("--step", type=float, default=4, help="query_range step, seconds")
    p.add_argument("--prometheus-port", type=int, default=19090)
    p.add_argument("--threads", default="1", help="torch threads per pod (OMP_NUM_THREADS)")
    p.add_argument("--ready-timeout", type=float, default=1200)
    p.add_argument("--plot-only", metavar="JSON", help="draw the PNG of a results JSON again; run nothing")
    args = p.parse_args(argv)
    if start_main(p, args, plot):
        return 0
    work = Path(tempfile.mkdtemp(prefix="dashboard-snapshot-"))
    state = work / "state"
    neuronfleet("up", "--state", str(state), "--detach", env={**os.environ, "OMP_NUM_THREADS": args.threads})
    try:
        result = run(args, LocalMode(state), work)
    finally:
        neuronfleet("down", "--state", str(state))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "dashboard.json").write_text(json.dumps(result) + "\n")
    plot(result, RESULTS / "dashboard.png")
    empty = [f"{p['row']}: {p['title']}" for p in result["panels"] if not p["series"]]
    print(f"answered {result['answered']}, failed {result['failed']}; panels without data: {empty or 'none'}")
    print(f"wrote {RESULTS / 'dashboard.json'} and {RESULTS / 'dashboard.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
