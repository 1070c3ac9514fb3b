"""The per-worker training loop: what ``torchrun ... -m geotrain.train`` runs on every machine.

Read it top to bottom: join the process group, load this worker's data shard, build the GPT and
its optimizer, wrap both in the chosen sync algorithm, train for ``steps`` steps recording
metrics, then finalize (so the replicas end as one model), evaluate, save and summarise.

    torchrun --nnodes 4 --nproc-per-node 1 --node-rank I --master-addr HOST0 --master-port 29500 \\
        -m geotrain.train --algo diloco --H 10 --model mini --steps 200 --run-dir runs/x

The run's configuration is ``train_config.py``, its flags ``train_args.py``, and this process's
way into and out of a run (admission, a spare's place, leaving) ``train_worker.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import shutil
import statistics
import sys
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from geotrain.api import Sync, lr_factor
from geotrain.comm.buckets import flatten, unflatten_into
from geotrain.comm.communicator import CollectiveTimeout, Communicator, peer_lost_line, timeout_line
from geotrain.comm.guard import AUTO, AUTO_MIN_WORKERS
from geotrain.data.corpus import BatchSampler, DataError, load_corpus
from geotrain.ft.atomic import atomic_file, write_atomic
from geotrain.ft.chaos import fire_at_step, parse_chaos
from geotrain.ft.elastic import StepStatus, admit_after_redo, copies_at_the_end, owned_shards, regroup
from geotrain.ft.keeper import KeeperClient
from geotrain.ft.membership import (
    EXIT_BELOW_MIN_WORKERS,
    EXIT_NO_STATE_HOLDER,
    BelowMinWorkers,
    Excluded,
    JoinRefused,
    Membership,
    MembershipChanged,
    NoStateHolder,
    RunFinished,
)
from geotrain.ft.snapshots import ResumeError, SnapshotConfig, Snapshotter, restore
from geotrain.ft.state import capture, param_digest, tensors_digest
from geotrain.ft.state import restore as restore_state
from geotrain.launch.admission import Refused, eviction, read_token
from geotrain.launch.agent import TRAINER_LOG_ONLY
from geotrain.launch.coordinator import Heartbeat
from geotrain.launch.dist import (
    DistContext,
    choose_backend,
    init_distributed,
    init_from_broker,
    init_joiner,
    shutdown_distributed,
    uses_nccl,
)
from geotrain.metrics import MetricsWriter, metrics_up_to, summary_table
from geotrain.models import build_model, describe
from geotrain.sync import ConfigError, build_sync
from geotrain.train_args import add_train_arguments, config_from_args
from geotrain.train_config import AUTO_H, AUTO_WARMUP, TrainConfig, warmup_arg, warmup_for
from geotrain.train_worker import _admit, _fatal, _leave, _run_hosts, broker_address, take_a_place

# geotrain.train's public names: the loop's own, and (re-exported) the configuration and flag
# helpers that lived here before train_config.py and train_args.py, which tests, benchmarks and
# users import from geotrain.train.
__all__ = [
    "AUTO_H",
    "AUTO_WARMUP",
    "TrainConfig",
    "add_train_arguments",
    "config_from_args",
    "evaluate",
    "evaluate_run",
    "forward_precision",
    "lr_at",
    "main",
    "make_optimizer",
    "train",
    "train_parser",
    "warmup_arg",
    "warmup_for",
]


def lr_at(step: int, cfg: TrainConfig) -> float:
    """The (inner) optimizer's learning rate at 0-based ``step``: a linear warm-up over
    ``cfg.warmup`` steps, then constant or a cosine from ``lr`` down to ``min_lr_ratio * lr`` at
    the last step. It depends on the step alone, so a resumed or regrouped worker (or a joiner)
    picks it up where the others are, and every algorithm gets the same one."""
    if cfg.warmup and step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    if cfg.lr_schedule == "constant":
        return cfg.lr
    decay_steps = (cfg.lr_steps or cfg.steps) - 1 - cfg.warmup
    # With nothing left to decay over: the peak once, then the floor.
    progress = (step - cfg.warmup) / decay_steps if decay_steps > 0 else float(step > cfg.warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]  # with --lora: the adapters
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))


def forward_precision(device: torch.device, autocast: str):
    """Where forward passes run: under torch.autocast in bfloat16 with ``--autocast bf16`` (on
    CUDA and CPU alike); a no-op context otherwise. Backward follows the forward's casts."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast == "bf16")


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches, device: torch.device, autocast: str = "off") -> float:
    was_training = model.training
    model.eval()
    with forward_precision(device, autocast):
        losses = [model(x.to(device), y.to(device))[1].float().item() for x, y in batches]
    model.train(was_training)
    return sum(losses) / len(losses)


def evaluate_run(
    model: torch.nn.Module,
    batches,
    device: torch.device,
    comm: Communicator,
    average: bool,
    autocast: str = "off",
) -> tuple[float, float | None]:
    """A mid-run validation: ``(val_loss, val_loss_replicas)``.

    The replicas' own losses, averaged, are the first figure without ``average``, or where the
    replicas are one model (the second is then None). With it, where they differ (a periodic
    method between its syncs), the first is the loss of their mean, the model ``finalize`` would
    make of them if the run stopped here, which is what a time-to-loss comparison with DDP must
    score; the second is still the replicas'. The mean is evaluated in place and the replica's
    own parameters are put back bitwise, so training goes on exactly as without the evaluation.
    """
    replicas = comm.mean_scalars([evaluate(model, batches, device, autocast)])[0]
    if not average or comm.world_size == 1:
        return replicas, None
    trained = [p.data for p in model.parameters() if p.requires_grad]
    own = flatten(trained)
    if comm.same_everywhere(own):
        return replicas, None  # already one model (a sync step, or a synchronous method)
    try:
        unflatten_into(comm.mean_control(own.to(torch.float32, copy=True)), trained)
        mean_loss = comm.mean_scalars([evaluate(model, batches, device, autocast)])[0]
    finally:
        unflatten_into(own, trained)
    return mean_loss, replicas


