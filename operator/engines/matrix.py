"""The engine matrix: for each engine and instance family, the pinned contract that serves it (image, the
versions inside, where they are published) and what each serving mode does there. The README's "What runs
where" and "Pinned images" tables are written from it (`what_runs_where`, `pinned_images`;
tests/unit/test_engine_matrix.py checks the README against them and every cell against validation).
Pure."""

from __future__ import annotations

from dataclasses import dataclass

from neuronfleet.contract import TORCHNEURON_PINNED

from . import sglang, tgi, vllm_nxdi, vllm_plugin
from .common import Pinned

FAMILIES = ("cpu", "inf2", "trn1", "trn2", "trn3")
ENGINES = ("embedded", "vllm", "tgi", "sglang")
MODES = ("unified", "disaggregated")
NEEDS_NEURON = "refused (needs Neuron devices)"


@dataclass(frozen=True)
class Support:
    """What one engine does on one instance family: its pinned contract (None: our own runtime, or none) and
    a cell per serving mode ("works (how it is proven)", "experimental (with what settings; why it is not
    yet proven)" or "refused (why)")."""

    pinned: Pinned | None
    unified: str
    disaggregated: str


_NO_BACKEND = "refused (our runtime's TorchNeuron backend serves Trn2 and Trn3 only)"
_TORCHNEURON = (
    f"experimental (TorchNeuron: torch-neuronx {TORCHNEURON_PINNED['torch-neuronx']}, SDK "
    f"{TORCHNEURON_PINNED['neuron-sdk']}, with `neuron.compiledSteps: neuron`, a rank per NeuronCore; not "
    "yet run on a device: `tests/device/neuron_smoke.py` is the proof to run on one)"
)
_TORCHNEURON_PD = "refused (our runtime moves KV caches from host memory, not yet from the device's)"
_NXDI = "vLLM 0.16.0 over NxD Inference, SDK 2.31.1"
_PLUGIN = "vLLM Neuron plugin, vLLM 0.24.0, SDK 2.32.0"
_NXDI_TEST = "contract-tested: `tests/unit/test_engine_vllm_nxdi.py`"
_PLUGIN_TEST = "contract-tested: `tests/unit/test_engine_vllm_plugin.py`"
_SGLANG_TEST = "contract-tested: `tests/unit/test_engine_sglang.py`"
_TGI = "refused (TGI 3.3.5 Neuron: Inferentia2 and Trainium1 only)"
_SGLANG = "refused (SGLang-Neuron 0.1.0 serves LLMs on Trn3 only)"

MATRIX: dict[tuple[str, str], Support] = {
    ("embedded", "cpu"): Support(
        None,
        "works (local mode end to end, `tests/cluster` in CI)",
        "works (KV over tcp or NIXL; local mode end to end, `tests/cluster` in CI)",
    ),
    **{("embedded", f): Support(None, _NO_BACKEND, _NO_BACKEND) for f in ("inf2", "trn1")},
    **{("embedded", f): Support(None, _TORCHNEURON, _TORCHNEURON_PD) for f in ("trn2", "trn3")},
    **{
        ("vllm", f): Support(
            vllm_nxdi.PINNED,
            f"works ({_NXDI}, compiled on the serving instance type; {_NXDI_TEST})",
            f"refused ({_NXDI} has no KV-cache connector; use trn2 or trn3)",
        )
        for f in ("inf2", "trn1")
    },
    ("vllm", "trn2"): Support(
        vllm_plugin.PINNED,
        f"works ({_PLUGIN}, compiled ahead on a CPU node; {_PLUGIN_TEST})",
        f"works (NIXL over EFA, compiled ahead on a CPU node; {_PLUGIN_TEST})",
    ),
    ("vllm", "trn3"): Support(
        vllm_plugin.PINNED,
        f"works ({_PLUGIN}, compiled ahead on a CPU node; {_PLUGIN_TEST})",
        f"works (NIXL over EFA, compiled ahead on a CPU node; {_PLUGIN_TEST})",
    ),
    **{
        ("tgi", f): Support(
            tgi.PINNED,
            "works (legacy: TGI 3.3.5, SDK 2.24.1; contract-tested: `tests/unit/test_engine_tgi.py`)",
            "refused (TGI has no prefill/decode split)",
        )
        for f in ("inf2", "trn1")
    },
    **{("tgi", f): Support(None, _TGI, _TGI) for f in ("trn2", "trn3")},
    **{("sglang", f): Support(None, _SGLANG, _SGLANG) for f in ("inf2", "trn1", "trn2")},
    ("sglang", "trn3"): Support(
        sglang.PINNED,
        "works (SGLang-Neuron 0.1.0, SDK 2.33.0, compiles as it starts into the cache claim; "
        f"{_SGLANG_TEST})",
        f"works (NIXL over EFA; {_SGLANG_TEST})",
    ),
    **{(e, "cpu"): Support(None, NEEDS_NEURON, NEEDS_NEURON) for e in ENGINES if e != "embedded"},
}


def cell(engine: str, mode: str, family: str) -> str:
    return getattr(MATRIX[(engine, family)], mode)


def what_runs_where() -> str:
    """The README's table: a row per engine and mode, a column per instance family."""
    rows = [
        "| engine | mode | " + " | ".join(FAMILIES) + " |",
        "| --- | --- | " + " | ".join("---" for _ in FAMILIES) + " |",
    ]
    for engine in ENGINES:
        for mode in MODES:
            rows.append(
                f"| {engine} | {mode} | " + " | ".join(cell(engine, mode, f) for f in FAMILIES) + " |"
            )
    return "\n".join(rows)


def pinned_images() -> str:
    """The README's table of the pinned images: engine, families, image, the versions inside."""
    seen: dict[int, tuple[str, list[str], Pinned]] = {}
    for (engine, family), support in MATRIX.items():
        if support.pinned is not None:
            seen.setdefault(id(support.pinned), (engine, [], support.pinned))[1].append(family)
    rows = ["| engine | instance families | image | versions inside |", "| --- | --- | --- | --- |"]
    for engine, families, pinned in seen.values():
        versions = ", ".join(f"{k} {v}" for k, v in pinned.versions.items())
        rows.append(f"| {engine} | {', '.join(families)} | `{pinned.image}` | {versions} |")
    return "\n".join(rows)
