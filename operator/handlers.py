"""The kopf handlers: thin triggers of the one reconcile path (`reconcile.reconcile`).

A NeuronModel is reconciled when it is created, changed or found at start-up (resume), when one of its
compile Jobs or Deployments changes (so status follows the children), and every RESYNC_SECONDS (drift).
Deletion needs no handler: every child carries an ownerReference, and the garbage collector removes them.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from . import builders, kube, spec
from .reconcile import reconcile

RESYNC_SECONDS = 30.0
CHILD_LABELS = {f"{builders.LABEL_PREFIX}/model": kopf.PRESENT}

_client: kube.Kube | None = None


def client() -> kube.Kube:
    global _client
    if _client is None:
        _client = kube.Kube(kube.load_credentials())
    return _client


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.posting.level = logging.INFO  # transitions become Kubernetes events
    settings.persistence.finalizer = f"{spec.GROUP}/kopf"
    settings.watching.server_timeout = 60
    settings.networking.request_timeout = 30
    # no watching of CRDs and namespaces at run time: the chart installs our CRD before the operator starts,
    # and the operator needs no cluster-wide permission beyond its own resources (RBAC_RULES)
    settings.scanning.disabled = True


@kopf.on.cleanup()
async def close(**_: Any) -> None:
    if _client is not None:
        await _client.close()


def _emitter(body: Any, logger: logging.Logger):
    def emit(kind: str, reason: str, message: str) -> None:
        (kopf.warn if kind == "Warning" else kopf.info)(body, reason=reason, message=message or reason)
        logger.info("%s %s: %s", kind, reason, message)

    return emit


@kopf.on.resume(spec.GROUP, spec.VERSION, spec.PLURAL)
@kopf.on.create(spec.GROUP, spec.VERSION, spec.PLURAL)
@kopf.on.update(spec.GROUP, spec.VERSION, spec.PLURAL)
async def on_model(body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
    await reconcile(client(), dict(body), _emitter(body, logger))


@kopf.timer(spec.GROUP, spec.VERSION, spec.PLURAL, interval=RESYNC_SECONDS, idle=RESYNC_SECONDS)
async def resync(body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
    await reconcile(client(), dict(body), _emitter(body, logger))


async def _owner_changed(body: kopf.Body, logger: logging.Logger) -> None:
    owner_name = body["metadata"]["labels"][f"{builders.LABEL_PREFIX}/model"]
    owner = await client().get(spec.KIND, body["metadata"]["namespace"], owner_name)
    if owner is not None:
        await reconcile(client(), owner, _emitter(owner, logger))


@kopf.on.event("batch", "v1", "jobs", labels=CHILD_LABELS)
async def on_job(body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
    await _owner_changed(body, logger)


@kopf.on.event("apps", "v1", "deployments", labels=CHILD_LABELS)
async def on_deployment(body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
    await _owner_changed(body, logger)
