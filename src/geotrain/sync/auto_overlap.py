"""SparseLoCo's ``--overlap auto``: whether an outer step's all-gather runs under the next
period's compute, and where its mean lands, following the link through a run.

``overlap`` "auto" (the default) overlaps only where that reaches a loss sooner: the first
outer step runs synchronously and times its all-gather against the period's compute (H times
the median step interval before it), and every later step overlaps where the step it saves
outweighs the steps to a loss that its late landing costs (``plan.gather.weigh_overlap``: a
mean landing L of H steps late costs min(0.4 L / H, 0.24) more steps, measured on GPT ``tiny``;
a gather of 5% of the period overlaps at H=20, landing 2 steps late, and not at H=5, where it
lands a fifth of the period late), else none does, until the landing moves (below). (A fixed
5% of the period decided before: it overlapped on ``tiny`` at H=5 for 5.3%, and the run
ended at 2.1395 against 2.0577 synchronous at H=5, 400 steps; the default now runs it
synchronously, at the H=10 its probe then picks: 2.1012.) With ``H`` "auto" (the default) the
start-up probe has timed a step and a gather already, and the verdict is taken from
those, before step 1: the first outer step overlaps too where the link is slow (at 350 kbit/s
its synchronous gather was 26 s of an 80-step run's 160), unless the gather outlasts about four
periods, where overlap would hide one of them and cost 24% more steps. Overlapping, each gather
lands ``LAND_MARGIN`` (1.5) times its measured length in steps after it was launched (``tau``
0, the default; at most H), by when it has arrived. Every worker takes the same verdict (the
largest ratio measured), and snapshots keep it. Overlap costs loss (above), so a link fast
enough to hide nothing behind is better used synchronously. ``--overlap`` without ``--tau``
lands a period late, as before ``tau`` was built.

Under auto the landing then follows the link (``next_landing``): each worker notes when its
gather was there (the first step boundary at which it had completed, or, where the landing had
to wait, the landing plus the wait in steps) and sends that figure in 4 bytes after its next
message; at that message's landing every worker reads the same figures and moves the landing to
the step the slowest worker's gather was there by (later at once; sooner only with a step to
spare, so that it does not flap between two steps). The first gather is timed alone, and later
ones share the cores with compute and take longer; a link that slows or speeds up mid-run moves
the landing with it. Where the landing moves later than overlap pays for at the share the
verdict was taken on, the next outer step is synchronous, timed after a barrier, and decides
again on the share it measures, landing no sooner than the link asked (``_reweigh``): a link
that slowed goes on overlapped after that one synchronous step, landing later; workers that
drifted apart go synchronous (on loopback a 4 ms gather turned overlap on at landing 1, the
landing then wandered over 2-10 steps with the drift, and the run ended 3% above a synchronous
one). Synchronous under auto, each message carries its sender's wait in the last gather, and a
shortest wait that stays twice its level after the verdict, where overlap would pay by
``watch_margin``, makes the next outer step a timed one that decides again (``_watch``): a link
that slows while the run is synchronous is hidden too.

With ``H`` "auto" a verdict taken again weighs the period as well (``_better_period``): the
gather it timed, in steps, priced at each of ``SPARSELOCO_PERIODS`` as the start-up choice
prices it (``plan.gather.choose_sparseloco_period``), and the run moves to a period that
reaches a loss ``PERIOD_MARGIN`` sooner than the one in force: a link that slowed tenfold
under H=10, whose gather no period of 10 can hide, goes on at H=20. Outer steps stay at the
multiples of the period from step 0 (the membership layer's rule), so a longer period starts
at the first outer step that is a multiple of it (at once where the timed step is one; else the
verdict for it is taken there, from the same figures: ``_take_next_period``). A watch (above)
asks for the timed step where a longer period would pay by ``PERIOD_MARGIN``, too, and so do
the arrival figures where they pass the period (``_weigh_longer``: a landing at H, which the
landing's check cannot move later). Periods only grow:
a faster link moves the landing sooner, and leaves the period as it is.

``AutoOverlap`` is the part of ``geotrain.sync.sparseloco.SparseLoCo`` that takes these verdicts
and moves the landing; it reads and sets the algorithm's state (``overlap``, ``landing``, the
anchor, the message in flight) and is not used on its own.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics

import torch

from geotrain.plan.gather import (
    LATE_LANDING_COST,
    SPARSELOCO_PERIODS,
    choose_sparseloco_period,
    gather_share,
    hiding_steps,
    weigh_overlap,
)

# The bytes after an overlapped message under auto: the sender's arrival figure (float32, steps)
ARRIVAL_BYTES = 4
# A landing may wait this fraction of a step before the next one lands a step later
WAIT_SLACK = 0.1
# Under auto's synchronous verdict, the shortest wait the gathers carry asks for a timed outer
# step (``_watch``) where it has stood ``WATCH_RISE`` times over its level (the least since the
# verdict) at ``WATCH_PERSIST`` outer steps in a row, and overlap would be sooner to a loss at it
# by ``watch_margin`` (or, under --H auto, a longer period by ``PERIOD_MARGIN``); the timed step
# turns overlap on only by that margin too. On 4 workers
# sharing 2 cores the shortest wait is not the link's: on loopback (GPT tiny, 10-step periods of
# 0.08-0.20 s) it measured 0.5-51% of the period from one outer step to the next,
# where gathers timed after a barrier read 0.9-24%; read once, against its level, it asked
# for a timed step one to seven times a run, and three of them turned overlap on (4.9% and 8.0%
# at H=10, 23.6% at H=5), two going off again at the next check.
WATCH_RISE = 2.0
WATCH_PERSIST = 2
WATCH_MARGIN = 0.02
# With --H auto a verdict taken again weighs the periods too, and moves to another only where
# that reaches a loss this much sooner (a fraction of the time to it) than the period in force:
# the period's price, in steps to a loss, is a line fitted on W1, not a measure that tells 5%.
PERIOD_MARGIN = 0.05


def watch_margin(H: int) -> float:
    """What overlap must win by, in a step, for the watch to turn it on: ``WATCH_MARGIN``, and
    at least what a landing one step later than predicted costs (``LATE_LANDING_COST`` / H),
    so that the landing's check (``SparseLoCo._reweigh``) does not undo it at the first move."""
    return max(WATCH_MARGIN, LATE_LANDING_COST / H)


