"""The cost model: predicted iteration time of each algorithm from a profile.

An iteration is forward F, backward B (layers in backward order, layer l finishing at
T_l = b_1 + ... + b_l), and the optimizer step O. One link carries one all-reduce at a time,
first launched first served; an all-reduce of n bytes takes ``alpha + beta * n`` (fitted by the
profiler on the real process group, so it already includes the worker count and the
all-reduce algorithm). Communication launched during backward is hidden until backward ends at
T_L; whatever runs past T_L is exposed:

    iteration = F + B + exposed + O.

``simulate_backward`` is that queue; each algorithm's prediction is one use of it.

Overlap is not free where communication needs the CPU that computes (workers sharing cores, a
NIC driven by the CPU): the profiler measures how much an all-reduce in flight slows backward,
``interference_s_per_byte`` (gamma), and every byte the link carries while backward runs costs
gamma seconds of compute (``interference_s``); communication runs ``comm_slowdown`` (sigma) times
slower while backward computes than on an idle machine; and a collective that every worker must
reach waits for the slowest (``sync_wait_s``). On GPUs with their own NICs gamma is close to 0
and sigma to 1.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from geotrain.comm.guard import GATHERED


@dataclass(frozen=True)
class LinkModel:
    """All-reduce time of an n-byte message: ``alpha_s + beta_s_per_byte * n``."""

    alpha_s: float
    beta_s_per_byte: float

    def __post_init__(self) -> None:
        if self.alpha_s < 0 or self.beta_s_per_byte < 0:
            raise ValueError(f"link model needs alpha, beta >= 0, got {self.alpha_s}, {self.beta_s_per_byte}")

    def time(self, nbytes: float) -> float:
        return self.alpha_s + self.beta_s_per_byte * nbytes if nbytes > 0 else 0.0

    def scaled(self, k: float) -> LinkModel:
        """The same link k times slower (latency and per byte alike)."""
        return LinkModel(self.alpha_s * k, self.beta_s_per_byte * k)


def guard_factors(
    workers: int,
    aggregate: str = "mean",
    checked: bool = False,
    round_trip: bool = False,
    rows_in_band: bool = False,
) -> tuple[float, float]:
    """What the trust options (``comm/guard.py``) multiply an all-reduce's latency and per-byte
    time by. A checked mean learns its verdict from 2 N floats carried in its own all-reduce
    (``Communicator._checked_mean``): no more latency; nor a quantised codec (``rows_in_band``),
    whose all-to-all carries each worker's norm and gives each owner every contribution to its
    shard (trimmed and median too). Where the verdict must come first, one more latency: any
    aggregate but the mean (clip scales a contribution before it is sent), and ``round_trip``
    (a checked weighted sum, co2's). ``trimmed`` and ``median`` gather every contribution: each
    worker sends N - 1 copies of its message where a ring all-reduce sends 2 (N - 1) / N, so
    N / 2 times the bytes."""
    if rows_in_band and aggregate != "clip":
        return 1.0, 1.0
    latency = 2.0 if aggregate != "mean" or (checked and round_trip) else 1.0
    return latency, max(1.0, workers / 2) if aggregate in GATHERED else 1.0


def guarded_link(
    link: LinkModel,
    workers: int,
    aggregate: str = "mean",
    checked: bool = False,
    round_trip: bool = False,
    rows_in_band: bool = False,
) -> LinkModel:
    """The all-reduce line under the trust options, from one measured without them."""
    latency, per_byte = guard_factors(workers, aggregate, checked, round_trip, rows_in_band)
    return LinkModel(link.alpha_s * latency, link.beta_s_per_byte * per_byte)


def unguarded_link(
    link: LinkModel, workers: int, aggregate: str = "mean", checked: bool = False
) -> LinkModel:
    """The plain all-reduce line from one measured on ``workers`` hosts with the trust options
    (a profile's plain all-reduces: a checked one learned its verdict with it)."""
    latency, per_byte = guard_factors(workers, aggregate, checked)
    return LinkModel(link.alpha_s / latency, link.beta_s_per_byte / per_byte)


@dataclass(frozen=True)
class ComputeModel:
    """Per-layer backward times (backward order), layer sizes, and the rest of an iteration."""

    names: tuple[str, ...]
    backward_s: tuple[float, ...]
    nbytes: tuple[int, ...]
    forward_s: float
    optimizer_s: float
    interference_s_per_byte: float = 0.0
    comm_slowdown: float = 1.0
    # Per layer, the bytes of what its average sends only after backward (a codec's second
    # phase: waited for before the update at lag 0, under the update and the forward at lag 1,
    # ``exposed_for_layers``; ``priced_for_codec``); () for none.
    tail_bytes: tuple[int, ...] = ()
    # Per layer, its fp32 bytes where ``nbytes`` prices a codec's messages: a run's buckets are
    # cut on these (``comm.buckets``), each bucket one message of the codec; () where the same.
    raw_nbytes: tuple[int, ...] = ()
    # Per layer, the seconds a codec's encoding and decoding of its message take
    # (``plan.codec_time``): compute on the step, wherever the message is sent; () for none.
    codec_s: tuple[float, ...] = ()
    # The slowest worker's lead at the end of a step (``plan.profile``: a barrier after each
    # profiled step): what a collective that every worker must reach waits, once per sync.
    sync_wait_s: float = 0.0

    def __post_init__(self) -> None:
        if self.sync_wait_s < 0:
            raise ValueError(f"the wait for the slowest worker must be >= 0 s, got {self.sync_wait_s}")
        if self.comm_slowdown < 1:
            raise ValueError(f"comm slowdown under compute must be >= 1, got {self.comm_slowdown}")
        if self.interference_s_per_byte < 0:
            raise ValueError(f"interference must be >= 0 s/byte, got {self.interference_s_per_byte}")
        if not (len(self.names) == len(self.backward_s) == len(self.nbytes)) or not self.names:
            raise ValueError(
                "a compute model needs one backward time and one size per layer, at least one layer"
            )
        if self.codec_s and (len(self.codec_s) != len(self.names) or min(self.codec_s) < 0):
            raise ValueError(
                f"a codec's times must be one per layer ({len(self.names)}), each >= 0; "
                f"got {len(self.codec_s)}"
            )

    @property
    def n_layers(self) -> int:
        return len(self.names)

    @property
    def backward_total_s(self) -> float:
        return sum(self.backward_s)

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_total_s + self.optimizer_s

    def codec_total_s(self, layers: Iterable[int] | None = None) -> float:
        """The codec's compute for averaging ``layers`` (None: every layer) once."""
        if not self.codec_s:
            return 0.0
        return sum(self.codec_s) if layers is None else sum(self.codec_s[i] for i in layers)

    def finish_times(self) -> list[float]:
        t, out = 0.0, []
        for b in self.backward_s:
            t += b
            out.append(t)
        return out


def queue_spans(
    ready_s: Sequence[float], comm_s: Sequence[float], end_s: float, slowdown: float = 1.0
) -> list[tuple[float, float]]:
    """(start, finish) of messages launched at ``ready_s`` (ascending) that take ``comm_s`` on an
    idle link, one at a time; before ``end_s`` (while backward runs) they progress ``slowdown``
    times slower."""
    spans, queue = [], 0.0
    for ready, c in zip(ready_s, comm_s, strict=True):
        start = max(queue, ready)
        queue = _finish(start, c, end_s, slowdown)
        spans.append((start, queue))
    return spans


def _finish(start: float, c: float, end_s: float, slowdown: float) -> float:
    """When a message started at ``start`` that takes ``c`` on an idle link ends, ``slowdown``
    times slower before ``end_s`` (while backward runs)."""
    if start >= end_s:
        return start + c
    if c * slowdown <= end_s - start:
        return start + c * slowdown
    return end_s + c - (end_s - start) / slowdown  # part under backward, the rest at full speed


def simulate_backward(
    ready_s: Sequence[float], comm_s: Sequence[float], end_s: float, slowdown: float = 1.0
) -> float:
    """Exposed time: how far the last message finishes after ``end_s``."""
    spans = queue_spans(ready_s, comm_s, end_s, slowdown)
    return max(0.0, spans[-1][1] - end_s) if spans else 0.0


def deadlines(compute: ComputeModel, late: bool) -> list[float]:
    """When each layer's average must have landed, from its iteration's backward start: at the
    end of backward (T_L, the paper's: before the update), or ``late`` (DreamDDP's ``lag`` 1)
    when the layer's next forward begins: T_L + O + F_l, with F_l the forward of the layers
    before it (forward time shared out as backward's is: the profile times forward whole)."""
    finish = compute.finish_times()
    end = finish[-1]
    if not late:
        return [end] * len(finish)
    share = compute.forward_s / end if end > 0 else 0.0
    return [end + compute.optimizer_s + share * (end - t) for t in finish]


# DreamDDP with a codec, landing at once: before a layer's first phase goes out, the second
# phase of the one launched this many launches earlier does (``codec_exposed``). Not the one
# just before: waiting for a first phase is waiting for the slowest worker to reach that layer,
# and workers sharing cores drift apart by a few layers (measured on W1: below)
ADVANCE_DEPTH = 3


def exposed_for_layers(
    compute: ComputeModel, link: LinkModel, layers: Iterable[int], late: bool = False
) -> float:
    """Exposed communication of one iteration that averages ``layers``, each launched when ready:
    how far the last of them lands after the end of backward, or ``late`` (see ``deadlines``)
    how far the most overdue one makes the next forward wait (a wait there shifts the later
    layers' deadlines with it, so the largest lateness is the wait). A codec's two phases
    landing at once: ``codec_exposed``."""
    if compute.tail_bytes and not late:
        return codec_exposed(compute, link, layers)
    finish = compute.finish_times()
    chosen = sorted(layers)
    spans = queue_spans(
        [finish[i] for i in chosen],
        [link.time(compute.nbytes[i]) for i in chosen],
        finish[-1],
        compute.comm_slowdown,
    )
    if not spans:
        return 0.0
    due = deadlines(compute, late)
    if not compute.tail_bytes:
        return max(0.0, max(end - due[i] for (_, end), i in zip(spans, chosen, strict=True)))
    # A codec's averages landing late: the update waits for every first phase (``before_step``
    # advances them all), then the second phases go out in forward order, each due at its
    # layer's forward, which starts that much later.
    wait = max(0.0, max(end for _, end in spans) - finish[-1])
    t, overdue = finish[-1] + wait, 0.0
    for i in reversed(chosen):
        t += link.time(compute.tail_bytes[i])
        overdue = max(overdue, t - (due[i] + wait))
    return wait + overdue


def codec_exposed(
    compute: ComputeModel, link: LinkModel, layers: Iterable[int], depth: int | None = None
) -> float:
    """Exposure of a codec's averages of ``layers`` landing at once, whose second phase
    (``tail_bytes``) is computed from the first's result and goes out under backward
    (DreamDDP's ``_advance_launched``): each layer's first phase goes out when it is ready, and
    before it the one launched ``depth`` (``ADVANCE_DEPTH``) launches earlier is advanced:
    backward waits for its first phase (a stall where the link is behind) and queues its
    second. After backward the rest are advanced, the last launched first, and the update waits
    for every second phase. One link, first queued first served, ``comm_slowdown`` times slower
    under backward."""
    chosen = sorted(layers)
    if not chosen:
        return 0.0
    finish = compute.finish_times()
    return advanced_under_backward(
        [finish[i] for i in chosen],
        [link.time(compute.nbytes[i]) for i in chosen],
        [link.time(compute.tail_bytes[i]) for i in chosen],
        finish[-1],
        compute.comm_slowdown,
        ADVANCE_DEPTH if depth is None else depth,
    )


def advanced_under_backward(
    ready: list[float], first_s: list[float], tail_s: list[float], end: float, slowdown: float, depth: int
) -> float:
    """How far past ``end`` (backward's) messages of two phases land, launched at ``ready`` in
    that order, each one's second phase (``tail_s``) queued when the one launched ``depth``
    later goes out (backward waiting for its first phase where it is not in), the last
    ``depth`` after backward, the last launched first (``codec_exposed``: DreamDDP's layers;
    ``predict_ssgd``: a codec's buckets)."""
    stall, free = 0.0, 0.0  # backward's waits so far; when the link is next free

    def serve(at: float, c: float) -> float:
        nonlocal free
        free = _finish(max(free, at), c, end + stall, slowdown)
        return free

    first: list[float] = []  # when each launched message's first phase lands
    for k, r in enumerate(ready):
        r += stall
        if k >= depth:
            if first[k - depth] > r:  # backward waits for that one's first phase
                stall += first[k - depth] - r
                r = first[k - depth]
            serve(r, tail_s[k - depth])
        first.append(serve(r, first_s[k]))
    if not first:
        return 0.0
    # after backward: the rest advanced, the last launched first (waiting for every first phase)
    t = max(end + stall, first[-1])
    for k in reversed(range(max(0, len(ready) - depth), len(ready))):
        t = serve(t, tail_s[k])
    return t - end


def interference_s(
    compute: ComputeModel, link: LinkModel, sent_bytes: float, first_ready_s: float = 0.0
) -> float:
    """How much longer backward takes while ``sent_bytes`` (priced as all-reduce bytes) go out
    under it, the first of them ready ``first_ready_s`` into backward: the profile's seconds per
    byte (``interference_s_per_byte``, its contention probe), for no more bytes than the link
    carries from then to backward's end (a saturated link takes the CPU at its rate, not at the
    bytes queued behind it)."""
    if compute.interference_s_per_byte <= 0 or sent_bytes <= 0:
        return 0.0
    per_byte = link.beta_s_per_byte * compute.comm_slowdown
    span = max(0.0, compute.backward_total_s - first_ready_s)
    carried = span / per_byte if per_byte > 0 else sent_bytes
    return compute.interference_s_per_byte * min(sent_bytes, carried)


def stretched(compute: ComputeModel, extra_s: float) -> ComputeModel:
    """``compute`` with backward ``extra_s`` longer, each layer's share alike: the layers'
    gradients are ready later by what the transfers took from backward before them."""
    total = compute.backward_total_s
    if extra_s <= 0 or total <= 0:
        return compute
    k = (total + extra_s) / total
    return replace(compute, backward_s=tuple(b * k for b in compute.backward_s))


def iteration_overhead(
    compute: ComputeModel, link: LinkModel, layers: Iterable[int], late: bool = False
) -> float:
    """What averaging ``layers`` during backward adds to an iteration: the interference (backward
    slowed by the transfers under it, ``interference_s``), exposure on that slower backward (a
    codec's second phases in it: under backward, ``codec_exposed``, or ``late`` under the update
    and the forward), the codec's compute (``codec_s``) and the wait for the slowest worker
    (``sync_wait_s``)."""
    chosen = list(layers)
    if not chosen:
        return 0.0
    slowed, exposed = slowed_and_exposed(compute, link, chosen, late)
    return slowed + exposed + compute.codec_total_s(chosen) + compute.sync_wait_s


def slowed_and_exposed(
    compute: ComputeModel, link: LinkModel, layers: Sequence[int], late: bool = False
) -> tuple[float, float]:
    """An iteration averaging ``layers``: how much longer its backward takes for the transfers
    under it (``interference_s``, from the first of them ready), and its exposure on that
    slower backward (``exposed_for_layers``)."""
    if not layers:
        return 0.0, 0.0
    sent = sum(compute.nbytes[i] for i in layers)
    if compute.tail_bytes:
        sent += sum(compute.tail_bytes[i] for i in layers)
    first = min(compute.finish_times()[i] for i in layers)
    slowed = interference_s(compute, link, sent, first)
    return slowed, exposed_for_layers(stretched(compute, slowed), link, layers, late)


def _buckets(compute: ComputeModel, cap_bytes: float, ddp: bool = False) -> list[list[int]]:
    """The layers of each bucket of ``cap_bytes`` in backward order, cut on the layers' fp32
    sizes as a run cuts them (``raw_nbytes`` where a codec is priced): from the output end,
    none over the cap but a layer larger than it (``comm.buckets.make_buckets``). ``ddp``: as
    PyTorch DDP cuts them, from the input end in registration order, each closed once it
    reaches the cap, then the list reversed, so the bucket backward fills first is the
    partial one (``DistributedDataParallel._ddp_init_helper``; DDP keeps that cut while
    ``sync/ddp.py`` passes ``find_unused_parameters=True``, else it cuts again after a step)."""
    raw = compute.raw_nbytes or compute.nbytes
    if ddp:
        cut: list[list[int]] = [[]]
        size = 0
        for i in reversed(range(len(raw))):
            cut[-1].append(i)
            size += raw[i]
            if size >= cap_bytes:
                cut.append([])
                size = 0
        return [sorted(b) for b in reversed(cut) if b]
    buckets: list[list[int]] = [[]]
    size = 0
    for i, nbytes in enumerate(raw):
        if size and size + nbytes > cap_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += nbytes
    return buckets


def _bucketed(
    compute: ComputeModel, cap_bytes: float, ddp: bool = False
) -> tuple[list[float], list[int], list[int]]:
    """Each gradient bucket of ``cap_bytes`` (cut as ``_buckets`` does): when it is ready, its
    (priced) size, and the size of a codec's second phase for it (``tail_bytes``; 0 without one)."""
    finish = compute.finish_times()
    buckets = _buckets(compute, cap_bytes, ddp)
    tail = compute.tail_bytes or (0,) * compute.n_layers
    return (
        [finish[b[-1]] for b in buckets],
        [sum(compute.nbytes[i] for i in b) for b in buckets],
        [sum(tail[i] for i in b) for b in buckets],
    )


def predict_ssgd(compute: ComputeModel, link: LinkModel, bucket_mb: float = 4.0, ddp: bool = False) -> float:
    """A step of bucketed all-reduces under backward (``ssgd``; ``ddp``: PyTorch DDP's buckets,
    its default 25 MB). A codec's second phases go out under it too, each bucket's when the one
    launched ``ADVANCE_DEPTH`` later does, the rest after backward (``sync/ssgd.py``,
    ``sync/ddp.py``'s codec hook)."""
    ready, sizes, tails = _bucketed(compute, bucket_mb * 2**20, ddp)
    # backward slowed by the transfers under it, the buckets ready that much later (as
    # ``stretched``: each layer's share alike)
    sent = sum(sizes) + (sum(tails) if compute.tail_bytes else 0)
    interference = interference_s(compute, link, sent, ready[0] if ready else 0.0)
    end, first = compute.backward_total_s + interference, [link.time(s) for s in sizes]
    if interference > 0:  # > 0 only where backward has taken time
        ready = [r * end / compute.backward_total_s for r in ready]
    if compute.tail_bytes:
        second = [link.time(t) for t in tails]
        exposed = advanced_under_backward(ready, first, second, end, compute.comm_slowdown, ADVANCE_DEPTH)
    else:
        exposed = simulate_backward(ready, first, end, compute.comm_slowdown)
    return compute.compute_s + interference + exposed + compute.codec_total_s() + compute.sync_wait_s


def whole_model_allreduce_s(compute: ComputeModel, link: LinkModel, bucket_mb: float = 4.0) -> float:
    """All buckets in flight back to back: what a periodic average costs, nothing hidden (a
    codec's second phases after them, and its compute)."""
    _, sizes, tails = _bucketed(compute, bucket_mb * 2**20)
    links = sum(link.time(s) for s in sizes) + sum(link.time(t) for t in tails)
    return links + compute.codec_total_s()


def predict_periodic(compute: ComputeModel, link: LinkModel, H: int, bucket_mb: float = 4.0) -> float:
    """Local SGD and DiLoCo: compute every step, one unhidden whole-model all-reduce every H steps."""
    return compute.compute_s + (whole_model_allreduce_s(compute, link, bucket_mb) + compute.sync_wait_s) / H


def predict_co2(compute: ComputeModel, link: LinkModel, H: int, bucket_mb: float = 4.0) -> float:
    """CO2: compute every step, and a whole-model all-reduce every H steps under the next H
    steps of compute: only what outlasts them shows."""
    exposed = whole_model_allreduce_s(compute, link, bucket_mb) - H * compute.compute_s
    return compute.compute_s + max(0.0, exposed) / H


# DreamDDP's schedules are searched on a link this much slower than measured (slack)
PLAN_HEADROOM = 0.25
# DreamDDP's default lag (``DreamDDPConfig.lag``): its averages land at the layers' next forward
DEFAULT_LAG = 1


def default_lag(codec: bool) -> int:
    """DreamDDP's lag where none is given: 1, or 0 with a codec. A codec's second phase at lag 1
    runs under the update and the forward, which on CPU workers it slows more than it saves:
    on W1 at 100 Mbit/s (int4, H=2) 2.756 s a step at lag 1 against 2.458 s at lag 0 (nosync
    2.089), and the plan predicted the same order (2.62 against 2.38 s: the interference its
    profile measured). With the second phases under backward at lag 0 (``codec_exposed``) the
    two measured the same (2.217 s at lag 0, 2.212 s at lag 1; nosync 1.899), and lag 1's
    prediction is the further off (13% under, against 6%). An accelerator's compute does not
    share the cores with the transfers."""
    return 0 if codec else DEFAULT_LAG


def lands_late(lag: int, h: int, H: int) -> bool:
    """Whether iteration h of a period's averages land at the next forward: with ``lag`` 1, all
    but the period's last, which lands its own at once so that a period ends with none in flight."""
    return bool(lag) and h < H - 1


def predict_schedule(
    compute: ComputeModel, link: LinkModel, schedule: Sequence[Iterable[int]], lag: int = 0
) -> float:
    """DreamDDP: mean over the period of compute plus each iteration's layer-sync overhead."""
    H = len(schedule)
    overhead = [
        iteration_overhead(compute, link, layers, lands_late(lag, h, H)) for h, layers in enumerate(schedule)
    ]
    return compute.compute_s + sum(overhead) / len(overhead)


def priced_for_codec(
    compute: ComputeModel,
    codec: Any,
    shapes: Sequence[Sequence[tuple[int, ...]]],
    workers: int,
    codec_s: Sequence[float] = (),
) -> ComputeModel:
    """The compute model of a profile taken with plain all-reduces, for layers averaged through
    ``codec``: the link's line is the same, the messages are not.

    The profile's line prices an all-reduce of n bytes, whose ring puts 2 (N - 1) / N n on each
    link: a message that puts w bytes there costs what an all-reduce of w N / (2 (N - 1)) bytes
    does. A codec's first collective (``Codec.phase_bytes``) is launched when the layer's
    gradient is ready and queued under backward like a plain all-reduce; its second (the
    quantisers' all-gather, PowerSGD's Q) goes out after backward, one layer after another
    (``tail_bytes``), each paying the latency again: waited for before the update, or at lag 1
    under the update and the forward (``exposed_for_layers``). Encoding and decoding take
    ``codec_s`` per layer (``plan.codec_time``, timed by a profile taken with the codec); without
    them a run's re-plan takes them from the steps measured (``fit_link_scale``)."""
    if workers < 2:
        return compute
    ring = 2 * (workers - 1) / workers
    phases = [codec.phase_bytes(list(s), workers) for s in shapes]
    nbytes = tuple(max(1, round(first / ring)) for first, _ in phases)
    tail = tuple(round(second / ring) for _, second in phases)
    # Interference is charged per byte the link carries under backward, both phases'
    # (``iteration_overhead``).
    raw = compute.raw_nbytes or compute.nbytes
    return replace(
        compute, nbytes=nbytes, tail_bytes=tail if any(tail) else (), raw_nbytes=raw, codec_s=tuple(codec_s)
    )


def unpriced(compute: ComputeModel) -> ComputeModel:
    """The compute model of plain all-reduces back from one ``priced_for_codec`` made."""
    if not compute.raw_nbytes:
        return compute
    return replace(compute, nbytes=compute.raw_nbytes, tail_bytes=(), raw_nbytes=(), codec_s=())


def fit_link_scale(
    compute: ComputeModel,
    link: LinkModel,
    schedule: Sequence[Iterable[int]],
    measured_s: float,
    lag: int = 0,
) -> float | None:
    """The factor k on the link's times (latency and per byte) that makes ``predict_schedule``
    equal ``measured_s``: what a re-plan takes from the steps already measured instead of a new
    profile (a slower or faster link, a codec's encoding: time spent per message). None where no
    k in [1/1000, 1000] can: a measured step below the compute alone (the compute got faster:
    profile again). A busier worker is read as a slower link here: the schedule then hides
    less, until a change of members profiles again."""
    schedule = [list(layers) for layers in schedule]

    def predicted(k: float) -> float:
        return predict_schedule(compute, link.scaled(k), schedule, lag)

    # Not monotonic in k everywhere: a slower link carries fewer bytes under backward, so its
    # interference falls while its exposure grows. So every crossing on a log grid is bisected,
    # and the scale nearest 1 (the link as it was) taken.
    grid = [10 ** (i / 10) for i in range(-30, 31)]
    values = [predicted(k) for k in grid]
    roots = []
    for (lo, p_lo), (hi, p_hi) in itertools.pairwise(zip(grid, values, strict=True)):
        if not (min(p_lo, p_hi) <= measured_s <= max(p_lo, p_hi)):
            continue
        rising = p_hi >= p_lo
        for _ in range(40):
            mid = math.sqrt(lo * hi)
            below = predicted(mid) < measured_s
            lo, hi = (mid, hi) if below == rising else (lo, mid)
        roots.append(math.sqrt(lo * hi))
    return min(roots, key=lambda k: abs(math.log(k)), default=None)


def window_exposure(
    compute: ComputeModel, link: LinkModel, schedule: Sequence[Iterable[int]], lag: int = 0
) -> list[float]:
    """Each iteration's predicted exposure (``exposed_for_layers``) where a run measures it: in
    the step it lands in. Landing late (``lag`` 1), iteration h's wait falls in step h + 1 (at
    its forward); the period's last lands at once, so nothing crosses into the next period."""
    schedule = [list(layers) for layers in schedule]
    H = len(schedule)
    out = [0.0] * H
    for h, layers in enumerate(schedule):
        late = lands_late(lag, h, H)
        out[h + 1 if late else h] += slowed_and_exposed(compute, link, layers, late)[1]
    return out


# The most a link is taken to slow under backward: a run's fit's range, and a profile's bound
MAX_COMM_SLOWDOWN = 4.0
SLOWDOWN_GRID = tuple(1 + 0.05 * i for i in range(61))  # sigma from 1 to 4 in steps of 0.05


def fit_comm_slowdown(
    compute: ComputeModel,
    link: LinkModel,
    schedule: Sequence[Iterable[int]],
    measured_s: Sequence[float],
    lag: int = 0,
) -> tuple[float, float]:
    """(sigma, c): the link's slowdown under backward and a constant wait per step (for the
    slowest worker, who paces every collective) that make each step's predicted exposure
    (``window_exposure`` + c) closest to ``measured_s``, each step of a period's time blocked in
    collectives, in least squares. Sigma on ``SLOWDOWN_GRID``, c >= 0; of equal fits the
    smallest sigma (a period whose exposure does not depend on it says nothing about it, and
    keeps 1). Where workers share cores the link slows while they compute (fitted on W1: 1.6 to
    2.4 in three runs); a profile's contention probe reads 1.3-1.4 there, with all-reduces.
    With H=2 the two steps' medians determine sigma and c exactly: nothing averages out."""
    if len(measured_s) != len(schedule):
        raise ValueError(
            f"one measured time per iteration of the period ({len(schedule)}), got {len(measured_s)}"
        )
    best: tuple[float, float, float] | None = None
    for sigma in SLOWDOWN_GRID:
        predicted = window_exposure(replace(compute, comm_slowdown=sigma), link, schedule, lag)
        residual = [m - p for m, p in zip(measured_s, predicted, strict=True)]
        c = max(0.0, sum(residual) / len(residual))
        error = sum((r - c) ** 2 for r in residual)
        if best is None or error < best[0] * (1 - 1e-9) - 1e-12:
            best = (error, sigma, c)
    assert best is not None
    return best[1], best[2]
