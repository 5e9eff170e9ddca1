"""The local node's settings (`neuronfleet up --node-label/--node-resource`, the emulated API server's own
kubelet likewise): what it advertises beside the machine's own, the flags that name them and their checks.
Light (the standard library only at import: no aiohttp, no jsonschema): the command line builds every
command's parser with it, the operator image's too."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

NODE_OWN = ("cpu", "memory", "pods", "ephemeral-storage")  # the machine's, never set by a setting


@dataclass(frozen=True)
class NodeSettings:
    """What the local node advertises beside the machine's own: labels (e.g. the instance type a Neuron
    model's pods select on) and extended resources (as a device plugin would: `aws.amazon.com/neuroncore`,
    `vpc.amazonaws.com/efa`), name -> count."""

    labels: dict[str, str] = field(default_factory=dict)
    resources: dict[str, str] = field(default_factory=dict)


def _pairs(items: list[str], what: str, example: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{what} {item!r}: it is {example}")
        out[key.strip()] = value.strip()
    return out


def add_node_arguments(parser: Any) -> None:
    """`--node-label` and `--node-resource`, read by `node_settings` (`neuronfleet up` and the emulated API
    server's own kubelet take both)."""
    parser.add_argument(
        "--node-label", action="append", default=[], metavar="KEY=VALUE",
        help="a label of the local node (repeat for more), e.g. "
        "node.kubernetes.io/instance-type=trn2.48xlarge: what a model's pods select on",
    )  # fmt: skip
    parser.add_argument(
        "--node-resource", action="append", default=[], metavar="NAME=COUNT",
        help="an extended resource the local node offers (repeat for more), as a device plugin advertises "
        "it, e.g. aws.amazon.com/neuroncore=64 (recorded, not enforced)",
    )  # fmt: skip


def node_settings(labels: list[str], resources: list[str]) -> NodeSettings:
    """The node's settings from `KEY=VALUE` labels and `NAME=COUNT` resources; a ValueError saying what is
    wrong with one (a label Kubernetes refuses, a resource that is not an extended one, a count that is not a
    whole number)."""
    from .admission import label_problems  # (jsonschema: local mode's, not every command's)

    node_labels = _pairs(
        labels, "node label", "KEY=VALUE, e.g. node.kubernetes.io/instance-type=trn2.48xlarge"
    )
    problems = label_problems(node_labels, "node label")
    if problems:
        raise ValueError("; ".join(f"{where}: {message}" for where, message in problems))
    counts = _pairs(resources, "node resource", "NAME=COUNT, e.g. aws.amazon.com/neuroncore=64")
    for name, count in counts.items():
        if name in NODE_OWN or "/" not in name:
            raise ValueError(
                f"node resource {name!r}: the node's own ({', '.join(NODE_OWN)}) are the machine's; a "
                "setting names an extended resource, DOMAIN/NAME, e.g. aws.amazon.com/neuroncore"
            )
        if not count.isdigit():
            raise ValueError(
                f"node resource {name}={count!r}: an extended resource's count is a whole number"
            )
    return NodeSettings(node_labels, counts)
