"""The per-worker training loop: what ``torchrun ... -m geotrain.train`` runs on every machine.

Read it top to bottom: join the process group, load this worker's data shard, build the GPT and
its optimizer, wrap both in the chosen sync algorithm, train for ``steps`` steps recording
metrics, then finalize (so the replicas end as one model), evaluate, save and summarise.

    torchrun --nnodes 4 --nproc-per-node 1 --node-rank I --master-addr HOST0 --master-port 29500 \\
        -m geotrain.train --algo diloco --H 10 --model mini --steps 200 --run-dir runs/x
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, fields, replace
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from geotrain.api import LR_SCALE_DEFAULT, LR_SCALES, Sync, checked_lr_scale, lr_factor
from geotrain.comm.buckets import flatten, unflatten_into
from geotrain.comm.communicator import CollectiveTimeout, Communicator, peer_lost_line, timeout_line
from geotrain.comm.guard import (
    AUTO,
    AUTO_MIN_WORKERS,
    GATHERED,
    GUARDED_ALGOS,
    GUARDED_CODECS,
    SPARSE_CODECS,
    default_norm_ratio,
    norm_ratio_arg,
    parse_aggregate,
)
from geotrain.compress import plain_spec
from geotrain.compress.codec import make_codec
from geotrain.data.corpus import BatchSampler, DataError, load_corpus
from geotrain.ft.atomic import atomic_file, write_atomic
from geotrain.ft.chaos import ChaosError, fire_at_step, parse_chaos
from geotrain.ft.elastic import StepStatus, owned_shards, regroup
from geotrain.ft.keeper import KeeperClient
from geotrain.ft.membership import (
    EXIT_BELOW_MIN_WORKERS,
    RETIRED,
    BelowMinWorkers,
    Excluded,
    JoinRefused,
    Membership,
    MembershipChanged,
    RunFinished,
    first_hosts,
    host_beating,
    spare_placed,
    wait_for_vacancy,
)
from geotrain.ft.redundancy import parse_redundancy
from geotrain.ft.snapshots import ResumeError, SnapshotConfig, Snapshotter, restore
from geotrain.ft.state import capture, param_digest
from geotrain.ft.state import restore as restore_state
from geotrain.launch.admission import Pass, Refused, eviction, prove, read_token
from geotrain.launch.agent import TRAINER_LOG_ONLY
from geotrain.launch.coordinator import Heartbeat
from geotrain.launch.dist import (
    BACKENDS,
    DistContext,
    choose_backend,
    init_distributed,
    init_from_broker,
    init_joiner,
    shutdown_distributed,
    uses_nccl,
)
from geotrain.metrics import MetricsWriter, metrics_up_to, summary_table
from geotrain.models import MODEL_SIZES, ModelError, ModelSpec, build_model, describe, parameter_count
from geotrain.netem.links import LinkSpecError, parse_bandwidth
from geotrain.plan.network import collective_timeout_s
from geotrain.plan.schedule import AUTO_CODEC, AUTO_CODECS
from geotrain.sync import ALGORITHMS, ConfigError, build_sync, sync_config
from geotrain.sync.periods import resolve_every

OPTIMIZERS = ("adamw", "sgd")
LR_SCHEDULES = ("constant", "cosine")
AUTOCASTS = ("off", "bf16")
EVAL_MODELS = ("auto", "average", "replicas")


HIERARCHIES = ("off", "sites", "auto")


AUTO_WARMUP = -1  # --warmup auto
MAX_AUTO_WARMUP = 100


def warmup_for(planned_steps: int) -> int:
    """``--warmup auto``: a tenth of the steps the schedule is planned over, at most 100. AdamW
    at full rate from step 1 costs a run most of its first hundreds of steps: on ``mini`` (4
    workers, 8 x 128) DDP scored 2.571 at step 150 without a warm-up, 2.143 with 50 steps of it,
    lower than its 2.176 at step 400 without (README, "Reaching DDP's loss")."""
    return min(MAX_AUTO_WARMUP, max(0, planned_steps) // 10)


AUTO_H = -1  # --H auto (dreamddp: its planner picks the period)


def H_arg(text: str) -> int:
    """``--H``'s value: ``auto`` (AUTO_H), or a number of steps >= 0."""
    word = str(text).strip()
    if word.lower() == "auto":
        return AUTO_H
    if not word.isdigit():
        raise argparse.ArgumentTypeError(
            f"takes a period >= 1, 0 (the algorithm's default) or auto; got {text!r}"
        )
    return int(word)


def warmup_arg(text: str) -> int:
    """``--warmup``'s value: ``auto`` (AUTO_WARMUP), or a number of steps."""
    return AUTO_WARMUP if str(text).strip().lower() == "auto" else int(text)


