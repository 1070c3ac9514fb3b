"""Rejecting contributions that cannot be right, before they enter an average.

One worker with a broken GPU, a bug or bad intent sends NaNs or huge values, and one all-reduce
spreads them to every replica. So, where ``--max-norm-ratio R`` is set, every mean all-reduce
through the communicator (gradient buckets, pseudo-gradients, parameter averages, DreamDDP's
layers) goes with a tiny control collective: each worker's contribution's L2 norm and whether
it is finite (two floats per worker, not the vectors). Every worker then judges every
contribution the same way (:func:`judge`): one that is not finite, or whose norm is more than R
times the median norm of the others, is left out, its owner sends zeros, and the sum is divided
by the number of contributions kept, so the result is the mean over the honest workers (bitwise
what they alone would have averaged: adding zeros is exact).

If every contribution is left out, every worker keeps its own (nothing is averaged). With
``--aggregate clip`` every kept contribution is also scaled down to the median of the kept norms
where it is above it (:func:`clip_norm`), at no extra communication.

Robust averages (``--aggregate trimmed:f=F`` and ``median``) need every contribution, not their
sum: the mean all-reduce becomes an all-gather of the vectors (each worker sends N - 1 copies of
its message instead of about 2, so N / 2 times the bytes), and every worker computes the same
coordinate-wise statistic over the contributions the check kept (:func:`robust_mean`). They
resist what a norm cannot see: a contribution with a plausible norm pointing the wrong way (a
flipped sign), up to F of them (``median``: fewer than half). Weighted sums in flight (an
adopter's empty message weighing 0) keep the plain check; co2 and streaming refuse them.

What it costs: 2 N floats per mean all-reduce, and a norm of the message. A plain mean carries
them as its last values (``Communicator._checked_mean``; a 16-bit one in a float64 all-reduce
launched with it): no worker waits for a verdict before sending, so a bucket launched from
backward costs what an unchecked one does; only when a contribution is left out is the mean
taken again, from each worker's contribution, left as it was. The quantised codecs (int8, int4,
sign) send the same row in each part of their all-to-all (``Communicator.norm_bytes``), and
every owner judges the rows on arrival (``judge_rows``) and averages the kept ones (trimmed and
median cost nothing extra there); a message left out has been sent, is dropped by every owner,
and its error feedback with it. Where the verdict must come first it is a round trip, counted as
blocked time: ``--aggregate clip`` (a contribution is scaled before it is sent, the quantised
codecs' too: ``Communicator.screen``), the robust averages of a plain mean, co2's weighted sums,
and PyTorch's PowerSGD hook (``ddp_powersgd``: its one bucket judged before the hook forms its
factors). It covers what goes through ``Communicator.all_reduce`` as a
mean: plain buckets, the fp16, bf16, PowerSGD and ACP-SGD codecs (each factor judged on its
own), DDP's buckets (its comm hook goes through the communicator when the check is on). Where
every worker holds every message (top-k's and chunked top-k's all-gathers, sparseloco, demo,
streaming) the decoded messages are judged where they arrive, with no communication
(``Communicator.weigh_gathered``). The quantised codecs' second phase (each worker re-quantises
the mean of its own shard) is checked against a bound the first phase's norms set
(``Verdict.shard_bound``): a shard owner that spoils its shard within that bound, or flips its
sign, is not caught; nothing but a second owner of each shard could catch it.

On by default (``auto``, :func:`default_norm_ratio`): R = 10 among 3 workers or more for the
periodic methods and the gathers, whose check costs a round trip per sync, or nothing; between
two workers, where a ratio cannot say which is wrong, only finiteness. Off for the per-step
means (``ssgd``, ``dreamddp``, a run with a warm start: a ratio rejects honest gradients there,
and finiteness alone costs 1.0% of the step on W1, 3.9% before its buffers were kept, and 1.4%
of DreamDDP's int4 step since its verdict travels in the all-to-all, 12.7% before;
``--max-norm-ratio inf`` checks it),
``ddp`` (PyTorch's own all-reduce, the reference; checked, its buckets go through a hook),
``ddp_powersgd`` (a round trip per step) and ``--pace time`` runs (their weighted contributions
would be judged as they are).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch

from geotrain.compress import plain_spec

# What the check covers (mean all-reduces, CO2's weighted sums, the codecs' own collectives and
# the frontier methods' gathers, PyTorch's PowerSGD hook): where --max-norm-ratio and --chaos
# corrupt apply. Not: nosync (nothing is averaged).
GUARDED_ALGOS = (
    *(
        "ssgd",
        "ddp",
        "ddp_powersgd",
        "localsgd",
        "diloco",
        "dreamddp",
        "co2",
        "streaming",
        "sparseloco",
        "demo",
    ),
)
# Their messages are gathered, one per worker, and decoded and added by every worker.
SPARSE_CODECS = ("topk", "adatopk", "chunktopk")
GUARDED_CODECS = (*("", "fp16", "bf16", "int8", "int4", "sign", "powersgd", "acpsgd", *SPARSE_CODECS),)
# Checked unless told otherwise: a round trip per sync (every H steps), or none (the gathers).
CHECKED_BY_DEFAULT = ("localsgd", "diloco", "co2", "streaming", "sparseloco", "demo")
# Their check travels in their all-to-all's rows (each owner holds every contribution to its
# shard), so a verdict, trimmed and median included, costs them nothing more; clip's comes first.
ROWS_IN_BAND_CODECS = ("int8", "int4", "sign")


def judged_in_rows(compress: str) -> bool:
    """Whether the codec ``compress`` (a ``--compress`` spec) carries the check in its rows."""
    return compress.partition(":")[0] in ROWS_IN_BAND_CODECS


DEFAULT_NORM_RATIO = 10.0
SHARD_SLACK = 10.0  # a re-quantised shard of the mean may be this many times what the kept allow
AUTO = -1.0  # max_norm_ratio's "auto": default_norm_ratio decides
AUTO_MIN_WORKERS = 3  # under auto, the check is on only in groups of this many workers or more


def default_norm_ratio(algo: str, compress: str = "", pace: str = "steps", warm_start: int = 0) -> float:
    """``--max-norm-ratio auto``: 10 where the check is (nearly) free, else 0 (off). Off for the
    averages taken every step (ssgd, ddp, dreamddp, a run with a warm start): a ratio rejects honest
    gradients there (one step's gradient on a small batch is heavy-tailed: on W1 an honest
    bucket's norm was 38 to 450 times the others' median, several times in 20 steps, where a
    period's pseudo-gradients and parameters never came near 10), and finiteness alone
    (``--max-norm-ratio inf``), though its verdict travels with the mean, measured
    4.7% more step time on W1, most of it fresh memory for each bucket's buffer; kept since
    (``Communicator._take_buffer``), 1.0%, still 0.12 s a step outside the waits. The
    communicator keeps the ratio on only while the group has AUTO_MIN_WORKERS or more
    (``Communicator.auto_min_workers``), and below judges only finiteness: of two workers that
    disagree a ratio cannot say which is wrong, and would leave out the larger, an honest one as
    often as not (against a joiner's first short delta, say). Off for ``ddp``, the reference:
    checked, its buckets leave PyTorch's all-reduce for a hook."""
    codec = plain_spec(compress).partition(":")[0]
    free = algo in CHECKED_BY_DEFAULT and codec in GUARDED_CODECS and pace != "time" and not warm_start
    return DEFAULT_NORM_RATIO if free else 0.0


def norm_ratio_arg(text: str) -> float:
    """``--max-norm-ratio``'s value: ``auto`` (AUTO), or a number."""
    return AUTO if str(text).strip().lower() == "auto" else float(text)


AGGREGATES = ("mean", "clip", "trimmed:f=F", "median")
GATHERED = ("trimmed", "median")  # aggregates that need every contribution (an all-gather)
COLUMNS = 1 << 20  # values per slice the robust statistics sort at a time


def parse_aggregate(text: str) -> tuple[str, int]:
    """``--aggregate``: (name, f). ``trimmed:f=1`` drops the f largest and f smallest values of
    each coordinate before the mean; ``median`` is the coordinate-wise median."""
    name, _, args = text.partition(":")
    if name in ("mean", "clip", "median") and not args:
        return name, 0
    if name == "trimmed":
        key, eq, value = args.partition("=")
        if key == "f" and eq and value.isdigit() and int(value) >= 1:
            return name, int(value)
        raise ValueError(f"--aggregate {text!r}: give trimmed:f=F, F >= 1 values cut at each end")
    raise ValueError(f"unknown --aggregate {text!r}; accepted: {', '.join(AGGREGATES)}")


def robust_mean(rows, kind: str, f: int = 0):
    """The coordinate-wise trimmed mean (``trimmed``: the f lowest and f highest of each column
    left out, at most as many as leave one) or median (the middle value, or the mean of the two
    middle ones) of ``rows``, a (contributions, values) tensor. Sums run in a fixed order, so
    every worker computes the same bits."""
    k = rows.shape[0]
    cut = (k - 1) // 2 if kind == "median" else min(f, (k - 1) // 2)
    flat = rows.reshape(k, -1)
    out = torch.empty(flat.shape[1], dtype=rows.dtype, device=rows.device)
    for start in range(0, flat.shape[1], COLUMNS):  # in slices: a sort holds values and indices
        middle = flat[:, start : start + COLUMNS].sort(dim=0).values[cut : k - cut]
        out[start : start + COLUMNS] = middle.sum(dim=0) / middle.shape[0]
    return out.view(rows.shape[1:])


@dataclass(frozen=True)
class Verdict:
    kept: list[bool]  # by rank
    reasons: list[str]  # by rank: "" where kept
    norms: tuple[float, ...] = ()  # by rank, as judged (where the contributions' norms are known)

    @property
    def count(self) -> int:
        return sum(self.kept)

    def shard_bound(self) -> float:
        """The largest norm a part of the average can honestly have, times SHARD_SLACK: a shard
        of the mean (or of a coordinate-wise statistic) of the kept contributions is at most
        the root of the sum of their squared norms. A second phase that re-quantises the mean
        (``compress.quantize``) adds two roundings and its server residual, which the slack
        leaves room for unless the contributions shrink SHARD_SLACK-fold from one average to
        the next. inf where no norms are known or all are 0 (then only finiteness is judged)."""
        kept = [n for n, k in zip(self.norms, self.kept, strict=True) if k] if self.norms else []
        bound = SHARD_SLACK * math.sqrt(sum(n * n for n in kept))
        return bound if bound > 0 else float("inf")


def message_norm(values, valid: bool = True) -> tuple[float, bool]:
    """A received message's (norm, finite) for :func:`judge`, where every worker judges the
    messages it holds without exchanging norms: in float64, rounded to 6 significant digits, so
    that hosts whose kernels sum in different orders still reach the same verdict and clip by
    the same factors. ``valid`` False (indices repeated or out of range: a message built to
    pass the norm and still move one coordinate far) counts as not finite."""
    if not valid:
        return 0.0, False
    # Summed in float64 without a float64 copy of the message (a third of the time on a
    # quantised codec's shards, checked at every sync); a finite norm means finite values,
    # so they are scanned only where it is not (inf or NaN in them, or a float64 overflow)
    floats = values if values.is_floating_point() else values.double()
    norm = float(torch.linalg.vector_norm(floats, dtype=torch.float64))
    if not math.isfinite(norm) and not bool(values.isfinite().all()):
        return 0.0, False
    return float(f"{norm:.6g}"), True


def clip_norm(norms: list[float], kept: list[bool]) -> float:
    """``--aggregate clip``: the norm every kept contribution is clipped to, the median of the
    kept non-zero norms (inf where there is none). It needs nothing beyond the norms the check
    gathers already, and bounds what any one worker can move the average by."""
    live = [n for n, k in zip(norms, kept, strict=True) if k and n > 0]
    return statistics.median(live) if live else float("inf")


def judge(norms: list[float], finite: list[bool], ratio: float) -> Verdict:
    """Which contributions enter the average: a finite one whose norm is at most ``ratio`` times
    the median of the other finite, non-zero contributions' norms. Empty (all-zero) ones, such as
    a joiner's stand-in message, do not count in the median: with them a median of 0 would reject
    every honest contribution. Where no other is non-zero, any finite norm is kept. With two
    workers the ratio can only say that they disagree, and leaves out the larger. ``ratio`` 0:
    only what is not finite is left out."""
    kept, reasons = [], []
    for i, (norm, ok) in enumerate(zip(norms, finite, strict=True)):
        if not ok:
            kept.append(False)
            reasons.append("not finite")
            continue
        others = [n for j, (n, f) in enumerate(zip(norms, finite, strict=True)) if j != i and f and n > 0]
        median = statistics.median(others) if others else float("inf")
        if ratio > 0 and norm > ratio * median:
            kept.append(False)
            reasons.append(f"norm {norm:.3g} > {ratio:g} x the others' median {median:.3g}")
        else:
            kept.append(True)
            reasons.append("")
    return Verdict(kept, reasons, tuple(norms))


# the shards' bound each owner sends with its shard, where verdicts are taken on arrival
BOUND_BYTES = 4


def shard_bound_bytes(bound: float, device) -> torch.Tensor:
    return torch.tensor([bound], dtype=torch.float32).view(torch.uint8).to(device)


def agreed_shard_bound(rows) -> float:
    """The bound every worker checks the gathered shards against (``rows``: each owner's
    ``shard_bound_bytes``, in rank order, the same on every worker): the lower median of the
    owners' bounds. Where each owner's verdict came from the rows it received (the quantised
    codecs' in-band check), honest owners all hold the same one; a sender that sent them
    different norms cannot make workers check a shard against different bounds, and one owner
    cannot loosen it in a group of 3 or more (in a group of 2 it can only tighten it). NaN
    counts as 0: a bound nobody passes."""
    bounds = rows.contiguous().cpu().view(torch.float32).reshape(-1).tolist()
    return statistics.median_low([0.0 if math.isnan(b) else b for b in bounds])
