"""``geotrain.wrap``: any PyTorch training loop, spread over machines joined by slow links.

A script launched by ``torchrun`` that initialised ``torch.distributed`` as usual (gloo on CPU,
NCCL on GPU) wraps its model and optimizer, unchanged::

    import geotrain
    sync = geotrain.wrap(model, optimizer, algo="diloco", H=10, compress="int4")
    for x, y in loader:
        loss = loss_fn(sync.model(x), y)   # sync.model is the model itself, except under ddp
        loss.backward()
        sync.step()        # the optimizer step, and whatever communication the algorithm does
        sync.zero_grad()
    sync.finish()          # the replicas become one model (the end-of-run average)

The algorithm (``geotrain.sync``) reaches the network only through a ``Communicator`` over the
given process group (the default one unless ``group=``), so ``sync.stats`` counts every byte it
sent and every second it waited. Options are the algorithm's own config fields (``H``,
``compress``, ``outer_lr``, ...); one it does not take is refused with the list of those it does.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from geotrain.comm.communicator import Communicator
from geotrain.comm.guard import AUTO_MIN_WORKERS, default_norm_ratio
from geotrain.launch.dist import NCCL
from geotrain.sync import ALGORITHMS, ConfigError, SyncAlgorithm, sync_config
from geotrain.sync.noise import NoiseScale

# Names a user passes that the configs spell otherwise.
ALIASES = {"plan": "plan_path"}
# lr_scale: "sqrt" runs a local method's own optimizer steps at sqrt(N) times the learning rate
# (SyncAlgorithm.local_lr_factor), "auto" at the factor the measured gradient noise calls for,
# between 1 and sqrt(N) (geotrain.sync.noise), "1" leaves it as given; "" (the default) is the
# algorithm's own (SyncConfig.default_lr_scale: 1 for every algorithm today).
LR_SCALES = ("auto", "sqrt", "1")
LR_SCALE_DEFAULT = ""


def checked_lr_scale(lr_scale: str | int, algo: str = "") -> str:
    """``lr_scale`` as one of LR_SCALES (the number 1 as "1"; "" as ``algo``'s default), or a
    ConfigError saying which."""
    if lr_scale == 1:
        return "1"
    if lr_scale == LR_SCALE_DEFAULT:
        return ALGORITHMS[algo][1].default_lr_scale if algo in ALGORITHMS else "1"
    if lr_scale not in LR_SCALES:
        raise ConfigError(f"lr_scale takes {' or '.join(map(repr, LR_SCALES))}, got {lr_scale!r}")
    return str(lr_scale)


def lr_factor(algorithm: SyncAlgorithm, lr_scale: str) -> float:
    """The factor on the learning rate of ``algorithm``'s step under way: for a local method's
    own steps sqrt(N) under ``lr_scale="sqrt"``, the measured noise's factor under ``"auto"``
    (1 until it is measured, and for the methods that do not measure it); else 1."""
    if lr_scale == "sqrt":
        return algorithm.local_lr_factor()
    if algorithm.noise is not None and algorithm.steps_locally():
        return algorithm.noise.factor(algorithm.comm.world_size)
    return 1.0


class Sync:
    """A wrapped model and optimizer: ``step``, ``zero_grad``, ``finish``, their state and the
    communication counters. Built by :func:`wrap`."""

    def __init__(
        self, algorithm: SyncAlgorithm, optimizer: torch.optim.Optimizer, lr_scale: str = LR_SCALE_DEFAULT
    ) -> None:
        self.algorithm = algorithm
        self.optimizer = optimizer
        self.lr_scale = checked_lr_scale(lr_scale, algorithm.name)
        self._finished = False
        if self.lr_scale == "auto" and algorithm.measures_noise:
            algorithm.noise = NoiseScale(algorithm.parameters(), optimizer)

    def lr_factor(self) -> float:
        """What the next optimizer step multiplies the optimizer's learning rate by."""
        return lr_factor(self.algorithm, self.lr_scale)

    @property
    def model(self) -> nn.Module:
        """The module to call forward on: the model itself, or PyTorch DDP's wrapper (``ddp``)."""
        return self.algorithm.model

    def step(
        self,
        *,
        before_update: Callable[[], None] | None = None,
        after_update: Callable[[], None] | None = None,
    ) -> bool:
        """After ``loss.backward()``: the optimizer step and this step's communication. Returns
        True when this step synchronised the replicas (every step for per-step methods, every H
        for periodic ones). ``before_update`` and ``after_update`` run just around the optimizer
        step, after the communication that must precede it and before the rest (the CLI's loop
        times the update there, and marks that a failure from then on comes after it)."""
        if self._finished:
            raise RuntimeError("step() after finish(): wrap the model again to train on")
        self.algorithm.before_step()
        if before_update is not None:
            before_update()
        factor = self.lr_factor()
        if factor == 1.0:
            self.optimizer.step()
        else:
            self._scaled_step(factor)
        if after_update is not None:
            after_update()
        synced = self.algorithm.after_step()
        self.algorithm.settle()  # complete: a later failure keeps what its messages changed
        return synced

    def _scaled_step(self, factor: float) -> None:
        """The optimizer step at ``factor`` x each group's learning rate, its weight decay held
        where it was (lr x wd: decay is not gradient noise), then the caller's values put back,
        unless the step set new ones itself (a step hook's scheduler): those are kept, unscaled."""
        groups = self.optimizer.param_groups
        given = [(group["lr"], group.get("weight_decay")) for group in groups]
        for group, (lr, wd) in zip(groups, given, strict=True):
            group["lr"] = lr * factor
            if wd:
                group["weight_decay"] = wd / factor
        scaled = [(group["lr"], group.get("weight_decay")) for group in groups]
        try:
            self.optimizer.step()
        finally:
            for group, (lr, wd), (lr_in, wd_in) in zip(groups, given, scaled, strict=True):
                group["lr"] = lr if group["lr"] == lr_in else group["lr"] / factor
                if wd:
                    group["weight_decay"] = (
                        wd if group["weight_decay"] == wd_in else group["weight_decay"] * factor
                    )

    def computes(self) -> bool:
        """Before a step: whether this worker computes it. Always True but under
        ``pace="time"`` (``localsgd``, ``diloco``), where a straggler skips its last steps of a
        period: call ``skip()`` instead of the forward, backward and ``step()``."""
        return self.algorithm.computes_step()

    def skip(self) -> bool:
        """A step this worker does not compute (``computes()`` said so): only the sync it
        holds, if any. Returns True when it synchronised."""
        if self._finished:
            raise RuntimeError("skip() after finish(): wrap the model again to train on")
        synced = self.algorithm.after_step()
        self.algorithm.settle()
        return synced

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def finish(self) -> None:
        """Leave one model on every worker (the end-of-run average of replicas that may differ),
        release the algorithm's hooks, and wait for every worker to get here, so that each can
        then destroy the process group. Called once, after the last ``step``."""
        if self._finished:
            return
        self.algorithm.finalize()
        self.algorithm.close()
        # Leave together: a worker that destroys its process group while a peer still finishes
        # makes gloo abort that peer at exit ("terminate called without an active exception").
        self.algorithm.comm.barrier()
        gc.collect()  # what holds the group (a DDP reducer, works) goes before the group does
        self._finished = True

    @property
    def stats(self) -> dict[str, float]:
        """Bytes handed to collectives (``payload_bytes``), put on the link (``sent_bytes``) and
        taken off it (``recv_bytes``), collectives launched (``calls``), seconds spent waiting
        for them (``blocked_s``), since ``wrap``."""
        return self.algorithm.comm.stats.as_dict()

    def state_dict(self) -> dict[str, Any]:
        """This worker's training state: model, optimizer and the algorithm's own (outer
        optimizer, codec residuals, a message in flight). ``load_state_dict`` of it on the same
        workers continues where it was (``torch.save`` it; the CLI snapshots the same parts).
        Not in it: random generators (dropout, your data order: yours to save) and, under
        ``ddp_powersgd``, PyTorch's PowerSGD state (its error feedback restarts)."""
        sync = self.algorithm.state_dict()  # first: DreamDDP lands the averages in flight
        return {
            "sync": sync,
            "model": self.algorithm.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"model", "optimizer", "sync"} - set(state)
        if missing:
            raise ValueError(f"not a geotrain.wrap state: it lacks {', '.join(sorted(missing))}")
        self.algorithm.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.algorithm.load_state_dict(state["sync"])

    def __enter__(self) -> Sync:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.finish()
        else:  # an error: leave the replicas as they are, but take the hooks away
            self.algorithm.close()


def accepted_options(algo: str) -> list[str]:
    """The options ``wrap`` takes for ``algo``: its config's fields."""
    names = [f.name for f in fields(ALGORITHMS[algo][1]) if f.init]
    return [next((k for k, v in ALIASES.items() if v == n), n) for n in names]


def _with_cpu_backend(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """``group``, or where it is NCCL's alone (``init_process_group("nccl")``), a group of the
    same ranks that pairs NCCL with gloo: geotrain exchanges a few CPU numbers (losses, digests,
    the norm check's verdicts), which NCCL refuses. Collective: every rank calls ``wrap``."""
    if not (dist.is_available() and dist.is_initialized()):
        return group
    if str(dist.get_backend(group)) not in ("nccl", "cuda:nccl"):
        return group
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    # only the group's own ranks take part (a subgroup's wrap is not called by the others)
    return dist.new_group(ranks, backend=NCCL, use_local_synchronization=True)


def wrap(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    algo: str = "diloco",
    *,
    group: dist.ProcessGroup | None = None,
    profile: Callable[[], torch.Tensor] | None = None,
    max_norm_ratio: float | str = "auto",
    aggregate: str = "mean",
    lr_scale: str = LR_SCALE_DEFAULT,
    **options: Any,
) -> Sync:
    """Wrap ``model`` and ``optimizer`` (neither is changed or subclassed) in ``algo``, one of
    ``geotrain.sync.ALGORITHMS``, over ``group`` (default: the default process group; without
    one initialised, a world of one that moves nothing). Every worker starts from rank 0's
    parameters. ``options`` are the algorithm's (``accepted_options(algo)``); ``dreamddp`` takes
    ``plan=`` (a file from ``geotrain plan``), or ``profile=``, a function that computes a
    training loss on a batch, called a few times here to profile the model and the link; with
    neither it times the loop's first steps (synchronous ones) and plans from them.
    ``sparseloco`` with ``H="auto"`` times steps and a gather with ``profile=`` to choose its
    period; without it, it runs at 20 and says so. ``streaming`` with ``tau="auto"`` times them
    likewise to choose how many steps each fragment's sync overlaps; without it, 1. ``co2``
    (``tau="auto"``, its default) times them to choose how many steps into the next period each
    period's mean lands; without it, a period late (tau = H), and it says so. A
    ``load_state_dict`` after ``wrap`` (a resume) restores the period (tau) chosen before.
    ``max_norm_ratio`` R > 0 leaves out of every average a worker's contribution that is not
    finite or whose norm is more than R times the others' median (inf: only what is not
    finite; 0: off; "auto", the default: 10 for the periodic methods and the gathers, inf
    among 2 workers; off for the per-step averages of ssgd, ddp, dreamddp and a warm start and
    for ``pace="time"``), and ``aggregate="clip"``
    scales each one down to the median norm
    (``geotrain.comm.guard``). ``lr_scale="sqrt"`` runs the optimizer steps each worker takes
    on its own gradient (the local methods': ``SyncAlgorithm.local_steps``) at sqrt(N) times the
    optimizer's learning rate, N the group's size, so that their average moves as far as a
    synchronous step at the learning rate given where gradient noise dominates; "auto" at the
    factor between 1 and sqrt(N) that the noise measured across the workers at each sync calls
    for (``geotrain.sync.noise``: localsgd, diloco, dreamddp, co2 without eager, sparseloco
    without overlap; 1 for the others); "1" leaves it as given. By default each algorithm's own
    (``SyncConfig.default_lr_scale``): "1" for every algorithm today."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"wrap takes a torch.nn.Module as the model, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"wrap takes a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if algo not in ALGORITHMS:
        raise ConfigError(f"unknown algorithm {algo!r}; accepted: {', '.join(ALGORITHMS)}")
    lr_scale = checked_lr_scale(lr_scale, algo)  # before the algorithm puts its hooks on the model
    accepted = accepted_options(algo)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ConfigError(
            f"{algo} does not take {', '.join(unknown)}; it takes: {', '.join(accepted) or 'no options'}"
        )
    config = sync_config(algo, {ALIASES.get(k, k): v for k, v in options.items()})
    if isinstance(max_norm_ratio, str):
        if max_norm_ratio != "auto":
            raise ConfigError(
                f"max_norm_ratio takes a number >= 1, 0 for off, or 'auto'; got {max_norm_ratio!r}"
            )
        max_norm_ratio = default_norm_ratio(
            algo,
            str(getattr(config, "compress", "")),
            str(getattr(config, "pace", "steps")),
            int(getattr(config, "warm_start", 0)),
        )
        auto_min_workers = AUTO_MIN_WORKERS
    else:
        auto_min_workers = 0
    group = _with_cpu_backend(group)
    try:
        comm = Communicator(
            group=group, max_norm_ratio=max_norm_ratio, aggregate=aggregate, auto_min_workers=auto_min_workers
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    algorithm = ALGORITHMS[algo][0](model, optimizer, comm, config)
    if profile is not None:
        algorithm.prepare(profile)
    else:
        algorithm.prepare_unprofiled()
    return Sync(algorithm, optimizer, lr_scale)
