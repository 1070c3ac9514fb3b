"""``geotrain plan``: from a profile, the DreamDDP schedule and every algorithm's predicted step time.

``--choose`` picks the period H with the fastest predicted time to a given loss, within a
convergence budget. The time to a loss is (predicted step time) x (steps needed), and the steps
needed grow with the staleness that H allows. How fast they grow depends on model, data and
optimizer; the planner takes the user's estimate as ``penalty`` (extra steps per unit of H, as a
fraction of synchronous SGD's: steps(H) = steps_ssgd * (1 + penalty * (H - 1))) and considers
only the H whose factor stays within ``budget`` (1.25: at most 25% more steps than synchronous).
"""

from __future__ import annotations

import math
from dataclasses import asdict, replace
from typing import Any

from geotrain.comm.guard import GATHERED, default_norm_ratio, judged_in_rows
from geotrain.compress import DEFAULT_CODECS, plain_spec
from geotrain.netem.links import LinkSpecError, describe_links, parse_bandwidths
from geotrain.netem.topology import Topology
from geotrain.plan.codec_time import codec_key
from geotrain.plan.cost import (
    PLAN_HEADROOM,
    ComputeModel,
    LinkModel,
    default_lag,
    exposed_for_layers,
    guarded_link,
    lands_late,
    predict_co2,
    predict_periodic,
    predict_schedule,
    predict_ssgd,
    priced_for_codec,
    queue_spans,
    unguarded_link,
    whole_model_allreduce_s,
)
from geotrain.plan.gather import (
    Accelerator,
    choose_sparseloco_period,
    format_rate,
    gather_s,
    predict_co2_gathered,
    predict_demo,
    predict_sparseloco,
    predict_streaming,
    sparseloco_message_bytes,
    stands_for_bps,
)
from geotrain.plan.network import NetworkModel
from geotrain.plan.profile import codec_times, models_from_profile
from geotrain.plan.schedule import (
    AUTO_CODEC,
    CODEC_MARGIN,
    ChooseConfig,
    Schedule,
    auto_codecs,
    choose_codec,
    choose_period,
    schedule_to_json,
    search_schedule,
)
from geotrain.plan.sites import choose_periods, format_sites, site_links, two_level_gather_link
from geotrain.sync.co2 import CO2Config
from geotrain.sync.periods import check_schedule, periods_for, resolve_every
from geotrain.sync.streaming import StreamingConfig

OWN_PERIOD = 20  # what a plan saved before sparseloco's --H auto priced it at (sparseloco_period)


PREDICTED = ("nosync", "ddp", "ssgd", "localsgd", "diloco", "dreamddp", "sparseloco", "demo", "streaming")
PREDICTED += ("co2",)
OWN_H = ("streaming", "co2")  # priced at their default period, whatever the plan's H (sparseloco at its own)


# judged where their messages land, with no communication (co2 where it gathers quantised ones)
GATHERING = ("sparseloco", "demo", "streaming") + (("co2",) if CO2Config.bits < 32 else ())


def own_period(algo: str) -> int:
    """The period streaming and co2 are priced at: their configs' defaults."""
    return {"streaming": StreamingConfig.H, "co2": CO2Config.H}[algo]


def sparseloco_period(compute: ComputeModel, link: LinkModel, workers: int) -> int:
    """The period sparseloco runs at with its defaults (``--H auto``): its choice from the
    predicted step and gather, as a run takes it from the measured ones, with the wait for the
    slowest worker that a synchronous gather pays."""
    n_params = sum(compute.raw_nbytes or compute.nbytes) // 4
    gather = gather_s(link, sparseloco_message_bytes(n_params), workers)
    return choose_sparseloco_period(compute.compute_s, gather, sync_wait_s=compute.sync_wait_s)[0]


