"""The operator's triggers of the one reconcile path (`reconcile.reconcile`), all from its own watch-backed
caches (`cache.Cache`); kopf runs the process (start-up, signals, clean-up, liveness) and watches nothing.

A NeuronModel is reconciled when it is added or changed by anyone but the operator itself, and when one of
its children (labelled neuronfleet.dev/model) is added, changed or deleted (a deleted Service comes back as
soon as the watch reports it); every model once when this replica starts to lead (at start-up, or on
taking over). Reconciles read the caches, not the API server; a rare cache-only pass over every model
(RESYNC_SECONDS) is the safety net for a change no watch reported. The caches list again the moment the API
server answers after an outage, and a NeuronModel CRD that is missing (not installed yet, or being
replaced) is waited for: the operator never exits for it.

No finalizer: deletion never needs the operator. Every child carries an ownerReference to its NeuronModel
(controller, blockOwnerDeletion), so the API server's garbage collector deletes them when the model goes;
nothing outside the owner references (no external resource, no shared file) needs cleaning, so a model is
deleted at once even with the operator stopped or uninstalled.

The builtin autoscaler's tick loop (`autoscale_loop.AutoscaleLoop`) starts when this replica leads and
queues a model's reconcile through the triggers when it has changed the model's replicas; it hears of every
pod the caches report (a cold start ends when a new pod is ready), and with `--wake-port` the wake endpoint
(`wake.py`) runs its decision for a model whose front door holds a request.

Several replicas (leader election, `leader.py`): every replica keeps its caches warm; only the leader
reconciles, runs the autoscaler's loop and answers wake calls, and `kube.Kube` refuses any other replica's
write, so a follower writes nothing at all. A leader that may not act for a while (its renewal late: the
process was starved) keeps every model it takes meanwhile, and every model whose pass a refused write cut
off, and queues them again once it acts (`Triggers.resume`, after each renewal): none waits for the resync.

Shutdown: on SIGTERM the cleanup handler stops the wake endpoint, the autoscaler's loop and the trigger
workers, then releases the Lease (a follower leads at once) and stops the caches before it closes the HTTP
session.
"""

from __future__ import annotations

import sys
from typing import Any

import kopf

from . import kube, leader, names, spec, wake
from .autoscale_loop import AutoscaleLoop
from .cache import Cache, watch_namespaces
from .triggers import Triggers

_client: kube.Kube | None = None
_triggers: Triggers | None = None


def client() -> kube.Kube:
    global _client
    if _client is None:
        _client = kube.Kube(kube.load_credentials())
    return _client


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    global _triggers
    # kopf watches nothing (the caches do): no scanning of CRDs and namespaces either, so the operator needs
    # no cluster-wide permission beyond its own resources (RBAC_RULES)
    settings.scanning.disabled = True
    election = leader.settings()
    cache = Cache(client(), watch_namespaces(sys.argv), lambda event, obj: triggers.changed(event, obj))
    _triggers = triggers = Triggers(client(), cache)
    client().cache = cache
    cache.start()
    _triggers.start()
    triggers.autoscaler = AutoscaleLoop(client(), triggers.enqueue, cache.models)
    triggers.elector = leader.LeaderElector(client(), election, triggers.lead, triggers.resume)
    client().may_write = triggers.elector.acting
    if (where := wake.configured()) is not None:

        async def known(namespace: str, name: str) -> bool:  # from the cache alone: no call for a name
            if not cache.watches(spec.KIND, namespace):
                return False
            return await cache.get(spec.KIND, namespace, name) is not None

        async def secret(namespace: str, name: str) -> dict[str, Any] | None:  # (Secrets are never cached)
            return await client().get("Secret", namespace, names.internal(name), live=True)

        tokens = wake.Tokens(known, secret)
        triggers.wake = wake.WakeServer(triggers.autoscaler.wake, tokens, triggers.acting)
        await triggers.wake.start(*where)
    triggers.elector.start()


@kopf.on.cleanup()
async def close(**_: Any) -> None:
    if _triggers is not None:
        if _triggers.wake is not None:
            await _triggers.wake.stop()
        if _triggers.autoscaler is not None:
            await _triggers.autoscaler.stop()
        await _triggers.stop()  # (a reconcile in flight finishes, while this replica still leads)
        if _triggers.elector is not None:
            await _triggers.elector.stop()  # then the Lease is released: a follower leads at once
        await _triggers.cache.stop()
    if _client is not None:
        await _client.close()
