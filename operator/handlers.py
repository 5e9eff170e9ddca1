"""kopf's part of the operator: the registry of its handlers and `run`, which starts kopf embedded in the
`neuronfleet operator` process with its settings as arguments.

kopf logs in, watches the NeuronModels and their children (`watching.py`: its indexes are the store the
reconciles read, its event handlers the triggers), queues and batches each object's events, and runs the
process (start-up, signals, clean-up, liveness). Ours: the work queue of models (`triggers.py`: a child's
change queues its owner, one pass per model at a time), the one reconcile path (`reconcile.reconcile`),
leader election on a Lease (`leader.py`), the builtin autoscaler's loop and the wake endpoint. kopf
persists nothing: event handlers and indexes write no annotation, finalizer or status field, and kopf posts
no Event (the reconciles post their own).

A NeuronModel is reconciled when it is added or changed by anyone but the operator itself, and when one of
its children (labelled neuronfleet.dev/model) is added, changed or deleted (a deleted Service comes back as
soon as the watch reports it); every model once when this replica starts to lead (at start-up, or on
taking over). Reconciles read kopf's indexes, not the API server; a rare index-only pass over every model
(triggers.RESYNC_SECONDS) is the safety net for a change no watch reported. In cluster mode kopf also
watches CustomResourceDefinitions, so a NeuronModel CRD that is missing (not installed yet, or being
replaced) is served once it comes: the operator never exits for it.

No finalizer: deletion never needs the operator. Every child carries an ownerReference to its NeuronModel
(controller, blockOwnerDeletion), so the API server's garbage collector deletes them when the model goes;
nothing outside the owner references (no external resource, no shared file) needs cleaning, so a model is
deleted at once even with the operator stopped or uninstalled.

Where the chart grants it (`Config.read_nodes`), kopf also watches what the nodes offer (`node_watch.py`:
the kinds it may read decided by one LIST each before kopf starts); a change of an offer queues the models
of that instance type.

Several replicas (leader election, `leader.py`): kopf runs on every replica, so every replica keeps its
indexes warm; only the leader reconciles, runs the autoscaler's loop and answers wake calls, and
`kube.Kube` refuses any other replica's write, so a follower writes nothing at all.

Shutdown: on SIGTERM the clean-up handler stops the wake endpoint, the autoscaler's loop and the trigger
workers, then releases the Lease (a follower leads at once) before it closes the client.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import kopf

from . import devices, kube, leader, login, names, scaling, spec, wake, watching
from .autoscale_loop import AutoscaleLoop
from .node_watch import NodeWatch, probe
from .triggers import Triggers
from .watching import Observed

log = logging.getLogger(__name__)

WATCH_SECONDS = 300  # one watch request's server-side timeout; kopf then resumes from its resourceVersion


@dataclass(frozen=True)
class Config:
    """What `neuronfleet operator` runs with (its flags, their defaults from the environment the chart sets,
    read once by the command): given to kopf and to the operator's parts as arguments."""

    namespaces: list[str] | None = None  # None: every namespace
    kubeconfig: str | None = None  # None: KUBECONFIG, ~/.kube/config or the pod's service account
    liveness: str | None = None  # kopf's liveness endpoint, e.g. http://0.0.0.0:8080/healthz
    election: leader.Settings | None = None  # None: leader.settings() from the environment
    wake_at: tuple[str, int] | None = None  # (host, port) of the wake endpoint, when it is served
    wake_url: str | None = None  # the wake endpoint as routers reach it
    autoscale_every: float = scaling.TICK_SECONDS  # seconds between the builtin autoscaler's decisions
    read_nodes: bool = False  # what the nodes offer is read (node_watch: the Schedulable condition)


@dataclass
class Operator:
    """The process's parts: the client, what kopf observes, the work queue (made at start-up)."""

    config: Config
    login: login.Login
    observed: Observed = field(init=False)
    client: kube.Kube | None = None
    triggers: Triggers | None = None
    nodes: NodeWatch | None = None  # what the nodes offer, where they are read (made before kopf starts)

    def __post_init__(self) -> None:
        self.observed = Observed(self.config.namespaces)

    async def start(self, indices: dict[str, Any]) -> None:
        config = self.config
        self.observed.attach(indices)
        election = config.election or leader.settings()
        self.client = client = kube.Kube(self.login)
        client.cache = self.observed

        async def live_list(kind: str, namespace: str | None) -> list[dict[str, Any]]:
            selector = "" if kind == spec.KIND else watching.CHILD_LABEL  # as kopf's watches select
            return (await client.list_all(kind, namespace, selector))[0]

        self.observed.live_list = live_list
        self.observed.live_get = lambda kind, ns, name: client.get(kind, ns, name, live=True)
        self.triggers = triggers = Triggers(client, self.observed)
        self.observed.on_change = triggers.changed
        if self.nodes is not None:
            self.nodes.attach(indices)
            self.nodes.on_change = triggers.offers_changed
            self.observed.nodes = self.nodes
        triggers.start()
        triggers.wake_url = config.wake_url
        triggers.autoscaler = AutoscaleLoop(
            client, triggers.enqueue, self.observed.models, config.autoscale_every
        )
        triggers.elector = leader.LeaderElector(client, election, triggers.lead, triggers.resume)
        client.may_write = triggers.elector.acting
        if config.wake_at is not None:
            observed = self.observed

            async def known(namespace: str, name: str) -> bool:  # from the index alone: no call for a name
                if not observed.watches(spec.KIND, namespace):
                    return False
                return await observed.get(spec.KIND, namespace, name) is not None

            async def secret(namespace: str, name: str) -> dict[str, Any] | None:  # (Secrets are not watched)
                return await client.get("Secret", namespace, names.internal(name), live=True)

            tokens = wake.Tokens(known, secret)
            triggers.wake = wake.WakeServer(triggers.autoscaler.wake, tokens, triggers.acting)
            await triggers.wake.start(*config.wake_at, config.wake_url)
        triggers.elector.start()

    async def stop(self) -> None:
        triggers = self.triggers
        if triggers is not None:
            if triggers.wake is not None:
                await triggers.wake.stop()
            if triggers.autoscaler is not None:
                await triggers.autoscaler.stop()
            await triggers.stop()  # (a reconcile in flight finishes, while this replica still leads)
            if triggers.elector is not None:
                await triggers.elector.stop()  # then the Lease is released: a follower leads at once
        await self.observed.stop()
        if self.nodes is not None:
            self.nodes.stop()
        if self.client is not None:
            await self.client.close()


