"""Our runtime's host KV store as the operator sizes it (pure): its bytes (what a serving pod's memory request
counts: `host_resources`) and its tokens (what a router's index counts a pod to hold beside its slots:
`front_door.routing_options`), from neuron.hostKVCache or the runtime's default, the slots' own KV cache
(`RuntimeConfig.host_kv_bytes`). Its own module: the resources and the routers' options both read it, and the
engines read those."""

from __future__ import annotations

from . import topology
from .spec import NeuronModelSpec
from .spec_base import quantity_value


def _kv_bytes_per_token(spec: NeuronModelSpec) -> int | None:
    """A token's keys and values across the model's layers, in the spec's dtype; None where the model's shape
    is unknown."""
    shape = topology.model_shape(spec.model.uri, spec.model.shape)
    if shape is None:
        return None
    per = topology.BYTES_PER_DTYPE.get(spec.neuron.dtype, 4)
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * per


def host_kv_bytes(spec: NeuronModelSpec) -> int:
    """Engine embedded: its host KV store's bytes, neuron.hostKVCache or by default what the runtime takes
    (`RuntimeConfig.host_kv_bytes`): the slots' own KV cache, batchSize x sequenceLength tokens of the model's
    keys and values (0 where the model's shape is unknown); 0 for the other engines."""
    n = spec.neuron
    if spec.engine != "embedded":
        return 0
    if n.hostKVCache is not None:
        return int(quantity_value(n.hostKVCache))
    per_token = _kv_bytes_per_token(spec)
    return 0 if per_token is None else n.batchSize * n.sequenceLength * per_token


def host_kv_tokens(spec: NeuronModelSpec) -> int:
    """The tokens a serving pod's host KV store holds beside its slots (what a router's index of the pod
    counts too): by default as many as the slots (batchSize x sequenceLength), else neuron.hostKVCache over a
    token's keys and values (where the model's shape is unknown, the default's count stands in); 0 for the
    other engines and a store turned off."""
    n = spec.neuron
    slots_tokens = n.batchSize * n.sequenceLength
    if spec.engine != "embedded":
        return 0
    if n.hostKVCache is None:
        return slots_tokens
    size, per_token = int(quantity_value(n.hostKVCache)), _kv_bytes_per_token(spec)
    if size == 0:
        return 0
    return slots_tokens if per_token is None else size // per_token
