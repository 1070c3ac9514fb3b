"""What a sparse all-gather costs against a compressed all-reduce, and what an emulated link means.

**Gather or reduce.** SparseLoCo's and DeMo's messages cannot be summed on the wire (every worker
picks other entries), so they travel by all-gather: each worker sends its P-byte message to the
N-1 others, ``(N-1) P`` bytes, growing with N. A quantised all-reduce (int4: half a byte per value
and a scale per block) sends ``2 (N-1)/N M`` for an M-byte message, which hardly grows. The gather
stops sending fewer bytes once ``N > 2 M / P`` (``crossover_workers``); past that an int4
all-reduce of the dense pseudo-gradient is cheaper (across sites of equal size the two-level
gather of ``comm/hierarchy.py`` sends each message through each uplink once, not N-1 times), and
``geotrain`` says so when a run is larger (``gather_warning``). The planner prices a gather on the
profiled all-reduce line (``gather_s``): SparseLoCo's every H steps, under the next H steps'
compute with overlap; DeMo's every step (``predict_sparseloco``, ``predict_demo``).

**What an emulated rate stands for.** What decides efficiency is link time over compute time per
step. A worker here computes a step's share of a parameter in ``step_s / n_params`` seconds; an
accelerator at ``mfu`` of ``flops`` peak taking ``tokens`` per step in ``6 * tokens / (flops *
mfu)`` (forward and backward, per parameter). The same bytes per parameter per step then need a
link ``factor`` times faster on the accelerator: an emulated ``rate`` stands for ``rate * factor``
on it (``stands_for_bps``; W1 here at 350 kbit/s is an H100 on about 10 Mbit/s).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from geotrain.compress.chunked import ChunkTopK
from geotrain.plan.cost import LinkModel

H100_BF16_FLOPS = 989e12
# SparseLoCo's --overlap auto weighs an overlapped outer step by time to a loss: it hides the
# gather, but its mean lands L of the H steps into the next period, and every step it lands late
# costs steps to a loss (the replicas train on a stand-in for the mean meanwhile). That cost is
# min(LATE_LANDING_COST * L / H, LATE_LANDING_MOST) more steps, the line through GPT tiny's tokens
# to the synchronous run's final loss (4 workers, 400 steps, loopback, seeds 0 and 1, validation
# smoothed over 3 evaluations; docs/frontier.md, "Overlap where it pays"): at H=5 landing 1, 2, 3
# and 5 steps late 1.11, 1.18, 1.24, 1.26x; at H=10 landing 1, 2, 3, 5, 10: 1.03, 1.08, 1.11,
# 1.21, 1.25x; at H=20 landing 1, 3, 6, 10, 20: 1.00, 1.04, 1.06, 1.18, 1.21x. (A fixed threshold,
# overlap above 5% of the period's compute, came before: it overlapped at H=5 on tiny where the
# gather was 5.3% of the period, for 1.11x the steps or more.)
LATE_LANDING_COST = 0.4
LATE_LANDING_MOST = 0.24
# sparseloco --H auto: the periods weighed, and the extra steps to a loss per step of period, as a
# fraction of the steps at H -> 0: the line through tokens to DDP's final loss on W1, measured on
# curves run past DDP's 2,000 steps until they reached it (docs/frontier.md, "The period"): 1.01x
# at H=5, 1.07x at H=10, so 0.95 (1 + 0.0126 H). (Read on 2,000 steps alone, past their ends on
# DDP's curve, they were 1.12x and 1.16x, and H=20's ~1.26x: 1.070 (1 + 0.0088 H) before.)
SPARSELOCO_PERIODS = (5, 10, 20, 40)
SPARSELOCO_PENALTY = 0.0126
# An overlapped gather lands this many times its measured duration (in steps) after its launch
# (SparseLoCo's --overlap auto, Streaming's --tau auto): the gather was timed alone at start-up,
# and later ones share the link and the cores with compute
LAND_MARGIN = 1.5


def gather_bytes(payload: int, workers: int) -> int:
    """Bytes one worker sends in an all-gather of a ``payload``-byte message."""
    return (workers - 1) * payload


def allreduce_bytes(message: int, workers: int) -> int:
    """Bytes one worker sends in a ring (or two-phase compressed) all-reduce of ``message`` bytes."""
    return 2 * (workers - 1) * message // workers


def int4_message_bytes(n_values: int, block: int = 256) -> int:
    """The int4 codec's message for ``n_values``: half a byte each and an fp32 scale per block."""
    return quantized_message_bytes(n_values, 4, block)