def train(cfg: TrainConfig, ctx: DistContext, heartbeat: Heartbeat | None = None) -> dict[str, Any]:
    """Train on this worker; returns the run summary (numbers averaged over workers).

    With ``cfg.elastic`` and a ``heartbeat``, a failure of another worker does not end the run:
    this worker regroups with the survivors (``ft/elastic.py``) and goes on. With ``cfg.join`` it
    is a replacement: it waits to be admitted, receives the members' state, and trains with them."""
    torch.manual_seed(cfg.seed)
    torch.set_flush_denormal(True)  # denormals slow CPU runs by 10-20% here
    threads = cfg.threads or max(1, (os.cpu_count() or 1) // ctx.local_world_size)
    torch.set_num_threads(threads)
    device = ctx.device
    run_dir = Path(cfg.run_dir) if cfg.run_dir else None
    if run_dir is not None and cfg.elastic:  # this host's regroup records (no launcher made it)
        (run_dir / "control").mkdir(parents=True, exist_ok=True)

    corpus = load_corpus(cfg.data or None, cfg.tokenizer)
    model = build_model(cfg.model_spec(), corpus.vocab_size, cfg.block_size or None, corpus.tokens).to(device)
    sampler = BatchSampler(corpus, model.block_size, cfg.batch_size, ctx.rank, ctx.world_size, cfg.seed)
    val_batches = sampler.val_batches(cfg.eval_batches)
    eval_average = cfg.eval_model == "average" or (
        cfg.eval_model == "auto" and cfg.network_mode == "loopback"
    )

    optimizer = make_optimizer(model, cfg)
    # What is alive now lives as long as the run: the modules (the optimizer's first parameter
    # group imports torch._dynamo and sympy: 2,000 modules, 120,000 objects), the model, the
    # data. Kept out of every collection until ``shutdown_distributed`` unfreezes it, so the two
    # full collections of each regroup (``Membership.join``) take milliseconds, not 0.3-1 s on a
    # loaded machine. Garbage goes first, and nothing that holds a group beyond the group itself
    # exists yet (a DDP reducer, works): those stay collectable.
    gc.collect()
    gc.freeze()
    membership = None
    if cfg.elastic and heartbeat is not None and ctx.world_size > 1:
        first = [] if cfg.join else list(range(ctx.world_size))  # a joiner is in no epoch yet
        membership = Membership(*heartbeat.address, ctx.rank, first, cfg.timeout_s)
        membership.join_request = heartbeat.join_request
        membership.snapshot_groups = cfg.redundancy != "off" and bool(cfg.keeper)
        membership.follow_sites = cfg.hierarchy == "sites"  # a spare's own site (coordinator's numbers)
        membership.measure_joiners = cfg.hierarchy == "auto"  # a joiner's site from its links
        heartbeat.membership = membership
    beyond = sorted(h for h in cfg.slow_factors() if h >= ctx.world_size)
    if beyond:
        raise ConfigError(f"--slow names host {beyond[0]}; the run's hosts are 0 to {ctx.world_size - 1}")
    if cfg.hierarchy != "off" and uses_nccl(ctx.backend):
        raise ConfigError(
            f"--hierarchy {cfg.hierarchy} runs its groups on gloo, not NCCL yet: use --hierarchy off on GPUs"
        )
    sites = cfg.site_of_host() if cfg.hierarchy == "sites" else None
    if cfg.hierarchy == "auto" and ctx.world_size > 1:
        sites = _measured_sites(cfg, ctx, membership, run_dir)
    if sites is not None and len(sites) != ctx.world_size:
        raise ConfigError(
            f"--sites names {len(sites)} hosts; the run has {ctx.world_size}: give one site per host"
        )
    comm = Communicator(
        latency_s=cfg.latency_ms / 1000,
        membership=membership,
        timeout_s=cfg.timeout_s,
        link=cfg.link,
        site_of_host=sites,
        max_norm_ratio=cfg.norm_ratio(),
        auto_min_workers=AUTO_MIN_WORKERS if cfg.max_norm_ratio == AUTO else 0,
        aggregate=cfg.aggregate,
    )
    # Profiling batches come from their own sampler so that the training data stream is the same
    # for every algorithm.
    profile_sampler = BatchSampler(
        corpus, model.block_size, cfg.batch_size, ctx.rank, ctx.world_size, cfg.seed + 1
    )

    def profile_loss() -> torch.Tensor:
        x, y = profile_sampler.next_train()
        with forward_precision(device, cfg.autocast):
            return model(x.to(device), y.to(device))[1]

    if cfg.profile_out:
        return _write_profile(cfg, ctx, model, optimizer, comm, profile_loss)
    sync = build_sync(cfg.algo, model, optimizer, comm, cfg.sync_options())
    stepper = Sync(sync, optimizer, cfg.lr_scale)  # its step() is geotrain.wrap's, run in this loop
    if membership is not None:
        membership.period = sync.sync_period  # asked at each boundary: 1 in a warm start, then H
    generators = {"sampler": sampler.gen, "profile_sampler": profile_sampler.gen}
    snap_dir = run_dir / "snapshots" if run_dir is not None else None
    snap_comm = (
        Communicator(group=ctx.snapshot_group, timeout_s=cfg.timeout_s)
        if ctx.snapshot_group is not None
        else None
    )
    keeper = KeeperClient(cfg.keeper) if cfg.keeper else None
    progress0: dict[str, Any] = {"step": 0, "train_s": 0.0, "eval_s": 0.0, "wall_s": 0.0, "val_loss": None}
    resumed = None
    if not cfg.resume and not cfg.join and snap_dir is not None:
        # A fresh run in a used directory: an old run's snapshots must never be resumed as its own.
        shutil.rmtree(snap_dir / f"rank{ctx.rank}", ignore_errors=True)
    if cfg.resume:
        comm.max_scalars([0.0])  # workers start unevenly: time the restore, not the wait for the slowest
        t_restore = time.perf_counter()
        state, source = restore(ctx.rank, ctx.world_size, keeper, snap_dir, snap_comm, cfg.resume_step)
        progress0 = restore_state(state, model=model, optimizer=optimizer, sync=sync, generators=generators)
        if progress0["step"] > cfg.steps:
            raise ConfigError(
                f"--steps {cfg.steps} is below the snapshot's step {progress0['step']}; give the total, "
                f"e.g. --steps {2 * progress0['step']}"
            )
        if source == "member":
            # Not training at that step (lost and not replaced): it comes back as a joiner is
            # admitted, with fresh windows of its shard (its old stream would repeat batches).
            sampler.fresh_stream(cfg.seed, ctx.rank, salt=7_919 * progress0["step"])
        (restore_s,) = comm.max_scalars([time.perf_counter() - t_restore])
        sources = comm.all_gather_object(source)
        resumed = {"step": progress0["step"], "sources": sources, "restore_s": restore_s}
    sync.prepare(profile_loss)  # dreamddp: profiles and plans, unless its plan was restored
    first_step = progress0["step"] + 1
    snapshots = Snapshotter(
        SnapshotConfig(
            every=cfg.snapshot_every or sync.default_snapshot_every(),
            checkpoint_every=cfg.checkpoint_every,
            redundancy=cfg.redundancy,
            rate_bps=cfg.snapshot_rate_bps(),
            keeper=cfg.keeper,
            directory=snap_dir,
        ),
        ctx.rank,
        ctx.world_size,
        snap_comm,
        control=comm,
        # Parameters, two optimizer moments and one more copy (an anchor): what a snapshot holds.
        # With LoRA the moments and the anchor are the adapters' only.
        size_hint=sum(
            p.numel() * p.element_size() * (4 if p.requires_grad else 1) for p in model.parameters()
        ),
    )

    records = metrics_up_to(run_dir, ctx.rank, progress0["step"]) if cfg.resume else []
    writer = MetricsWriter(run_dir, ctx.rank)
    tokens_per_step = cfg.batch_size * model.block_size * ctx.world_size
    tokens_done = progress0.get("tokens", progress0["step"] * tokens_per_step)
    progress = None
    if ctx.is_main and cfg.progress:
        from tqdm import tqdm

        progress = tqdm(
            total=cfg.steps,
            initial=progress0["step"],
            desc=f"{cfg.algo} x{ctx.world_size}",
            unit="step",
            file=sys.stderr,
        )

    val_loss = progress0["val_loss"]
    eval_s = progress0[
        "eval_s"
    ]  # excluded from train_s, so evaluation frequency does not change time-to-loss
    start = time.perf_counter() - progress0["wall_s"]
    faults = [f for f in parse_chaos(cfg.chaos) if not f.timed]
    token = read_token(cfg.token_file)  # --max-rejections: signed requests to drop a host
    in_a_row: dict[int, int] = {}  # by host: steps whose contribution the checks rejected
    counted_in = [0]  # the membership epoch in_a_row counts in
    keeper_pid = keeper.pid() if keeper is not None and any(f.kind == "kill-host" for f in faults) else 0

    def take_snapshot(step: int, final: bool = False) -> None:
        def state(copy: bool) -> dict[str, Any]:
            now = time.perf_counter()
            return capture(
                step=step,
                model=model,
                optimizer=optimizer,
                sync=sync,
                generators=generators,
                progress={
                    "tokens": tokens_done,
                    "train_s": now - start - eval_s,
                    "eval_s": eval_s,
                    "wall_s": now - start,
                    "val_loss": val_loss,
                },
                replicated=sync.replicated_parts(),
                copy=copy,
            )

        # After a membership change a snapshot says who was training: a resume rebuilds the
        # others from a member (``ft.snapshots.restorable``).
        members = membership.members if membership is not None and membership.epoch > 0 else None
        snapshots.take(step, state, final=final, members=members)

    host = ctx.rank  # this worker's place in the first epoch: its shard, metrics file and chaos
    slow = cfg.slow_factors().get(host, 1.0)
    # A straggler's compute is timed on its own thread's CPU clock where all of it runs on that
    # thread (CPU, one torch thread): a wall clock would count the time other processes held its
    # core, and on a shared machine it would then sleep for their work too.
    compute_clock = time.perf_counter
    if device.type == "cpu" and torch.get_num_threads() == 1:
        compute_clock = time.thread_time
    events: list[dict[str, Any]] = []  # membership changes survived (--on-failure continue)
    phase, loss = "compute", torch.tensor(float("nan"))
    # Evaluations and snapshots (whose agreement to ship is a collective of the group) at steps
    # up to it are skipped: a regroup passed them, or members are not yet in step.
    quiet_through = 0

    def one_step(x: torch.Tensor | None, y: torch.Tensor | None, step: int) -> bool:
        """One step; with no batch, a step this worker skips (``--pace time``): only the sync
        it holds, if any."""
        nonlocal phase, loss
        phase = "compute"
        if membership is not None and membership.changed():
            raise MembershipChanged("a new epoch was published")
        if membership is not None and membership.admit_before(step):
            # The group is whole here, on every member at this boundary: what the last step
            # left in flight lands now (DreamDDP's late means), where the regroup would drop it.
            sync.land_in_flight()
            raise MembershipChanged("a joiner is admitted")
        if x is None:
            loss = torch.tensor(float("nan"))
            phase = "sync"  # nothing to apply: only the synchronisation can fail
            return stepper.skip()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step - 1, cfg)
        for f in faults:  # --chaos corrupt: the communicator spoils this worker's next contribution
            if f.corrupts_at(step, host):
                what = {"shard": "shard of a mean", "stamp": "owners' stamp"}.get(f.part, "contribution")
                if f.part == "shard":
                    comm.corrupt_shard = f.corruption
                elif f.part == "stamp":
                    comm.corrupt_stamp = True
                else:
                    comm.corrupt_next = f.corruption
                print(
                    f"geotrain: chaos: rank {host} corrupts its next {what} ({f.corruption}) "
                    f"from step {step}",
                    file=sys.stderr,
                    flush=True,
                )
        t_forward = compute_clock()
        with forward_precision(device, cfg.autocast):
            _, loss = sync.model(x.to(device), y.to(device))
        if slow > 1:  # a straggler (--slow): its forward's time, the compute without communication
            if device.type == "cuda":
                torch.cuda.synchronize()
            t_forward = compute_clock() - t_forward
        loss.backward()
        t_update = 0.0

        def before_update() -> None:
            nonlocal t_update
            t_update = compute_clock()

        def after_update() -> None:
            nonlocal phase
            stepper.zero_grad()  # before the sync, whose buffers may need that memory
            if slow > 1:  # forward, backward (about twice the forward; it may hold communication,
                # so it is not timed) and the optimizer's update take FACTOR times as long
                time.sleep((slow - 1) * (3 * t_forward + compute_clock() - t_update))
            phase = "sync"  # the local step is applied: only its synchronisation can still fail

        # The step a library user's loop takes (geotrain.wrap): one path for both.
        synced = stepper.step(before_update=before_update, after_update=after_update)
        phase = "after"
        return synced

    pause_after: int | None = None  # fewer than --min-workers: the boundary where they wait
    # A deferred admission (ft/elastic.py): the sync where the joiners meet the members, and
    # the joiners' ranks (their part of it is left out; a joiner skips its steps up to it).
    deferred_until: int | None = None
    deferred_ranks: frozenset[int] = frozenset()
    # A regroup whose joiners stood in for a sync redone before this worker reached it: the
    # joiners receive the state once it has met that sync (``admit_joiners``).
    admit_after: dict | None = None

    def wait_for_joiners(boundary: int) -> None:
        """Fewer than ``--min-workers`` are left: every member stops after the same sync boundary
        (the one the regroup agreed they head for), snapshots there, and waits for a joiner
        (admitted right there, as at any boundary) or another change of members. After
        ``--join-timeout`` it stops, and ``--resume`` goes on from that snapshot."""
        take_snapshot(boundary, final=True)  # this epoch's members, and on disk: the stop may be long
        snapshots.wait()  # in the keeper before anything can stop this trainer
        left = len(membership.members)
        if comm.rank == 0:
            print(
                f"geotrain: {left} worker(s) left, fewer than --min-workers {cfg.min_workers}: paused "
                f"after step {boundary}, waiting up to {cfg.join_timeout:g} s for a replacement",
                file=sys.stderr,
                flush=True,
            )
        # Rank 0 decides when the wait is over, so that all stop together (a member that left on
        # its own clock while a joiner was being admitted would hold the others in the regroup).
        deadline = time.monotonic() + cfg.join_timeout
        while True:
            if membership.stopping():
                raise BelowMinWorkers(f"stopped after step {boundary}")
            if membership.joining() or membership.changed():
                return
            if comm.rank == 0 and time.monotonic() > deadline:
                membership.finish(stopped=True)  # a joiner arriving now is told the run is over
                print(
                    f"geotrain: no replacement came within --join-timeout {cfg.join_timeout:g} s: "
                    f"stopped after step {boundary} with its snapshot; --resume goes on from it",
                    file=sys.stderr,
                    flush=True,
                )
                raise BelowMinWorkers(f"stopped after step {boundary}")
            time.sleep(0.1)

    def recover(error: RuntimeError, status: StepStatus) -> StepStatus:
        """Regroup with the survivors (or re-raise what is not a lost member)."""
        nonlocal tokens_per_step, tokens_done, quiet_through, pause_after
        nonlocal deferred_until, deferred_ranks, admit_after

        def lost_member(e: RuntimeError) -> bool:
            # A collective's error is a lost member if the coordinator says so within the time
            # it takes to find one (an exit at once, a silent host after the fault timeout).
            return isinstance(e, MembershipChanged) or membership.wait_published(cfg.fault_timeout_s + 5)

        if membership is None or not lost_member(error):
            raise error
        previous, stopped_at = list(membership.members), status
        held = None
        if comm.rank in deferred_ranks:  # a deferred joiner that has not met the members: admitted afresh
            held, status = status, StepStatus(-1, False)  # (the state it holds is of a sync they are
            # past; where none of them is left, it goes on from that state: ``regroup``'s ``held``)

        def adopted(leaders: StepStatus, tokens: int) -> None:
            nonlocal status, tokens_done, held  # a retried regroup starts from the state now loaded
            status, tokens_done, held = leaders, tokens, None

        while True:
            try:
                event = regroup(
                    membership, comm, sync, model, optimizer, status, ctx.backend or "gloo", tokens_done,
                    previous, adopted, cfg.steps, held,
                )  # fmt: skip
                break
            except (Excluded, RunFinished, NoStateHolder):
                raise
            except RuntimeError as e:  # a member lost while the group formed: regroup again
                if not lost_member(e):
                    raise
                why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                print(
                    f"geotrain: host {host}: the regroup was cut short ({why}); regrouping again",
                    file=sys.stderr,
                    flush=True,
                )
        tokens_done = event.pop("tokens")
        deferred_until, deferred_ranks = None, frozenset()
        admit_after, again = None, None  # (each regroup decides afresh what is pending)
        if event["deferred"]:  # the members train on while the joiners receive the state
            # no evaluation before that sync: the members would wait there for the joiners
            quiet_through = max(quiet_through, event["deferred_until"] - 1)
            if not event["hand_over_after"]:  # (else once the redo is done: admit_after_redo)
                deferred_until = event["deferred_until"]
                deferred_ranks = frozenset(event["members"].index(h) for h in event["deferred"])
        left_out = frozenset(event["members"].index(h) for h in event["left_out"])
        short = left_out and comm.rank not in left_out and event["resume"].done < event["left_out_until"]
        if short:
            # Short of a sync the others redid with joiners' copies of the leader's state (or
            # joiners standing in): it meets that sync from its own step, their part left out as
            # in the redo (the joiners skip nothing: they are past it, or not training yet).
            deferred_until, deferred_ranks = event["left_out_until"], left_out
        if event["hand_over_after"]:
            if short:  # once it has met the redone sync, in the loop
                admit_after = event
            else:  # the redo is done here: the joiners receive the state now (recorded below)
                try:
                    event.update(admit_joiners(event))
                except RuntimeError as e:  # regrouped again below, once this one is recorded
                    again = e
        # A member behind the furthest (periodic methods: each goes on from its own step) must
        # not wait in an evaluation the others have done or skipped, nor in a snapshot's
        # agreement to ship (due off a sync where ``--snapshot-every`` is no multiple of H).
        quiet_through = max(quiet_through, event["quiet_through"])
        sampler.read_shards(owned_shards(host, ctx.world_size, event["members"]))
        tokens_per_step = cfg.batch_size * model.block_size * comm.world_size
        # Snapshots go on, each into this host's keeper, and redundancy among the new members.
        group = membership.snapshot_group
        snapshots.regroup(
            Communicator(group=group, timeout_s=cfg.timeout_s) if group is not None else None,
            event["members"],
        )
        if not cfg.snapshot_every:  # a joiner that chose its period alone (--H auto): the members' now
            snapshots.cfg.every = sync.default_snapshot_every()
        resume = event.pop("resume")
        # The boundary the regroup agreed they all head for (each from its own step).
        few = len(event["members"]) < cfg.min_workers
        pause_after = event["boundary"] if few and event["boundary"] < cfg.steps else None
        if host in event["joined"] and again is None:
            empty = event.get("empty_parts", [])
            stripes = ", ".join(f"{p} from {n}" for p, n in event["stripes"].items() if p not in empty)
            kept = event.get("resumed_bytes", 0)
            amount = f"{kept / 1e6:.1f} MB" if kept >= 100_000 else f"{kept / 1e3:.1f} KB"
            kept_line = f", {amount} of it kept from a hand-over cut short" if kept else ""
            print(
                f"geotrain: host {host} was admitted after step {resume.done}: "
                f"{event['handed_over_bytes'] / 1e6:.1f} MB of state ({stripes} member(s), "
                f"checked{kept_line}) in {event['hand_over_s']:.2f} s",
                file=sys.stderr,
                flush=True,
            )
        event.update(at_step=stopped_at.committed + 1, step=resume.done, at=round(time.time(), 3))
        events.append(event)
        if run_dir is not None:  # every host's view: the summary's writer may have joined late
            view = dict(event, host=host)
            if event["joined"]:  # for audit: every member's parameters at an admission, and what
                # they hold equal there (the parameters, or an anchor where replicas differ)
                view["param_digest"] = param_digest(model)
                shared = sync.shared_state()  # None: nothing held equal (DreamDDP)
                view["shared_digest"] = tensors_digest(shared) if shared is not None else None
            with (
                contextlib.suppress(OSError),
                (run_dir / "control" / f"regroups-h{host}.jsonl").open("a") as f,
            ):
                f.write(json.dumps(view) + "\n")
        print(
            f"geotrain: host {host}: epoch {event['epoch']} with hosts {event['members']}; training "
            f"goes on after step {event['step']} (regrouped in {event['regroup_s']:.2f} s)",
            file=sys.stderr,
            flush=True,
        )
        if again is not None:  # a member lost in the joiners' hand-over after the redo
            if host in event["deferred"]:  # still a joiner: it holds nothing of the members' state
                return recover(again, StepStatus(-1, False))
            done = StepStatus(event["hand_over_after"], False)
            resumed = recover(again, done)
            # Where it goes on from its own step, that step is the one it computed and whose
            # sync was redone (its tokens counted, its snapshot taken where due), as for a member
            # that met the redo short of the boundary and lost the same hand-over.
            own = (resumed.committed, resumed.local_done) == (done.committed, False)
            return StepStatus(done.committed - 1, True) if own else resumed
        return resume

    def admit_joiners(event: dict) -> dict:
        """A regroup's joiners stood in for its redone sync (``hand_over_after``): once this
        worker has completed it, the joiners receive the state of that step (the members post
        their sends and train on) and meet the members at their next sync, as in a deferred
        admission. Returns the hand-over's figures."""
        nonlocal deferred_until, deferred_ranks
        t0 = time.perf_counter()
        joiners = [event["members"].index(h) for h in event["deferred"]]
        handed = admit_after_redo(
            membership, comm, sync, model, optimizer, event["hand_over_after"], joiners, event["from_state"]
        )
        deferred_until, deferred_ranks = event["deferred_until"], frozenset(joiners)
        return handed | {"hand_over_s": round(event["hand_over_s"] + time.perf_counter() - t0, 3)}

    def snapshot_if_due(at: int) -> int:
        """Step ``at``'s snapshot where one is due (the final one too, before the end-of-run
        average: a resumed run continues from it). Returns the step training goes on after: ``at``,
        or where the regroup says if a member was lost in the agreement to ship (redundancy)."""
        if at != cfg.steps and not snapshots.due(at):
            return at
        try:
            take_snapshot(at, final=at == cfg.steps)
        except RuntimeError as e:
            return recover(e, StepStatus(at, False)).done
        return at

    batch = None
    step = first_step
    if cfg.join:
        # A replacement: admitted at the members' next sync boundary; it takes their state there.
        membership.request_join()
        resume = recover(MembershipChanged("joining"), StepStatus(-1, False))
        step = resume.done + 1
        # Fresh windows of its shard: its predecessor's stream from the start would repeat data.
        sampler.fresh_stream(cfg.seed, host, salt=1_000_003 * membership.epoch)
        # Admitted into a sync the members redid with it (theirs failed at a boundary): they
        # take that step's snapshot now, so it does too (with --redundancy, a snapshot's
        # agreement to ship is a collective every member joins).
        if resume.local_done:
            step = snapshot_if_due(resume.done) + 1
    while step <= cfg.steps:
        if pause_after is not None and step == pause_after + 1:
            pause_after = None
            wait_for_joiners(step - 1)
        t0 = time.perf_counter()
        before = comm.stats.copy()
        computes = sync.computes_step()  # False: a straggler's skipped step (--pace time)
        deferring = deferred_until is not None and step <= deferred_until
        computes = computes and not (deferring and comm.rank in deferred_ranks)  # a joiner skips to it
        computing = sync.workers_computing() - (len(deferred_ranks) if deferring else 0)
        step_tokens = cfg.batch_size * model.block_size * computing
        if batch is None and computes:
            batch = sampler.next_train()
        counted = False  # this step's tokens are in tokens_done already (adopted from a leader)
        met = False
        try:
            # The sync where deferred joiners meet the members: their part is left out (they hold
            # the state of the sync before, and trained no step since).
            meeting = step == deferred_until
            with comm.leaving_out(deferred_ranks) if meeting else contextlib.nullcontext():
                synced = one_step(*(batch if computes else (None, None)), step)
            batch = None if computes else batch
            met = meeting
        except RuntimeError as e:
            if phase == "sync":
                batch = None  # this worker's step used it
            resume = recover(e, StepStatus(step - 1, phase == "sync"))
            if not resume.local_done and resume.committed < step:
                step = resume.committed + 1  # redo it
                continue
            # At most the new group's workers (--pace time: at most those that computed the step)
            step_tokens = min(step_tokens, cfg.batch_size * model.block_size * comm.world_size)
            if not resume.local_done:
                # Behind the leader, this worker adopted its state after its step (tokens too):
                # that step is done here as well, and recorded like any other.
                step, synced, counted = resume.committed, True, True
                loss = torch.tensor(float("nan"))
            else:  # the failed averaging was redone on the new group: the step is complete
                step, synced = resume.done, True
                if phase != "sync":
                    loss = torch.tensor(float("nan"))  # adopted from the leader, not computed here
        if met:  # the joiners received the state before they came: the sends are done
            if events and run_dir is not None and comm.rank not in deferred_ranks:
                # the members' wait here for what the hand-over took past their period (the
                # soak's cost of an admission), beside their regroup records
                wait = {
                    "epoch": events[-1]["epoch"],
                    "meeting_wait_s": round(comm.stats.delta(before).blocked_s, 3),
                }
                with (
                    contextlib.suppress(OSError),
                    (run_dir / "control" / f"meetings-h{host}.jsonl").open("a") as f,
                ):
                    f.write(json.dumps(wait) + "\n")
            membership.received.clear()  # (a joiner's copy of what it received, kept till now)
            finish, membership.sending = membership.sending, None
            deferred_until, deferred_ranks = None, frozenset()
            try:
                if finish is not None:
                    finish.finish()
                if admit_after is not None:  # the sync it met was the one redone with stand-ins
                    pending, admit_after = admit_after, None
                    pending.update(admit_joiners(pending))  # (its event: the summary's record)
            except RuntimeError as e:  # a member lost since: the step itself is complete
                step = recover(e, StepStatus(step, False)).done
        if device.type == "cuda":
            torch.cuda.synchronize()
        if not counted:
            tokens_done += step_tokens
        # At the period's boundaries where it moves (sparseloco --H auto; dreamddp's re-plans): every
        # worker moves it at the same step, so their snapshots stay at the same steps
        if not cfg.snapshot_every:
            snapshots.cfg.every = sync.default_snapshot_every()
        # Not at a step adopted from a leader: the others are past their snapshot of it (a
        # snapshot's agreement to ship is a collective every member must join).
        # Nor before a deferred admission's meeting: the joiner holds the state of the sync
        # before, not of this step (and a shipment's agreement would wait for its hand-over).
        before_meeting = deferred_until is not None and step < deferred_until
        if not counted and not before_meeting and step > quiet_through:
            step = snapshot_if_due(step)
        step_s = time.perf_counter() - t0
        spent = comm.stats.delta(before)
        blocked = spent.blocked_s if sync.measures_blocked_time else None
        record = {
            "step": step,
            "tokens": tokens_done,
            "train_loss": loss.item(),
            "wall_s": time.perf_counter() - start,
            "train_s": time.perf_counter() - start - eval_s,
            "at": round(time.time(), 3),  # wall clock: hosts that started apart line up (soak plot)
            "step_s": step_s,
            "compute_s": step_s - (blocked or 0.0),
            "comm_blocked_s": blocked,
            "payload_bytes": spent.payload_bytes,
            "sent_bytes": spent.sent_bytes,
            "recv_bytes": spent.recv_bytes,
            "calls": spent.calls,
            "synced": synced,
        }
        if not computes:
            record["computed"] = False  # skipped (--pace time)
        if sync.noise is not None:  # --lr-scale auto: the factor of the next local step, and rho
            record["lr_factor"] = round(stepper.lr_factor(), 4)
            rho = sync.noise.signal_fraction()
            if rho is not None:
                record["signal_fraction"] = round(rho, 4)
        if membership is not None:
            record["workers"] = comm.world_size
        if cfg.eval_every and step % cfg.eval_every == 0 and quiet_through < step < cfg.steps:
            # On the same batches everywhere: the replicas' mean model, or each replica (--eval-model).
            t_eval = time.perf_counter()
            try:
                val_loss, replicas_loss = evaluate_run(
                    model, val_batches, device, comm, eval_average, cfg.autocast
                )
                record["val_loss"] = val_loss
                if replicas_loss is not None:
                    record["val_loss_replicas"] = replicas_loss
            except RuntimeError as e:  # a member lost here: this evaluation is skipped
                resume = recover(e, StepStatus(step, False))
                step = resume.done
            eval_s += time.perf_counter() - t_eval
        writer.write(record)
        records.append(record)
        if cfg.max_rejections and membership is not None:
            # Per step, not per collective (a step checks every bucket): a host rejected in any
            # check of a step counts once, and only a step whose checks all kept it resets it.
            if membership.epoch != counted_in[0]:  # a new membership: counts start again (a
                in_a_row.clear()  # replacement must not inherit its predecessor's)
                counted_in[0] = membership.epoch
            checked, rejected = comm.take_step_verdicts()
            for h in checked:
                in_a_row[h] = in_a_row.get(h, 0) + 1 if h in rejected else 0
            for h, count in in_a_row.items():
                if count < cfg.max_rejections or h == host or h not in membership.members:
                    continue
                # Every honest member asks, signed for this epoch, and again each step while it
                # is over (a restarted coordinator's store has lost the earlier requests).
                if count == cfg.max_rejections:
                    print(
                        f"geotrain: host {h}'s contributions were rejected {count} steps in a row "
                        f"(--max-rejections {cfg.max_rejections}): asking to drop it",
                        file=sys.stderr,
                        flush=True,
                    )
                membership.evict(h, eviction(token, h, host, membership.epoch))
        if faults:
            fire_at_step(
                faults, step, host, keeper_pid, snap_dir, run_dir / "control" if run_dir else None,
                settle=snapshots.wait_stored,
            )  # fmt: skip
        if progress is not None:
            mbit = spent.sent_bytes * 8 / step_s / 1e6
            postfix = {"loss": f"{record['train_loss']:.3f}", "tok/s": f"{step_tokens / step_s:,.0f}"}
            if val_loss is not None:
                postfix["val"] = f"{val_loss:.3f}"
            postfix["link"] = f"{mbit:.1f}Mbit/s"
            if membership is not None and comm.world_size != ctx.world_size:
                postfix["workers"] = comm.world_size
            progress.set_postfix(postfix, refresh=False)
            progress.update(1)
        step += 1
    train_s = time.perf_counter() - start - eval_s
    if membership is not None:
        membership.finish()  # a joiner still waiting is not admitted any more

    before = comm.stats.copy()
    t_final = time.perf_counter()
    finalized = False
    # the ranks holding a copy of the leader's state, from the start where a regroup left them
    # at the end (the leader was in this average, or done)
    copies = copies_at_the_end(events, cfg.steps, not sync.parameters_from_state)
    while True:
        try:
            if not finalized:
                with comm.leaving_out(copies):  # (their message would count the leader's twice)
                    sync.finalize()  # part of training: the replicas become one model
                sync.settle()
                finalized = True
            final_s = time.perf_counter() - t_final
            final_spent = comm.stats.delta(before)
            val_loss = comm.mean_scalars([evaluate(model, val_batches, device, cfg.autocast)])[0]
            break
        except RuntimeError as e:  # a member lost in the last average: average the survivors
            # A member whose last average completed reports a step past every sync, so the ones
            # whose copy of it failed adopt its model instead of all redoing it (twice for it).
            past = cfg.steps + sync.sync_period()
            finalized = recover(e, StepStatus(past if finalized else cfg.steps, False)).committed > cfg.steps
            copies = copies_at_the_end(events, cfg.steps, not sync.parameters_from_state)
    writer.write(
        {
            "step": cfg.steps,
            "tokens": tokens_done,
            "val_loss": val_loss,
            "final": True,
            "train_s": train_s + final_s,
            "finalize_sent_bytes": final_spent.sent_bytes,
            "param_digest": param_digest(model),  # every host's: the replicas ended as one model
        }
    )
    writer.close()
    if progress is not None:
        progress.close()
    snapshots.close()  # every snapshot stored, the final disk checkpoint written

    summary = _summarise(cfg, ctx, model, sync, comm, records, val_loss, train_s, tokens_done)
    summary.update(_snapshot_summary(snapshots, comm, len(records) - (first_step - 1), resumed))
    summary["param_digest"] = param_digest(model)
    if membership is not None:
        summary["membership"] = events
    if run_dir is not None and comm.rank == 0:  # the lowest surviving host
        # through a temporary file: a disk that fills midway leaves the last checkpoint whole
        with atomic_file(run_dir / "checkpoint.pt") as f:
            torch.save(
                {
                    "model": model.state_dict(),
                    "model_spec": describe(model, cfg.model_spec()),
                    "optimizer": optimizer.state_dict(),
                    "sync": sync.state_dict(),
                    "train_config": asdict(cfg),
                },
                f,
            )
        write_atomic(run_dir / "summary.json", (json.dumps(summary, indent=2) + "\n").encode())
    sync.close()
    comm.close()  # its two-level groups go before the process group does
    return summary


