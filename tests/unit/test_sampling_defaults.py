"""Sampling defaults: what an OpenAI request that leaves a field out gets (the model's generation_config.json
under --override-generation-config, as vLLM applies them), and that a request's own values always win."""

from __future__ import annotations

import pytest

from neuronfleet.contract import ServeConfig
from neuronfleet.runtime.serving.api_requests import parse_openai_chat, parse_openai_completion
from neuronfleet.runtime.serving.errors import InvalidRequest
from neuronfleet.runtime.serving.sampling_params import SamplingDefaults

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_the_models_generation_config_under_the_override_with_the_apis_defaults_for_the_rest():
    model = {"temperature": 0.6, "top_p": 0.95, "bos_token_id": 1, "do_sample": True}
    defaults = SamplingDefaults.of(model, {"temperature": 0.2, "top_k": -1})
    assert defaults.as_dict() == {"temperature": 0.2, "top_p": 0.95, "top_k": 0, "repetition_penalty": 1.0}
    assert SamplingDefaults.of({}).as_dict() == SamplingDefaults().as_dict()  # the OpenAI API's: 1, 1, off, 1


@pytest.mark.parametrize(
    ("override", "message"),
    [({"temprature": 0.2}, "'temprature' is not a sampling default; expected one of temperature, top_p"),
     ({"top_p": 0}, "top_p must be greater than 0 and at most 1"),
     ({"temperature": "warm"}, "temperature must be a finite number")],
)  # fmt: skip
def test_a_bad_default_is_refused_naming_it(override, message):
    with pytest.raises(InvalidRequest, match=message):
        SamplingDefaults.of({}, override, "--override-generation-config")


def test_a_request_that_leaves_a_field_out_gets_the_default_and_its_own_values_win():
    defaults = SamplingDefaults(temperature=0.2, top_p=0.9, top_k=40, repetition_penalty=1.1)
    left_out = parse_openai_chat(CHAT, defaults).params
    assert (left_out.temperature, left_out.top_p, left_out.top_k, left_out.repetition_penalty) == (
        0.2,
        0.9,
        40,
        1.1,
    )
    null = parse_openai_chat(
        {**CHAT, "temperature": None}, defaults
    ).params  # null: left out, as OpenAI reads it
    assert null.temperature == 0.2
    own = parse_openai_chat({**CHAT, "temperature": 0, "top_p": 1.0, "top_k": 0}, defaults).params
    assert (own.temperature, own.top_p, own.top_k, own.repetition_penalty) == (0.0, 1.0, 0, 1.1)
    completion = parse_openai_completion({"model": "m", "prompt": "Hi"}, defaults).params
    assert completion.temperature == 0.2
    assert parse_openai_chat(CHAT).params.temperature == 1.0  # without defaults: the OpenAI API's own


def test_the_serve_option_is_a_json_object_and_only_where_requests_are_parsed():
    ServeConfig(model="/m", override_generation_config='{"temperature": 0}')
    with pytest.raises(ValueError, match="expected a JSON object such as"):
        ServeConfig(model="/m", override_generation_config="temperature=0")
    with pytest.raises(ValueError, match="a front door or an engine's router passes them on"):
        ServeConfig(role="router", unified=["http://u:1"], override_generation_config='{"temperature": 0}')


@pytest.mark.parametrize(
    "sample", ["llama-3.3-70b-vllm-trn2-disaggregated.yaml", "llama-3.2-3b-tgi-inf2.yaml"]
)
def test_another_engines_model_is_refused_sampling_defaults_saying_what_works(sample):
    import yaml
    from support import ROOT

    from neuronfleet.operator import validation

    obj = yaml.safe_load((ROOT / "crds" / "samples" / sample).read_text())
    obj["spec"].setdefault("serving", {})["sampling"] = {"temperature": 0.2}
    errors = validation.check(obj).errors
    assert any(e.startswith("serving.sampling: the operator does not yet pass") and "engine embedded" in e
               for e in errors), errors  # fmt: skip
    local = yaml.safe_load((ROOT / "crds" / "samples" / "smollm2-135m-local-cpu.yaml").read_text())
    assert not validation.check(local).errors  # the local samples set it (engine embedded)