def predict_algo(
    algo: str, compute: ComputeModel, link: LinkModel, H: int, workers: int, schedule: Schedule | None = None
) -> float:
    """The predicted mean step of ``algo`` (one of ``PREDICTED``) with its defaults; ``H`` is the
    period of localsgd, diloco and sparseloco, ``schedule`` dreamddp's plan."""
    n_params = sum(compute.raw_nbytes or compute.nbytes) // 4
    if algo == "nosync":
        return compute.compute_s
    if algo in ("ddp", "ssgd"):  # their default buckets: DDP's 25 MB, geotrain's 4 MB
        return predict_ssgd(compute, link, bucket_mb=25.0 if algo == "ddp" else 4.0, ddp=algo == "ddp")
    if algo in ("localsgd", "diloco"):
        return predict_periodic(compute, link, H)
    wait = compute.sync_wait_s  # what a synchronous gather waits for the slowest worker
    if algo == "sparseloco":
        return predict_sparseloco(compute.compute_s, link, n_params, workers, H, sync_wait_s=wait)
    if algo == "demo":
        return predict_demo(compute.compute_s, link, n_params, workers, sync_wait_s=wait)
    if algo == "streaming":
        cfg = StreamingConfig  # its defaults (H: the period it is priced at)
        return predict_streaming(
            compute.compute_s, link, n_params, workers, H, cfg.fragments, cfg.tau, cfg.bits
        )
    if algo == "co2" and CO2Config.bits < 32:  # its default: quantised messages, gathered
        return predict_co2_gathered(compute.compute_s, link, n_params, workers, H, CO2Config.bits)
    if algo == "co2":
        return predict_co2(compute, link, H)
    if algo == "dreamddp" and schedule is not None:
        return predict_schedule(compute, link, schedule.iterations, schedule.lag)
    raise ValueError(f"no prediction for {algo!r} (predicted: {', '.join(PREDICTED)}; dreamddp needs a plan)")


def predictions(
    compute: ComputeModel,
    link: LinkModel,
    H: int,
    schedule: Schedule,
    workers: int,
    plain: LinkModel | None = None,
    options: tuple[str, bool] = ("mean", False),
    auto_check: bool = False,
    uncompressed: ComputeModel | None = None,
    mean_period: float | None = None,
    compress: str = "",
    defaults: dict[str, tuple[ComputeModel, str]] | None = None,
    *,
    sparseloco_H: int,
) -> dict[str, float]:
    """Every algorithm's step; sparseloco (at ``sparseloco_H``: ``sparseloco_period``),
    streaming and co2 at their own default period, not the plan's H. With trust options
    (``options``: aggregate, norm check), ``link`` is the all-reduce under them and ``plain`` the
    one without: the gathering methods (sparseloco, demo, streaming, and co2 with its default
    4-bit messages) judge the messages they hold with no communication, co2's fp32 weighted sum
    (``CO2Config.bits`` 32) pays the check's round trip only, and the combinations a run
    refuses (trimmed or median with them) are left out. ``auto_check`` (``--max-norm-ratio
    auto``): each algorithm checked as a run of it would be by default
    (``guard.default_norm_ratio``), ``link`` being the unchecked line.
    ``uncompressed``: where ``compute`` prices a codec's messages, the model without it, for the
    methods that take no codec (their own messages: nosync, sparseloco, demo, streaming, co2).
    ``mean_period``: localsgd's and diloco's steps per sync under an ``--H-schedule``.
    ``compress``: the codec ``compute`` is priced for; the quantised ones carry each worker's
    norm in their all-to-all, so a checked one costs what an unchecked one does (but for clip,
    ``cost.guard_factors``). ``defaults``: methods priced with a codec of their own instead
    (its model and spec: diloco's default int4 where no ``--compress`` was given)."""
    periods: dict[str, float] = {algo: own_period(algo) if algo in OWN_H else H for algo in PREDICTED}
    periods["sparseloco"] = sparseloco_H
    if mean_period is not None:
        periods["localsgd"] = periods["diloco"] = mean_period
    plain = plain or link
    aggregate, checked = options
    rows = judged_in_rows(compress)
    out = {}
    for algo in PREDICTED:
        if aggregate in GATHERED and algo in ("sparseloco", "demo", "streaming", "co2"):
            continue  # refused by the run: a coordinate-wise statistic of these is not offered
        on = checked
        own = (defaults or {}).get(algo)
        codec = own[1] if own else compress if algo in CODEC_ALGOS else ""
        if auto_check:
            on = default_norm_ratio(algo, codec) > 0  # below 3 workers: finiteness, as dear
        quantised = judged_in_rows(codec) if own else rows and algo in CODEC_ALGOS
        line = (
            link
            if on == checked and not own
            else guarded_link(plain, workers, aggregate, on, rows_in_band=quantised)
        )
        if algo in GATHERING:
            line = plain  # each worker judges the messages it holds
        elif algo == "co2":  # its checked weighted sum waits for the verdict
            line = guarded_link(plain, workers, "mean", on or aggregate != "mean", round_trip=True)
        model = uncompressed if uncompressed is not None and algo not in CODEC_ALGOS else compute
        if own:
            model = own[0]
        out[algo] = predict_algo(algo, model, line, periods[algo], workers, schedule)
    return out


CODEC_ALGOS = ("ddp", "ssgd", "localsgd", "diloco", "dreamddp")  # those that take --compress


