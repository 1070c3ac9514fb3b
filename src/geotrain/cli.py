"""geotrain: train one model on machines joined by slow links.

    geotrain run --workers 4 --bandwidth 100mbit --algo diloco --model mini --steps 200
    geotrain train ...        # the per-worker entry point that torchrun starts on each machine
    geotrain profile --workers 4 --bandwidth 100mbit --model mini --out profile.json
    geotrain plan --profile profile.json --H 10 --out plan.json     # or --choose
    geotrain bench [--quick]  # algorithms x links x workers: time to loss, plots, report
    geotrain keeper --socket PATH --dir DIR   # hold a host's snapshots (real clusters)
    geotrain broker --hosts 4 --port 29400     # coordinate a real cluster: survivors go on
    geotrain join --broker ADDR:29400 --host 2 ...  # a replacement machine joins the run
    geotrain soak --steps 600 --kill-every 60s   # train through a fault a minute, vs undisturbed
    geotrain export RUN_DIR --to DIR   # the final model as safetensors, loadable by transformers
    geotrain sweep [--keepers]  # remove namespaces left by crashed runs (and lingering keepers)

Every mistake in the input gets one line saying what is wrong and what is accepted, exit code 2,
and nothing is created before the input is known to be good.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path
from typing import Any

from geotrain.comm.guard import AUTO, norm_ratio_arg, parse_aggregate
from geotrain.data.corpus import DataError, load_corpus
from geotrain.ft.chaos import ChaosError, parse_chaos
from geotrain.models import ModelError, model_context
from geotrain.netem.cluster import MAX_HOSTS, netem_unavailable_reason, sweep_stale
from geotrain.netem.links import (
    LinkSpecError,
    describe_links,
    format_bandwidth,
    parse_bandwidths,
    parse_latency,
)
from geotrain.netem.topology import parse_topology
from geotrain.sync import ConfigError
from geotrain.train import add_train_arguments, config_from_args

EXIT_USAGE = 2


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        # No abbreviations: `--ste 40` must not pass for `--steps` unseen (resume checks flags).
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str):  # one line, not argparse's usage dump
        raise UsageError(f"{message} (see '{self.prog} --help')")


def _run_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="geotrain run",
        description="Train on N emulated hosts joined by shaped links, on this machine.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--workers", type=int, default=4, help=f"emulated hosts (1 to {MAX_HOSTS})")
    p.add_argument(
        "--bandwidth",
        default="100mbit",
        help="each host's link, both directions: one rate (100mbit) or one per host (100mbit,20mbit,...)",
    )
    p.add_argument(
        "--topology",
        default="",
        help="sites instead of one link per host: SITES,lan=RATE,wan=RATE, e.g. 2x2,lan=1gbit,wan=20mbit "
        "(2 sites of 2 hosts; each site's hosts share its WAN uplink) or 3+1,wan=20mbit+5mbit "
        "(a WAN rate per site); sets --workers",
    )
    p.add_argument("--latency", default="0ms", help="software latency per collective ring step (emulated)")
    p.add_argument("--no-netem", action="store_true", help="run on loopback, unshaped, without namespaces")
    p.add_argument("--run-dir", default="", help="output folder (empty: runs/<time>-<algo>-<workers>x<link>)")
    p.add_argument(
        "--timeout",
        type=float,
        default=0.0,
        help="stop the whole run after this many seconds, its newest snapshots on disk for --resume "
        "(0: never; a hung collective or host is caught by --timeout-s and --fault-timeout)",
    )
    p.add_argument(
        "--on-failure",
        dest="on_failure",
        default="continue",
        help="when a host fails: continue (the survivors regroup without it and go on, keeping their "
        "progress), rollback (every worker returns to the newest snapshot all can restore, a "
        "replacement takes the failed one's place, the run goes on, exactly) or stop",
    )
    p.add_argument(
        "--max-faults", dest="max_faults", type=int, default=10, help="give up at the fault after this many"
    )
    p.add_argument(
        "--min-workers",
        dest="min_workers",
        type=int,
        default=1,
        help="with continue: when fewer workers are left they pause after their next sync boundary, "
        "snapshot, and wait --join-timeout seconds for a replacement before they stop (--resume goes on)",
    )
    p.add_argument(
        "--join-timeout",
        dest="join_timeout",
        type=float,
        default=120.0,
        help="with --min-workers: seconds the paused workers wait for a replacement",
    )
    p.add_argument(
        "--fault-timeout",
        dest="fault_timeout",
        type=float,
        default=10.0,
        help="seconds without a heartbeat after which a host has failed (frozen, cut off, gone)",
    )
    p.add_argument(
        "--spares",
        type=int,
        default=0,
        help="with continue: K more hosts wait, started and ready, in a backup pool; one takes a lost "
        "host's place at once (its links the slowest host's rate; a restarted host rejoins the pool)",
    )
    p.add_argument(
        "--resume",
        dest="resume_dir",
        default="",
        metavar="RUN_DIR",
        help="continue this run (stopped, killed or finished) from its newest snapshot; "
        "--steps gives the new total",
    )
    add_train_arguments(p)
    return p


# What a resumed run may change; everything else must match the run directory's config.
RESUME_MAY_CHANGE = {
    "steps",
    "timeout",
    "resume_step",
    "eval_every",
    "progress",
    "chaos",
    "snapshot_every",
    "checkpoint_every",
    "snapshot_bandwidth",
    "threads",
    "timeout_s",
    "min_workers",
    "join_timeout",
    "lr_steps",
}


def saved_train_config(train_saved: dict[str, Any]) -> dict[str, Any]:
    """A run directory's saved training config in today's terms. A run made before the
    algorithms had their own defaults and timeouts were derived (its config has no ``link_rate``)
    saved overlap=True, the one default then (DeMo's is now off), and the fixed 600 s timeout."""
    saved = dict(train_saved)
    saved.setdefault("lr_scale", "1")  # saved before --lr-scale: off, its only behaviour then
    if saved.get("algo") == "sparseloco":  # saved before --mean-over: every worker's mean
        saved.setdefault("mean_over", "workers")
    if "link_rate" not in saved:
        if saved.get("overlap") is True:
            saved["overlap"] = None
        if saved.get("timeout_s") == 600.0:
            saved["timeout_s"] = 0.0
    return saved


def _given_flags(argv: list[str], parser: argparse.ArgumentParser) -> set[str]:
    """The dests of the options written on the command line (not defaults)."""
    by_flag = {flag: a.dest for a in parser._actions for flag in a.option_strings}
    given = set()
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if flag in by_flag:
            given.add(by_flag[flag])
    return given


def _cmd_resume(argv: list[str]) -> int:
    import json
    from dataclasses import fields, replace

    from geotrain.ft.keeper import KeeperClient
    from geotrain.ft.snapshots import ResumeError, preflight
    from geotrain.launch.local import LaunchConfig, RunFailed, keeper_socket, run_local_cluster
    from geotrain.sync.periods import resolve_every
    from geotrain.train import AUTO_WARMUP, TrainConfig

    parser = _run_parser()
    argv = _attach_dash_values(argv, ("--steps", "--resume-step"))
    args = parser.parse_args(argv)
    run_dir = Path(args.resume_dir)
    config_path = run_dir / "config.json"
    if not config_path.is_file():
        raise UsageError(f"--resume {run_dir}: not a geotrain run directory (no config.json there)")
    try:
        saved = json.loads(config_path.read_text())
        train_saved, workers = saved_train_config(saved["train"]), int(saved["workers"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        raise UsageError(f"--resume {run_dir}: config.json is unreadable; cannot resume this run") from None
    given = _given_flags(argv, parser) - {"resume_dir"}
    fixed = sorted(given & {"bandwidth", "latency", "no_netem", "run_dir", "topology"})
    if fixed:
        raise UsageError(
            f"--resume: a resumed run keeps its links and run directory; drop --{fixed[0].replace('_', '-')}"
        )
    if "workers" in given and args.workers != workers:
        raise UsageError(
            f"--resume: the run has {workers} workers, not {args.workers}; a resumed run keeps them"
        )
    names = {f.name for f in fields(TrainConfig)}
    for name in sorted(given & names - RESUME_MAY_CHANGE):
        if name == "warmup" and args.warmup == AUTO_WARMUP:
            continue  # auto was resolved when the run was made, and saved as a number
        planned = train_saved.get("lr_steps") or train_saved.get("steps", 0)
        if name == "H_schedule" and resolve_every(args.H_schedule, planned) == train_saved.get(name):
            continue  # grow's length of a stage was resolved when the run was made, and saved
        if getattr(args, name) != train_saved.get(name):
            raise UsageError(
                f"--resume: the run was made with {name}={train_saved.get(name)!r}, not "
                f"{getattr(args, name)!r}; a resumed run keeps its model, data, workers and algorithm "
                f"(it may change: {', '.join(sorted(RESUME_MAY_CHANGE))})"
            )
    overrides = {n: getattr(args, n) for n in given & names & RESUME_MAY_CHANGE}
    if "steps" in overrides and "lr_steps" not in overrides and not train_saved.get("lr_steps"):
        # A longer run goes on with the schedule it trained under (a cosine planned over the
        # first --steps), not a new one that would jump back up; --lr-steps re-plans it.
        overrides["lr_steps"] = train_saved.get("steps", 0)
    try:
        # A chaos fault or a chosen step of the earlier launch is not repeated unless asked again.
        base = {k: v for k, v in train_saved.items() if k in names} | {"chaos": "", "resume_step": 0}
        cfg = TrainConfig(**(base | overrides))
    except (ConfigError, DataError) as e:
        raise UsageError(str(e)) from None
    keepers = [KeeperClient(keeper_socket(run_dir, i), timeout_s=60.0) for i in range(workers)]
    try:
        step, how = preflight(keepers, run_dir / "snapshots", cfg.resume_step)
    except ResumeError as e:
        raise UsageError(f"--resume {run_dir}: {e}") from None
    if cfg.steps < step:
        raise UsageError(f"--steps {cfg.steps} is below the snapshot's step {step}; give the new total")
    check_disk(run_dir, cfg, workers)
    where = {"member": "a member's state (it was not training then)"}
    sources = ", ".join(f"rank {r} from {where.get(h, h)}" for r, h in sorted(how.items()))
    print(f"geotrain: resuming {run_dir} at step {step} of {cfg.steps} ({sources})", file=sys.stderr)
    rates = saved.get("rates_bps")
    if saved.get("network_mode") == "netns" and netem_unavailable_reason():
        raise UsageError(
            f"--resume: the run had emulated links, which cannot be made here now "
            f"({netem_unavailable_reason()}); run as root"
        )
    try:
        launch = LaunchConfig(
            workers,
            rates if saved.get("network_mode") == "netns" else None,
            run_dir,
            netem=saved.get("network_mode") == "netns",
            timeout_s=args.timeout,
            on_failure=args.on_failure,
            max_faults=args.max_faults,
            fault_timeout_s=args.fault_timeout,
            # The run's own unless given again.
            min_workers=args.min_workers if "min_workers" in given else train_saved.get("min_workers", 1),
            join_timeout_s=args.join_timeout
            if "join_timeout" in given
            else train_saved.get("join_timeout", 120.0),
            spares=args.spares if "spares" in given else int(saved.get("spares", 0)),
            topology=saved.get("topology", ""),
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        summary = run_local_cluster(launch, replace(cfg, resume=True, resume_step=step))
    except RunFailed as e:
        print(f"geotrain: run failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\ngeotrain: interrupted; resume again with: geotrain run --resume {run_dir}", file=sys.stderr)
        return 130
    _print_wire_bytes(summary)
    print(f"geotrain: network mode {summary['network_mode']}; run directory: {run_dir}")
    return 0


def _attach_dash_values(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """``--bandwidth -5mbit`` -> ``--bandwidth=-5mbit``, so the value reaches its own validation
    instead of argparse taking it for a flag."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        if (
            argv[i] in flags
            and i + 1 < len(argv)
            and argv[i + 1].startswith("-")
            and argv[i + 1][1:2].isdigit()
        ):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def _parse_cluster_job(argv: list[str], parser: argparse.ArgumentParser):
    """Parse and validate everything a cluster job needs; create nothing."""
    from dataclasses import replace

    argv = _attach_dash_values(argv, ("--bandwidth", "--latency", "--workers", "--H", "--steps"))
    args = parser.parse_args(argv)
    try:
        sites = parse_topology(args.topology) if getattr(args, "topology", "") else None
        if sites is not None:
            given = _given_flags(argv, parser)
            if "workers" in given and args.workers != sites.workers:
                raise UsageError(
                    f"--topology {args.topology} has {sites.workers} hosts, not --workers {args.workers}; "
                    "leave --workers out"
                )
            for clash in ("bandwidth", "no_netem", "sites"):
                if clash in given:
                    flag = "--" + clash.replace("_", "-")
                    raise UsageError(
                        f"--topology sets the hosts, their sites and links (lan=, wan=) on emulated hosts; "
                        f"drop {flag}"
                    )
            if parser.prog == "geotrain profile":
                raise UsageError(
                    "geotrain profile takes --bandwidth, not --topology: profile on one host's links, "
                    "then plan for the sites' rates"
                )
            args.workers, args.bandwidth = sites.workers, format_bandwidth(sites.lan_bps)
            if args.hierarchy != "auto":  # auto measures them (and is the check of this layout)
                args.sites = ",".join(str(site) for site in sites.host_sites())
        if parser.prog == "geotrain profile" and (args.hierarchy != "off" or args.slow):
            raise UsageError(
                "geotrain profile measures the flat all-reduce and every host's own compute: "
                "drop --hierarchy and --slow"
            )
        latency_ms = parse_latency(args.latency) * 1000
        args.latency_ms = latency_ms
        cfg = config_from_args(args)
        hf_dir = Path(cfg.model[3:]).expanduser() if cfg.model.startswith("hf:") else None
        if hf_dir is not None and hf_dir.is_dir():  # the same model for a resume from elsewhere
            cfg = replace(cfg, model=f"hf:{hf_dir.resolve()}")
        if not 1 <= args.workers <= MAX_HOSTS:
            raise UsageError(
                f"--workers must be 1 to {MAX_HOSTS} (one /24 subnet on one bridge), got {args.workers}"
            )
        if args.workers + max(0, getattr(args, "spares", 0)) > MAX_HOSTS:
            raise UsageError(f"--workers plus --spares must be at most {MAX_HOSTS} (one /24 subnet)")
        # With sites, exactly their LAN rate (not through --bandwidth's printed rate).
        rates = sites.host_rates() if sites is not None else parse_bandwidths(args.bandwidth, args.workers)
        check_model_and_data(cfg, args.workers)
        if args.timeout < 0:
            raise UsageError(f"--timeout must be >= 0 seconds (0: never), got {args.timeout}")
        if getattr(args, "on_failure", "continue") not in ("continue", "rollback", "stop"):
            raise UsageError(f"--on-failure {args.on_failure!r}: accepted: continue, rollback, stop")
        if getattr(args, "max_faults", 0) < 0:
            raise UsageError(f"--max-faults must be >= 0, got {args.max_faults}")
        if getattr(args, "fault_timeout", 10.0) < 2:
            raise UsageError(f"--fault-timeout must be >= 2 seconds (4 heartbeats), got {args.fault_timeout}")
        beyond = sorted(h for h in cfg.slow_factors() if h >= args.workers)
        if beyond:
            raise UsageError(f"--slow names host {beyond[0]}; the run's hosts are 0 to {args.workers - 1}")
        chaos = parse_chaos(cfg.chaos, args.workers)
        if args.no_netem and any(f.kind == "cut" for f in chaos):
            raise UsageError("--chaos cut: needs emulated links (a cut of loopback would cut every host)")
    except (ConfigError, DataError, LinkSpecError, ChaosError, ModelError) as e:
        raise UsageError(str(e)) from None

    return args, cfg, rates


def _launch_config(args, rates, label: str):
    from geotrain.launch.local import LaunchConfig

    links = describe_links(rates) if not args.no_netem else "loopback"
    if getattr(args, "topology", ""):
        links = "sites-" + args.topology.split(",")[0]
    run_dir = Path(args.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{label}-{args.workers}x{links}")
    try:
        return LaunchConfig(
            args.workers,
            None if args.no_netem else rates,
            Path(str(run_dir).replace(",", "_")),
            netem=not args.no_netem,
            timeout_s=args.timeout,
            on_failure=args.on_failure,
            max_faults=args.max_faults,
            fault_timeout_s=args.fault_timeout,
            min_workers=getattr(args, "min_workers", 1),
            join_timeout_s=getattr(args, "join_timeout", 120.0),
            spares=getattr(args, "spares", 0),
            topology=getattr(args, "topology", ""),
        )
    except ValueError as e:  # what LaunchConfig refuses (e.g. --min-workers): one line, exit 2
        raise UsageError(str(e)) from None


def _cmd_run(argv: list[str]) -> int:
    from geotrain.launch.local import RunFailed, run_local_cluster

    if any(a == "--resume" or a.startswith("--resume=") for a in argv):
        return _cmd_resume(argv)
    args, cfg, rates = _parse_cluster_job(argv, _run_parser())
    launch = _launch_config(args, rates, cfg.algo)
    run_dir = launch.run_dir
    check_disk(run_dir, cfg, args.workers)
    print(
        f"geotrain: {cfg.algo} on {args.workers} hosts, model {cfg.model}, run directory {run_dir}",
        file=sys.stderr,
    )
    try:
        summary = run_local_cluster(launch, cfg)
    except RunFailed as e:
        print(f"geotrain: run failed: {e}", file=sys.stderr)
        print(f"geotrain: run directory: {run_dir}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            f"\ngeotrain: interrupted; hosts stopped, namespaces removed. Partial metrics in {run_dir}",
            file=sys.stderr,
        )
        return 130
    _print_wire_bytes(summary)
    print(f"geotrain: network mode {summary['network_mode']}; run directory: {run_dir}")
    return 0


def _print_wire_bytes(summary: dict) -> None:
    """With sites: what stayed inside them and what crossed their uplinks, per step."""
    if summary.get("wan_bytes_per_step") is None:
        return
    from geotrain.metrics import format_bytes

    by_site = enumerate(summary["wan_bytes_per_step_by_site"])
    sites = ", ".join(f"site {i}: {format_bytes(b)}" for i, b in by_site)
    print(
        f"geotrain: on the wire per step: {format_bytes(summary['lan_bytes_per_step'])} inside the "
        f"sites, {format_bytes(summary['wan_bytes_per_step'])} across their WAN uplinks ({sites})"
    )


def _cmd_profile(argv: list[str]) -> int:
    from dataclasses import replace

    from geotrain.launch.local import RunFailed, run_local_cluster
    from geotrain.plan.profile import contention_scale

    parser = _run_parser()
    parser.prog = "geotrain profile"
    parser.description = (
        "Measure per-layer backward times and the link's all-reduce cost on the emulated cluster."
    )
    parser.add_argument("--out", default="profile.json", help="where the profile JSON goes")
    auto = any(a == "--compress=auto" for a in argv) or any(
        a == "--compress" and b == "auto" for a, b in itertools.pairwise(argv)
    )
    if auto and not any(a == "--algo" or a.startswith("--algo=") for a in argv):
        # a profile is no algorithm's; --compress auto (every candidate timed) is dreamddp's
        argv = [*argv, "--algo", "dreamddp"]
    args, cfg, rates = _parse_cluster_job(argv, parser)
    out = Path(args.out).resolve()
    launch = _launch_config(args, rates, "profile")
    print(f"geotrain: profiling {cfg.model} on {args.workers} hosts", file=sys.stderr)
    try:
        profile = run_local_cluster(launch, replace(cfg, profile_out=str(out), progress=False))
    except RunFailed as e:
        print(f"geotrain: profile failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ngeotrain: interrupted; hosts stopped, namespaces removed.", file=sys.stderr)
        return 130
    link = profile["allreduce"]
    mbit = 8e-6 / link["beta_s_per_byte"] if link["beta_s_per_byte"] else float("inf")
    print(
        f"{len(profile['layers'])} layers; forward {profile['forward_s'] * 1e3:.1f} ms, backward "
        f"{profile['backward_total_s'] * 1e3:.1f} ms (cv {profile['spread']['backward_cv']:.1%}), optimizer "
        f"{profile['optimizer_s'] * 1e3:.1f} ms, timed inside whole steps with every host computing: "
        f"{profile['step_s'] * 1e3:.1f} ms each ({contention_scale(profile):.2f}x the parts; the plans price "
        "the whole step)"
    )
    print(
        f"all-reduce: {link['alpha_s'] * 1e3:.2f} ms + bytes at {mbit:.1f} Mbit/s (fit residual up to "
        f"{profile['spread']['link_max_rel_residual']:.1%}); profiling took {profile['profile_s']:.1f} s"
    )
    if profile.get("contention_measured"):
        print(
            f"while backward runs, all-reduces are {profile['comm_slowdown_in_backward']:.2f}x slower, and "
            f"backward slows by {profile['interference_s_per_byte'] * 1e9:.1f} ms per MB sent"
        )
    else:
        print("contention between communication and backward: not measured (assumed none)")
    for spec, timed in profile.get("codecs", {}).items():
        total = sum(timed["layers"].values())
        print(
            f"{spec}: {total * 1e3:.1f} ms to encode and decode the whole model (priced by `geotrain plan`)"
        )
    print(f"profile: {out}")
    return 0


def _cmd_plan(argv: list[str]) -> int:
    import json

    from geotrain.plan.gather import Accelerator
    from geotrain.plan.planner import ChooseConfig, format_plan, make_plan

    p = _Parser(
        prog="geotrain plan", description="The DreamDDP schedule and predicted step times from a profile."
    )
    p.add_argument("--profile", required=True, help="a profile JSON from `geotrain profile`")
    p.add_argument("--H", type=int, default=None, help="the schedule's period (or --choose)")
    p.add_argument("--choose", action="store_true", help="pick the H with the fastest predicted time to loss")
    p.add_argument(
        "--budget",
        type=float,
        default=ChooseConfig.budget,
        help="--choose: most steps allowed, x synchronous SGD's",
    )
    p.add_argument(
        "--penalty",
        type=float,
        default=ChooseConfig.penalty,
        help="--choose: extra steps per unit of H, a fraction of synchronous SGD's (default: %(default)s, "
        "measured on W1; see the README)",
    )
    p.add_argument("--max-H", dest="max_H", type=int, default=ChooseConfig.max_H)
    p.add_argument(
        "--workers", type=int, default=None, help="predict for this many workers (default: the profile's)"
    )
    p.add_argument("--bandwidth", default=None, help="predict for these links: one rate or one per worker")
    p.add_argument(
        "--topology",
        default=None,
        help="predict for sites (as geotrain run takes them, e.g. 2x2,lan=1gbit,wan=20mbit): the flat "
        "ring against two levels, and the periods across and inside sites (--H, --site-H) that keep "
        "the step within --speed of nosync",
    )
    p.add_argument(
        "--speed",
        type=float,
        default=None,
        help="with --topology: the fraction of nosync's step rate the chosen periods keep (0.95)",
    )
    p.add_argument(
        "--compute-scale",
        dest="compute_scale",
        type=float,
        default=1.0,
        help="multiply the profile's compute times (slower or faster machines)",
    )
    p.add_argument(
        "--accel-tflops",
        dest="accel_tflops",
        type=float,
        default=989.0,
        help="the accelerator the links are read for: its peak TFLOP/s (default: an H100's bf16)",
    )
    p.add_argument(
        "--accel-mfu", dest="accel_mfu", type=float, default=0.4, help="the fraction of its peak it reaches"
    )
    p.add_argument(
        "--accel-tokens",
        dest="accel_tokens",
        type=float,
        default=0.5e6,
        help="tokens per step on each accelerator",
    )
    p.add_argument(
        "--aggregate",
        default=None,
        help="price a trust option on a profile taken without it: mean, clip, trimmed:f=F or median "
        "(the last two gather every contribution: N/2 times the bytes; default: as profiled)",
    )
    p.add_argument(
        "--max-norm-ratio",
        dest="max_norm_ratio",
        type=norm_ratio_arg,
        default=None,
        help="price the norm check (> 0: a round trip before co2's sum and the quantised codecs' "
        "collectives, none before a mean, whose verdict travels with it; 0: none; auto: as a run's "
        "default: the periodic averages and the gathers; default: as profiled)",
    )
    p.add_argument(
        "--compress",
        default="",
        help="price a codec (int4, int8, sign, topk:ratio=0.01, powersgd:rank=4, ..., or auto: "
        "none, int8 or int4, as a run's --compress auto chooses, with the table it chose from): the DreamDDP "
        "schedule is searched on its messages (a run with that codec and worker count takes the plan "
        "as it is), and ssgd, ddp, localsgd and diloco are predicted with it; the others send their "
        "own messages. Its encoding and decoding are priced where the profile timed them (`geotrain "
        "profile --compress` the same codec); otherwise a run refits them from its first steps",
    )
    p.add_argument(
        "--H-schedule",
        dest="H_schedule",
        default="",
        help="price localsgd and diloco under a run's --H-schedule (grow, or PERIODxSTEPS,...), at "
        "their mean steps per sync over --steps",
    )
    p.add_argument("--steps", type=int, default=1000, help="the steps an --H-schedule is planned over")
    p.add_argument(
        "--lag",
        type=int,
        choices=(0, 1),
        default=None,
        help="DreamDDP's schedule for a run's --lag: 1 (its default without --compress) lands a "
        "layer's average at its next forward, 0 before the update (the paper's; the default with "
        "--compress)",
    )
    p.add_argument(
        "--fill-in",
        dest="fill_in",
        action="store_true",
        help="DreamDDP's schedule for a run's --fill-in: each iteration also averages the layers "
        "that fit in its idle link time",
    )
    p.add_argument("--out", default="plan.json", help="where the plan JSON goes")
    p.add_argument("--png", default="", help="also draw the schedule's timeline to this PNG")
    args = p.parse_args(_attach_dash_values(argv, ("--H", "--workers", "--bandwidth", "--steps")))
    try:
        profile = json.loads(Path(args.profile).read_text())
    except FileNotFoundError:
        raise UsageError(
            f"--profile {args.profile}: no such file; make one with `geotrain profile`"
        ) from None
    except json.JSONDecodeError as e:
        raise UsageError(f"--profile {args.profile} is not JSON: {e}") from None
    if args.H is None and not args.choose:
        raise UsageError("give --H N or --choose")
    try:
        accel = Accelerator(args.accel_tflops * 1e12, args.accel_mfu, args.accel_tokens)
        choose = ChooseConfig(args.budget, args.penalty, args.max_H) if args.choose else None
        if args.workers is not None and not 1 <= args.workers <= 100_000:
            raise ValueError(f"--workers must be 1 to 100000, got {args.workers}")
        topology = parse_topology(args.topology) if args.topology else None
        if topology is None and args.speed is not None:
            raise ValueError("--speed chooses the periods on sites: give --topology too")
        if topology is not None and (args.workers is not None or args.bandwidth):
            raise ValueError("--topology gives the hosts and their links: drop --workers and --bandwidth")
        workers = args.workers or profile.get("workers")
        rates = parse_bandwidths(args.bandwidth, workers) if args.bandwidth else None
        ratio = args.max_norm_ratio
        if ratio is not None and not (ratio in (0, AUTO) or ratio >= 1):
            raise ValueError(f"--max-norm-ratio must be >= 1, 0 for off, or auto; got {ratio:g}")
        aggregate = parse_aggregate(args.aggregate)[0] if args.aggregate else None
        checked = None if ratio is None else "auto" if ratio == AUTO else ratio > 0
        plan = make_plan(
            profile, None if args.choose else args.H, choose, args.workers, rates, args.compute_scale,
            aggregate=aggregate, checked=checked, topology=topology,
            speed=0.95 if args.speed is None else args.speed, compress=args.compress,
            H_schedule=args.H_schedule, steps=args.steps, lag=args.lag, fill_in=args.fill_in,
        )  # fmt: skip
    except (ValueError, KeyError, LinkSpecError) as e:
        raise UsageError(
            str(e) if not isinstance(e, KeyError) else f"profile lacks {e}; profile again"
        ) from None
    Path(args.out).write_text(json.dumps(plan, indent=2) + "\n")
    if args.png:
        from geotrain.plan.planner import codec_priced, plot_schedule, retarget

        if topology is not None:  # the table's line: a flat ring through the slowest uplink
            workers, rates = topology.workers, [min(topology.wan_bps)] * topology.workers
        compute, link = retarget(
            profile, workers if topology else args.workers, rates, args.compute_scale,
            aggregate=aggregate, checked=False if checked == "auto" else checked,
        )  # fmt: skip
        codec = plan["target"]["compress"]  # --compress auto: the codec it chose
        compute = codec_priced(profile, compute, codec, workers or int(profile["workers"]))[0]
        plot_schedule(plan, compute, link, args.png)
    print(format_plan(plan, accel))
    print(f"\nplan: {args.out}" + (f"\ntimeline: {args.png}" if args.png else ""))
    return 0


def check_disk(run_dir: Path, cfg, workers: int) -> None:
    """Refuse (UsageError) a run whose files would not fit on its run directory's disk; warn where
    those of a run stopped unfinished would not (``geotrain.launch.disk``)."""
    from geotrain.launch.disk import NoRoom, check_room, disk_need
    from geotrain.models import parameter_count

    try:
        vocab = load_corpus(cfg.data or None, cfg.tokenizer).vocab_size
        n_params = parameter_count(cfg.model_spec(), vocab)
        need = disk_need(
            n_params, workers, cfg.algo, cfg.compress, bool(cfg.lora), bool(cfg.checkpoint_every)
        )
        warning = check_room(run_dir, need)
    except (NoRoom, DataError, ModelError) as e:
        raise UsageError(str(e)) from None
    if warning:
        print(warning, file=sys.stderr)


def check_model_and_data(cfg, workers: int) -> None:
    """The model and the data a job will train on, checked in the launcher before anything starts
    (text is tokenized here, once, and cached): raises ModelError, DataError or ConfigError."""
    corpus = load_corpus(cfg.data or None, cfg.tokenizer)
    context = model_context(cfg.model_spec(), corpus.vocab_size, cfg.block_size, corpus.tokens)
    corpus.check_fits(context, workers)


def _cmd_bench(argv: list[str]) -> int:
    from geotrain.bench.matrix import DEFAULT_ALGOS, DEFAULT_BANDWIDTHS, Bench, BenchConfig
    from geotrain.bench.report import markdown_table, scale_table, write_report
    from geotrain.launch.disk import state_copies
    from geotrain.launch.local import RunFailed
    from geotrain.train import warmup_arg

    p = _Parser(
        prog="geotrain bench",
        description="Algorithms x links x workers on the emulated cluster: "
        "time to loss, step-time breakdown, plots and a report.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--quick", action="store_true", help="a small matrix for CI: 2 workers, 100mbit, 4 algorithms"
    )
    p.add_argument(
        "--algos",
        default=",".join(DEFAULT_ALGOS),
        help="algorithms, each optionally with a codec: ssgd+int8, ssgd+acpsgd:rank=4, diloco+int4 "
        "(codec parameters separated by ';')",
    )
    p.add_argument(
        "--bandwidths",
        default=",".join(DEFAULT_BANDWIDTHS),
        help="link rates, one matrix column each; the report says what each stands for on an H100",
    )
    p.add_argument(
        "--workers", default="4", help="worker counts, e.g. 2,4,8 (several: predictions are checked)"
    )
    p.add_argument("--model", default="tiny", help="tiny, mini, small, hf:DIR or hf:TYPE (as geotrain run)")
    p.add_argument("--model-config", dest="model_config", default="", help="NAME=VALUE,... (as geotrain run)")
    p.add_argument("--lora", default="", help="r=8,alpha=16,targets=q_proj,v_proj (as geotrain run)")
    p.add_argument("--lora-fa", dest="lora_fa", action="store_true", help="LoRA-FA (as geotrain run)")
    p.add_argument("--data", default="", help="as geotrain run (empty: the standard library's sources)")
    p.add_argument("--tokenizer", default="", help="as geotrain run: --data tokenized once, cached")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch-size", dest="batch_size", type=int, default=32)
    p.add_argument("--eval-every", dest="eval_every", type=int, default=15)
    p.add_argument("--H", type=int, default=8, help="localsgd and diloco period (dreamddp plans its own)")
    p.add_argument("--max-H", dest="max_H", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--target-loss",
        dest="target_loss",
        type=float,
        default=None,
        help="default: the loss ddp reaches at the token budget",
    )
    p.add_argument(
        "--smooth",
        type=int,
        default=3,
        help="evaluations in the centred moving mean each validation curve is read through (odd; 1: raw)",
    )
    p.add_argument(
        "--lr-schedule",
        dest="lr_schedule",
        default="constant",
        help="every cell's learning rate: constant, or cosine over --steps (over --horizon with one)",
    )
    p.add_argument(
        "--warmup",
        type=warmup_arg,
        default="auto",
        help="every cell's learning-rate warm-up in steps; auto: a tenth of the planned steps "
        "(--horizon or --steps), at most 100 (demo: none), as geotrain run's",
    )
    p.add_argument(
        "--horizon",
        type=int,
        default=0,
        help="time to the loss of a run this many steps long: each cell's learning curve comes from "
        "a run of HORIZON steps on loopback (same workers, seeds, batches), its time from the "
        "step time of the --steps run on the shaped link (composed; the report says so and checks "
        "the two curves against each other over --steps)",
    )
    p.add_argument(
        "--cell-budget",
        dest="cell_budget",
        type=float,
        default=300.0,
        help="seconds: a shaped cell the planner predicts to run longer is not run, and the report "
        "gives its predicted step time (0: run every cell)",
    )
    p.add_argument("--no-netem", action="store_true", help="loopback, unshaped (no predictions checked)")
    p.add_argument(
        "--keep-states",
        action="store_true",
        help="keep each cell's saved states (snapshots/, checkpoint.pt: 0.6-1.1 GB a cell of mini on "
        "4 hosts); by default they are removed once the cell has finished, the report reads metrics",
    )
    p.add_argument(
        "--out", default="", help="the bench directory (a rerun resumes it); default runs/bench-<time>"
    )
    args = p.parse_args(_attach_dash_values(argv, ("--H", "--steps", "--workers")))
    if args.quick:
        args.workers, args.bandwidths, args.algos = "2", "100mbit", "nosync,ddp,localsgd,dreamddp"
        args.steps, args.eval_every, args.batch_size = 30, 10, 16
    try:
        workers = [int(w) for w in args.workers.split(",")]
    except ValueError:
        raise UsageError(f"--workers takes comma-separated integers, got {args.workers!r}") from None
    try:
        cfg = BenchConfig(
            algos=args.algos.split(","),
            bandwidths=args.bandwidths.split(","),
            workers=workers,
            model=args.model,
            model_config=args.model_config,
            lora=args.lora,
            lora_fa=args.lora_fa,
            data=args.data,
            tokenizer=args.tokenizer,
            steps=args.steps,
            batch_size=args.batch_size,
            eval_every=args.eval_every,
            H=args.H,
            max_H=args.max_H,
            seed=args.seed,
            target_loss=args.target_loss,
            netem=not args.no_netem,
            smooth=args.smooth,
            lr_schedule=args.lr_schedule,
            warmup=args.warmup,
            horizon=args.horizon,
            cell_budget_s=args.cell_budget,
            keep_states=args.keep_states,
        )
        # The model and data every cell will use, checked (and text tokenized) once, here.
        check_model_and_data(cfg.train_config("nosync"), max(cfg.workers))
        # Room for the largest cell's states (removed once it has finished, but --keep-states).
        cells = [cfg.train_config(entry) for entry in cfg.algos]
        largest = max(cells, key=lambda c: state_copies(c.algo, c.compress, bool(c.lora)))
        check_disk(Path(args.out or "runs"), largest, max(cfg.workers))
    except (ConfigError, DataError, LinkSpecError, ModelError) as e:
        raise UsageError(str(e)) from None
    out = Path(args.out or f"runs/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    bench = Bench(cfg, out, echo=lambda msg: print(f"geotrain: {msg}", file=sys.stderr))
    try:
        results = bench.run()
    except ConfigError as e:
        raise UsageError(str(e)) from None
    except RunFailed as e:
        print(
            f"geotrain: bench cell failed: {e}\ngeotrain: rerun the same command to resume", file=sys.stderr
        )
        return 1
    except KeyboardInterrupt:
        print(
            f"\ngeotrain: interrupted; finished cells are kept. Resume: geotrain bench ... --out {out}",
            file=sys.stderr,
        )
        return 130
    report = write_report(results, out)
    print(markdown_table(results))
    if results["scale"]:
        print("\n" + scale_table(results))
    print(f"\nreport: {report['html']}\nnumbers: {out / 'bench.json'}")
    return 0


def _cmd_soak(argv: list[str]) -> int:
    from geotrain.bench.soak import SoakJob, soak

    p = _Parser(
        prog="geotrain soak",
        description="Train under a fault every so often and compare with the same run undisturbed.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    job = SoakJob()
    p.add_argument("--workers", type=int, default=job.workers)
    p.add_argument("--bandwidth", default=job.bandwidth)
    p.add_argument("--model", default=job.model)
    p.add_argument("--algo", default=job.algo)
    p.add_argument("--H", type=int, default=job.H)
    p.add_argument("--batch-size", dest="batch_size", type=int, default=job.batch_size)
    p.add_argument(
        "--steps",
        type=int,
        default=job.steps,
        help="steps of each run (4 mini hosts at 100mbit, diloco: ~19 a minute undisturbed)",
    )
    p.add_argument("--eval-every", dest="eval_every", type=int, default=job.eval_every)
    p.add_argument(
        "--kill-every", dest="kill_every", default="60s", help="a random worker SIGKILLed this often"
    )
    p.add_argument(
        "--restart", default="5", help="seconds until a replacement joins (0: none; the run shrinks)"
    )
    p.add_argument("--fault-timeout", dest="fault_timeout", type=float, default=job.fault_timeout)
    p.add_argument(
        "--spares", type=int, default=0, help="hosts waiting in a backup pool to replace the killed at once"
    )
    p.add_argument("--model-config", dest="model_config", default="", help="NAME=VALUE,... (as geotrain run)")
    p.add_argument("--lora", default="", help="r=8,alpha=16,targets=q_proj,v_proj (as geotrain run)")
    p.add_argument("--lora-fa", dest="lora_fa", action="store_true", help="LoRA-FA (as geotrain run)")
    p.add_argument("--out", default="runs/soak")
    args = p.parse_args(argv)
    from geotrain.train import TrainConfig

    try:  # refused here in one line, not after the first run has started
        TrainConfig(model=args.model, model_config=args.model_config, lora=args.lora, lora_fa=args.lora_fa)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    extra = ["--model-config", args.model_config] if args.model_config else []
    extra += ["--lora", args.lora] if args.lora else []
    extra += ["--lora-fa"] if args.lora_fa else []
    restart = f",restart={args.restart}" if args.restart not in ("", "0") else ""
    chaos = f"kill:every={args.kill_every}{restart}"
    try:
        parse_chaos(chaos, args.workers)
    except ChaosError as e:
        raise UsageError(str(e)) from None
    if args.spares < 0:
        raise UsageError(f"--spares must be >= 0, got {args.spares}")
    for name in ("workers", "H", "batch_size", "steps", "eval_every"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    job = SoakJob(
        **{k: getattr(args, k) for k in SoakJob.__dataclass_fields__ if k not in ("extra", "on_failure")},
        extra=tuple(extra),
    )
    try:
        soak(job, chaos, Path(args.out))
    except RuntimeError as e:
        print(f"geotrain soak: {e}", file=sys.stderr)
        return 1
    return 0


def _cmd_sweep(argv: list[str]) -> int:
    from geotrain.launch.local import stop_lingering_keepers

    p = _Parser(prog="geotrain sweep", description="Remove namespaces and bridges of dead geotrain runs.")
    p.add_argument(
        "--keepers",
        action="store_true",
        help="also stop keepers whose launcher is gone (their snapshots in memory are lost; disk stays)",
    )
    args = p.parse_args(argv)
    removed = sweep_stale()
    print(f"removed {len(removed)}: {' '.join(removed)}" if removed else "nothing to remove")
    if args.keepers:
        stopped = stop_lingering_keepers()
        print(f"stopped {len(stopped)} keepers" if stopped else "no lingering keepers")
    return 0


def _cmd_export(argv: list[str]) -> int:
    p = _Parser(
        prog="geotrain export",
        description="Write a finished run's model as safetensors with a config.json that "
        "transformers loads without geotrain (geotrain's GPT in GPT-2's layout; LoRA adapters merged, "
        "and also kept alone in adapters.safetensors).",
    )
    p.add_argument("run_dir", help="the run's directory (it holds checkpoint.pt)")
    p.add_argument("--to", required=True, help="the directory to write (created if missing)")
    args = p.parse_args(argv)
    from geotrain.models import ModelError
    from geotrain.models.export import export

    try:
        record = export(args.run_dir, args.to)
    except ModelError as e:
        raise UsageError(str(e)) from None
    print(
        f"geotrain: exported {record['model']} ({record['parameters']:,} parameters"
        + (", LoRA merged" if record["lora_merged"] else "")
        + f") to {args.to}: {', '.join(record['files'])}"
    )
    return 0


def _cmd_keeper(argv: list[str]) -> int:
    from geotrain.ft.keeper import main as keeper_main

    return keeper_main(argv)


def _cmd_broker(argv: list[str]) -> int:
    from geotrain.launch.coordinator import broker

    return broker(argv)


def _cmd_join(argv: list[str]) -> int:
    """A replacement on a real cluster: ``geotrain train --join`` with the run's flags."""
    from geotrain.train import main as train_main

    if not any(a == "--broker" or a.startswith("--broker=") for a in argv):
        raise UsageError(
            "geotrain join needs --broker ADDR:PORT and --host I (the lost machine's id), or --spare "
            "(wait in the backup pool and take the place of whichever host is lost)"
        )
    if "--spare" in argv:
        return train_main(argv)
    return train_main([*argv, "--join"])


COMMANDS = {
    "run": _cmd_run,
    "profile": _cmd_profile,
    "plan": _cmd_plan,
    "bench": _cmd_bench,
    "soak": _cmd_soak,
    "sweep": _cmd_sweep,
    "export": _cmd_export,
    "keeper": _cmd_keeper,
    "broker": _cmd_broker,
    "join": _cmd_join,
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else EXIT_USAGE
    command, rest = argv[0], argv[1:]
    if command == "train":
        from geotrain.train import main as train_main

        return train_main(rest)
    if command not in COMMANDS:
        print(
            f"geotrain: error: unknown command {command!r}; accepted: {', '.join(['train', *COMMANDS])}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        return COMMANDS[command](rest)
    except UsageError as e:
        print(f"geotrain {command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
