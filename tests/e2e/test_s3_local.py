"""Models from S3 in local mode (the real operator, kubelet, runtime and `kubectl`), against a real S3 API
server (moto's server mode on a free loopback port) that the compile pods reach through AWS_ENDPOINT_URL and
the default credential chain, as a pod on EKS reaches S3 with its ServiceAccount's role:
- the real SmolLM2 GGUF uploaded to a bucket: a NeuronModel with its s3:// URI compiles, becomes Ready and
  answers a chat;
- a missing bucket and a missing key are each the compile's reason in `kubectl get neuronmodel -o yaml`
  (CompileFailed, `model source unavailable: s3://...: ...` saying what would fix it); the missing key is
  tried again by itself (status.compileRetryAt) and, once the object is uploaded, the model becomes Ready with
  no change to its spec."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import urllib.request
from pathlib import Path

import boto3
import pytest
import yaml
from support import HTTP_TIMEOUT, ROOT, Process, free_port, local_mode

from neuronfleet.runtime.gguf_import import default_gguf_path

SAMPLE = ROOT / "crds" / "samples" / "smollm2-135m-local-cpu.yaml"
KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    server = Process(
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)], log
    )

    def answers() -> bool:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
        return False

    try:
        server.wait_until(answers, "moto_server to listen")
        url = f"http://127.0.0.1:{port}"
        client = boto3.client("s3", endpoint_url=url, **{k.lower(): v for k, v in KEYS.items() if "KEY" in k},
                              region_name="us-east-1")  # fmt: skip
        client.create_bucket(Bucket="models")
        client.upload_file(str(default_gguf_path()), "models", "smollm2/smollm2-135m-instruct.gguf")
        yield client, url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def local(s3, tmp_path_factory):
    _, url = s3
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update({**KEYS, "AWS_ENDPOINT_URL": url})  # what every pod of the local kubelet inherits
    with local_mode(tmp_path_factory.mktemp("local"), env=env) as cluster:
        yield cluster


def apply(local, name: str, uri: str) -> None:
    manifest = yaml.safe_load(SAMPLE.read_text())
    manifest["metadata"]["name"] = name
    manifest["spec"]["model"]["uri"] = uri
    local.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(manifest))


def condition(model: dict, type_: str) -> dict:
    return next((c for c in (model.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def chat(endpoint: str, name: str) -> str:
    body = {"model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    req = urllib.request.Request(
        endpoint + "/v1/chat/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]


def test_a_missing_bucket_and_a_missing_key_are_the_reason_in_the_models_status(local):
    apply(local, "no-bucket", "s3://no-such-bucket/smollm2.gguf")
    apply(local, "s3-later", "s3://models/later/smollm2.gguf")
    for name in ("no-bucket", "s3-later"):
        model = lambda n=name: local.get("nm", n)  # noqa: E731
        local.wait(f"{name} CompileFailed", lambda m=model: condition(m(), "Compiled").get("reason")
                   == "CompileFailed")  # fmt: skip
    text = local.kubectl("get", "neuronmodel", "no-bucket", "-o", "yaml").stdout
    assert (
        "model source unavailable: s3://no-such-bucket/smollm2.gguf: bucket no-such-bucket does not exist "
        "(NoSuchBucket); check the bucket name in model.uri" in " ".join(text.split())
    ), text
    text = local.kubectl("get", "neuronmodel", "s3-later", "-o", "yaml").stdout
    assert "model source unavailable: s3://models/later/smollm2.gguf: no objects under it" in " ".join(
        text.split()
    ), text
    later = local.get("nm", "s3-later")
    assert later["status"]["phase"] == "Failed" and later["status"]["compileRetryAt"], later["status"]


def test_an_s3_model_becomes_ready_and_answers(local):
    apply(local, "from-s3", "s3://models/smollm2/smollm2-135m-instruct.gguf")
    model = lambda: local.get("nm", "from-s3")  # noqa: E731
    local.wait("from-s3 Ready", lambda: (model().get("status") or {}).get("phase") == "Ready")
    assert chat(model()["status"]["endpoint"], "from-s3")
    claim = local.get("pvc", "-l", "neuronfleet.dev/model=from-s3")["items"][0]["metadata"]["name"]
    sources = local.state / "node" / "volumes" / "default" / claim / "sources"
    assert sources.is_dir() and not [p for p in sources.rglob("*") if p.is_file()]  # converted: not kept


def test_a_missing_key_is_tried_again_and_ready_once_uploaded(local, s3):
    client, _ = s3
    model = lambda: local.get("nm", "s3-later")  # noqa: E731
    local.wait(
        "s3-later CompileFailed", lambda: condition(model(), "Compiled").get("reason") == "CompileFailed"
    )
    client.upload_file(str(default_gguf_path()), "models", "later/smollm2.gguf")
    local.wait("s3-later Ready with no change", lambda: (model().get("status") or {}).get("phase") == "Ready")
    assert model()["metadata"]["generation"] == 1
    assert chat(model()["status"]["endpoint"], "s3-later")