def _measured_sites(cfg: TrainConfig, ctx: DistContext, membership, run_dir: Path | None) -> list[int]:
    """``--hierarchy auto``: the sites the link matrix shows (``comm/linkmatrix.py``), measured by
    the first epoch's hosts and kept in the coordinator's store for joiners, who take them, and in
    the run directory for a resume, which keeps them (the sums' order, and so the bits, with them)."""
    from geotrain.comm.linkmatrix import measure, sites_from

    key = "geotrain/sites"
    if cfg.join:  # admitted later: the members measured the links (the joiner takes its host's site)
        try:
            return json.loads(membership.store().get(key))
        except Exception:  # noqa: BLE001 - the store's missing key is a timeout of its own kind
            raise ConfigError(
                "the members published no measured sites: start the joiner with the run's --hierarchy"
            ) from None
    saved = run_dir / "control" / "sites.json" if run_dir is not None else None
    if cfg.resume and saved is not None and saved.exists():
        sites = json.loads(saved.read_text())["sites"]
        if membership is not None and ctx.rank == 0:
            membership.store().set(key, json.dumps(sites))
        return sites
    t0 = time.perf_counter()
    matrix = measure(Communicator(timeout_s=cfg.timeout_s))
    sites = sites_from(matrix)
    if membership is not None and ctx.rank == 0:
        membership.store().set(key, json.dumps(sites))
    if saved is not None and ctx.rank == 0:
        write_atomic(saved, json.dumps({"sites": sites, "matrix_bytes_per_s": matrix}).encode())
    if ctx.rank == 0:
        pairs = [matrix[i][j] for i in range(len(matrix)) for j in range(i + 1, len(matrix))]
        print(
            f"geotrain: links measured in {time.perf_counter() - t0:.1f} s (pairs {min(pairs) * 8e-6:.1f} to "
            f"{max(pairs) * 8e-6:.1f} Mbit/s): sites {sites}"
            + ("" if len(set(sites)) > 1 else ", one site: the all-reduce stays flat"),
            file=sys.stderr,
            flush=True,
        )
    return sites