def scheduled_periods(spec: str, H: int, steps: int) -> dict[str, Any] | None:
    """localsgd's and diloco's periods under ``--H-schedule spec`` over ``steps`` planned steps
    (``sync/periods.py``; grow's stages resolved from them as a run resolves them): the stages,
    the syncs, and the mean steps per sync the table prices them at. None for no schedule."""
    if not spec:
        return None
    if steps < 1:
        raise ValueError(f"--steps must be >= 1 (the steps the schedule is planned over), got {steps}")
    spec = resolve_every(spec, steps)
    check_schedule(spec, H)
    periods = periods_for(spec, H)
    syncs = len(periods.boundaries(0, steps))
    return {
        "H_schedule": spec,
        "steps": steps,
        "periods": periods.describe(),
        "syncs": syncs,
        "mean_period": steps / max(1, syncs),
    }


def codec_priced(
    profile: dict[str, Any], compute: ComputeModel, compress: str, workers: int
) -> tuple[ComputeModel, str]:
    """``compute`` with each layer's average sent through the codec ``compress`` ("": as it is),
    and the key a run compares with its own codec (``DreamDDP._codec_key``): a plan priced for
    the run's codec and group is taken as it is, and its re-plans refit it."""
    if not compress:
        return compute, ""
    from geotrain.compress.codec import make_codec

    codec = make_codec(compress)  # a bad spec: ConfigError, a ValueError
    shapes = []
    for layer in profile["layers"]:
        if "shapes" not in layer and codec.name in ("powersgd", "acpsgd"):
            raise ValueError(
                f"--compress {compress} prices each matrix's factors, and this profile has no parameter "
                "shapes (taken before they were recorded): profile again"
            )
        shapes.append([tuple(s) for s in layer.get("shapes", [[int(layer["bytes"]) // 4]])])
    timed = codec_times(profile, compute, codec.spec(), workers)
    return priced_for_codec(compute, codec, shapes, workers, timed), f"{codec.spec()} x{workers}"


def profile_rates(profile: dict[str, Any]) -> list[int]:
    """The per-host link rates a profile was taken on (from its link description)."""
    text = str(profile.get("link", "")).split(" ")[0]
    try:
        return parse_bandwidths(text, int(profile["workers"]))
    except LinkSpecError:
        raise ValueError(
            f"the profile was taken on {profile.get('link')!r}, not on shaped links, so it cannot be scaled "
            "to other workers or bandwidths; profile with --bandwidth"
        ) from None


def retarget(
    profile: dict[str, Any],
    workers: int | None = None,
    rates_bps: list[int] | None = None,
    compute_scale: float = 1.0,
    algorithm: str = "best",
    aggregate: str | None = None,
    checked: bool | None = None,
    compress: str = "",
) -> tuple[ComputeModel, LinkModel]:
    """The profile's models, moved to ``workers`` hosts on ``rates_bps`` links (see ``network``).

    ``compute_scale`` multiplies compute times: 1 on real machines, where each worker has its own
    hardware, or the target machines' speed against the profiled ones'. Moving a profile across
    processes per core on one emulating machine is ``shared_cores``'s.
    ``aggregate`` and ``checked`` (``--aggregate``, ``--max-norm-ratio``; None: as profiled) price
    the trust options (``cost.guarded_link``): the options the profile was measured with are taken
    out of its line first, so any profile prices any options, at any worker count.
    The line returned is the all-reduce's under the options; ``trust_options`` says which;
    ``compress``: the codec the line carries (a quantised one judges in its own rows).
    The contention terms (the probe's slowdown and interference, the wait for the slowest
    worker) are the profiled cluster's: profile on the machines the plan is for.
    """
    compute, link = models_from_profile(profile)
    wanted = trust_options(profile, aggregate, checked)
    link = unguarded_link(link, int(profile["workers"]), *trust_options(profile))
    compute = scaled(compute, compute_scale)
    if workers is None and rates_bps is None:
        moved = link
        workers = int(profile["workers"])
    else:
        measured_rates = profile_rates(profile)
        net = profile_network(profile)
        workers = workers or int(profile["workers"])
        rates = rates_bps or [min(measured_rates)] * workers
        moved = net.link_model(workers, rates, algorithm)
    return compute, guarded_link(moved, workers, *wanted, rows_in_band=judged_in_rows(compress))


# Where processes outnumber cores, the linear share (N/C processes per core) is optimistic in two
# ways, each measured in one scale check on this 2-core machine (`geotrain bench --workers 2,4,8`,
# `tiny`, a profile at 2 workers): local SGD's steps between syncs took 10% (4 workers) and 28%
# (8 workers) longer than nosync's free-running ones, about 0.095 per extra process per core: workers
# that step in lockstep reach the same phase at once and contend for the caches and memory together.
# And a collective's every hop waits for its peer to be given a core: per-hop latency grows with
# the processes per core (DreamDDP's per-layer all-reduces: 0.03 s blocked a step at 4 workers,
# 0.09 s at 8, against about 0.005 s predicted from the 2-worker profile).
LOCKSTEP_SLOWDOWN = 0.095


def shared_cores(
    compute: ComputeModel, link: LinkModel, share: float, profiled_share: float = 1.0, lockstep: bool = True
) -> tuple[ComputeModel, LinkModel]:
    """The models of a profile taken with ``profiled_share`` processes per core, moved to
    ``share`` (both ``max(1, N / cores)``): compute by the share's ratio, and by the lockstep
    term (``LOCKSTEP_SLOWDOWN``) for every algorithm that synchronises (``lockstep``; not nosync);
    the link's latency by the share's ratio. A profile's compute was timed in lockstep (after a
    barrier), so its own term is divided out for every algorithm, nosync too. 1 and 1 (each
    worker with its own hardware): the models unchanged."""
    if share < 1 or profiled_share < 1:
        raise ValueError(f"processes per core must be >= 1, got {share} and {profiled_share}")
    ratio = share / profiled_share / (1 + LOCKSTEP_SLOWDOWN * (profiled_share - 1))
    if lockstep:
        ratio *= 1 + LOCKSTEP_SLOWDOWN * (share - 1)
    return scaled(compute, ratio), replace(link, alpha_s=link.alpha_s * share / profiled_share)


def scaled(compute: ComputeModel, compute_scale: float) -> ComputeModel:
    """The compute times multiplied by ``compute_scale`` (> 0)."""
    if compute_scale <= 0:
        raise ValueError(f"compute scale must be > 0, got {compute_scale}")
    if compute_scale == 1.0:
        return compute
    return replace(
        compute,
        backward_s=tuple(b * compute_scale for b in compute.backward_s),
        forward_s=compute.forward_s * compute_scale,
        optimizer_s=compute.optimizer_s * compute_scale,
        # a lead in compute time, and backward's seconds per byte sent: compute too
        sync_wait_s=compute.sync_wait_s * compute_scale,
        interference_s_per_byte=compute.interference_s_per_byte * compute_scale,
    )


def profile_network(profile: dict[str, Any]) -> NetworkModel:
    """Per-hop latency and link efficiency from the profile's all-reduce, without the trust
    options it was measured with (``network.NetworkModel``)."""
    _, link = models_from_profile(profile)
    link = unguarded_link(link, int(profile["workers"]), *trust_options(profile))
    return NetworkModel.calibrate(link, int(profile["workers"]), profile_rates(profile))


def trust_options(
    profile: dict[str, Any], aggregate: str | None = None, checked: bool | None = None
) -> tuple[str, bool]:
    """The (aggregate, norm check) to price: those given, the rest as the profile's all-reduces
    were measured with."""
    measured = profile["allreduce"].get("aggregate", "mean"), bool(profile["allreduce"].get("checked", False))
    return aggregate or measured[0], measured[1] if checked is None else checked


def make_plan(
    profile: dict[str, Any],
    H: int | None,
    choose: ChooseConfig | None = None,
    workers: int | None = None,
    rates_bps: list[int] | None = None,
    compute_scale: float = 1.0,
    aggregate: str | None = None,
    checked: bool | str | None = None,
    topology: Topology | None = None,
    speed: float = 0.95,
    compress: str = "",
    H_schedule: str = "",
    steps: int = 1000,
    lag: int | None = None,
    fill_in: bool = False,
) -> dict[str, Any]:
    """The plan for ``workers`` hosts on ``rates_bps`` links (default: as profiled), or on a
    ``topology`` of sites: then the table is for a flat ring through the slowest uplink, and
    ``sites`` prices the two levels and picks their periods (``plan/sites.py``). ``checked``
    "auto" prices the norm check where a run's ``--max-norm-ratio auto`` has it: on the
    periodic averages and the gathers, not on the per-step averages (a checked mean's verdict
    travels with it and costs nothing; co2's waits for it). Below 3 workers auto judges only
    finiteness, with the same collectives.
    ``compress``: a codec spec; the schedule is searched on its messages (``codec_priced``), and
    the methods that take a codec are predicted with it. ``H_schedule`` (``--H-schedule``, over
    ``steps`` planned steps): localsgd and diloco at their mean steps per sync."""
    codec_table = None
    # not given (not even "none"): each codec-taking method is priced with its own default
    # codec where it has one (diloco's int4: DEFAULT_CODECS), the others in fp32
    own_defaults = compress == ""
    compress = plain_spec(compress)
    if compress == AUTO_CODEC:  # a run's --compress auto: the codec chosen first, then priced as named
        if topology is not None:
            workers, rates_bps = topology.workers, [min(topology.wan_bps)] * topology.workers
        compress, codec_table = choose_plan_codec(
            profile, H, choose, workers, rates_bps, compute_scale, lag, fill_in, aggregate, checked
        )
    # searched as a run searches its own (DreamDDPConfig's defaults: lag, 0 with a codec, fill-in,
    # the headroom)
    lag = default_lag(bool(compress)) if lag is None else lag
    searched = {"lag": lag, "fill_in": fill_in, "headroom": PLAN_HEADROOM}
    auto = checked == "auto"
    if auto:  # the schedule's line: unchecked (auto checks DreamDDP's means at no cost, and
        checked = False  # leaves its quantised codecs unchecked)
    if topology is not None:
        workers, rates_bps = topology.workers, [min(topology.wan_bps)] * topology.workers
    # The quantised codecs' check travels in their all-to-all: no round trip (clip's aside).
    compute, link = retarget(
        profile,
        workers,
        rates_bps,
        compute_scale,
        aggregate=aggregate,
        checked=checked,
        compress=compress or "",
    )
    plain_compute = compute
    group = int(workers or profile["workers"])
    compute, codec_key = codec_priced(profile, compute, compress, group)
    defaults = (
        {
            algo: (codec_priced(profile, plain_compute, spec, group)[0], spec)
            for algo, spec in DEFAULT_CODECS.items()
        }
        if own_defaults
        else {}
    )
    options = trust_options(profile, aggregate, checked)
    plain = retarget(profile, workers, rates_bps, compute_scale, aggregate="mean", checked=False)[1]
    table: list[dict] = []
    if choose is not None:
        H, table = choose_period(compute, link, choose, **searched)
    if H is None:
        raise ValueError("give --H or --choose")
    if not 1 <= H <= compute.n_layers:
        raise ValueError(f"--H must be 1 to the number of layers ({compute.n_layers}), got {H}")
    schedule = search_schedule(compute, link, H, **searched)
    schedule.validate(compute.n_layers)
    periodic = scheduled_periods(H_schedule, H, steps)
    # localsgd's and diloco's averages across sites: checked by auto
    site_options = (options[0], options[1] or auto)
    try:
        slowest = min(rates_bps or profile_rates(profile))
    except ValueError:  # a loopback profile predicted for its own loopback: no rate to speak of
        slowest = None
    # sparseloco's period as a run with its defaults takes it (--H auto), on its own line and model
    sparseloco_H = sparseloco_period(plain_compute if compress else compute, plain, group)
    return {
        "H": H,
        "parameters": sum(plain_compute.nbytes) // 4,
        "profile": {k: profile.get(k) for k in ("model", "workers", "link", "network_mode", "batch_size")},
        "target": {
            "workers": workers or profile.get("workers"),
            "link": describe_links(rates_bps) if rates_bps else profile.get("link"),
            "slowest_bps": slowest,
            "compute_scale": compute_scale,
            # the trust options priced (comm/guard.py)
            "aggregate": options[0],
            "max_norm_check": "auto" if auto else options[1],
            "compress": compress,  # the codec the schedule and the codec-taking methods are priced for
            # where none was given: the methods priced with a default codec of their own
            "default_codecs": {algo: spec for algo, (_, spec) in defaults.items()},
            "default_codecs_timed": {algo: bool(model.codec_s) for algo, (model, _) in defaults.items()},
            # its encoding and decoding per step, where the profile timed them (--compress)
            "codec_s": compute.codec_total_s() if compress and compute.codec_s else None,
            **(periodic or {}),  # --H-schedule: localsgd's and diloco's stages and mean period
        },
        "link_model": {
            "alpha_s": link.alpha_s,
            "beta_s_per_byte": link.beta_s_per_byte,
            "effective_mbit_s": 8e-6 / link.beta_s_per_byte if link.beta_s_per_byte else None,
        },
        "schedule": schedule_to_json(schedule, list(compute.names)),
        # what the schedule was searched on: a run's re-plan refits these (sync/dreamddp.py)
        "models": {"compute": asdict(compute), "link": asdict(link), "codec": codec_key},
        "predicted_s": predictions(
            compute,
            link,
            H,
            schedule,
            group,
            plain,
            options,
            auto,
            plain_compute if compress else None,
            periodic["mean_period"] if periodic else None,
            compress,
            defaults,
            sparseloco_H=sparseloco_H,
        ),  # fmt: skip
        "choose": table,
        "sparseloco_H": sparseloco_H,
        # --compress auto: the codec chosen (a run with --compress auto takes it) and those weighed
        **({"codec": compress, "codec_choice": codec_table} if codec_table is not None else {}),
        # the site averages send fp32 parameters, whatever codec the table prices
        "sites": None
        if topology is None
        else plan_sites(profile, plain_compute, topology, speed, site_options),
    }


def choose_plan_codec(
    profile: dict[str, Any],
    H: int | None,
    choose: ChooseConfig | None,
    workers: int | None,
    rates_bps: list[int] | None,
    compute_scale: float,
    lag: int | None,
    fill_in: bool,
    aggregate: str | None,
    checked: bool | str | None,
) -> tuple[str, list[dict]]:
    """``--compress auto`` as a run chooses it (``DreamDDP._choose_codec``): each of
    ``AUTO_CODECS`` priced on the target (its encoding where the profile timed it: `geotrain
    profile --compress auto` times them all), DreamDDP's schedule searched at the lag a run with
    it lands at, at ``H`` or, with ``choose``, at each period; the codec (its full spec, "" for
    none) with the shortest predicted time to a loss, and the table it was chosen from."""
    if H is None and choose is None:
        raise ValueError("give --H or --choose")
    checked = False if checked == "auto" else checked  # auto leaves DreamDDP's averages unchecked
    group = int(workers or profile["workers"])
    candidates = {}
    timed = profile.get("codecs", {})
    for spec in auto_codecs(aggregate):
        if spec and timed and codec_key(spec) not in timed:
            # a profile that timed other codecs (made before this one was a candidate): unpriced,
            # its encoding would look free; `geotrain profile --compress auto` times them all
            continue
        # priced as make_plan prices the one it plans
        compute, link = retarget(
            profile, workers, rates_bps, compute_scale, aggregate=aggregate, checked=checked, compress=spec
        )
        if H is not None and not 1 <= H <= compute.n_layers:
            raise ValueError(f"--H must be 1 to the number of layers ({compute.n_layers}), got {H}")
        priced = codec_priced(profile, compute, spec, group)[0]
        lands = default_lag(bool(spec)) if lag is None else lag
        candidates[codec_key(spec) if spec else ""] = (priced, link, lands)
    ranking = choose or ChooseConfig(budget=math.inf, max_H=compute.n_layers)
    spec, _, table = choose_codec(
        candidates, None if choose else H, ranking, fill_in=fill_in, headroom=PLAN_HEADROOM
    )
    return spec, table


def plan_sites(
    profile: dict[str, Any],
    compute: ComputeModel,
    topology: Topology,
    speed: float,
    options: tuple[str, bool] = ("mean", False),
) -> dict[str, Any]:
    """The two levels priced on ``topology`` and their periods chosen (``plan/sites.py``). The
    trust options (``options``) weigh on the averages across sites; a site's own average is
    not checked (``Communicator.site_mean``)."""
    net = profile_network(profile)
    links = site_links(net, topology)
    n, aggregate = topology.workers, options[0]
    flat = guarded_link(links.flat, n, *options)
    if aggregate in GATHERED:
        # A coordinate-wise statistic gathers every contribution: on sites of equal size in two
        # levels, each message crossing each uplink once, after the verdict's flat round trip
        # (``Communicator._screen``); on uneven sites a flat gather.
        gather = two_level_gather_link(net, topology)
        two_level = flat if gather is None else replace(gather, alpha_s=gather.alpha_s + links.flat.alpha_s)
    elif aggregate != "mean":  # clip's verdict comes first: a flat all-reduce of 2 N floats
        two_level = replace(links.two_level, alpha_s=links.two_level.alpha_s + links.flat.alpha_s)
    else:
        two_level = links.two_level
    links = replace(links, flat=flat, two_level=two_level)
    model_bytes = sum(compute.nbytes)
    return {
        "topology": topology.describe(),
        "model_bytes": model_bytes,
        "links": {name: vars(line) for name, line in vars(links).items()},
        "allreduce_s": {name: whole_model_allreduce_s(compute, line) for name, line in vars(links).items()},
        "choice": choose_periods(compute, links, speed),
    }


def stands_for_line(plan: dict[str, Any], accel: Accelerator | None = None) -> str:
    """What the plan's slowest link stands for on ``accel``: the link that gives it the same link
    time over compute time per step (``plan/gather.py``), from the predicted compute here."""
    accel = accel or Accelerator()
    slowest = plan["target"].get("slowest_bps")
    if not slowest or not plan.get("parameters"):
        return ""
    step = plan["predicted_s"]["nosync"]
    bps = stands_for_bps(slowest, step, plan["parameters"], accel)
    return (
        f"{format_rate(slowest)} here stands for {format_rate(bps)} on an accelerator at "
        f"{accel.mfu:.0%} of {accel.flops / 1e12:g} TFLOP/s taking {accel.tokens_per_step:,.0f}-token steps "
        f"(the same link time over compute time: a step's compute here is {step:.3f} s for "
        f"{plan['parameters']:,} parameters, {bps / slowest:.0f}x the accelerator's)"
    )


def _trust_note(target: dict[str, Any]) -> str:
    """The trust options priced into the all-reduce line, if any (``cost.guarded_link``)."""
    priced = []
    if target.get("max_norm_check") is True:
        priced.append("the norm check")
    if target.get("aggregate") not in (None, "mean"):
        priced.append(f"--aggregate {target['aggregate']}")
    notes = [f"with {' and '.join(priced)}"] if priced else []
    if target.get("max_norm_check") == "auto":  # the line is unchecked; the periodic averages are
        notes.append("norm check auto: on the periodic averages and the gathers")
    return f" ({'; '.join(notes)})" if notes else ""


def format_plan(plan: dict[str, Any], accel: Accelerator | None = None) -> str:
    pred = plan["predicted_s"]
    base = pred["nosync"]
    prof = plan["profile"]
    target = plan["target"]
    lines = [
        f"profile: {prof['model']} on {prof['workers']} workers x {prof['link']}"
        + (
            f"; predicted for {target['workers']} workers x {target['link']}"
            if (target["workers"], target["link"]) != (prof["workers"], prof["link"])
            else ""
        )
        + "; "
        f"all-reduce = {plan['link_model']['alpha_s'] * 1e3:.2f} ms + bytes / "
        f"{(plan['link_model']['effective_mbit_s'] or float('inf')):.1f} Mbit/s" + _trust_note(target),
        *([line] if (line := stands_for_line(plan, accel)) else []),
        "",
        f"{'algorithm':<10} {'H':>4} {'step s':>9} {'x nosync':>9}",
    ]
    codec = target.get("compress", "")
    for algo, s in pred.items():
        h = str(plan["H"]) if algo in ("localsgd", "diloco", "dreamddp") else "-"
        if algo in ("localsgd", "diloco") and target.get("mean_period"):
            h = f"~{target['mean_period']:.1f}"  # its steps per sync under --H-schedule
        h = str(own_period(algo)) if algo in OWN_H else h
        if algo == "sparseloco":  # a plan saved before --H auto priced it at 20
            h = str(plan.get("sparseloco_H", OWN_PERIOD))
        own = target.get("default_codecs", {}).get(algo)
        with_codec = (
            f"  + {codec}" if codec and algo in CODEC_ALGOS else f"  + {own} (its default)" if own else ""
        )
        lines.append(f"{algo:<10} {h:>4} {s:>9.3f} {s / base:>9.2f}{with_codec}")
    for algo, spec in target.get("default_codecs", {}).items():
        if algo in pred and not target.get("default_codecs_timed", {}).get(algo):
            lines.append(
                f"({algo}'s default {spec} is priced on its bytes: the profile did not time its "
                f"encoding; geotrain profile with --compress {spec} times it)"
            )
    if codec and target.get("codec_s") is None:
        lines.append(
            f"(the encoding of {codec} is not priced: its profile did not time it; "
            f"profile with --compress {codec})"
        )
    elif codec:
        lines.append(f"({codec}: {target['codec_s'] * 1e3:.0f} ms to encode and decode the whole model)")
    sched = plan["schedule"]
    n_fill = sum(len(it) for it in sched["iterations"]) - len(sched["layers"])
    lines += [
        "",
        f"dreamddp schedule, H={sched['H']}: {len(sched['layers'])} layers, {n_fill} fill-in syncs, "
        f"{'averages landing at the next forward (lag 1)' if sched.get('lag') else 'lag 0'} "
        f"(search: {sched['search']['nodes']} nodes, {sched['search']['seconds'] * 1e3:.0f} ms"
        f"{'' if sched['search']['complete'] else ', budget reached'})",
    ]
    for h, layers in enumerate(sched["iterations"]):
        primary = [sched["layers"][i] for i, a in enumerate(sched["assignment"]) if a == h]
        shown = ", ".join(primary[:4]) + (f", ... ({len(primary)})" if len(primary) > 4 else "")
        lines.append(
            f"  iteration {h:>2}: {shown}  +{len(layers) - len(primary)} fill-in, "
            f"exposed {sched['exposed_s'][h] * 1e3:.0f} ms"
        )
    if plan.get("sites"):
        lines += ["", format_sites(plan["sites"], base)]
    if plan["choose"]:
        lines += ["", f"{'H':>4} {'step s':>9} {'steps x':>8} {'time-to-loss x nosync':>22}"]
        for row in plan["choose"]:
            mark = "  <- chosen" if row["H"] == plan["H"] else ""
            lines.append(
                f"{row['H']:>4} {row['predicted_step_s']:>9.3f} {row['steps_factor']:>8.2f} "
                f"{row['time_to_loss_factor']:>22.3f}{mark}"
            )
    if plan.get("codec_choice"):
        lines += [
            "",
            "--compress auto: each codec's best period (a codec must be "
            f"{CODEC_MARGIN:.0%} sooner than fp32 to be taken)",
            f"{'codec':<28} {'H':>4} {'lag':>4} {'step s':>9} {'time-to-loss x nosync':>22}",
        ]
        best: dict[str, dict] = {}
        for row in plan["codec_choice"]:
            if (
                row["codec"] not in best
                or row["time_to_loss_factor"] < best[row["codec"]]["time_to_loss_factor"]
            ):
                best[row["codec"]] = row
        for name, row in best.items():
            mark = "  <- chosen" if name == plan.get("codec") else ""
            lines.append(
                f"{name or 'none (fp32)':<28} {row['H']:>4} {row['lag']:>4} {row['predicted_step_s']:>9.3f} "
                f"{row['time_to_loss_factor']:>22.3f}{mark}"
            )
    return "\n".join(lines)


def plot_schedule(plan: dict[str, Any], compute: ComputeModel, link: LinkModel, path) -> None:
    """One period as a timeline: per iteration, backward and the link queue of its layer syncs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sched = plan["schedule"]
    finish = compute.finish_times()
    end = finish[-1]
    H = sched["H"]
    fig, ax = plt.subplots(figsize=(10, 0.45 * H + 1.5))
    lag = int(sched.get("lag", 0))
    for h, names in enumerate(sched["iterations"]):
        ax.barh(h, end, height=0.8, color="#dddddd", label="backward" if h == 0 else None)
        late = lands_late(lag, h, H)
        if late:  # the averages land at the next forward: the link runs on under it
            ax.barh(
                h, compute.optimizer_s + compute.forward_s, left=end, height=0.8, color="#f2f2f2",
                label="next update and forward" if h == 0 else None,
            )  # fmt: skip
        layers = sorted(compute.names.index(n) for n in names)
        comm = [link.time(compute.nbytes[i]) for i in layers]
        spans = queue_spans([finish[i] for i in layers], comm, end, compute.comm_slowdown)
        queue = spans[-1][1] if spans else 0.0
        for i, (start, stop) in zip(layers, spans, strict=True):
            primary = sched["assignment"][i] == h
            ax.barh(
                h,
                stop - start,
                left=start,
                height=0.4,
                edgecolor="white",
                linewidth=0.5,
                color="#1f77b4" if primary else "#9ecae1",
            )
        exposed = exposed_for_layers(compute, link, layers, late)
        if exposed > 0:
            ax.barh(
                h,
                exposed,
                # a codec's second phases are not drawn: what they expose starts at backward's end
                left=end if compute.tail_bytes else queue - exposed,
                height=0.8,
                color="none",
                edgecolor="#d62728",
                hatch="//",
                label="exposed" if h == 0 else None,
            )
    ax.barh(0, 0, color="#1f77b4", label="scheduled layer sync")
    ax.barh(0, 0, color="#9ecae1", label="fill-in sync")
    ax.axvline(end, color="black", linewidth=1)
    ax.set_yticks(range(H))
    ax.set_yticklabels([f"iteration {h}" for h in range(H)])
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the start of backward")
    ax.set_title(
        f"dreamddp schedule, H={H}: predicted {plan['predicted_s']['dreamddp']:.3f} s/step "
        f"(nosync {plan['predicted_s']['nosync']:.3f})"
    )
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.6 / (0.45 * H + 1.5) - 0.1), ncol=4)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
