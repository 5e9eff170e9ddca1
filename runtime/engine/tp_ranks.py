"""The ranks of a tensor-parallel server: its other processes, started by rank 0, and what rank 0 tells them
each step.

Rank 0 is the server: its engine schedules, its runner samples. It starts ranks 1..world-1 as child processes
(multiprocessing's spawn: each imports torch afresh). Not torchrun (torch.distributed.run): it starts every
rank as a peer under a launcher, where here one rank is the HTTP server the pod's probes and Service reach,
and the others are its helpers, started when its model loads and stopped with it. All of them join one
torch.distributed process group: gloo on CPU, TorchNeuron's `neuron` backend on a Neuron device (the Neuron
docs, torch/guides/torch-distributed). Each rank loads its share of the model (`tensor_parallel.Shard`) with
its own KV cache and host KV pool. Before each step rank 0 broadcasts the step's work (`ModelRunner.StepWork`:
the slots' moves, saves, copies and fetches, and the pass's input tensors). Every rank then runs the same
work, and the pass's all-reduces meet. A rank other than 0 keeps no requests, no sampler state and no
scheduler; it does what it is told and drops the logits.

On a Neuron device each rank holds one NeuronCore (`rank_cores`): the i-th of the cores the pod was given
(`NEURON_RT_VISIBLE_CORES`, which the Neuron device plugin sets in the container), set in the rank's
environment before its runtime starts, as the Neuron runtime's configuration guide partitions an instance
between processes. TorchNeuron's `neuron` backend carries the passes' all-reduces; a step's work goes over
a gloo group beside it (`_control`), on the host.

The group is torch's, for its collectives; the broadcast of a step's work is `broadcast_object_list` (a
pickle of a few small tensors and lists). Nothing of it is reachable from outside the pod: the ranks meet
through a FileStore in a private temporary folder (torch's default, a TCPStore, listens on every interface
for the server's life, and unpickles nothing but would let anyone who reaches it meddle with the group), and
gloo's connections are bound to the loopback interface (GLOO_SOCKET_IFNAME=lo; it would otherwise bind the
address the pod's hostname resolves to). What torch does not give: a child that outlives its parent. A rank
whose server died (SIGKILL, OOM) would wait in the next broadcast for ever, so each rank watches its parent
and exits when it is gone.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

log = logging.getLogger(__name__)

STOP = None  # the message that ends a rank's loop
VISIBLE_CORES_ENV = "NEURON_RT_VISIBLE_CORES"  # the NeuronCores a process may use (Neuron runtime's)
_control: Any = None  # this process's gloo group for the steps' work (the world group where that is gloo)


def backend_for(device: str) -> str:
    return "neuron" if device == "neuron" else "gloo"


def parse_cores(visible: str) -> list[int]:
    """NEURON_RT_VISIBLE_CORES as the Neuron runtime reads it: an index, a range `4-7`, or a list of them
    (`0,2-3`); ValueError saying what is wrong."""
    cores: list[int] = []
    for part in visible.replace(" ", "").split(","):
        first, sep, last = part.partition("-")
        if not first.isdigit() or (sep and not last.isdigit()):
            raise ValueError(
                f"{VISIBLE_CORES_ENV}={visible!r}: expected core indices and ranges, like 0-3 or 0,2"
            )
        low, high = int(first), int(last) if sep else int(first)
        if high < low:
            raise ValueError(f"{VISIBLE_CORES_ENV}={visible!r}: the range {part} runs backwards")
        cores += range(low, high + 1)
    if len(set(cores)) != len(cores):
        raise ValueError(f"{VISIBLE_CORES_ENV}={visible!r} names a core twice")
    return cores


def rank_cores(visible: str | None, world: int) -> list[str]:
    """Each rank's NeuronCore, as its NEURON_RT_VISIBLE_CORES: the i-th of the pod's cores (`visible`, the
    server's own NEURON_RT_VISIBLE_CORES), or core i where the server was given no such list (the runtime
    then sees every core of the node). ValueError where the pod has fewer cores than ranks."""
    cores = parse_cores(visible) if visible else list(range(world))
    if len(cores) < world:
        raise ValueError(
            f"tensor parallelism {world} runs a rank per NeuronCore, but this pod has {len(cores)} "
            f"({VISIBLE_CORES_ENV}={visible}): request {world} NeuronCores, or serve at --tensor-parallel "
            f"{len(cores)}"
        )
    return [str(c) for c in cores[:world]]


def _join(rank: int, world: int, store: str, device: str, core: str | None) -> None:
    """Join the group through the FileStore at `store`, on NeuronCore `core` where the device is Neuron (set
    before the runtime starts: nothing here has touched the device yet); gloo's connections on the loopback
    interface."""
    global _control
    backend = backend_for(device)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    if backend == "neuron":  # one core a rank; the torchrun-style names the backend reads, and loopback
        os.environ.update({VISIBLE_CORES_ENV: core or str(rank), "LOCAL_RANK": str(rank), "RANK": str(rank),
                           "LOCAL_WORLD_SIZE": str(world), "WORLD_SIZE": str(world),
                           "MASTER_ADDR": "127.0.0.1"})  # fmt: skip
    dist.init_process_group(backend, store=dist.FileStore(store, world), rank=rank, world_size=world)
    _control = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo")


def _watch_parent(parent: int) -> None:
    """Exit this rank when the server that started it is gone (it would wait in a broadcast for ever)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _rank_main(
    rank: int, world: int, store: str, model_dir: str, config: Any, parent: int, runner_class: type,
    core: str | None,
) -> None:  # fmt: skip
    """A rank other than 0: join the group, load its share (`runner_class`: the ModelRunner), run each step's
    work until told to stop."""
    _watch_parent(parent)
    _join(rank, world, store, config.device, core)
    runner = runner_class(model_dir, config, rank=rank)
    try:
        while True:
            message = [None]
            dist.broadcast_object_list(message, src=0, group=_control)
            if message[0] is STOP:
                break
            runner.execute(message[0])
    finally:
        dist.destroy_process_group()