def quantized_message_bytes(n_values: int, bits: int, block: int = 256) -> int:
    """A worker's message of ``n_values`` in ``bits`` (4 or 8, an fp32 scale per block; 32: fp32)."""
    return 4 * n_values if bits == 32 else n_values * bits // 8 + 4 * -(-n_values // block)


def gather_s(link: LinkModel, payload: int, workers: int) -> float:
    """An all-gather of a ``payload``-byte message, priced on the all-reduce line ``link``: a ring
    all-gather sends (N-1) P per worker and a ring all-reduce of M bytes 2 (N-1)/N M, so the
    gather costs what an all-reduce of N P / 2 bytes does."""
    return link.time(workers * payload / 2) if workers > 1 else 0.0


def sparseloco_message_bytes(n_params: int, chunk: int = 4096, k: int = 64, bits: int = 2) -> int:
    return ChunkTopK(chunk=chunk, k=k, bits=bits).payload_bytes(n_params)


def demo_message_bytes(n_params: int, chunk: int = 64, k: int = 32, bits: int = 8) -> int:
    """DeMo's message, taking every block as ``chunk`` x ``chunk`` (1-d parameters have smaller
    blocks, so this is a little under the real size: 223 KB against 252 KB for GPT ``mini``)."""
    return ChunkTopK(chunk=chunk * chunk, k=k, bits=bits).payload_bytes(n_params)


def predict_sparseloco(
    compute_s: float,
    link: LinkModel,
    n_params: int,
    workers: int,
    H: int = 20,
    overlap: bool | str = "auto",
    sync_wait_s: float = 0.0,
) -> float:
    """Mean step: compute every step, and one gather of the message every H steps; with overlap
    the gather runs under the next H steps, and only what outlasts them shows. ``auto`` (the
    default) overlaps where that reaches a loss sooner (``weigh_overlap``), as the run decides
    from its start-up probe (``--H auto``) or its first outer step. A synchronous
    gather also waits ``sync_wait_s`` for the slowest worker (``ComputeModel.sync_wait_s``); one
    landing a period later does not."""
    gather = gather_s(link, sparseloco_message_bytes(n_params), workers)
    return sparseloco_step(compute_s, gather, H, overlap, sync_wait_s)[0]


def gather_share(gather: float, period_s: float) -> float:
    """A gather's seconds as a share of the period's compute: what ``weigh_overlap`` weighs. One
    expression for the choice of H and the run's verdict, so that the two never differ at the
    boundary."""
    return gather / period_s


def landing_penalty(landing: int, H: int) -> float:
    """The extra steps to a loss, as a fraction, of an overlapped outer step whose mean lands
    ``landing`` of the ``H`` steps into the next period (``LATE_LANDING_COST``)."""
    return min(LATE_LANDING_COST * landing / H, LATE_LANDING_MOST)


@dataclass(frozen=True)
class OverlapVerdict:
    """SparseLoCo's outer step weighed both ways, in a step's compute (1 = nosync's step):
    ``sync``, the mean step with the gather every H steps; ``overlapped``, the mean step with
    only what outlasts the period showing, times the steps to a loss that landing ``landing``
    steps late costs (``penalty``: ``landing_penalty``)."""

    overlap: bool
    landing: int  # with overlap: the steps into the next period at which the mean lands
    sync: float
    overlapped: float
    penalty: float


def weigh_overlap(share: float, H: int, overlap: bool | str = "auto", tau: int = 0) -> OverlapVerdict:
    """Whether an outer step whose gather takes ``share`` of the period's compute overlaps: as
    ``overlap`` says, or under "auto" where that is sooner to a loss. Overlapped it lands at
    ``tau`` where given (at most H), else under auto at ``LAND_MARGIN`` times the gather's steps
    (at least 1, at most H: ``hiding_steps``) and otherwise a period late (H); what the steps
    before the landing do not cover shows (the landing waits for it). A gather of over 1 / 0.24
    (about 4) periods is synchronous under auto: overlap would hide one period of it and cost
    24% more steps.

    The wait for the slowest worker is left out of the verdict, as the run's own verdict leaves
    it out (it times its gather after a barrier): where workers share cores, as on this machine,
    a worker that waits lends its core to the others, and counting the wait turned overlap on for
    loopback runs, whose gathers take milliseconds."""
    if tau:
        landing = min(tau, H)
    elif overlap == "auto":  # the gather in steps of compute (share x H), hidden with the margin
        landing = hiding_steps(1.0, share * H, H)
    else:
        landing = H
    penalty = landing_penalty(landing, H)
    sync = 1.0 + share
    # What the landing's steps do not cover shows: the landing waits for it
    overlapped = (1.0 + max(0.0, share - landing / H)) * (1.0 + penalty)
    decided = overlapped < sync if overlap == "auto" else bool(overlap)
    return OverlapVerdict(decided, landing, sync, overlapped, penalty)


