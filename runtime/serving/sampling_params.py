"""Per-request generation settings and their validation (pure; no torch)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from neuronfleet.runtime.serving.errors import InvalidRequest
from neuronfleet.runtime.serving.output_constraints import OutputConstraint

MAX_LOGPROBS = 20  # the most likely tokens a request may ask for at each step (OpenAI's top_logprobs bound)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 means greedy. `max_tokens` None means up to the slot's length.
    """

    max_tokens: int | None = None
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None  # each token's log probability and this many most likely ones' (None: none)
    constraint: OutputConstraint | None = None  # a grammar the answer must match (structured outputs)

    def __post_init__(self) -> None:
        def bad(name: str, value: object, allowed: str) -> InvalidRequest:
            return InvalidRequest(f"{name} must be {allowed}, got {value!r}", name)

        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "an integer of at least 1")
        for name, _lo, _hi in (
            ("temperature", 0.0, 100.0),
            ("top_p", 0.0, 1.0),
            ("repetition_penalty", 0.0, 100.0),
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, value, "a finite number")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", self.temperature, "between 0 and 100")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "greater than 0 and at most 1")
        if not 0.0 < self.repetition_penalty <= 100.0:
            raise bad("repetition_penalty", self.repetition_penalty, "greater than 0 and at most 100")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", self.top_k, "an integer of at least 0 (0 disables it)")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise bad("seed", self.seed, "an integer between 0 and 2**63 - 1")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", self.stop, "a list of non-empty strings")
        n = self.logprobs
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_LOGPROBS):
            raise bad("logprobs", n, f"an integer between 0 and {MAX_LOGPROBS} (most likely tokens)")
        if self.constraint is not None and self.ignore_eos:
            field_name = self.constraint.field
            raise InvalidRequest(f"ignore_eos would run a constrained answer past its grammar's end; send "
                                 f"{field_name} or ignore_eos, not both", "ignore_eos")  # fmt: skip

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


SAMPLING_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")  # generation_config.json's names


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves a sampling field out gets: the model's own generation settings (its
    generation_config.json: `temperature`, `top_p`, `top_k`, `repetition_penalty`, where it has them), over
    which `--override-generation-config` is laid, as vLLM does with `--generation-config auto` and its
    `--override-generation-config`; the OpenAI API's defaults (1, 1, off, 1) for the rest. A request's own
    values always win. (vLLM's: vllm-project/vllm `vllm/config/model.py`, ModelConfig.generation_config
    "auto" and override_generation_config, "merged with the default config from the model".)"""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                       repetition_penalty=self.repetition_penalty)  # the same ranges  # fmt: skip

    @classmethod
    def of(cls, generation_config: dict, override: dict | None = None, where: str = "") -> SamplingDefaults:
        """From a generation_config.json's content and an override (both by generation_config's names);
        InvalidRequest names a bad key or value and `where` it came from."""
        merged = {k: v for k, v in generation_config.items() if k in SAMPLING_KEYS and v is not None}
        for key, value in (override or {}).items():
            if key not in SAMPLING_KEYS:
                raise InvalidRequest(f"{where}: {key!r} is not a sampling default; expected one of "
                                     f"{', '.join(SAMPLING_KEYS)}", key)  # fmt: skip
            merged[key] = value
        if merged.get("top_k") == -1:  # vLLM's "off"
            merged["top_k"] = 0
        try:
            return cls(**merged)
        except InvalidRequest as e:
            raise InvalidRequest(f"{where}: {e}", e.field_name) from None

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in SAMPLING_KEYS}
