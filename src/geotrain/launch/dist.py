"""Process-group set-up from torchrun's environment: the one place that reads RANK and friends.

A worker started by ``torchrun`` (locally by ``geotrain run`` or by hand across real machines)
finds ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and the rendezvous store in its environment. A
worker started without torchrun is a world of one and creates no process group, unless it is
given a broker (``geotrain broker``, ``init_from_broker``): then the broker's store is the
rendezvous of the first epoch as of every later one.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    backend: str | None
    device: torch.device
    local_world_size: int = 1  # workers on this machine, which share its cores
    # A gloo group of its own for snapshot traffic, so that background transfers never interleave
    # with the training collectives (None in a world of one).
    snapshot_group: Any = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


# NCCL moves only CUDA tensors; the control traffic (losses, digests, verdicts, pickled
# state) is a few CPU floats, so GPU groups pair it with gloo for CPU tensors (torch's
# per-device backends) rather than copying each number to the GPU and back.
NCCL = "cpu:gloo,cuda:nccl"
BACKENDS = ("auto", "nccl", "gloo")


def choose_backend(requested: str, cuda_devices: int, local_workers: int, who: str = "workers") -> str:
    """The process-group backend for ``requested`` (auto, nccl or gloo) on a machine with
    ``cuda_devices`` GPUs running ``local_workers`` workers. auto: NCCL (with gloo for CPU
    tensors) where every worker has a GPU of its own; gloo, which moves CUDA tensors too, where
    several share one, since NCCL refuses two ranks on one GPU; gloo without a GPU. ``who``
    names the workers in the refusals ("hosts": the local launcher's emulated machines)."""
    if requested not in BACKENDS:
        raise ValueError(f"backend takes {', '.join(BACKENDS)}; got {requested!r}")
    if requested == "gloo" or cuda_devices == 0:
        if requested == "nccl":
            raise ValueError("backend nccl needs a CUDA GPU, and none is visible: use gloo")
        return "gloo"
    if requested == "nccl" and local_workers > cuda_devices:
        raise ValueError(
            f"backend nccl needs a GPU per {who[:-1]}: {local_workers} {who} on this machine share "
            f"{cuda_devices} GPU(s) (NCCL refuses two ranks on one GPU); use gloo or fewer {who}"
        )
    return NCCL if local_workers <= cuda_devices else "gloo"


def uses_nccl(backend: str | None) -> bool:
    return backend is not None and "nccl" in backend


def worker_device(local_rank: int) -> torch.device:
    """This worker's device: its GPU (workers beyond the GPUs share them round-robin), else CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def device_and_backend(
    requested: str = "auto", local_rank: int | None = None, local_workers: int | None = None
) -> tuple[torch.device, str]:
    """This worker's device (``worker_device``) and its group's backend (``choose_backend``);
    ``local_rank`` and ``local_workers`` default to torchrun's ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE``. A script of one's own under torchrun can start with it too:
    ``dist.init_process_group(backend, device_id=device if uses_nccl(backend) else None)``."""
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_workers is None:
        local_workers = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    device = worker_device(local_rank)
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    return device, choose_backend(requested, gpus, local_workers)


def init_distributed(timeout_s: float = 600.0, backend: str = "auto") -> DistContext:
    """Join the process group torchrun prepared: NCCL where each worker has a GPU of its own
    (with gloo for CPU tensors), gloo otherwise (``choose_backend``)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    device, backend = device_and_backend(backend, local_rank, local_world_size)
    if world_size == 1:
        return DistContext(0, 1, 0, None, device, local_world_size)
    dist.init_process_group(
        backend=backend,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if uses_nccl(backend) else None,
    )
    snapshot_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    return DistContext(
        dist.get_rank(), dist.get_world_size(), local_rank, backend, device, local_world_size, snapshot_group
    )


def init_from_broker(
    addr: str, port: int, host: int, hosts: int, timeout_s: float = 600.0, backend: str = "auto"
) -> DistContext:
    """Join the first epoch on the broker's store (one worker per machine, no torchrun): host
    ``host`` of ``hosts`` is rank ``host``. The rendezvous lives in the broker, not in a trainer,
    so losing any trainer (the first one included) loses nothing, and no torchrun agent waits at
    exit for the agent of a lost machine."""
    device, backend = device_and_backend(backend, local_rank=0, local_workers=1)
    store = dist.TCPStore(
        addr, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
    )
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("geotrain/epoch0", store),
        rank=host,
        world_size=hosts,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if uses_nccl(backend) else None,
    )
    snapshot_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    return DistContext(host, hosts, 0, backend, device, 1, snapshot_group)


def init_joiner(host: int, hosts: int, timeout_s: float = 600.0, backend: str = "auto") -> DistContext:
    """A replacement worker (``--join``): a world of one of its own until the members admit it
    (``ft/membership.py``), so that its model, optimizer and algorithm are built as everywhere.
    ``rank`` is its host id among the ``hosts`` the run started with (its data shard)."""
    device, backend = device_and_backend(backend, local_rank=0, local_workers=1)  # before any group
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timedelta(seconds=timeout_s))  # fmt: skip
    return DistContext(host, hosts, 0, backend, device, 1, None)


def shutdown_distributed(together: bool = True) -> None:
    """Leave the group. After success, leave together: a worker that tears its connections down
    while a peer is still finishing makes gloo abort that peer ("terminate called without an
    active exception"). After an error, do not wait for peers that may be stuck elsewhere.

    Objects that hold a process group (a DDP reducer, pending works) are collected before the
    groups are destroyed: one freed later, during interpreter exit, destroys a gloo context whose
    threads are still joinable, and C++ ``std::terminate``s the process after it has finished."""
    if dist.is_available() and dist.is_initialized():
        try:
            if together:
                dist.barrier()
        finally:
            gc.unfreeze()  # (a trainer froze what its start made: ``train``) all of it is seen
            gc.collect()
            dist.destroy_process_group()
            gc.collect()
