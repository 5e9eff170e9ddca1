"""An hf:// model's length limit read before any compile: config.json from a Hub (a fake one on loopback,
answering as the Hub does), with the model's token, kept per repository, revision and token; refusals from
validation say what the model allows and where that was read; a failed read refuses nothing."""

from __future__ import annotations

import asyncio
import base64

import pytest
import yaml
from fake_hub import FakeHub
from support import ROOT

from neuronfleet.contract import model_length_limit
from neuronfleet.operator import hub, planner, validation

LLAMA_31 = {  # the fields of meta-llama/Llama-3.1-8B-Instruct's config.json that say its length
    "max_position_embeddings": 131072,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}  # fmt: skip
COMMIT = "0e9e39f249a16976918f6564b8830bc894c89659"


@pytest.fixture()
def fake_hub(monkeypatch):
    monkeypatch.delenv(hub.OFFLINE_ENV, raising=False)
    served = FakeHub()
    yield served
    served.stop()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("config", "limit"),
    [
        ({"max_position_embeddings": 8192}, 8192),
        (LLAMA_31, 131072),  # llama3's scaling is counted in max_position_embeddings already
        ({"max_position_embeddings": 32768, "rope_scaling": {"type": "yarn", "factor": 4.0}}, 131072),
        ({"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "linear", "factor": 2}}, 8192),
        ({"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "linear", "factor": 1}}, 4096),
        ({"text_config": {"max_position_embeddings": 8192}, "max_position_embeddings": 512}, 8192),
        ({"vocab_size": 32000}, None),
        ({"max_position_embeddings": True}, None),
        ({"max_position_embeddings": "8192"}, None),
    ],
)
def test_a_configs_length_limit(config, limit):
    assert model_length_limit(config) == limit


def test_a_gated_models_config_is_read_with_its_token_and_kept(fake_hub):
    fake_hub.add_config("meta-llama/Llama-3.1-8B-Instruct", LLAMA_31)
    fake_hub.gated["meta-llama/Llama-3.1-8B-Instruct"] = "hf_right"
    clock = Clock()
    configs = hub.HubConfigs(fake_hub.url, clock=clock)
    uri = "hf://meta-llama/Llama-3.1-8B-Instruct"

    refused = asyncio.run(configs.read(uri, None, None))
    assert refused.limit is None and "401" in refused.error and "no token" in refused.error
    wrong = asyncio.run(configs.read(uri, None, "hf_wrong"))
    assert "has no access" in wrong.error and "hf_wrong" not in wrong.error  # a token is never said
    read = asyncio.run(configs.read(uri, None, "hf_right"))
    assert read.limit == 131072 and read.error is None
    assert fake_hub.asked("meta-llama/Llama-3.1-8B-Instruct")[-1] == (
        "/meta-llama/Llama-3.1-8B-Instruct/resolve/main/config.json",
        "Bearer hf_right",
    )
    asked = len(fake_hub.requests)

    async def many():  # concurrent reconciles of models on one repository: kept, not asked again
        return await asyncio.gather(*(configs.read(uri, None, "hf_right") for _ in range(5)))

    assert {r.limit for r in asyncio.run(many())} == {131072}
    assert len(fake_hub.requests) == asked
    clock.now += hub.KEEP_SECONDS + 1  # a branch may move: read again after a while
    asyncio.run(configs.read(uri, None, "hf_right"))
    assert len(fake_hub.requests) == asked + 1


def test_concurrent_first_reads_share_one_request(fake_hub):
    fake_hub.add_config("org/model", {"max_position_embeddings": 2048})
    configs = hub.HubConfigs(fake_hub.url)

    async def many():
        return await asyncio.gather(*(configs.read("hf://org/model", None, None) for _ in range(8)))

    assert {r.limit for r in asyncio.run(many())} == {2048}
    assert len(fake_hub.asked("org/model")) == 1


def test_a_commits_read_is_kept_for_good_and_a_failure_is_tried_again(fake_hub):
    clock = Clock()
    configs = hub.HubConfigs(fake_hub.url, clock=clock)
    missing = asyncio.run(configs.read("hf://org/model", COMMIT, None))
    assert missing.limit is None and "404" in missing.error
    fake_hub.add_config("org/model", {"max_position_embeddings": 2048}, revision=COMMIT)
    assert asyncio.run(configs.read("hf://org/model", COMMIT, None)).error  # kept a while
    clock.now += hub.RETRY_SECONDS + 1
    assert asyncio.run(configs.read("hf://org/model", COMMIT, None)).limit == 2048
    asked = len(fake_hub.requests)
    clock.now += 10 * hub.KEEP_SECONDS
    assert asyncio.run(configs.read("hf://org/model", COMMIT, None)).limit == 2048
    assert len(fake_hub.requests) == asked
    assert fake_hub.requests[-1][0] == f"/org/model/resolve/{COMMIT}/config.json"


def test_what_cannot_be_read_says_why_and_refuses_nothing(fake_hub, monkeypatch):
    fake_hub.files[("org/broken", "main")] = {"config.json": b"{not json"}
    fake_hub.files[("org/list", "main")] = {"config.json": b"[1, 2]"}
    configs = hub.HubConfigs(fake_hub.url)
    assert asyncio.run(configs.read("hf://org/broken", None, None)).error == "its config.json is not JSON"
    assert "not a JSON object" in asyncio.run(configs.read("hf://org/list", None, None)).error
    nobody = hub.HubConfigs("http://127.0.0.1:9", timeout=2)  # (the discard port: nothing listens)
    assert "did not answer" in asyncio.run(nobody.read("hf://org/model", None, None)).error
    monkeypatch.setenv(hub.OFFLINE_ENV, "1")
    before = len(fake_hub.requests)
    assert "HF_HUB_OFFLINE" in asyncio.run(configs.read("hf://org/model", None, None)).error
    assert len(fake_hub.requests) == before


def test_a_revision_is_quoted_into_the_address():
    assert hub.config_url("https://hub.example/", "org/m", "refs/pr/1") == (
        "https://hub.example/org/m/resolve/refs%2Fpr%2F1/config.json"
    )


def test_a_token_comes_from_the_secrets_key():
    secret = {"data": {"token": base64.b64encode(b"hf_abc\n").decode(), "other": "!!"}}
    assert hub.secret_token(secret, "token") == "hf_abc"
    assert hub.secret_token(secret, "missing") is None
    assert hub.secret_token(secret, "other") is None
    assert hub.secret_token(None, "token") is None


def _neuron_sample(sequence_length: int) -> dict:
    obj = yaml.safe_load((ROOT / "crds" / "samples" / "llama-3.1-8b-vllm-inf2.yaml").read_text())
    obj["metadata"]["uid"] = "u1"
    obj["spec"]["neuron"].update(sequenceLength=sequence_length, maxInputLength=sequence_length - 1)
    return obj


def test_validation_refuses_a_sequence_length_past_the_models_once_saying_what_is_allowed():
    where = "from hf://meta-llama/Llama-3.1-8B-Instruct's config.json on the Hub"
    limit = validation.ModelLimit(4096, where)
    report = validation.check(_neuron_sample(8192), limit)
    said = (
        "neuron.sequenceLength 8192 is past the model's max_position_embeddings (4096, from "
        "hf://meta-llama/Llama-3.1-8B-Instruct's config.json on the Hub): set it to 4096 or less (and "
        "neuron.maxInputLength below it)"
    )
    assert report.errors == [said]
    assert validation.check(_neuron_sample(4096), limit).ok
    assert validation.check(_neuron_sample(8192)).ok  # unread: the compile checks
    parsed = planner.parse(_neuron_sample(8192), limit)
    assert not parsed.valid and parsed.errors == [said]


def test_the_validate_command_reads_the_hub_with_hf_token_unless_offline(fake_hub, tmp_path):
    import os
    import subprocess
    import sys

    repo = "meta-llama/Llama-3.1-8B-Instruct"
    fake_hub.add_config(repo, {"max_position_embeddings": 4096})
    fake_hub.gated[repo] = "hf_right"
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(_neuron_sample(8192)))
    env = {**os.environ, "HF_ENDPOINT": fake_hub.url, "HF_HUB_OFFLINE": "0", "HF_TOKEN": "hf_right"}

    def validate(*flags: str, **changes: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-P", "-m", "neuronfleet.cli", "validate", *flags, str(path)]
        return subprocess.run(command, capture_output=True, text=True, env={**env, **changes})

    refused = validate()
    assert refused.returncode == 1, refused.stderr
    assert "past the model's max_position_embeddings (4096, from hf://" in refused.stdout
    assert fake_hub.asked(repo)[-1][1] == "Bearer hf_right"
    asked = len(fake_hub.requests)
    assert validate("--offline").returncode == 0 and len(fake_hub.requests) == asked
    unread = validate(HF_TOKEN="")  # gated, no token: said, and the rest is validated
    assert unread.returncode == 0 and "not read (the Hub refused the read (401)" in unread.stderr