def next_landing(landing: int, arrivals: list[float], H: int) -> int:
    """The landing for the gathers to come, from the workers' arrival figures of the last one
    (steps after its launch at which each worker had it; 0: no figure, a worker that adopted
    another's state). Later at once to the slowest's (a wait under ``WAIT_SLACK`` of a step
    is let go); sooner only where every gather was there two steps before the landing, to one
    step after the slowest: the figures are whole step boundaries there, and a landing set to
    the slowest's boundary exactly would flap between it and the next. Within [1, H]."""
    known = [a for a in arrivals if math.isfinite(a) and a > 0]  # (4 bytes from any peer)
    if not known:
        return landing
    needed = max(1, math.ceil(round(min(max(known), H + 1) - WAIT_SLACK, 6)))
    if needed > landing:
        return min(H, needed)
    if needed < landing - 1:
        return needed + 1
    return landing


class AutoOverlap:
    """``--overlap auto``'s verdicts, the landing's figures and the two checks, for SparseLoCo."""

    @property
    def follows_link(self) -> bool:
        """The landing moves with the measured arrivals: auto chose it (``--tau`` not given)."""
        return bool(self.overlap) and self.config.overlap == "auto" and not self.config.tau

    @property
    def watches_link(self) -> bool:
        """Synchronous under auto's verdict (``--tau`` not given): each message carries its
        sender's wait in the last gather, and the shortest is weighed (``_watch``)."""
        return (
            self.overlap is False
            and self.config.overlap == "auto"
            and not self.config.tau
            and self._share is not None
        )

    def _watch(self, waited: float, figures: list[float], weights: list[float] | None) -> None:
        """Auto's synchronous verdict watched through the waits the last gather carried. The
        worker that reached it last waited least, for the link and for the others to wake to
        it; the least such shortest wait since a verdict is its level. Where one has risen
        ``WATCH_RISE`` times over it and overlap would be sooner to a loss at it by
        ``watch_margin`` (under --H auto, or a longer period by ``PERIOD_MARGIN``,
        ``_better_period``) at ``WATCH_PERSIST`` outer steps in a row, the next outer step is timed
        after a barrier and decides (``_decide``, by the margin too), as the first one does: a
        link that slowed mid-run is hidden again. Every worker reads the same figures. Each
        worker's own wait here goes with its next message. A figure from a message the check
        left out, or a missing one (a worker that adopted another's state, the first gather
        after a verdict), has no say, and then none is read."""
        period_s = self._step_s() * self.config.H
        self._waited = waited / period_s if period_s > 0 else 0.0
        if weights is not None:
            figures = [f for f, w in zip(figures, weights, strict=False) if w > 0]
        known = [f for f in figures if math.isfinite(f) and f > 0]
        if not known or len(known) < len(figures):
            self._rises = 0  # "in a row": a step with no reading breaks the row
            return
        shortest = min(known)
        if self._watch_level is None:
            self._watch_level = shortest
            return
        verdict = weigh_overlap(shortest, self.config.H)
        rose = shortest >= WATCH_RISE * self._watch_level
        pays = verdict.overlap and verdict.sync - verdict.overlapped >= watch_margin(self.config.H)
        pays = pays or self._better_period(shortest) is not None
        self._rises = self._rises + 1 if rose and pays else 0
        if not rose:  # the level is the least shortest wait since the verdict
            self._watch_level = min(self._watch_level, shortest)
        if self._rises >= WATCH_PERSIST:
            level, now = 100 * self._watch_level, 100 * shortest
            why = f"the synchronous gathers' shortest wait up from {level:.1f}% to {now:.1f}%"
            self._decide_again(why)

    @staticmethod
    def _with_figure(payload: torch.Tensor, figure: float) -> torch.Tensor:
        """The message and, after it, one of auto's figures in ``ARRIVAL_BYTES`` (float32): the
        arrival of the last gather overlapped, or the wait in the last one synchronous."""
        return torch.cat([payload, torch.tensor([figure], dtype=torch.float32).view(torch.uint8)])

    def _message_part(self, rows: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
        """Gathered messages (or one) without the figures after them (auto's: the arrival of the
        last gather overlapped, or the wait in the last one synchronous), and the figures (none
        where the messages carry none: sent without auto, or saved before it had them)."""
        if rows.shape[-1] != self.chunker.payload_bytes(self.n) + ARRIVAL_BYTES:
            return rows, []
        figures = rows[..., -ARRIVAL_BYTES:].contiguous().view(torch.float32).reshape(-1)
        return rows[..., :-ARRIVAL_BYTES].contiguous(), figures.tolist()

    def _reweigh(self) -> None:
        """Auto's verdict again where the landing moves: where overlap, landing as late as the
        last figures ask, no longer reaches a loss sooner than waiting for the gather (the share
        the verdict was taken on), the next outer step is synchronous and timed after a barrier,
        as the first one is, and decides afresh (``_decide``) on the share it measures, with the
        landing the link asked for as the least it would land at. Every worker reads the same
        figures, so all do it at the same outer step.

        Why both: a gather is seen late where the link slowed, and where a worker drifted ahead
        of the others (on loopback, 4 workers on 2 cores arrive several 20 ms steps apart), and
        the figures cannot tell the two apart. A synchronous gather after a barrier measures the
        link alone. Measured on GPT ``tiny`` (4 workers, loopback, H=10, 400 steps): a first
        gather of 4-5% of the period turned overlap on, landing 1 step late; the landing then
        wandered over 2-10 steps with the drift (moved 29 times in one run), and those runs
        ended 3.0-3.5% above the synchronous ones, where landing at 1 throughout (``--tau 1``)
        cost 0.7% on the mean of 8 seeds. There a share of 4% against a landing of 2 of 10
        already goes synchronous (1.08 against 1.04); a 3.5 Mbit/s link slowed to 1.2 Mbit/s
        took one synchronous outer step (a share of 9.4%, the figures asking for 6 of 20), timed
        23.2%, and went on overlapped, landing 7 of 20 (docs/frontier.md). Not at a landing taken
        at the outer step itself (after a regroup, or at H), nor in ``finalize``: there the
        figures are weighed at the next landing."""
        moved = self._next_landing
        if self._share is None or not moved or moved <= self.landing or self._again:
            return
        verdict = weigh_overlap(self._share, self.config.H, tau=moved)
        if not verdict.overlap:
            why = f"the gathers there {moved} of {self.config.H} steps after launch"
            self._decide_again(
                why, moved, f"overlapped {verdict.overlapped:.3f} against synchronous {verdict.sync:.3f}"
            )

    def _better_period(self, share: float) -> tuple[int, float, float] | None:
        """--H auto: the longer period that reaches a loss soonest where a gather takes ``share``
        of the period in force (``choose_sparseloco_period`` on the gather's length in steps, as
        the start-up choice weighs it), its time to a loss and the present period's (x nosync's
        step), where it is ``PERIOD_MARGIN`` sooner; else None, and always with a fixed H. Both are
        priced with the landing that hides the gather, without the least landing a check asked
        for or the margin the verdict then takes at the new period. Only
        longer: the checks are asked where gathers take longer, and a gather timed after a
        barrier leaves out the wait for the slowest worker that the start-up choice counts, so
        it would shorten a period chosen with it."""
        if not self.auto_period or not math.isfinite(share) or share < 0:
            return None
        H = self.config.H
        longer = tuple(sorted({H, *(h for h in SPARSELOCO_PERIODS if h > H)}))
        best, table = choose_sparseloco_period(1.0, share * H, longer)
        factor = {row["H"]: row["time_to_loss_factor"] for row in table}
        if best == H or factor[best] > (1 - PERIOD_MARGIN) * factor[H]:
            return None
        return best, factor[best], factor[H]

    def _weigh_period(
        self, gather_s: float, period_s: float, ratio: float, nominal: float | None, floor: int
    ) -> tuple[float, float, bool, str]:
        """A verdict taken again (``_decide``), under --H auto: a move still pending is weighed
        again on these figures, and a longer period that pays (``_better_period``) is taken, at
        once where this outer step is a multiple of it, else at its first multiple, decided
        there from these figures (``_period_next``, ``_take_next_period``). The share that prices
        it is the smaller of the run's and the start-up probe's (``nominal``; None: not
        measured): the run's steps are faster while a worker waits (4 workers on 2 cores), and
        slower where something else takes the CPU, and a move needs both. Returns the share and
        the period's compute for the verdict at the period in force after it (the probe's where
        they priced the move: its steps will not wait on the link; ``_share`` then holds it, and
        the checks after weigh on it), whether the probe's steps did, and what the summary says."""
        self._period_next = None
        share = min(ratio, nominal) if nominal is not None and nominal > 0 else ratio
        better = self._better_period(share)
        if better is None:
            return ratio, period_s, False, ""
        (new, sooner, now), H = better, self.config.H
        scale = new / H
        weighed = f"time to a loss x nosync's step {now:.3f} at H={H}, {sooner:.3f} at H={new}"
        probed = share != ratio
        if probed:
            weighed += f", on the start-up probe's steps: a share of {100 * share:.1f}%"
            ratio, period_s = share, self.probe_step_s * H
        if self.step_count % new == 0:  # a boundary of the longer period too: from here
            self._switch_period(new)
            return (
                ratio / scale,
                period_s * scale,
                probed,
                f"; the period from H={H} to H={new} here ({weighed})",
            )
        at = -(-self.step_count // new) * new
        self._period_next = [new, gather_s, period_s * scale, ratio / scale, floor, self.step_count]
        return (
            ratio,
            period_s,
            probed,
            f"; the period to go from H={H} to H={new} at step {at}, its multiple ({weighed})",
        )

    def _switch_period(self, H: int) -> None:
        """Run at period H from this outer step (a multiple of it) on, and note it."""
        self.period_moves.append([self.step_count, H])
        self._set_period(H)
        self._longer_asked = 0.0  # the figures at the new period ask afresh

    def _take_next_period(self) -> None:
        """At the first outer step that is a multiple of the longer period a verdict taken again
        chose (``_decide``): the gather in flight lands first (as at a check,
        ``_to_undecided``), the period changes, and the verdict for it is taken from the figures
        timed then; where a check asks for a timed step here, that step decides instead."""
        new, gather_s, period_s, share, floor, chosen_at = self._period_next
        old = self.config.H
        self._land_for_a_verdict()
        # Only once it has landed: a wait that fails leaves the move pending for the retry
        # (``retry_sync`` runs this outer step again), as it leaves the message in flight.
        self._period_next = None
        self._switch_period(new)
        if self._again:  # this outer step is timed: it decides at the new period
            return
        self._again = (f"the period from H={old} to H={new} as weighed at step {chosen_at}", floor)
        self._decide(gather_s, period_s, share, choose_period=False)

    def _weigh_longer(self, latest: float) -> None:
        """--H auto: where the last gathers were there past the period (``latest``, the largest
        arrival figure, over H steps after launch) and a longer period would reach a loss
        ``PERIOD_MARGIN`` sooner at that share, the next outer step is timed and decides again.
        The landing's check cannot ask there once the landing is at H (it moves no later), and
        a landing at H is taken at the outer step, where it weighs nothing. Not where a check
        is asked already, or a longer period chosen."""
        H = self.config.H
        if not self.auto_period or self._again or self._period_next or self._share is None or latest <= H:
            return
        # Once a timed step has kept the period, only a figure risen ``WATCH_RISE`` times over the
        # one that asked asks again: the figures count the run's steps, which run faster while a
        # worker waits on the link, and the timed step prices the probe's (``_decide``), so the
        # same figures would ask every few outer steps. (The run's own step is each worker's, and
        # every worker must ask alike: the figures are the agreed measure here.)
        if self._longer_asked and latest < WATCH_RISE * self._longer_asked:
            return
        if self._better_period(latest / H) is not None:
            self._longer_asked = latest
            self._decide_again(f"the gathers there {latest:.1f} steps after launch, past the period", H)

    def _decide_again(self, why: str, floor: int = 0, weighed: str = "") -> None:
        """The next outer step synchronous, timed after a barrier, deciding again (``_decide``),
        landing no sooner than ``floor``: asked for by the landing's check (``_reweigh``), by
        the synchronous waits (``_watch``) or, under --H auto, by arrival figures past the period
        (``_weigh_longer``). Every worker asks at the same outer step."""
        self._again = (why, floor)
        said = f" ({weighed} at the share measured before)" if weighed else ""
        self.notice(f"sparseloco --overlap auto: {why}{said}; the next outer step is timed and decides again")

    def _to_undecided(self) -> None:
        """This outer step synchronous and timed (``_decide_again``): the gather in flight, where
        one is, lands first with the mean and alpha it was launched with, the replica moving
        with the anchor as at a landing inside the period (``_land_early``), so that the
        synchronous pseudo-gradient is the whole period's progress."""
        self._land_for_a_verdict()
        self.overlap = None

    def _land_for_a_verdict(self) -> None:
        """Before a verdict is taken again (``_to_undecided``, ``_take_next_period``): the gather
        in flight, where one is, lands with the mean and alpha it was launched with (its
        landing's; its figures weigh nothing: the verdict is taken here), and the arrival
        figures start afresh."""
        if self.in_flight.flying:
            self._land_early(reweigh=False, longer=False)
        self._next_landing, self._seen, self._arrival = 0, 0, 0.0

    def _take_next_landing(self) -> None:
        moved, self._next_landing = self._next_landing, 0
        if not moved or moved == self.landing:
            return
        self.notice(
            f"sparseloco: the last gathers arrived later or sooner than they landed; "
            f"landing moved from {self.landing} to {moved} of {self.config.H} steps",
        )
        self.landing = moved
        self.landing_moves += 1

    def _step_s(self) -> float:
        """The median interval between the last H steps' ends (0 before one has ended)."""
        times = self._stepped_at
        return statistics.median(b - a for a, b in itertools.pairwise(times)) if len(times) > 1 else 0.0

    def _restart_timing(self) -> None:
        self._stepped_at.clear()
        self._stepped_at.append(self.clock())

    def _verdict(self, gather_s: float) -> tuple[float, float, float]:
        """--overlap auto: this worker's gather time and the period's compute (H times the median
        interval between the steps before it, so a validation or the first step's start-up
        does not count), and the largest ratio of the two over the workers. Under --H auto the
        largest share of a period of the start-up probe's steps is agreed in the same call, for
        ``_decide`` (``_nominal_share``)."""
        period_s = self._step_s() * self.config.H
        # A worker that timed no step here (it adopted another's state for this sync) has no
        # say: -1 leaves the others' verdict, and where no worker has one, none is taken yet.
        ratio = gather_share(gather_s, period_s) if period_s > 0 else -1.0
        # --H auto: the share of a period of the start-up probe's steps, too, for a move of the
        # period (``_decide``): while a worker waits on a slow link, 4 workers on 2 cores step
        # faster (W1 at 350 kbit/s: 0.65-0.7 s where nosync steps 1.45 s), and a period priced
        # on those steps would be chosen for a gather twice as long as it is.
        probe = self.probe_step_s * self.config.H
        nominal = gather_share(gather_s, probe) if probe > 0 and period_s > 0 else -1.0
        most, self._nominal_share = self.comm.max_scalars([ratio, nominal])
        return gather_s, period_s, most

    def _decide(
        self,
        gather_s: float,
        period_s: float,
        ratio: float,
        at_start: bool = False,
        choose_period: bool = True,
    ) -> None:
        """Take auto's verdict (``plan.gather.weigh_overlap``): overlap where that reaches a loss
        sooner, the gather taking ``ratio`` of the period's compute (the largest over the
        workers) and landing ``LAND_MARGIN`` times its steps later, each step late costing steps
        to a loss; synchronous, the gather shows. Made at the first outer step, or before step 1 where ``--H
        auto`` measured a gather and a step already (``prepare``), so that the first outer step
        of a slow link is not waited for; and again at an outer step ``_decide_again`` asked for
        (``_again``, kept where no worker timed a step, for the outer step that decides
        instead), landing no sooner than its floor and turning overlap on only by
        ``watch_margin``, so that a near tie does not flip a run that was checked. Taken again
        under --H auto, it weighs the period too (``_better_period``; not where
        ``choose_period`` is False: the verdict for a period chosen at an earlier step)."""
        self._start = self._anchor.clone()
        self._start_moved_at = self._no_entries()
        if ratio < 0:  # no worker timed a step: the next outer step is timed instead
            self._restart_timing()
            return
        again, self._again, self._rises = self._again, None, 0
        nominal, self._nominal_share = self._nominal_share, None  # (``_verdict``'s, used once)
        probed, period = False, ""
        if again and choose_period:
            ratio, period_s, probed, period = self._weigh_period(gather_s, period_s, ratio, nominal, again[1])
        H = self.config.H
        whose_steps = " (the start-up probe's steps)" if probed else ""
        tau = max(again[1], hiding_steps(1.0, ratio * H, H)) if again else self.config.tau
        verdict = weigh_overlap(ratio, H, tau=tau)
        if again and verdict.overlap and verdict.sync - verdict.overlapped < watch_margin(H):
            verdict = dataclasses.replace(verdict, overlap=False)  # a near tie stays as it was
        self.overlap, self._share, self._waited, self._watch_level = verdict.overlap, ratio, 0.0, None
        if self.overlap:  # lands once it has arrived, with a margin (or at --tau)
            self.landing = verdict.landing
        lands = f", each gather landing {self.landing} of {H} steps later" if self.overlap else ""
        timed = "at start-up, a gather" if at_start else "the first outer step's gather"
        if again:
            timed = f"again at step {self.step_count}, {again[0]}; a gather"
        whose = "the slowest worker's share" if at_start else "the largest share on any worker"
        taken = (
            f"--overlap auto: {'on' if self.overlap else 'off'} ({timed} took "
            f"{gather_s:.3f} s against {period_s:.2f} s of the period's compute{whose_steps}; {whose} "
            f"{100 * ratio:.1f}%; time to a loss x nosync's: synchronous {verdict.sync:.3f}, "
            f"overlapped {verdict.overlapped:.3f} (landing {verdict.landing} of {H} steps late: "
            f"{100 * verdict.penalty:.0f}% more steps){lands}){period}"
        )
        # The summary keeps the first verdict, and the last of those taken again with their count
        if again and self.decision:
            self.verdicts_again += 1
            self.last_verdict = taken
        else:
            self.decision = taken
        self.notice(f"sparseloco {taken}")