def _snapshot_summary(snapshots: Snapshotter, comm, steps_here: int, resumed) -> dict[str, Any]:
    st = snapshots.stats
    steps_here = max(steps_here, 1)
    sent = snapshots.sent_bytes()
    critical, background, snap_bytes = comm.mean_scalars(
        [st.critical_s / steps_here, st.background_s / steps_here, sent / steps_here]
    )
    return {
        "snapshots": st.taken,
        "snapshot_every": snapshots.cfg.every,
        "snapshot_critical_s_per_step": critical,
        "snapshot_background_s_per_step": background,
        "snapshot_bytes_per_step": snap_bytes,
        "snapshot_full_bytes": st.full_bytes,
        "snapshot_recycled": st.recycled,  # written into the pages of one the keeper let go
        "snapshot_unique_bytes": st.unique_bytes,
        "redundancy": snapshots.cfg.redundancy if snapshots.scheme is not None else "off",
        "snapshots_shipped": len(snapshots.shipped),
        "snapshot_errors": st.errors,
        "snapshot_each": st.each,  # this worker's (rank 0's in the summary): step, wait s, copy s
        "resumed_from": resumed,
    }


def _write_profile(cfg, ctx, model, optimizer, comm, loss_fn) -> dict[str, Any]:
    from geotrain.plan.layers import layer_groups
    from geotrain.plan.profile import build_profile

    meta = {
        "model": cfg.model,
        "batch_size": cfg.batch_size,
        "block_size": model.block_size,
        "link": cfg.link,
        "network_mode": cfg.network_mode,
        "optimizer": cfg.optimizer,
    }
    # --compress (and --profile-codecs): their encoding is timed too, for the plans that price it
    codecs = cfg.profile_codec_specs()
    profile = build_profile(model, layer_groups(model), loss_fn, optimizer, comm, meta, codecs=codecs)
    if ctx.is_main:
        Path(cfg.profile_out).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.profile_out).write_text(json.dumps(profile, indent=2) + "\n")
    return profile


