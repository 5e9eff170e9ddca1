"""The model-server protocol of the Gateway API Inference Extension's endpoint picker, on a live `neuronfleet
serve`: every metric the pinned picker reads (tests/data/gie-v1.5.0-epp-scraped-metrics.yaml, with its
sources) exists under vLLM's name, with its type and labels, parses with Prometheus' text format parser
(prometheus_client's), and means what the picker takes it to mean: queue and running requests and KV use
follow the load, the cache config describes the KV cache, no LoRA adapter is ever reported. Ready means
serving: once /ready answers 200 a completion is served."""

from __future__ import annotations

import json
import threading
import urllib.request

import pytest
import yaml
from support import CEILING, ROOT, http_status, metrics_text, post, running_server, wait_until

pytestmark = pytest.mark.real_model

SCRAPED = ROOT / "tests" / "data" / "gie-v1.5.0-epp-scraped-metrics.yaml"
SLOTS, MAX_SEQ_LEN = 2, 256


def families(base: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name: f for f in text_string_to_metric_families(metrics_text(base))}


def value(base: str, name: str) -> float:
    (sample,) = families(base)[name].samples
    return sample.value


def test_every_metric_the_endpoint_picker_reads_exists_and_follows_the_load(smollm2_dir):
    read = yaml.safe_load(SCRAPED.read_text())["metrics"]
    assert {m["name"] for m in read} == {
        "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
        "vllm:lora_requests_info", "vllm:cache_config_info",
    }  # fmt: skip
    options = ("--slots", str(SLOTS), "--max-seq-len", str(MAX_SEQ_LEN), "--max-waiting", "8")
    with running_server(smollm2_dir, *options) as (base, _):
        # ready means serving: the model is loaded before the port opens, and a request is answered
        assert http_status(base + "/ready") == 200
        code, body, _ = post(base, "/v1/completions", {"model": "smollm2", "prompt": "Hi", "max_tokens": 4})
        assert code == 200 and body["choices"][0]["text"], body
        found = families(base)
        for m in read:
            family = found.get(m["name"])
            assert family is not None, f"{m['name']} missing from /metrics"
            assert family.type == m["type"], (m["name"], family.type)
            assert family.samples, m["name"]
            for sample in family.samples:
                assert set(m["labels"]) <= set(sample.labels), (m["name"], sample.labels)
                for label in m.get("integer_labels", []):
                    assert int(sample.labels[label]) > 0, (m["name"], sample.labels)
        (cache,) = found["vllm:cache_config_info"].samples
        block = int(cache.labels["block_size"])
        assert int(cache.labels["num_gpu_blocks"]) * block == SLOTS * MAX_SEQ_LEN  # the whole KV cache
        (lora,) = found["vllm:lora_requests_info"].samples
        # no adapters: the picker skips a series whose running and waiting adapters are both empty
        assert (lora.labels["running_lora_adapters"], lora.labels["waiting_lora_adapters"]) == ("", "")
        assert lora.labels["max_lora"] == "0" and lora.value > 0  # its value: a timestamp
        # idle
        assert value(base, "vllm:num_requests_waiting") == 0 and value(base, "vllm:num_requests_running") == 0
        assert 0 <= value(base, "vllm:kv_cache_usage_perc") <= 1
        # loaded: both slots busy and two requests queued; KV in use
        done: list[int] = []

        def stream() -> None:
            request = urllib.request.Request(
                base + "/v1/completions",
                data=json.dumps(
                    {
                        "model": "smollm2",
                        "prompt": "Tell me a long story about a cat.",
                        "max_tokens": 40,
                        "ignore_eos": True,
                        "stream": True,
                    }
                ).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=CEILING) as r:
                r.read()
                done.append(r.status)

        threads = [threading.Thread(target=stream) for _ in range(SLOTS + 2)]
        for t in threads:
            t.start()

        def loaded() -> dict | None:
            names = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
            now = {n: value(base, n) for n in names}
            full = now["vllm:num_requests_running"] == SLOTS and now["vllm:num_requests_waiting"] == 2
            return now if full else None

        seen = wait_until(loaded, "both slots running and two requests waiting")
        assert 0 < seen["vllm:kv_cache_usage_perc"] <= 1
        for t in threads:
            t.join()
        assert done == [200] * (SLOTS + 2)
        assert value(base, "vllm:num_requests_waiting") == 0 and value(base, "vllm:num_requests_running") == 0
        assert value(base, "vllm:kv_cache_usage_perc") == 0