@dataclass
class Ranks:
    """Rank 0's handle on the other ranks: `broadcast(work)` before each step, `stop()` at the end."""

    world: int
    folder: str  # the private folder of the group's FileStore
    processes: list[Any] = field(default_factory=list)
    stopped: bool = False

    @classmethod
    def start(cls, model_dir: str | Path, config: Any, runner_class: type) -> Ranks:
        """Start ranks 1..world-1, each loading its share with `runner_class` (the ModelRunner, passed by
        name: this module imports none), and join the group as rank 0 (returns once every rank has
        joined)."""
        world = config.tensor_parallel
        cores: list[str | None] = [None] * world
        if config.device == "neuron":  # (refused before any rank starts where the pod has too few)
            cores = [*rank_cores(os.environ.get(VISIBLE_CORES_ENV), world)]
        ranks = cls(world, tempfile.mkdtemp(prefix="neuronfleet-ranks-"))  # (mode 0700)
        store = os.path.join(ranks.folder, "store")
        context = multiprocessing.get_context("spawn")
        for rank in range(1, world):
            process = context.Process(
                target=_rank_main,
                args=(rank, world, store, str(model_dir), config, os.getpid(), runner_class, cores[rank]),
                name=f"tensor-parallel-rank-{rank}", daemon=True,
            )  # fmt: skip
            process.start()
            ranks.processes.append(process)
        _join(0, world, store, config.device, cores[0])
        log.info(
            "tensor parallelism %d: ranks 1..%d started (%s)", world, world - 1, backend_for(config.device)
        )
        return ranks

    def broadcast(self, work: Any) -> None:
        dead = [f"{p.name} (exit code {p.exitcode})" for p in self.processes if not p.is_alive()]
        if dead:
            raise RuntimeError(f"tensor-parallel {', '.join(dead)} exited")
        dist.broadcast_object_list([work], src=0, group=_control)

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        try:
            if all(p.is_alive() for p in self.processes):
                dist.broadcast_object_list([STOP], src=0, group=_control)
            dist.destroy_process_group()
        finally:
            for p in self.processes:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
            shutil.rmtree(self.folder, ignore_errors=True)
