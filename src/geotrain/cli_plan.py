"""``geotrain plan``: read a profile from ``geotrain profile`` and print the DreamDDP schedule
with every algorithm's predicted step time (the planning itself is ``plan/planner.py``).
"""

from __future__ import annotations

from pathlib import Path

from geotrain.cli_common import Parser, UsageError, attach_dash_values
from geotrain.comm.guard import AUTO, norm_ratio_arg, parse_aggregate
from geotrain.netem.links import LinkSpecError, parse_bandwidths
from geotrain.netem.topology import parse_topology


def cmd_plan(argv: list[str]) -> int:
    import json

    from geotrain.plan.gather import Accelerator
    from geotrain.plan.planner import ChooseConfig, format_plan, make_plan

    p = Parser(
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
        "measured on W1; see docs/dreamddp.md)",
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
        "none, int8, int4 or chunktopk, as a run's --compress auto chooses, with the table it chose "
        "from): the DreamDDP "
        "schedule is searched on its messages (a run with that codec and worker count takes the plan "
        "as it is), and ssgd, ddp, localsgd and diloco are predicted with it; the others send their "
        "own messages. Its encoding and decoding are priced where the profile timed them (`geotrain "
        "profile --compress` the same codec); otherwise a run refits them from its first steps. Not "
        "given: each method with its own default (diloco's int4; none: fp32 for all)",
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
    args = p.parse_args(attach_dash_values(argv, ("--H", "--workers", "--bandwidth", "--steps")))
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
        codec = plan["target"]["compress"]  # --compress auto: the codec it chose
        compute, link = retarget(
            profile, workers if topology else args.workers, rates, args.compute_scale,
            aggregate=aggregate, checked=False if checked == "auto" else checked, compress=codec or "",
        )  # fmt: skip
        compute = codec_priced(profile, compute, codec, workers or int(profile["workers"]))[0]
        plot_schedule(plan, compute, link, args.png)
    print(format_plan(plan, accel))
    print(f"\nplan: {args.out}" + (f"\ntimeline: {args.png}" if args.png else ""))
    return 0