def _summarise(cfg, ctx, model, sync, comm, records, val_loss, train_s, tokens) -> dict[str, Any]:
    # Means, not medians: a periodic algorithm's cost is in the few steps that synchronise.
    if not records:
        raise ConfigError("nothing to summarise: the run has no step metrics (metrics/ was removed?)")
    steady = records[1:] or records  # the first step pays for allocation and warm-up
    local = [
        statistics.fmean(r["step_s"] for r in steady),
        statistics.fmean(r["compute_s"] for r in steady),
        statistics.fmean(r["comm_blocked_s"] for r in steady) if sync.measures_blocked_time else float("nan"),
        sum(r["sent_bytes"] for r in records) / len(records),
        train_s,
    ]
    step_s, compute_s, blocked_s, sent_per_step, _ = comm.mean_scalars(local)
    (wall_s,) = comm.max_scalars([train_s])
    sync_cfg = cfg.sync_config().as_dict() | sync.resolved_options()
    skipped = None
    if cfg.pace == "time":  # by rank of the last group: the steps each left to the faster ones
        skipped = comm.all_gather_object(sum(r.get("computed") is False for r in records))
    return {
        "algo": cfg.algo,
        "algo_config": " ".join(f"{k}={v}" for k, v in sync_cfg.items()),
        "model": cfg.model,
        "parameters": model.num_parameters(),
        # With --lora only these train and cross the network (the frozen base never does).
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "lora": (f"LoRA-FA {cfg.lora}" if cfg.lora_fa else f"LoRA {cfg.lora}") if cfg.lora else None,
        "workers": comm.world_size,  # at the end (fewer than at the start after a failure)
        "workers_start": ctx.world_size,
        "link": cfg.link,
        "network_mode": cfg.network_mode,
        "stragglers": {str(h): f for h, f in cfg.slow_factors().items()} or None,  # --slow
        "skipped_steps": skipped and {str(r): n for r, n in enumerate(skipped)},  # --pace time
        # --max-norm-ratio: contributions left out of averages, by rank of the last group
        "rejected_updates": {str(r): n for r, n in sorted(comm.rejected_by_rank.items())},
        # a quantised codec's owners=2: shards whose two owners disagreed, by pair of hosts
        "disputed_shards": {f"{a},{b}": n for (a, b), n in sorted(comm.disputed_shards.items())} or None,
        # auto resolved (0: off; "inf": only what is not finite); applied from these workers on:
        "max_norm_ratio": cfg.norm_ratio() if math.isfinite(cfg.norm_ratio()) else "inf",
        "norm_check_min_workers": comm.auto_min_workers or None,
        "sites": comm.site_of_host,  # with --hierarchy sites or auto: the site of each host
        "latency_ms": cfg.latency_ms,
        "backend": ctx.backend,
        "device": str(ctx.device),
        "autocast": cfg.autocast,
        "steps": cfg.steps,
        # --lr-scale: the local steps' factor on the schedule's lr (in the last group, at the end)
        "lr_scale": cfg.lr_scale,
        "local_lr_factor": round(lr_factor(sync, cfg.lr_scale), 4),
        # --lr-scale auto: the gradients' signal fraction measured at the syncs (noise.py)
        "signal_fraction": sync.noise and sync.noise.signal_fraction(),
        "lr_schedule": f"{cfg.lr_schedule} lr={cfg.lr:g} warmup={cfg.warmup}"
        + (
            f" min_lr_ratio={cfg.min_lr_ratio:g} over={cfg.lr_steps or cfg.steps}"
            if cfg.lr_schedule == "cosine"
            else ""
        ),
        "tokens": tokens,
        "first_train_loss": records[0]["train_loss"],
        # A step completed by adopting a peer's state has no loss of its own (NaN): skipped.
        "final_train_loss": statistics.fmean(
            [x for r in records[-min(10, len(records)) :] if (x := r["train_loss"]) == x] or [float("nan")]
        ),
        "final_val_loss": val_loss,
        "step_s_mean": step_s,
        "compute_s_mean": compute_s,
        "blocked_s_mean": None if blocked_s != blocked_s else blocked_s,  # NaN: not measurable
        "tokens_per_s": tokens / wall_s,
        "sent_bytes_per_step": sent_per_step,
        "link_mbit_s": sent_per_step * 8 / step_s / 1e6 if step_s else None,
        "syncs": sync.syncs,
        # --H-schedule: the period at each stage ("H 2 from step 0, 5 from step 40, ...")
        "periods": sync.periods.describe() if getattr(sync, "periods", None) else None,
        "startup_broadcast_bytes": getattr(sync, "startup_broadcast_bytes", 0),
        "wall_s": wall_s,
        "predicted_step_s": getattr(sync, "predicted_step_s", None),
        "replans": getattr(sync, "replans", None),
        "reprofiles": getattr(sync, "reprofiles", None),  # of them, those that profiled again
        # dreamddp: the link's slowdown under backward, fitted to the run's steps (plan.cost)
        "comm_slowdown_fitted": getattr(sync, "fitted_slowdown", None),
        # dreamddp --H auto: each period weighed (predicted step, steps factor) and the one chosen
        "period_choice": getattr(sync, "period_choice", None),
        # sparseloco --H auto: [step, H] where a verdict taken again moved the period
        "period_moves": getattr(sync, "period_moves", None),
        # dreamddp --compress auto: each codec weighed (with its periods under --H auto)
        "codec_choice": getattr(sync, "codec_choice", None),
        "codec_info": sync.info(),
    }