def sparseloco_step(
    compute_s: float,
    gather: float,
    H: int,
    overlap: bool | str = "auto",
    sync_wait_s: float = 0.0,
    tau: int = 0,
) -> tuple[float, OverlapVerdict]:
    """SparseLoCo's mean step from a step's compute and one outer step's gather (seconds), and
    the verdict on overlap it was priced under (``predict_sparseloco``, ``weigh_overlap``); a
    synchronous gather also waits ``sync_wait_s`` for the slowest worker."""
    period_s = H * compute_s
    share = gather_share(gather, period_s) if period_s > 0 else math.inf
    verdict = weigh_overlap(share, H, overlap, tau)
    # overlapped, only what the steps before its landing do not cover shows
    exposed = max(0.0, gather - verdict.landing * compute_s) if verdict.overlap else gather + sync_wait_s
    return compute_s + exposed / H, verdict


def choose_sparseloco_period(
    compute_s: float,
    gather: float,
    periods: tuple[int, ...] = SPARSELOCO_PERIODS,
    penalty: float = SPARSELOCO_PENALTY,
    overlap: bool | str = "auto",
    sync_wait_s: float = 0.0,
    tau: int = 0,
) -> tuple[int, list[dict]]:
    """``sparseloco --H auto``: the period of ``periods`` with the shortest predicted time to a
    loss, from a step's compute and one outer step's gather as measured (seconds), and the table
    it was chosen from (a row per period; ties go to the shorter). Time to a loss is the
    predicted step (``sparseloco_step``: the gather every H steps, synchronous or overlapped as
    the run's ``overlap`` and ``tau`` have it, auto deciding as it would; a synchronous gather
    also waits ``sync_wait_s`` for the slowest worker) times the steps it needs, ``1 + penalty *
    H`` (a shorter period learns more per token: ``SPARSELOCO_PENALTY``) and, overlapped, ``1 +
    landing_penalty`` (a mean landing late), over nosync's step."""
    if compute_s <= 0 or gather < 0:
        raise ValueError(f"need a step's compute > 0 and a gather >= 0, got {compute_s} and {gather}")
    if not periods:
        raise ValueError("no period to choose from")
    table = []
    for H in periods:
        step, verdict = sparseloco_step(compute_s, gather, H, overlap, sync_wait_s, tau)
        factor = (1 + penalty * H) * (1 + verdict.penalty if verdict.overlap else 1.0)
        table.append(
            {
                "H": H,
                "overlap": verdict.overlap,
                "landing": verdict.landing if verdict.overlap else H,
                "predicted_step_s": step,
                "steps_factor": factor,
                "time_to_loss_factor": step * factor / compute_s,
            }
        )
    return min(table, key=lambda row: row["time_to_loss_factor"])["H"], table


def predict_demo(
    compute_s: float,
    link: LinkModel,
    n_params: int,
    workers: int,
    overlap: bool = False,
    sync_wait_s: float = 0.0,
) -> float:
    """Mean step: compute and one gather every step (under the next step's compute with overlap);
    a synchronous gather also waits ``sync_wait_s`` for the slowest worker."""
    gather = gather_s(link, demo_message_bytes(n_params), workers)
    return compute_s + (max(0.0, gather - compute_s) if overlap else gather + sync_wait_s)


