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

from geotrain.cli_bench import cmd_bench, cmd_soak, cmd_sweep
from geotrain.cli_common import (
    EXIT_USAGE,
    Parser,
    UsageError,
    attach_dash_values,
    check_disk,
    check_model_and_data,
)
from geotrain.cli_plan import cmd_plan
from geotrain.data.corpus import DataError
from geotrain.ft.chaos import ChaosError, parse_chaos
from geotrain.models import ModelError
from geotrain.netem.cluster import MAX_HOSTS, netem_unavailable_reason
from geotrain.netem.links import (
    LinkSpecError,
    describe_links,
    format_bandwidth,
    parse_bandwidths,
    parse_latency,
)
from geotrain.netem.topology import parse_topology
from geotrain.sync import ConfigError
from geotrain.train_args import add_train_arguments, config_from_args


def _run_parser() -> argparse.ArgumentParser:
    p = Parser(
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
    if saved.get("algo") == "streaming":  # saved before --carry: the paper's mix, its only merge then
        saved.setdefault("carry", False)
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
    from geotrain.launch.keepers import keeper_socket
    from geotrain.launch.local import LaunchConfig, RunFailed, run_local_cluster
    from geotrain.sync.periods import resolve_every
    from geotrain.train_config import AUTO_WARMUP, TrainConfig

    parser = _run_parser()
    argv = attach_dash_values(argv, ("--steps", "--resume-step"))
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


def _parse_cluster_job(argv: list[str], parser: argparse.ArgumentParser):
    """Parse and validate everything a cluster job needs; create nothing."""
    from dataclasses import replace

    argv = attach_dash_values(argv, ("--bandwidth", "--latency", "--workers", "--H", "--steps"))
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
            f"backward slows by {profile['interference_s_per_byte'] * 1e9:.1f} ms per MB sent; a collective "
            f"waits {profile.get('sync_wait_s', 0.0) * 1e3:.1f} ms for the slowest host"
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


def _cmd_export(argv: list[str]) -> int:
    p = Parser(
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
    "plan": cmd_plan,
    "bench": cmd_bench,
    "soak": cmd_soak,
    "sweep": cmd_sweep,
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