@dataclass
class TrainConfig:
    """Everything a worker needs; the same on every worker. Each field is a ``--flag``."""

    algo: str = "diloco"
    model: str = "mini"
    model_config: str = ""  # NAME=VALUE,... over the model's config (e.g. n_layer=2,n_embd=64)
    lora: str = ""  # LoRA adapters, e.g. r=8,alpha=16,targets=q_proj,v_proj ("": none)
    lora_fa: bool = False  # LoRA-FA: the A matrices frozen too
    steps: int = 100
    batch_size: int = 8
    block_size: int = 0  # 0: the model size's context
    optimizer: str = "adamw"
    lr: float = 0.0  # 0: the algorithm's default (1e-3; demo 2e-3)
    weight_decay: float = 0.0
    warmup: int = AUTO_WARMUP  # steps of linear warm-up; auto: warmup_for(the planned steps)
    lr_schedule: str = "constant"  # constant | cosine: after the warm-up, over the planned --steps
    min_lr_ratio: float = 0.1  # cosine: the learning rate at the last step, as a fraction of --lr
    lr_steps: int = 0  # the steps the schedule is planned over (0: --steps)
    lr_scale: str = LR_SCALE_DEFAULT  # "": the algorithm's own (1 for every one today); api.py
    H: int = 0  # 0: the algorithm's default (10; dreamddp 2; sparseloco, streaming, co2 20); AUTO_H: chosen
    outer_lr: float = 0.0  # 0: the algorithm's default (0.7)
    outer_momentum: float = -1.0  # < 0: follows H (geotrain.sync.diloco.outer_momentum_for)
    momentum_ramp: int = -1  # diloco, streaming: outer steps for a momentum following H to reach 0.9
    warm_start: int = 0  # localsgd, diloco: synchronous steps before the periodic ones
    H_schedule: str = ""  # localsgd, diloco: shorter periods first (grow, or PxN,...), then H
    pace: str = "steps"  # localsgd, diloco: "time": a period lasts the fastest worker's H steps
    site_H: int = 0  # localsgd, diloco with --hierarchy: parameters averaged in each site every site_H
    bucket_mb: float = 0.0  # 0: the algorithm's default
    compress: str = ""  # a codec, e.g. int8, topk:ratio=0.01, acpsgd:rank=4 ("": none)
    # sparseloco and demo (0, or beta -1: the algorithm's default; see --help)
    chunk: int = 0
    k: int = 0
    bits: int = 0
    beta: float = -1.0
    alpha: float = 0.0
    # streaming (0, or -1: the algorithm's default)
    fragments: int = 0
    tau: int = -1
    mix: float = -1.0
    # co2 (0, or -1: the algorithm's default)
    gap_penalty: float = 0.0
    clip: float = -1.0
    eager: bool | None = None
    # sparseloco, demo: the update lands late, its gather under compute (None: the algorithm's default)
    overlap: bool | None = None
    mean_over: str = ""  # sparseloco: senders, workers or auto ("": the algorithm's default)
    plan: str = ""  # dreamddp: a plan from `geotrain plan` ("": profile and plan at start-up)
    replan_threshold: float = 0.25  # dreamddp: re-plan when measured time drifts this far (0: never)
    fill_in: bool | None = None  # dreamddp: average more layers where the link has room (None: off)
    lag: int = -1  # dreamddp: iterations before a layer's average lands (-1: the algorithm's default)
    profile_out: str = ""  # profile the model and link, write this JSON, and do not train
    # with profile_out: more codecs to time per layer, ";" between them (the bench's cells' codecs)
    profile_codecs: str = ""
    eval_every: int = 0  # 0: only at the end
    eval_batches: int = 4
    eval_model: str = "auto"  # mid-run validations score: average | replicas | auto (loopback: average)
    seed: int = 0
    data: str = ""  # "": the standard library's sources
    tokenizer: str = ""  # a tokenizers JSON (or its directory) for text --data ("": bytes)
    run_dir: str = ""  # "": write nothing
    latency_ms: float = 0.0
    link: str = "unshaped"  # a description of the links, recorded in the summary
    network_mode: str = "none"  # netns | loopback | none: how the links were made
    threads: int = 0  # 0: cores divided by workers on this machine
    backend: str = "auto"  # auto | nccl | gloo (launch/dist.py choose_backend)
    autocast: str = "off"  # off | bf16: forward passes under torch.autocast, parameters stay fp32
    timeout_s: float = 0.0  # 0: derived from the model's size and link_rate (collective_timeout_s)
    link_rate: str = ""  # the slowest host's link, e.g. 10mbit ("": unshaped or unknown)
    sites: str = ""  # the site of each host, e.g. 0,0,1,1 ("": one site; geotrain run --topology sets it)
    hierarchy: str = "off"  # off | sites | auto: all-reduces in two levels (comm/hierarchy.py)
    slow: str = ""  # stragglers: HOST:FACTOR[;HOST:FACTOR], that host's compute FACTOR x slower
    # > 0: leave out of averages what is not finite or R x the median norm; 0: off; AUTO (-1):
    # 10 where it is (nearly) free, the periodic methods and the gathers (comm/guard.py)
    max_norm_ratio: float = AUTO
    max_rejections: int = 0  # > 0: a host rejected this many times in a row is dropped (continue)
    aggregate: str = "mean"  # mean | clip | trimmed:f=F | median (comm/guard.py)
    progress: bool = True
    resume: bool = False  # continue the run in run_dir from its newest restorable snapshot
    resume_step: int = 0  # with resume: this snapshot step instead of the newest
    snapshot_every: int = 0  # 0: every sync boundary (periodic methods), every 50 steps otherwise
    checkpoint_every: int = 0  # disk checkpoints, written by the keeper (0: only at the end)
    redundancy: str = "off"  # off | ring | ec:K/N: unique state held by peers' keepers
    snapshot_bandwidth: str = "0"  # pace of redundancy traffic, e.g. 5mbit ("0": unpaced)
    keeper: str = ""  # this host's keeper socket ("": snapshots go to disk from a trainer thread)
    heartbeat: str = ""  # ADDR:PORT:ATTEMPT:HOST of the coordinator this trainer beats to ("": none)
    broker: str = ""  # ADDR:PORT of `geotrain broker` on a real cluster ("": none; see --host)
    host: int = -1  # with broker: this machine's host id, 0 .. the broker's --hosts - 1
    chaos: str = ""  # fault injection, see geotrain.ft.chaos (kill:step=S,rank=R; ...)
    token_file: str = ""  # the run's secret, else $GEOTRAIN_TOKEN (launch/admission.py)
    elastic: bool = False  # survivors of a failure regroup and go on (--on-failure continue)
    join: bool = False  # a replacement: admitted into the running group (needs elastic, heartbeat)
    spare: bool = False  # waits in the backup pool until given a lost host's place, then joins it
    fault_timeout_s: float = 10.0  # the coordinator's verdict on a silent host comes this late
    min_workers: int = 1  # elastic: fewer members than this pause at a sync boundary for joiners
    join_timeout: float = 120.0  # elastic: how long they wait there before they snapshot and stop

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        try:
            self.model_spec().check()
        except ModelError as e:
            raise ConfigError(str(e)) from None
        need(
            self.optimizer in OPTIMIZERS,
            f"unknown optimizer {self.optimizer!r}; accepted: {', '.join(OPTIMIZERS)}",
        )
        need(self.steps >= 1, f"--steps must be >= 1, got {self.steps}")
        need(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}")
        need(
            self.block_size >= 0,
            f"--block-size must be >= 0 (0 = the model's context), got {self.block_size}",
        )
        need(self.lr >= 0, f"--lr must be > 0 (or 0: the algorithm's default), got {self.lr}")
        if self.lr == 0 and self.algo in ALGORITHMS:
            self.lr = ALGORITHMS[self.algo][1].default_lr
        need(
            self.warmup >= 0 or self.warmup == AUTO_WARMUP,
            f"--warmup must be >= 0 or auto, got {self.warmup}",
        )
        need(
            self.lr_schedule in LR_SCHEDULES,
            f"unknown --lr-schedule {self.lr_schedule!r}; accepted: {', '.join(LR_SCHEDULES)}",
        )
        need(0 <= self.min_lr_ratio <= 1, f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        need(self.lr_steps >= 0, f"--lr-steps must be >= 0 (0 = --steps), got {self.lr_steps}")
        if self.warmup == AUTO_WARMUP:  # resolved once: the saved config (a resume) keeps the number
            wanted = self.algo not in ALGORITHMS or ALGORITHMS[self.algo][1].auto_warmup
            self.warmup = warmup_for(self.lr_steps or self.steps) if wanted else 0
        # resolved once, as --warmup auto is: the saved config (a resume) keeps the stages
        self.H_schedule = resolve_every(self.H_schedule, self.lr_steps or self.steps)
        need(
            self.H != AUTO_H or self.algo == "dreamddp",
            f"--H auto is dreamddp's (its planner picks the period); give {self.algo} a period >= 1 "
            "(0: its default)",
        )
        need(
            self.H != AUTO_H or not self.plan,
            "--H auto chooses dreamddp's period at start-up, and a --plan brings its own: give one",
        )
        need(
            self.H >= 0 or self.H == AUTO_H,
            f"--H must be >= 0 (0: the algorithm's default) or auto, got {self.H}",
        )
        if self.lr_scale == LR_SCALE_DEFAULT:  # resolved once: the saved config keeps the name
            self.lr_scale = checked_lr_scale(LR_SCALE_DEFAULT, self.algo)
        need(self.lr_scale in LR_SCALES, f"--lr-scale takes {' or '.join(LR_SCALES)}, got {self.lr_scale!r}")
        need(
            self.outer_momentum == -1 or 0 <= self.outer_momentum < 1,
            f"--outer-momentum must be in [0, 1), or -1 to follow H, got {self.outer_momentum}",
        )
        need(
            not (self.outer_momentum >= 0 and self.momentum_ramp > 0),
            f"--momentum-ramp {self.momentum_ramp} raises a momentum that follows H, and --outer-momentum "
            f"{self.outer_momentum} fixes it: give one of the two",
        )
        need(self.eval_every >= 0, f"--eval-every must be >= 0 (0 = only at the end), got {self.eval_every}")
        need(self.eval_batches >= 1, f"--eval-batches must be >= 1, got {self.eval_batches}")
        need(
            self.eval_model in EVAL_MODELS,
            f"unknown --eval-model {self.eval_model!r}; accepted: {', '.join(EVAL_MODELS)}",
        )
        need(self.latency_ms >= 0, f"--latency must be >= 0, got {self.latency_ms} ms")
        need(self.bucket_mb >= 0, f"--bucket-mb must be >= 0 (0 = default), got {self.bucket_mb}")
        need(self.threads >= 0, f"--threads must be >= 0, got {self.threads}")
        need(self.backend in BACKENDS, f"--backend takes {', '.join(BACKENDS)}; got {self.backend!r}")
        need(self.autocast in AUTOCASTS, f"--autocast takes {', '.join(AUTOCASTS)}; got {self.autocast!r}")
        try:
            parse_aggregate(self.aggregate)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        need(
            self.max_norm_ratio in (0, AUTO) or self.max_norm_ratio >= 1,
            f"--max-norm-ratio must be >= 1 (a multiple of the median norm), 0 for off, or auto; "
            f"got {self.max_norm_ratio:g}",
        )
        need(
            self.max_rejections >= 0,
            f"--max-rejections must be >= 0 (0: never drop), got {self.max_rejections}",
        )
        need(
            not self.max_rejections or self.norm_ratio() > 0 or self.aggregate != "mean",
            "--max-rejections counts what the checks reject, and the check is off here (--max-norm-ratio "
            + (
                "auto leaves it off for this --algo, --compress or --pace"
                if self.max_norm_ratio == AUTO
                else "0"
            )
            + "): give --max-norm-ratio R (or an --aggregate)",
        )
        need(self.resume_step >= 0, f"--resume-step must be >= 0 (0 = the newest), got {self.resume_step}")
        need(
            self.snapshot_every >= 0,
            f"--snapshot-every must be >= 0 (0 = each sync boundary, or 50 steps), got {self.snapshot_every}",
        )
        need(
            self.checkpoint_every >= 0,
            f"--checkpoint-every must be >= 0 (0 = only at the end), got {self.checkpoint_every}",
        )
        need(
            self.timeout_s >= 0,
            f"--timeout-s must be >= 0 (0 = derived from the model and --link-rate), got {self.timeout_s}",
        )
        need(
            self.hierarchy in HIERARCHIES,
            f"unknown --hierarchy {self.hierarchy!r}; accepted: {', '.join(HIERARCHIES)}",
        )
        self.site_of_host()
        self.slow_factors()
        need(
            self.hierarchy != "auto" or not self.sites,
            "--hierarchy auto measures the sites itself: drop --sites, or use --hierarchy sites",
        )
        need(
            self.hierarchy != "sites" or bool(self.sites),
            "--hierarchy sites needs the site of each host: run with --topology, or give geotrain train "
            "--sites 0,0,1,1 (one site number per host)",
        )
        need(
            self.pace != "time" or not (self.norm_ratio() > 0 or self.aggregate != "mean"),
            "--pace time weighs each worker's contribution by the steps it computed, which the norm check "
            "and the robust averages would judge as they are: drop --pace time, or --max-norm-ratio and "
            "--aggregate",
        )
        need(
            not self.site_H or self.hierarchy != "off",
            "--site-H averages inside each site: give the sites with --hierarchy sites (and --topology or "
            "--sites) or --hierarchy auto",
        )
        parse_redundancy(self.redundancy)
        self.snapshot_rate_bps()
        self.link_rate_bps()
        try:
            faults = parse_chaos(self.chaos)
        except ChaosError as e:
            raise ConfigError(str(e)) from None
        for spec in self._extra_profile_codecs():  # --compress is checked by its algorithm
            try:
                make_codec(spec)
            except ValueError as e:  # the codecs' own ConfigError
                raise ConfigError(f"--profile-codecs: {e}") from None
        codec = plain_spec(self.compress).partition(":")[0]
        checking = self.norm_ratio() > 0 or self.aggregate != "mean"
        codecs = AUTO_CODECS if self.compress == AUTO_CODEC else (codec,)  # auto: any it may choose
        covered = self.algo in GUARDED_ALGOS and all(c in GUARDED_CODECS for c in codecs)
        need(
            covered or not checking,
            f"--max-norm-ratio and --aggregate check the averages of {', '.join(GUARDED_ALGOS)}, "
            f"uncompressed or with {', '.join(c for c in GUARDED_CODECS if c)}; not --algo {self.algo}"
            + (f" --compress {self.compress}" if self.compress else ""),
        )
        robust = parse_aggregate(self.aggregate)[0] in GATHERED
        need(
            not (robust and self.algo in ("streaming", "co2", "ddp_powersgd")),
            f"--aggregate {self.aggregate} is not offered with {self.algo} (its fragments' gather, "
            "co2's weighted sum in flight, PyTorch's PowerSGD hook): use --max-norm-ratio R with "
            "--aggregate mean or clip",
        )
        sparse = self.algo in ("sparseloco", "demo") or codec in SPARSE_CODECS
        need(
            not (sparse and robust),
            f"--aggregate {self.aggregate} takes a statistic of each coordinate over the workers, "
            f"and sparse messages ({self.algo}" + (f" --compress {self.compress}" if self.compress else "")
            + ") leave most coordinates zero: use --max-norm-ratio R with --aggregate mean or clip",
        )  # fmt: skip
        if any(f.kind == "corrupt" for f in faults):
            need(
                covered and (self.algo != "ddp" or checking),
                f"--chaos corrupt spoils what the norm check covers (the averages of "
                f"{', '.join(GUARDED_ALGOS)}, uncompressed or with "
                f"{', '.join(c for c in GUARDED_CODECS if c)}; ddp's with --max-norm-ratio or an "
                f"--aggregate); not --algo {self.algo}"
                + (f" --compress {self.compress}" if self.compress else ""),
            )
        self.sync_config()  # validates the algorithm's own options

    def slow_factors(self) -> dict[int, float]:
        """``--slow 1:3;2:1.5`` as {host: factor}: each named host computes FACTOR times slower."""
        out: dict[int, float] = {}
        for part in filter(None, self.slow.split(";")):
            host, colon, factor = part.partition(":")
            try:
                h, f = int(host), float(factor)
            except ValueError:
                h, f = -1, 0.0
            if not colon or h < 0 or not 1 < f <= 100 or h in out:
                raise ConfigError(
                    f"--slow takes HOST:FACTOR, ';'-separated, each host once, a factor above 1, at most 100 "
                    f"(e.g. 1:3 makes host 1 compute 3x slower); got {part!r}"
                )
            out[h] = f
        return out

    def norm_ratio(self) -> float:
        """``--max-norm-ratio`` as it applies: the number given, or under ``auto`` (the default)
        ``guard.default_norm_ratio``'s: 10 for the methods whose check costs a round trip per
        sync or nothing, else 0 (off);
        in groups of fewer than 3 (``AUTO_MIN_WORKERS``) the communicator leaves out under auto
        only what is not finite.
        A profile measures the link unchecked."""
        if self.max_norm_ratio != AUTO:
            return self.max_norm_ratio
        if self.profile_out:
            return 0.0
        return default_norm_ratio(self.algo, self.compress, self.pace, self.warm_start)

    def _extra_profile_codecs(self) -> list[str]:
        """``profile_codecs`` as specs ("none", fp32, and empty items dropped)."""
        return [c for c in (plain_spec(c.strip()) for c in self.profile_codecs.split(";")) if c]

    def profile_codec_specs(self) -> list[str]:
        """The codecs a profile times: ``compress``'s (every candidate under auto), then
        ``profile_codecs``'; each once (``time_codecs`` times one spelling of a codec once)."""
        own = list(AUTO_CODECS) if self.compress == AUTO_CODEC else [plain_spec(self.compress)]
        return list(dict.fromkeys(c for c in own + self._extra_profile_codecs() if c))  # "": fp32

    def site_of_host(self) -> list[int] | None:
        """``--sites 0,0,1,1`` as a list (None: no sites given)."""
        if not self.sites:
            return None
        try:
            sites = [int(s) for s in self.sites.split(",")]
        except ValueError:
            sites = [-1]
        if min(sites) < 0:
            raise ConfigError(f"--sites takes a site number >= 0 per host, e.g. 0,0,1,1; got {self.sites!r}")
        return sites

    def snapshot_rate_bps(self) -> float:
        return _rate_bps(self.snapshot_bandwidth, "--snapshot-bandwidth")

    def link_rate_bps(self) -> float:
        return _rate_bps(self.link_rate, "--link-rate")

    def collective_timeout_s(self) -> float:
        """``--timeout-s``, or where it is 0 the timeout ``collective_timeout_s`` derives from the
        model's fp32 bytes and the slowest link (``--link-rate``)."""
        if self.timeout_s > 0:
            return self.timeout_s
        nbytes = 4 * parameter_count(self.model_spec())
        if parse_aggregate(self.aggregate)[0] in GATHERED:  # every contribution gathered: N - 1 copies
            nbytes *= 4
        return collective_timeout_s(nbytes, self.link_rate_bps())

    def model_spec(self) -> ModelSpec:
        return ModelSpec(self.model, self.model_config, self.lora, self.lora_fa)

    def process_backend(self) -> str:
        """``--backend``, with auto resolved to gloo for an elastic run: regrouping after a lost
        member has not run on NCCL, whose watchdog ends a process whose collective failed."""
        return "gloo" if self.backend == "auto" and self.elastic else self.backend

    def sync_options(self) -> dict[str, Any]:
        # None (H 0, overlap unset): the algorithm's default, which from_options leaves in place
        H = "auto" if self.H == AUTO_H else self.H or None
        opts: dict[str, Any] = {"H": H, "outer_lr": self.outer_lr or None}
        opts["overlap"] = self.overlap
        if self.eager is not None:
            opts["eager"] = self.eager
        if self.outer_momentum >= 0:
            opts["outer_momentum"] = self.outer_momentum
        if self.momentum_ramp >= 0:
            opts["momentum_ramp"] = self.momentum_ramp
        unset = {"chunk": 0, "k": 0, "bits": 0, "beta": -1.0, "alpha": 0.0}  # the algorithm's default
        unset |= {"fragments": 0, "tau": -1, "mix": -1.0, "gap_penalty": 0.0, "clip": -1.0}
        opts |= {name: getattr(self, name) for name, no in unset.items() if getattr(self, name) != no}
        if self.bucket_mb:
            opts["bucket_mb"] = self.bucket_mb
        if self.warm_start:
            opts["warm_start"] = self.warm_start
        if self.H_schedule:
            opts["H_schedule"] = self.H_schedule
        if self.pace != "steps":
            opts["pace"] = self.pace
        if self.site_H:
            opts["site_H"] = self.site_H
        if self.plan:
            opts["plan_path"] = self.plan
        if self.compress:  # "none": fp32, where an algorithm's default is a codec (sync_config)
            opts["compress"] = self.compress
        opts["replan_threshold"] = self.replan_threshold
        if self.fill_in is not None:
            opts["fill_in"] = self.fill_in
        if self.lag >= 0:
            opts["lag"] = self.lag
        if self.mean_over:
            opts["mean_over"] = self.mean_over
        return opts

    def sync_config(self):
        return sync_config(self.algo, self.sync_options())

    def to_argv(self) -> list[str]:
        """The command-line flags that rebuild this config in a worker."""
        argv = []
        for f in fields(self):
            value = getattr(self, f.name)
            flag = "--" + f.name.replace("_", "-")
            if value is None:  # an option left to the algorithm's default
                continue
            if isinstance(value, bool):
                argv.append(flag if value else "--no-" + f.name.replace("_", "-"))
            elif f.name == "H" and value == AUTO_H:
                argv += [flag, "auto"]
            else:
                argv += [flag, str(value)]
        return argv


def _rate_bps(text: str, flag: str) -> float:
    """A rate option in bit/s; "" or "0": none (0)."""
    if text in ("", "0"):
        return 0.0
    try:
        return float(parse_bandwidth(text))
    except LinkSpecError as e:
        raise ConfigError(f"{flag}: {e}") from None


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per ``TrainConfig`` field, with its default and type."""
    helps = {
        "algo": f"sync algorithm: {', '.join(ALGORITHMS)}",
        "model": f"the model: geotrain's GPT by size ({', '.join(MODEL_SIZES)}), or a Hugging Face "
        "causal LM: hf:DIR (saved with save_pretrained) or hf:TYPE (hf:gpt2, hf:llama: built from the "
        "type's config; needs the hf extra)",
        "model_config": "NAME=VALUE,... over the model's config, e.g. n_layer=2,n_embd=64 (GPT) or "
        "hidden_size=64,num_hidden_layers=2 (hf:llama)",
        "lora": "LoRA adapters (peft): r=8,alpha=16,targets=q_proj,v_proj[,dropout=0]; the base is "
        "frozen and only the adapters train and travel (targets default to the attention projections)",
        "lora_fa": "with --lora: freeze the A matrices too (LoRA-FA), halving what travels",
        "steps": "training steps per worker",
        "batch_size": "sequences per worker per step",
        "block_size": "tokens per sequence (0: the model's context)",
        "optimizer": f"the (inner) optimizer: {', '.join(OPTIMIZERS)}",
        "lr": "learning rate of the (inner) optimizer; 0: the algorithm's default (1e-3; demo, whose "
        "signed steps use it, 2e-3)",
        "weight_decay": "decoupled weight decay (adamw) or L2 (sgd)",
        "warmup": "steps of linear learning-rate warm-up; auto: a tenth of the planned steps (--lr-steps "
        "or --steps), at most 100 (demo: none); 0: none",
        "lr_schedule": "learning rate after the warm-up: constant, or cosine (decays to --min-lr-ratio "
        "x --lr at the last of --steps); the same for every algorithm",
        "min_lr_ratio": "cosine: the last step's learning rate as a fraction of --lr",
        "lr_steps": "the steps the schedule is planned over, if not --steps (a short run that "
        "follows the first part of a longer run's schedule)",
        "lr_scale": "sqrt: the optimizer steps each worker takes on its own gradient (localsgd, "
        "diloco, dreamddp, streaming, co2, sparseloco) run at sqrt(N) x the learning rate, so their "
        "average moves as far as a synchronous step at --lr where gradient noise dominates; auto: at "
        "the factor between 1 and sqrt(N) that the gradient noise measured at each sync calls for "
        "(localsgd, diloco, co2, sparseloco, dreamddp; 1 for the others); 1: at --lr (see the README)",
        "H": "steps between synchronisations (localsgd, diloco, sparseloco, co2; of each fragment, "
        "streaming); the schedule's period (dreamddp; auto: the period with the shortest predicted time "
        "to a loss, chosen at start-up from the profile, up to one layer per iteration: see the "
        "README); 0: the algorithm's default (10; dreamddp 2; sparseloco, streaming, co2 20)",
        "outer_lr": "the outer learning rate of diloco, streaming and co2 (0.7); 0: the algorithm's default",
        "outer_momentum": "the outer momentum: diloco's and streaming's Nesterov (-1: follows H: "
        "with --outer-lr 0.7, 0.5 up to H=10, rising to the paper's 0.9 at H=500; see the README), "
        "co2's heavy-ball (-1: 0.5)",
        "momentum_ramp": "diloco, streaming (each fragment): where the outer momentum follows H, it rises "
        "linearly from that value at the first outer step to the paper's 0.9 over this many outer "
        "steps (-1 or 0: off, the H value throughout; 10 measured best on tiny); see the README",
        "warm_start": "localsgd, diloco: the first W steps are synchronous SGD (gradients averaged "
        "every step, uncompressed), then periodic (post-local SGD); 0: periodic from the start",
        "H_schedule": "localsgd, diloco: shorter periods first, then H: grow (periods 2, 4, 8, ... below H, "
        "each for a tenth of the planned steps; grow:every=STEPS,start=P to choose) or PERIODxSTEPS,... "
        "(e.g. 2x50,5x100); each stage ends where both its period and the next divide the step count "
        "(see the README); empty: H throughout",
        "site_H": "localsgd, diloco with --hierarchy sites or auto: the parameters are averaged inside "
        "each site (over its LAN) every site_H steps, and across sites every H; 0: off (the two levels "
        "then only split each all-reduce)",
        "pace": "localsgd, diloco: steps (every worker computes the H steps of a period) or time (a "
        "period lasts the fastest worker's H steps: a straggler computes the steps it can in that "
        "time and skips the rest, and the average weighs each worker by the steps it computed)",
        "chunk": "sparseloco: values per top-k chunk (default 4096); demo: DCT block per dimension (64)",
        "k": "values sent per chunk: sparseloco 64 of 4096 (1.56%%), demo 32 of 64x64",
        "bits": "bits per value sent: 2, 4 or 8 (default: sparseloco 2, demo 8); streaming 4, 8 or "
        "32 (default 4)",
        "beta": "sparseloco: error-feedback decay (0.95); demo: momentum decay (0.999); in [0, 1)",
        "alpha": "sparseloco: outer learning rate (default 1 over senders, 2 over workers: --mean-over)",
        "fragments": "streaming: fragments that synchronise in turn, one every H / fragments steps (4)",
        "tau": "streaming: steps a fragment's synchronisation overlaps, below H / fragments (1; 0: none); "
        "sparseloco with overlap: steps into the next period at which an outer step's gather lands, 1 to H "
        "(0, the default: 1.5 times the first gather's length under --overlap auto, H under --overlap)",
        "mix": "streaming: weight of the local parameters when a fragment's sync lands, in [0, 1] (0.5)",
        "gap_penalty": "co2: the staleness gap penalty lambda >= 1 dividing the stale "
        "pseudo-gradient (1: none)",
        "clip": "co2: clamp the outer momentum element-wise to +-this (1.0; 0: off)",
        "eager": "co2 (on by default): each period starts from the anchor moved by this worker's own "
        "pseudo-gradient, standing in for the mean still in flight (eager updates, Kale et al. 2025)",
        "overlap": "sparseloco: each outer step lands later (--tau steps), its all-gather under "
        "the next steps' compute (--no-overlap: never; unset or --overlap auto: on where the first "
        "outer step's gather took over 5%% of the period's compute); demo (on only with --overlap, "
        "auto is off: the loss suffers, see the README): each step's update lands one step late, its "
        "all-gather under the next step's compute",
        "mean_over": "sparseloco: each entry of the outer step is the mean over the workers that "
        "sent it (senders, the reference code's) or over every worker (workers); auto: senders "
        "without overlap or landing in the period's first half (--tau), workers landing later (each "
        "measured the better there; see the README)",
        "bucket_mb": "all-reduce bucket size in MB (0: the algorithm's default)",
        "compress": "a codec for the synchronisation messages, e.g. int8, int4, sign, topk:ratio=0.01, "
        "adatopk:ratio=0.01, powersgd:rank=4, acpsgd:rank=4, fp16, bf16 (ssgd, ddp, localsgd, diloco, "
        "dreamddp; empty: the algorithm's default, uncompressed but for dreamddp's auto; none: "
        "uncompressed); auto (dreamddp's default): its planner chooses fp32, int8 or int4 with the "
        "schedule, by predicted time to a loss",
        "plan": "dreamddp: a plan JSON from `geotrain plan` (empty: profile and plan at start-up)",
        "fill_in": "dreamddp (off by default: no loss gained, 5-10%% of the step lost on W1): each "
        "iteration also averages the layers whose all-reduce fits in the link's idle time, beyond "
        "the period's schedule",
        "lag": "dreamddp: where a layer's average lands: 0 (the paper's: before this step's update) "
        "or 1 (the default uncompressed: at the layer's next forward, its all-reduce running on "
        "under the update and the forward below it; a period's last iteration lands at once); with "
        "a codec (the one --compress auto chooses included) 0 by default (at 1 the codec's second "
        "phase runs under the update and the forward, measured slower on CPU workers)",
        "replan_threshold": "dreamddp: re-profile and re-plan when step time drifts this fraction, "
        "and fit the link's slowdown under backward once (0: never re-plan, no fit)",
        "eval_every": "validation every K steps (0: only at the end)",
        "eval_batches": "validation batches per evaluation (the same on every worker)",
        "eval_model": "what a validation during the run scores: average (the mean of the replicas, "
        "the model the run would end with if stopped there: one all-reduce of the trained parameters "
        "per validation where the replicas differ, counted as control traffic, not in a step's bytes "
        "or time), replicas (each replica's own loss, averaged: no traffic), auto (average on "
        "loopback, replicas on shaped or real links)",
        "seed": "seed of the model and of each worker's data stream",
        "data": "a folder of text files or a uint16 .bin file (empty: Python's standard library sources); "
        "with --tokenizer: .txt, .jsonl (a 'text' field) or .parquet files, or a folder of them",
        "tokenizer": "a tokenizers JSON file, or a directory with tokenizer.json (a Hugging Face model's): "
        "--data is tokenized with it once, cached next to the data (empty: bytes, vocabulary 256)",
        "threads": "torch threads per worker (0: cores / workers on this machine)",
        "backend": "the process group's: nccl (CUDA tensors; gloo carries the CPU control numbers), "
        "gloo (CPU or CUDA tensors), auto (nccl where every worker on a machine has a GPU of its own, "
        "gloo otherwise: NCCL refuses two ranks on one GPU)",
        "autocast": "bf16: forward passes (training, profiling, validation) under torch.autocast in "
        "bfloat16 on the worker's device; parameters, gradients and what is averaged stay fp32 (off: fp32)",
        "timeout_s": "seconds a collective (and a membership rendezvous) may wait for the other workers "
        "before the run fails (0: twice what the slowest link, --link-rate, needs for three copies of "
        "the model, plus a minute, at least 600)",
        "sites": "the site of each host, e.g. 0,0,1,1 (geotrain run --topology sets it): with "
        "--hierarchy sites, all-reduces sum inside each site first",
        "hierarchy": "off; sites: every all-reduce in two levels (inside each site over its LAN, "
        "across sites in stripes carried by every member, then shared inside), so less crosses the "
        "slow links between sites (see the README); auto: the same, with the sites found by "
        "measuring each pair of hosts' link at start-up",
        "slow": "stragglers: HOST:FACTOR, ';'-separated (e.g. 1:3): that host computes FACTOR times "
        "slower (after each optimizer step it sleeps FACTOR - 1 times its compute: three times its "
        "forward's time, for forward and backward, plus the optimizer step's; on CPU with one "
        "thread, timed on its thread's CPU clock, so other processes on its core do not count)",
        "max_rejections": "with --on-failure continue (the default): a host whose contributions were "
        "rejected this many times in a row is dropped from the run (0: never; use with 3 or more workers)",
        "max_norm_ratio": "leave out of every average (gradients, pseudo-gradients, parameters) a worker's "
        "contribution that is not finite or whose norm is more than R times the others' median; "
        "inf: only what is not finite; 0: off; auto (the default): 10 for localsgd, diloco, co2, "
        "streaming, sparseloco and demo (a round trip per sync, or none), inf among 2 workers; off "
        "for the per-step averages (ssgd, ddp, dreamddp, a --warm-start: one step's gradients vary "
        "too much for a ratio) and --pace time (see the README: what it covers)",
        "aggregate": "mean; clip: every contribution to an average is also scaled down to the "
        "median norm where above it (no extra communication); trimmed:f=F: the coordinate-wise mean "
        "without each coordinate's F largest and F smallest values; median: the coordinate-wise "
        "median (these two all-gather every contribution: N/2 times an all-reduce's bytes); "
        "non-finite contributions are always left out",
        "link_rate": "the slowest host's link, e.g. 10mbit, for the collective timeout (geotrain run sets it "
        "from --bandwidth)",
        "progress": "show a progress bar on rank 0",
        "resume": "continue the run in --run-dir from its newest snapshot every worker can reach",
        "resume_step": "with --resume: restore this snapshot step instead of the newest",
        "snapshot_every": "steps between in-memory snapshots (0: each sync boundary of a periodic "
        "method, every 50 steps otherwise)",
        "checkpoint_every": "steps between disk checkpoints, written by the keeper from its copy "
        "(0: only at the end)",
        "redundancy": "who else holds each worker's unique state: off, ring (the next worker's "
        "keeper), ec:K/N (N erasure-coded stripes on N peers, any K rebuild it)",
        "snapshot_bandwidth": "pace of redundancy traffic, e.g. 5mbit (0: as fast as the link goes)",
        "keeper": "this host's keeper socket (`geotrain keeper --socket PATH`); empty: none",
        "token_file": "a file holding the run's secret (else $GEOTRAIN_TOKEN): this worker proves it "
        "holds it before it is let in (geotrain run makes one per run; see README, Trust)",
        "chaos": "fault injection, ';'-separated: kill:step=S,rank=R | kill-host:step=S,host=H | "
        "kill:every=60s, each with optional ,restart=SECONDS; corrupt:step=S|every=K,rank=R"
        "[,kind=nan|inf|signflip][,scale=X]: that worker's next contribution to an average is "
        "spoiled (see README)",
    }
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        launcher_set = (
            "link", "network_mode", "run_dir", "latency_ms", "profile_out", "profile_codecs", "resume",
            "keeper", "elastic",
            "fault_timeout_s", "join", "spare", "min_workers", "join_timeout",
        )  # fmt: skip
        if f.name in (*launcher_set, "heartbeat", "broker", "host"):
            continue  # set by the launcher or added by the caller
        if f.name == "overlap":  # --overlap, --no-overlap, or --overlap auto (unset: the same)
            parser.add_argument(
                flag, nargs="?", const=True, default=f.default, type=_auto_is_none, dest=f.name,
                metavar="auto", help=helps.get(f.name),
            )  # fmt: skip
            parser.add_argument("--no-overlap", action="store_false", dest=f.name, help=argparse.SUPPRESS)
        elif f.type in ("bool", bool, "bool | None"):
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=f.default, help=helps.get(f.name)
            )
        else:
            typ = {"int": int, "float": float, "str": str}[str(f.type)]
            typ = norm_ratio_arg if f.name == "max_norm_ratio" else typ  # a number or "auto"
            typ = warmup_arg if f.name == "warmup" else typ  # a number or "auto"
            typ = H_arg if f.name == "H" else typ
            typ = _lr_scale_arg if f.name == "lr_scale" else typ
            default = "auto" if f.name == "warmup" else f.default  # argparse runs it through typ
            default = LR_SCALE_SHOWN if f.name == "lr_scale" else default
            parser.add_argument(flag, type=typ, default=default, help=helps.get(f.name), dest=f.name)


# What --help says --lr-scale is when left out ("": each algorithm's own default).
LR_SCALE_SHOWN = "the algorithm's own: 1 for every algorithm today"


def _lr_scale_arg(text: str) -> str:
    return LR_SCALE_DEFAULT if text == LR_SCALE_SHOWN else text


def _auto_is_none(text: str) -> None:
    """The value ``--overlap`` may take: ``auto``, which is what leaving it out means."""
    if text != "auto":
        raise argparse.ArgumentTypeError(f"takes no value (on), or 'auto'; --no-overlap is off; got {text!r}")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    names = {f.name for f in fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names})


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
    snap_comm = Communicator(group=ctx.snapshot_group) if ctx.snapshot_group is not None else None
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
    no_eval_through = 0  # evaluations at steps up to it are skipped (a regroup passed them)

    def one_step(x: torch.Tensor | None, y: torch.Tensor | None, step: int) -> bool:
        """One step; with no batch, a step this worker skips (``--pace time``): only the sync
        it holds, if any."""
        nonlocal phase, loss
        phase = "compute"
        if membership is not None and membership.changed():
            raise MembershipChanged("a new epoch was published")
        if membership is not None and membership.admit_before(step):
            raise MembershipChanged("a joiner is admitted")
        if x is None:
            loss = torch.tensor(float("nan"))
            phase = "sync"  # nothing to apply: only the synchronisation can fail
            return stepper.skip()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step - 1, cfg)
        for f in faults:  # --chaos corrupt: the communicator spoils this worker's next contribution
            if f.corrupts_at(step, host):
                comm.corrupt_next = f.corruption
                print(
                    f"geotrain: chaos: rank {host} corrupts its next contribution ({f.corruption}) "
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
        nonlocal tokens_per_step, tokens_done, no_eval_through, pause_after

        def lost_member(e: RuntimeError) -> bool:
            # A collective's error is a lost member if the coordinator says so within the time
            # it takes to find one (an exit at once, a silent host after the fault timeout).
            return isinstance(e, MembershipChanged) or membership.wait_published(cfg.fault_timeout_s + 5)

        if membership is None or not lost_member(error):
            raise error
        previous, stopped_at = list(membership.members), status

        def adopted(leaders: StepStatus, tokens: int) -> None:
            nonlocal status, tokens_done  # a retried regroup starts from the state now loaded
            status, tokens_done = leaders, tokens

        while True:
            try:
                event = regroup(
                    membership, comm, sync, model, optimizer, status, ctx.backend or "gloo", tokens_done,
                    previous, adopted,
                )  # fmt: skip
                break
            except (Excluded, RunFinished):
                raise
            except RuntimeError as e:  # a member lost while the group formed: regroup again
                if not lost_member(e):
                    raise
        tokens_done = event.pop("tokens")
        # A member behind the furthest (periodic methods: each goes on from its own step) must
        # not wait in an evaluation the others have done or skipped.
        no_eval_through = max(no_eval_through, event["furthest"])
        sampler.read_shards(owned_shards(host, ctx.world_size, event["members"]))
        tokens_per_step = cfg.batch_size * model.block_size * comm.world_size
        # Snapshots go on, each into this host's keeper, and redundancy among the new members.
        group = membership.snapshot_group
        snapshots.regroup(Communicator(group=group) if group is not None else None, event["members"])
        if not cfg.snapshot_every:  # a joiner planned alone (dreamddp --H auto): the members' period now
            snapshots.cfg.every = sync.default_snapshot_every()
        resume = event.pop("resume")
        # The boundary the regroup agreed they all head for (each from its own step).
        few = len(event["members"]) < cfg.min_workers
        pause_after = event["boundary"] if few and event["boundary"] < cfg.steps else None
        if host in event["joined"]:
            stripes = ", ".join(f"{p} from {n}" for p, n in event["stripes"].items())
            print(
                f"geotrain: host {host} was admitted after step {resume.done}: "
                f"{event['handed_over_bytes'] / 1e6:.1f} MB of state ({stripes} member(s), "
                f"checked) in {event['hand_over_s']:.2f} s",
                file=sys.stderr,
                flush=True,
            )
        event.update(at_step=stopped_at.committed + 1, step=resume.done, at=round(time.time(), 3))
        events.append(event)
        if run_dir is not None:  # every host's view: the summary's writer may have joined late
            view = dict(event, host=host)
            if event["joined"]:  # for audit: every member's parameters at an admission
                view["param_digest"] = param_digest(model)
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
        return resume

    batch = None
    step = first_step
    if cfg.join:
        # A replacement: admitted at the members' next sync boundary; it takes their state there.
        membership.request_join()
        resume = recover(MembershipChanged("joining"), StepStatus(-1, False))
        step = resume.done + 1
        # Fresh windows of its shard: its predecessor's stream from the start would repeat data.
        sampler.fresh_stream(cfg.seed, host, salt=1_000_003 * membership.epoch)
    while step <= cfg.steps:
        if pause_after is not None and step == pause_after + 1:
            pause_after = None
            wait_for_joiners(step - 1)
        t0 = time.perf_counter()
        before = comm.stats.copy()
        computes = sync.computes_step()  # False: a straggler's skipped step (--pace time)
        step_tokens = cfg.batch_size * model.block_size * sync.workers_computing()
        if batch is None and computes:
            batch = sampler.next_train()
        counted = False  # this step's tokens are in tokens_done already (adopted from a leader)
        try:
            synced = one_step(*(batch if computes else (None, None)), step)
            batch = None if computes else batch
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
        if device.type == "cuda":
            torch.cuda.synchronize()
        if not counted:
            tokens_done += step_tokens
        # Not at a step adopted from a leader: the others are past their snapshot of it (a
        # snapshot's agreement to ship is a collective every member must join).
        if not counted and (step == cfg.steps or snapshots.due(step)):
            # The final one too, before the end-of-run average: a resumed run continues from it.
            try:
                take_snapshot(step, final=step == cfg.steps)
            except RuntimeError as e:  # a member lost in the agreement to ship (redundancy)
                step = recover(e, StepStatus(step, False)).done
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
        if cfg.eval_every and step % cfg.eval_every == 0 and no_eval_through < step < cfg.steps:
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
            for h in comm.step_checked:
                in_a_row[h] = in_a_row.get(h, 0) + 1 if h in comm.step_rejected else 0
            comm.step_checked.clear()
            comm.step_rejected.clear()
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
    while True:
        try:
            if not finalized:
                sync.finalize()  # part of training: the replicas become one model
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


def _admit(cfg: TrainConfig) -> Pass | None:
    """Prove to the run's coordinator (or broker) that this worker holds the run token, before
    anything else; returns its pass (None: no coordinator to prove it to)."""
    if cfg.broker:
        where = broker_address(cfg.broker, 0 if cfg.spare else cfg.host)
    elif cfg.heartbeat:
        where = cfg.heartbeat.rsplit(":", 2)[0]
    else:
        return None
    addr, port = where.rsplit(":", 1)
    try:
        token = read_token(cfg.token_file)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        store = dist.TCPStore(
            addr, int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=30)
        )
    except Exception as e:  # a broker that is gone (the run is over) or never was
        raise RunFinished(f"no coordinator answers at {where} ({type(e).__name__})") from None
    return prove(store, token, cfg.host if cfg.broker or cfg.spare else int(cfg.heartbeat.rsplit(":", 1)[1]))


def take_a_place(cfg: TrainConfig, admitted: Pass | None = None) -> TrainConfig:
    """A spare (``--spare``): wait in the backup pool of the coordinator (``--heartbeat``, set by
    the launcher) or broker (``--broker``) until it gives this process a lost host's place, and
    return the config of that host's replacement (``--join`` as that host, its keeper)."""
    if cfg.broker:
        addr, port = broker_address(cfg.broker, 0).rsplit(":", 1)
        attempt, label = "0", str(cfg.host)
    elif cfg.heartbeat and cfg.elastic:
        addr, port, attempt, label = cfg.heartbeat.rsplit(":", 3)
    else:
        raise ConfigError("--spare needs --broker ADDR:PORT (or the launcher's --heartbeat and --elastic)")
    name = f"spare {label}" if int(label) >= 0 else "spare"
    print(f"geotrain: {name} waits in the backup pool at {addr}:{port}", file=sys.stderr, flush=True)
    host = wait_for_vacancy(
        addr,
        int(port),
        int(label),
        timeout_s=max(30.0, cfg.fault_timeout_s * 3),
        sign=None if admitted is None else partial(admitted.sign, read_token(cfg.token_file), "spare"),
    )
    print(f"geotrain: {name} takes the place of host {host}", file=sys.stderr, flush=True)
    return replace(
        cfg, join=True, host=host, keeper=cfg.keeper.replace("{host}", str(host)),
        heartbeat=f"{addr}:{port}:{attempt}:{host}" if not cfg.broker else cfg.heartbeat,
    )  # fmt: skip


def broker_address(spec: str, host: int) -> str:
    """``ADDR:PORT`` checked, for ``--broker``; ``host`` must be given with it."""
    addr, _, port = spec.rpartition(":")
    if not addr or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--broker takes ADDR:PORT (the broker's address and --port), got {spec!r}")
    if host < 0:
        raise ConfigError("--broker needs --host I, this machine's host id (0 .. the broker's --hosts - 1)")
    return f"{addr}:{port}"


def _leave(cfg: TrainConfig, heartbeat: Heartbeat | None, code: int) -> None:
    """Say goodbye to the coordinator and the launcher; skip the destructors of groups abandoned
    in a regroup (``ft.membership.RETIRED``), which could wait forever for a cut-off peer."""
    try:
        if heartbeat is not None:
            # Under continue, a trainer that failed says so (its host leaves at once: the
            # deathrattle on a real cluster, where no launcher watches its exit).
            # One declared failed (3) says nothing: a replacement may be that host by now.
            heartbeat.close(
                failed=cfg.elastic and code not in (0, 3, EXIT_BELOW_MIN_WORKERS), silent=code == 3
            )
            if cfg.elastic and cfg.run_dir:
                # torchrun's agent waits for its peers' agents at exit (300 s if one is gone):
                # the launcher takes the trainer's own word that it is done.
                with contextlib.suppress(OSError):
                    exit_file = Path(cfg.run_dir) / "control" / f"exit-{heartbeat.host}"
                    write_atomic(exit_file, f"{code}\n".encode())
    finally:
        if RETIRED:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def _run_hosts(cfg: TrainConfig) -> int:
    """A joiner's or a broker run's first look at the coordinator, before this process beats as
    its host (a refused one must not speak for a host that is training): how many hosts the run
    started with. Refusals are ``ConfigError``s (exit 2), an absent coordinator ``RunFinished``."""
    addr, port, attempt, host = cfg.heartbeat.rsplit(":", 3)
    where, host = f"{addr}:{port}", int(host)
    deadline = time.monotonic() + cfg.timeout_s
    while True:
        try:
            hosts, epoch, members = first_hosts(
                addr, int(port), timeout_s=30.0 if cfg.join else cfg.timeout_s
            )
        except Exception as e:  # a broker that is gone (the run is over) or never was
            raise RunFinished(f"no coordinator answers at {where} ({type(e).__name__})") from None
        if not 0 <= host < hosts:
            raise ConfigError(f"--host must be in [0, {hosts}) (the run's hosts), got {host}")
        if not cfg.join:
            if epoch > 0 or host_beating(addr, int(port), attempt, host, window_s=1.2):
                raise ConfigError(
                    f"host {host} is already training in this run (or the run is under way): a machine "
                    "that replaces a lost one joins with `geotrain join`"
                )
            return hosts
        if host not in members:
            if not cfg.spare and spare_placed(addr, int(port), host):
                raise ConfigError(f"a spare from the backup pool is taking host {host}'s place")
            return hosts
        # Still listed: either alive (refused) or just lost, its verdict to come (the broker's
        # --fault-timeout, which this process does not know): wait for it to leave.
        if host_beating(addr, int(port), attempt, host):
            raise ConfigError(
                f"host {host} is still training in this run; a replacement takes the place of a lost "
                f"host (members now: {members})"
            )
        if time.monotonic() > deadline:
            raise ConfigError(f"host {host} is silent but still a member after {cfg.timeout_s:g} s")
        time.sleep(0.5)


def _fatal(cfg: TrainConfig, rank: int, said: str, reason: str) -> None:
    """Say why this worker ends, and tell the launcher not to retry what fails the same way every
    time (bad input, a collective that outlasts its timeout): it ends the run with ``reason``."""
    print(said, file=sys.stderr)
    if cfg.run_dir:
        with contextlib.suppress(OSError):
            write_atomic(Path(cfg.run_dir) / "control" / f"fatal-rank{rank}", f"{reason}\n".encode())


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
        shutdown_distributed(together=ok)
    return 0


if __name__ == "__main__":
    sys.exit(main())
