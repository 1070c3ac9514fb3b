"""A run's configuration: ``TrainConfig``, the same on every worker, and its checks.

Every field is a ``--flag`` (``train_args.py`` turns them into argparse's and back); the checks run
when a config is built, so a mistake is one line before anything starts. Here too are the special
values of ``--warmup auto`` and ``--H auto``, and the parsers of the flags that take them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

from geotrain.api import LR_SCALE_DEFAULT, LR_SCALES, checked_lr_scale
from geotrain.comm.guard import (
    AUTO,
    GATHERED,
    GUARDED_ALGOS,
    GUARDED_CODECS,
    ROWS_IN_BAND_CODECS,
    SPARSE_CODECS,
    default_norm_ratio,
    parse_aggregate,
)
from geotrain.compress import plain_spec, run_codec
from geotrain.compress.codec import make_codec
from geotrain.ft.chaos import ChaosError, parse_chaos
from geotrain.ft.redundancy import parse_redundancy
from geotrain.launch.dist import BACKENDS
from geotrain.models import ModelError, ModelSpec, parameter_count
from geotrain.netem.links import LinkSpecError, parse_bandwidth
from geotrain.plan.network import collective_timeout_s
from geotrain.plan.schedule import AUTO_CODEC, auto_codecs
from geotrain.sync import ALGORITHMS, ConfigError, sync_config
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
    lower than its 2.176 at step 400 without (docs/reaching-ddp-loss.md)."""
    return min(MAX_AUTO_WARMUP, max(0, planned_steps) // 10)


AUTO_H = -1  # --H auto (dreamddp: its planner picks the period; sparseloco: its own measure)


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


AUTO_TAU = -2  # --tau auto (streaming: the overlap its start-up probe finds hides a gather)


def tau_arg(text: str) -> int:
    """``--tau``'s value: ``auto`` (AUTO_TAU), or a number of steps (-1, as a worker's argv
    passes it on: the algorithm's default; the config refuses other negatives)."""
    word = str(text).strip()
    if word.lower() == "auto":
        return AUTO_TAU
    try:
        value = int(word)
    except ValueError:
        value = AUTO_TAU  # refused below, as a negative would be
    if value < -1:
        raise argparse.ArgumentTypeError(f"takes a number of steps >= 0 or auto; got {text!r}")
    return value


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
    H: int = 0  # 0: the default (10; dreamddp 2; sparseloco auto; co2 10; streaming 20); AUTO_H: chosen
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
    tau: int = -1  # AUTO_TAU: auto
    mix: float = -1.0
    carry: bool | None = None
    # co2 (0, or -1: the algorithm's default)
    gap_penalty: float = 0.0
    clip: float = -1.0
    eager: bool | None = None
    eager_weight: float = -1.0
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
    hierarchy: str = "off"  # off | sites | auto: all-reduces, all-gathers in two levels (comm/hierarchy.py)
    slow: str = ""  # stragglers: HOST:FACTOR[;HOST:FACTOR], that host's compute FACTOR x slower
    # > 0: leave out of averages what is not finite or R x the median norm; 0: off; AUTO (-1):
    # 10 where it is (nearly) free, the periodic methods and the gathers (comm/guard.py)
    max_norm_ratio: float = AUTO
    max_rejections: int = 0  # > 0: a host rejected this many times in a row is dropped (continue)
    aggregate: str = "mean"  # mean | clip | trimmed:f=F | median (comm/guard.py)
    progress: bool = True
    resume: bool = False  # continue the run in run_dir from its newest restorable snapshot
    resume_step: int = 0  # with resume: this snapshot step instead of the newest
    snapshot_every: int = 0  # 0: a sync boundary >= 50 steps on (periodic methods), every 50 steps otherwise
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
            self.H != AUTO_H or self.algo in ("dreamddp", "sparseloco"),
            f"--H auto is dreamddp's and sparseloco's (each picks its period at start-up); give "
            f"{self.algo} a period >= 1 (0: its default)",
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
            f"--snapshot-every must be >= 0 (0: the algorithm's default), got {self.snapshot_every}",
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
        codec = run_codec(self.algo, self.compress).partition(":")[0]  # the algorithm's default too
        checking = self.norm_ratio() > 0 or self.aggregate != "mean"
        auto = self.compress == AUTO_CODEC
        codecs = auto_codecs(self.aggregate) if auto else (codec,)  # auto: any it may choose
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
        if any(f.kind == "corrupt" and not f.part for f in faults):
            need(
                covered and (self.algo != "ddp" or checking),
                f"--chaos corrupt spoils what the norm check covers (the averages of "
                f"{', '.join(GUARDED_ALGOS)}, uncompressed or with "
                f"{', '.join(c for c in GUARDED_CODECS if c)}; ddp's with --max-norm-ratio or an "
                f"--aggregate); not --algo {self.algo}"
                + (f" --compress {self.compress}" if self.compress else ""),
            )
        if any(f.kind == "corrupt" and f.part == "shard" for f in faults):
            need(
                codec in ROWS_IN_BAND_CODECS,
                f"--chaos corrupt:...,part=shard spoils a worker's shard of a quantised codec's mean "
                f"(--compress {'|'.join(ROWS_IN_BAND_CODECS)}); not "
                + (f"--compress {self.compress}" if self.compress else "an uncompressed average"),
            )
        if any(f.kind == "corrupt" and f.part == "stamp" for f in faults):
            need(
                codec in ROWS_IN_BAND_CODECS
                and getattr(make_codec(run_codec(self.algo, self.compress)), "owners", 1) == 2,
                f"--chaos corrupt:...,part=stamp sends a worker's copies of shards under a false "
                f"owners' stamp (--compress {'|'.join(ROWS_IN_BAND_CODECS)} with :owners=2); not "
                + (
                    f"--compress {self.compress}"
                    if self.compress
                    else f"{self.algo}'s default, {run_codec(self.algo, '') or 'uncompressed'}"
                ),
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
        return default_norm_ratio(self.algo, run_codec(self.algo, self.compress), self.pace, self.warm_start)

    def _extra_profile_codecs(self) -> list[str]:
        """``profile_codecs`` as specs ("none", fp32, and empty items dropped)."""
        return [c for c in (plain_spec(c.strip()) for c in self.profile_codecs.split(";")) if c]

    def profile_codec_specs(self) -> list[str]:
        """The codecs a profile times: ``compress``'s (every candidate under auto), then
        ``profile_codecs``'; each once (``time_codecs`` times one spelling of a codec once)."""
        own = (
            list(auto_codecs(self.aggregate))
            if self.compress == AUTO_CODEC
            else [run_codec(self.algo, self.compress)]
        )
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
        if self.carry is not None:
            opts["carry"] = self.carry
        if self.outer_momentum >= 0:
            opts["outer_momentum"] = self.outer_momentum
        if self.momentum_ramp >= 0:
            opts["momentum_ramp"] = self.momentum_ramp
        unset = {"chunk": 0, "k": 0, "bits": 0, "beta": -1.0, "alpha": 0.0}  # the algorithm's default
        unset |= {"fragments": 0, "tau": -1, "mix": -1.0, "gap_penalty": 0.0, "clip": -1.0}
        unset |= {"eager_weight": -1.0}
        opts |= {name: getattr(self, name) for name, no in unset.items() if getattr(self, name) != no}
        if self.tau == AUTO_TAU:
            opts["tau"] = "auto"
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
            elif (f.name, value) in (("H", AUTO_H), ("tau", AUTO_TAU)):
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