def train_parser() -> argparse.ArgumentParser:
    """``geotrain train``'s flags: every ``TrainConfig`` field, so ``to_argv`` round-trips."""
    parser = argparse.ArgumentParser(
        prog="geotrain train", description=__doc__.split("\n")[0], allow_abbrev=False
    )
    add_train_arguments(parser)
    parser.add_argument(
        "--run-dir", dest="run_dir", default="", help="where metrics, summary and checkpoint go"
    )
    parser.add_argument("--latency-ms", dest="latency_ms", type=float, default=0.0)
    parser.add_argument("--link", default="unshaped", help=argparse.SUPPRESS)
    parser.add_argument("--network-mode", dest="network_mode", default="none", help=argparse.SUPPRESS)
    parser.add_argument(
        "--profile-out", dest="profile_out", default="", help="profile, write this JSON, exit"
    )
    parser.add_argument("--profile-codecs", dest="profile_codecs", default="", help=argparse.SUPPRESS)
    parser.add_argument(
        "--resume",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="continue the run in --run-dir from the newest snapshot every worker can reach",
    )
    parser.add_argument("--keeper", default="", help="this host's keeper socket (geotrain keeper --socket)")
    parser.add_argument(
        "--heartbeat", default="", help="ADDR:PORT:ATTEMPT:HOST of the coordinator (set by the launcher)"
    )
    parser.add_argument(
        "--broker",
        default="",
        metavar="ADDR:PORT",
        help="a real cluster's `geotrain broker`: the first rendezvous, heartbeats and membership "
        "(one process per machine, no torchrun; survivors of a failure go on); needs --host",
    )
    parser.add_argument("--host", type=int, default=-1, help="with --broker: this machine's host id (0..N-1)")
    parser.add_argument(
        "--elastic",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="with --heartbeat: survivors of a failure regroup and go on (set by the launcher)",
    )
    parser.add_argument(
        "--fault-timeout-s", dest="fault_timeout_s", type=float, default=10.0, help=argparse.SUPPRESS
    )
    parser.add_argument(
        "--min-workers",
        dest="min_workers",
        type=int,
        default=1,
        help="under continue: fewer members pause after their next sync boundary, snapshot, and wait "
        "--join-timeout seconds for a replacement before they stop",
    )
    parser.add_argument(
        "--join-timeout", dest="join_timeout", type=float, default=120.0, help="see --min-workers"
    )
    parser.add_argument(
        "--join",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="with --elastic: a replacement, admitted into the running group (set by the launcher)",
    )
    parser.add_argument(
        "--spare",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="wait in the run's backup pool until a host is lost, then join in its place (--host, if "
        "given, names this machine in the broker's record)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = train_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
        cfg = replace(cfg, timeout_s=cfg.collective_timeout_s())
        try:
            admitted = _admit(cfg)
        except Refused as e:
            print(f"geotrain train: error: {e}", file=sys.stderr)
            return 2
        if cfg.spare:
            try:
                cfg = take_a_place(cfg, admitted)
            except RunFinished as e:  # not needed: nothing to do, and nothing went wrong
                print(f"geotrain: {e}", file=sys.stderr)
                return 0
            except TimeoutError as e:
                print(f"geotrain train: error: {e}", file=sys.stderr)
                return 1
        if cfg.broker:
            cfg = replace(cfg, heartbeat=f"{broker_address(cfg.broker, cfg.host)}:0:{cfg.host}", elastic=True)
        hosts = _run_hosts(cfg) if (cfg.join or cfg.broker) and cfg.heartbeat else 0
    except (ConfigError, DataError) as e:
        print(f"geotrain train: error: {e}", file=sys.stderr)
        return 2
    except RunFinished as e:  # a spare given a place just as the run ended did nothing wrong
        print(f"geotrain train: {'' if cfg.spare else 'error: '}{e}", file=sys.stderr)
        return 0 if cfg.spare else 1
    heartbeat = Heartbeat(cfg.heartbeat) if cfg.heartbeat else None
    if heartbeat is not None and admitted is not None:  # a joiner's request, signed with its pass
        heartbeat.join_request = admitted.sign(read_token(cfg.token_file), "join", heartbeat.host)
    code = 1
    try:
        code = _main(cfg, heartbeat, hosts)
        return code
    finally:
        _leave(cfg, heartbeat, code)


def _main(cfg: TrainConfig, heartbeat: Heartbeat | None, hosts: int = 0) -> int:
    if cfg.join and (heartbeat is None or not cfg.elastic):
        print(
            "geotrain train: error: --join needs --elastic and --heartbeat (set by the launcher)",
            file=sys.stderr,
        )
        return 2
    where = ":".join(map(str, heartbeat.address)) if heartbeat is not None else ""
    backend = cfg.process_backend()
    try:
        choose_backend(backend, torch.cuda.device_count(), 1)  # nccl without a GPU: one line, now
    except ValueError as e:
        print(f"geotrain train: error: {e}", file=sys.stderr)
        return 2
    if cfg.join:
        ctx = init_joiner(heartbeat.host, hosts, cfg.timeout_s, backend)
    elif cfg.broker:
        try:
            ctx = init_from_broker(*heartbeat.address, heartbeat.host, hosts, cfg.timeout_s, backend)
        except Exception as e:
            print(
                f"geotrain train: error: the run's {hosts} hosts did not all join at {where} within "
                f"--timeout-s {cfg.timeout_s:g} ({type(e).__name__}): is every machine started?",
                file=sys.stderr,
            )
            return 1
    else:
        try:
            ctx = init_distributed(timeout_s=cfg.timeout_s, backend=backend)
        except ValueError as e:  # --backend nccl without a GPU per worker
            print(f"geotrain train: error: {e}", file=sys.stderr)
            return 2
    ok = False
    try:
        if heartbeat is not None and heartbeat.host != ctx.rank:
            raise ConfigError(f"host {heartbeat.host} got rank {ctx.rank}: start it with --node-rank")
        summary = train(cfg, ctx, heartbeat)
        ok = True
        if (not dist.is_initialized() or dist.get_rank() == 0) and not cfg.profile_out:
            print(summary_table(summary), flush=True)
    except Excluded as e:  # declared failed (silent too long) while it was only slow
        print(f"geotrain train: {e}; this worker leaves the run", file=sys.stderr)
        return 3
    except RunFinished as e:  # a joiner that came too late: nothing was lost
        print(f"geotrain train: {e}", file=sys.stderr)
        return 0
    except BelowMinWorkers:  # its snapshot is taken: a resume goes on from it
        return EXIT_BELOW_MIN_WORKERS
    except NoStateHolder as e:  # the launcher restores every host from the snapshots
        print(f"geotrain train: {e}", file=sys.stderr)
        return EXIT_NO_STATE_HOLDER
    except (ConfigError, DataError, ResumeError, JoinRefused) as e:
        _fatal(cfg, ctx.rank, f"geotrain train: error: {e}", str(e))
        return 2
    except (CollectiveTimeout, RuntimeError) as e:  # a timeout: one line, not a traceback per rank
        line = timeout_line(e, ctx.world_size, cfg.timeout_s, cfg.link)
        if line is not None:
            _fatal(cfg, ctx.rank, f"geotrain train: error: host {ctx.rank}: {line}", line)
            return 1
        # A peer gone (--on-failure rollback or stop: nothing regroups here): one line, not a
        # traceback under the launcher's own account of the failure, which is not this host's.
        gone = peer_lost_line(e, ctx.rank)
        if gone is None:
            raise
        for text in traceback.format_exc().splitlines():  # to the host's log only
            print(f"{TRAINER_LOG_ONLY} {text}", file=sys.stderr)
        print(f"geotrain train: {gone}", file=sys.stderr, flush=True)
        return 1
    finally:
        shutdown_distributed(together=ok)  # (it unfreezes what ``train`` froze first)
    return 0


if __name__ == "__main__":
    sys.exit(main())