def configure(settings: kopf.OperatorSettings, clusterwide: bool) -> None:
    """kopf's settings for the operator (https://kopf.readthedocs.io/en/stable/configuration/)."""
    settings.posting.enabled = False  # kopf posts no Events of its own: the reconciles post theirs
    settings.peering.standalone = True  # one replica acts by leader election on a Lease, not kopf's peering
    settings.watching.server_timeout = WATCH_SECONDS
    settings.watching.client_timeout = WATCH_SECONDS + 60
    settings.watching.inactivity_timeout = WATCH_SECONDS + 60  # (the server ends a watch first)
    settings.watching.connect_timeout = 30
    # a request that failed (the API server away: a restart) is tried again every second, not after kopf's
    # growing 1, 1, 2, 3, 5, 8, 13, 21 s: watching goes on within a second of the server answering again
    settings.networking.error_backoffs = [1.0] * 8
    # cluster mode: kopf watches CustomResourceDefinitions (a NeuronModel CRD installed later is served);
    # namespaced: no cluster-wide permission at all (the CRD must exist when the operator starts)
    settings.scanning.disabled = not clusterwide
    settings.persistence.diffbase_storage = NoDiffBase()


class NoDiffBase(kopf.DiffBaseStorage):
    """kopf's "last handled state", kept nowhere: only change handlers (on.create, on.update) read it, and the
    operator has none (its event handlers and indexes see every object as it is). kopf's default builds it
    for every event all the same, deep-copying the whole object (its annotations storage would even write it
    to the object on a change handler's success): a sixth of the CPU a re-list of everything costs
    (docs/benchmarks.md)."""

    def build(self, *, body: Any, extra_fields: Any = None) -> Any:
        return {}  # (an empty essence: nothing to compare, nothing copied)

    def fetch(self, *, body: Any) -> None:
        return None

    def store(self, *, body: Any, patch: Any, essence: Any) -> None:
        pass


def watching_parts(
    observed: Observed, clusterwide: bool, credentials: login.Login
) -> tuple[kopf.OperatorRegistry, kopf.OperatorSettings]:
    """A kopf registry that logs in with `credentials` and keeps `observed` (its indexes and event handlers),
    with kopf's settings: what every replica runs."""
    registry, settings = kopf.OperatorRegistry(), kopf.OperatorSettings()
    configure(settings, clusterwide)
    kopf.on.login(registry=registry)(login.kopf_login_with(credentials))
    observed.register(registry, settings)
    return registry, settings


def build(operator: Operator) -> tuple[kopf.OperatorRegistry, kopf.OperatorSettings]:
    """The registry of the operator's kopf handlers and kopf's settings."""
    registry, settings = watching_parts(operator.observed, operator.config.namespaces is None, operator.login)
    if operator.nodes is not None:
        operator.nodes.register(registry)

    @kopf.on.startup(registry=registry)
    async def start(**kwargs: Any) -> None:
        await operator.start(kwargs)

    @kopf.on.cleanup(registry=registry)
    async def stop(**_: Any) -> None:
        await operator.stop()

    return registry, settings


def run(config: Config, stop_flag: asyncio.Event | None = None) -> None:
    """Run the operator until SIGTERM or SIGINT (or `stop_flag`): kopf embedded, in this thread's event loop,
    with its settings as arguments."""
    operator = Operator(config, login.operator_login(config.kubeconfig))
    if config.read_nodes:  # the kinds the API server serves and lets it list, decided before kopf watches
        kinds = asyncio.run(probe(operator.login))
        if "Node" in kinds:
            operator.nodes = NodeWatch(kinds, [devices.settings().lnc_node_label])
    registry, settings = build(operator)
    kopf.run(
        registry=registry,
        settings=settings,
        clusterwide=config.namespaces is None,
        namespaces=config.namespaces or (),
        standalone=True,
        liveness_endpoint=config.liveness,
        stop_flag=stop_flag,
    )