def predict_streaming(
    compute_s: float,
    link: LinkModel,
    n_params: int,
    workers: int,
    H: int = 20,
    fragments: int = 4,
    tau: int | str = 1,
    bits: int = 4,
) -> float:
    """Streaming DiLoCo's mean step: compute every step, and every H / fragments steps one
    fragment's gather of ``bits``-bit messages, under tau steps of compute (fragments of equal
    size; ``tau`` "auto": as ``streaming_tau`` would choose from this gather)."""
    every = max(1, H // fragments)
    gather = gather_s(link, quantized_message_bytes(-(-n_params // fragments), bits), workers)
    if tau == "auto":
        tau = streaming_tau(compute_s, gather, every)
    return compute_s + max(0.0, gather - tau * compute_s) / every


def hiding_steps(compute_s: float, exchange_s: float, most: int) -> int:
    """The fewest steps of compute (at least 1, at most ``most``) that cover ``LAND_MARGIN``
    times an exchange of ``exchange_s`` seconds: where an overlapped exchange lands."""
    needed = math.ceil(round(LAND_MARGIN * exchange_s / compute_s, 6)) if compute_s > 0 else most
    return min(most, max(1, needed))


def streaming_tau(compute_s: float, gather: float, every: int) -> int:
    """Streaming's ``--tau auto``: the steps that hide a fragment's gather (``hiding_steps``),
    below ``every`` = H / fragments (one fragment in flight at most); 0 where every is 1 (no
    step to overlap)."""
    return 0 if every <= 1 else hiding_steps(compute_s, gather, every - 1)


def predict_co2_gathered(
    compute_s: float, link: LinkModel, n_params: int, workers: int, H: int, bits: int
) -> float:
    """CO2 with ``--bits`` 4 or 8: compute every step, and every H steps a gather of each
    worker's quantised pseudo-gradient under the next H steps of compute."""
    gather = gather_s(link, quantized_message_bytes(n_params, bits), workers)
    return compute_s + max(0.0, gather - H * compute_s) / H


def crossover_workers(payload: int, message: int) -> int:
    """The smallest worker count at which gathering ``payload`` sends more than all-reducing
    ``message`` (N > 2 M / P)."""
    return max(2, 2 * message // payload + 1)


def gather_warning(payload: int, n_values: int, workers: int) -> str:
    """A line for a run whose gather sends more than an int4 all-reduce would ("" if not)."""
    cross = crossover_workers(payload, int4_message_bytes(n_values))
    if workers < cross:
        return ""
    return (
        f"at {workers} workers the sparse all-gather sends {gather_bytes(payload, workers) / 1e6:.1f} MB "
        f"per worker, more than an int4 all-reduce of the dense update "
        f"({allreduce_bytes(int4_message_bytes(n_values), workers) / 1e6:.1f} MB; the gather is smaller "
        f"below {cross} workers): group the workers by site, or use diloco --compress int4"
    )


@dataclass(frozen=True)
class Accelerator:
    """An accelerator in the terms that set its step time: peak FLOP/s, utilisation, tokens/step."""

    flops: float = H100_BF16_FLOPS
    mfu: float = 0.4
    tokens_per_step: float = 0.5e6

    def __post_init__(self) -> None:
        if self.flops <= 0 or not 0 < self.mfu <= 1 or self.tokens_per_step <= 0:
            raise ValueError(
                "an accelerator needs FLOP/s > 0 (--accel-tflops), a utilisation in (0, 1] (--accel-mfu) "
                f"and tokens per step > 0 (--accel-tokens); got {self.flops:g}, {self.mfu:g}, "
                f"{self.tokens_per_step:g}"
            )

    def seconds_per_param_step(self) -> float:
        return 6 * self.tokens_per_step / (self.flops * self.mfu)


def speed_factor(step_s: float, n_params: int, accel: Accelerator | None = None) -> float:
    """How many times faster the accelerator computes a step's share of a parameter than a worker
    here that takes ``step_s`` per step for a model of ``n_params``."""
    return (step_s / n_params) / (accel or Accelerator()).seconds_per_param_step()


def stands_for_bps(rate_bps: float, step_s: float, n_params: int, accel: Accelerator | None = None) -> float:
    """The link on the accelerator that an emulated ``rate_bps`` stands for."""
    return rate_bps * speed_factor(step_s, n_params, accel)


def format_rate(bps: float) -> str:
    """``"28 Mbit/s"``, ``"1.6 Gbit/s"``: a link rate to two significant digits, for people."""
    rounded = float(f"{bps:.2g}")  # first, so that 999.6 Mbit/s reads 1 Gbit/s, not 1000 Mbit/s
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if rounded >= scale:
            return f"{rounded / scale:g} {unit}"
    return f"{rounded:g} bit/s"
