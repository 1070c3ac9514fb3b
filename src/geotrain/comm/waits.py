"""Waiting on collectives: the ``Handle`` of one in flight, waits that give up once the group
loses a member, and the one line that names a collective that timed out or lost its peer.

With a ``membership`` (``--on-failure continue``), every wait polls it: a collective on a peer
that froze or lost its link never returns (no reset arrives), so once the coordinator publishes
an epoch newer than the one the collective was launched in, the wait is abandoned with
``MembershipChanged`` and the caller regroups. (Newer than at launch, not than now: a wait in
another thread, such as a DDP bucket's, must give up even after the main thread has regrouped.)

A collective that outlasts the process group's timeout (gloo's "Timed out waiting ... for recv")
is raised as ``CollectiveTimeout``: one line naming the collective, its bytes, the links and the
option to change, in place of a traceback from every rank.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from geotrain.ft.membership import MembershipChanged, retire

if TYPE_CHECKING:
    from geotrain.comm.communicator import Communicator

INTERRUPT_POLL = timedelta(milliseconds=50)
NCCL_POLL_S = 0.001


class CollectiveTimeout(Exception):
    """A collective or transfer waited longer than the process group's timeout. Not a
    ``RuntimeError``: the elastic paths that take a failed collective for a lost member must not
    take this one for one (its peers are alive; the link is too slow for the timeout)."""


TIMEOUT_MARK = "waited longer than the collective timeout"


# gloo's words for its own timeout on a transfer, and for a transfer on a connection that an
# earlier timeout closed (DDP's backward surfaces either, by which bucket's all-reduce it reads)
_GLOO_TIMEOUT = ("Timed out waiting", "Application timeout caused pair closure")


def is_timeout(error: BaseException) -> bool:
    """gloo's own timeout on a transfer (not a poll of ``wait_work`` that timed out)."""
    return isinstance(error, RuntimeError) and any(words in str(error) for words in _GLOO_TIMEOUT)


def timeout_message(op: str, nbytes: int | None, workers: int, timeout_s: float, link: str) -> str:
    """One line: which collective, how many bytes, the limit, the links, and what to change."""
    what = f"the {op} of {nbytes:,} bytes" if nbytes is not None else f"a {op}"
    limit = f" of {timeout_s:g} s" if timeout_s else ""
    links = f" on {link}" if link else ""
    return (
        f"{what} among {workers} workers {TIMEOUT_MARK}{limit}{links}: a peer froze or lost its "
        "link, or the link is slower than that allows; raise --timeout-s (0 derives it from the "
        "model and the slowest link)"
    )


def timeout_line(error: BaseException, workers: int, timeout_s: float, link: str) -> str | None:
    """The one line for an error that is a collective's timeout, else None: a
    ``CollectiveTimeout``, one re-raised through a future (PyTorch DDP's backward wraps what a
    comm hook raised in a ``RuntimeError``), or gloo's own where no communicator waited (DDP's
    built-in all-reduce, ``all_gather_object``)."""
    if isinstance(error, CollectiveTimeout):
        return str(error)
    wrapped = re.search(rf"\b(?:the|a) [^\n]*{TIMEOUT_MARK}[^\n]*", str(error))
    if wrapped:
        return wrapped.group(0).strip()
    if is_timeout(error):
        return timeout_message(
            "collective outside geotrain's Communicator (PyTorch DDP's gradient all-reduce, or an "
            "exchange of state)", None, workers, timeout_s, link,
        )  # fmt: skip
    return None


# What gloo and NCCL say when the process at the other end of a connection is gone...
_PEER_GONE = re.compile(r"Connection (?:reset|closed) by peer|Broken pipe|remote process exited")
# ...in a message of theirs: not this host's keeper or store, whose failures say the same words
_BACKEND = re.compile(r"gloo|pair\.cc|NCCL")


def peer_lost_line(error: BaseException, rank: int) -> str | None:
    """One line for a collective that failed because a peer's process or link went away (a
    consequence: the launcher, or whoever watches the hosts, reports the host that failed), else
    None."""
    text = str(error)
    said = _PEER_GONE.search(text) if isinstance(error, RuntimeError) and _BACKEND.search(text) else None
    if said is None:
        return None
    gone = said.group(0)
    return f"host {rank}: a collective failed, a peer gone ({gone}); that peer's failure is reported apart"


def plain_wait(work, timeout: timedelta | None) -> None:
    """``work.wait()`` under ``timeout`` where one is given (gloo, the collective timeout).

    gloo times a send or receive waited on without one by its group's context, which keeps the
    timeout the group was formed under: a regroup's formation bound (``ft.membership``), not
    the collective timeout ``_set_pg_timeout`` gives its collectives afterwards. A hand-over or a
    snapshot share longer than that failed (a 0.85 MB hand-over at 1 Mbit/s, measured)."""
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout)


def wait_work(work, interrupt: Callable[[], bool] | None, timed_waits: bool = True) -> None:
    """``work.wait()``, abandoned with ``MembershipChanged`` once ``interrupt()`` says so.

    A wait with a timeout returns the moment the work completes, so polling costs no latency;
    a timed-out wait leaves the work as it was (gloo). NCCL aborts its communicator when a timed
    wait expires, so on a group with NCCL (``timed_waits`` False) the work is polled instead.
    For a collective: a send or receive is waited on by ``wait_transfers``."""
    if interrupt is None:
        work.wait()
        return
    while True:
        if work.is_completed():
            work.wait()  # its result, or its error
            return
        if not timed_waits:
            time.sleep(NCCL_POLL_S)
        else:
            try:
                work.wait(timeout=INTERRUPT_POLL)
                return
            except RuntimeError:
                if work.is_completed():  # it finished (or failed) as the wait timed out
                    work.wait()  # its result, or its own error
                    return
        if interrupt():
            raise MembershipChanged("the group lost a member while this collective waited")


# A lane keeps about this much of its link's time posted (``wait_transfers``)
WINDOW_S = 1.0
_POSTING = threading.Lock()  # lanes post their transfers from threads of their own


@dataclass
class Unposted:
    """A send or receive not posted yet: its ``post()`` posts it and returns its work. gloo
    sends a message only once its receive is posted, so ``wait_transfers`` posts a lane's
    receives a window at a time (what a transfer abandoned on a retired group leaves on the
    link), and its sends so (what stays pending there, its receives never posted)."""

    post: Callable[[], Any]
    nbytes: int
    receive: bool = True


_DONE, _DROPPED = object(), object()  # in place of a work: waited on; abandoned before posting


class _PostFailed:
    """A transfer whose posting raised: the error, told when its turn to be waited on comes
    (those before it in its lane, which may have arrived, are waited on and kept first)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def wait(self, timeout=None):
        raise self.error


def wait_transfers(
    works: list,
    interrupt: Callable[[], bool] | None,
    timeout: timedelta | None = None,
    lanes: list[int] | None = None,
    done: Callable[[int], None] | None = None,
) -> None:
    """Every point-to-point ``work.wait()``, abandoned with ``MembershipChanged`` once
    ``interrupt()`` says so.

    Not polled like a collective: gloo takes a timed-out wait on a send or receive for a failed
    transfer and closes the group's connections. So threads of their own wait on them plainly
    while this one watches ``interrupt``. Nor can a lost peer's connection error be counted on to
    end them: gloo tells it to the transfers queued on that connection, not to the one whose
    payload it is reading or writing, which waits for the group's timeout (a member killed
    mid-stripe of a joiner's state held the joiner, alive and beating, and every epoch after it
    waited for that joiner to be ready). An abandoned waiter and its works are retired.
    ``timeout``: each wait's (``plain_wait``). ``lanes``: a lane per work (its peer and
    direction; None: the unposted receives in one, the rest in another), each waited in order by a
    thread of its own, so that a transfer stuck on a lost peer does not hide those that
    completed from the others; ``done(i)`` is told as work i's wait returns, also after this
    call was abandoned: the transfers between live peers posted before go on (what a hand-over
    cut short keeps, ``ft/handover.py``).
    An ``Unposted`` transfer is posted by its lane once those before it leave less than
    ``WINDOW_S`` of the lane's rate in flight (measured from its first completion; two at
    first), and none once a member is lost (each lane asks ``interrupt()`` before each post; the
    trainer leaves that group next): a lane that stopped fails the call with
    ``MembershipChanged``, though what it posted completed. ``works`` is changed in place (so
    that what is retired holds no tensor it need not): a work waited on becomes ``_DONE``, one
    whose post failed ``_PostFailed``, one never posted ``_DROPPED``. Posted all at once, a
    hand-over cut short went on over the retired group's connections for as long as it had
    left, under its retry, which asked again for what had not arrived yet
    (``benchmarks/bench_handover_cut.py``: at 300 kbit/s a 1.6 MB part cut 6 s in was held whole
    after 77 s, 1.84 times its bytes sent; in windows, after 45 s, 1.05 times); and a sender's
    chunks whose receives were never posted stayed pending on the retired group until its
    timeout, each holding the whole encoded state (now a window of copies,
    ``Communicator._post``)."""
    if interrupt is None:  # never abandoned: all at once
        works = [w.post() if isinstance(w, Unposted) else w for w in works]
        for i, work in enumerate(works):
            plain_wait(work, timeout)
            if done is not None:
                done(i)
        return
    # (a lane never holds both: a send and a receive of the same peer, each waiting on its own
    # k-th message, would each wait for a receive the other posts only after that)
    lane_of = lanes if lanes is not None else [int(getattr(w, "receive", False)) for w in works]
    by_lane: dict[int, list[int]] = {}
    for i, lane in enumerate(lane_of):
        by_lane.setdefault(lane, []).append(i)
    left = threading.Semaphore(0)
    failed: list[BaseException] = []
    stop_posting = threading.Event()
    sizes = {i: w.nbytes for i, w in enumerate(works) if isinstance(w, Unposted)}  # in windows

    def post(j: int) -> bool:  # (under _POSTING where lanes run) False: it failed
        try:
            works[j] = works[j].post()
            return True
        except Exception as e:  # raised when its turn comes; the lane posts nothing after it
            # (without its traceback, whose frames hold the chunk, a view of the whole state)
            works[j] = _PostFailed(e.with_traceback(None))
            return False

    # Each lane's first two, here and in order (deterministic), even where a member is lost
    # already: what they bring is kept by a retry, and at most they stay pending.
    opened: dict[int, int] = {}
    for i, lane in enumerate(lane_of):
        if i in sizes and 0 <= opened.get(lane, 0) < 2:
            opened[lane] = opened.get(lane, 0) + 1 if post(i) else -1

    def waiter(order: list[int]) -> None:
        posted = in_flight = received = 0  # in the lane: items posted, their bytes pending, bytes in
        since = 0.0  # when its first transfer completed: the rate counts from there
        broken = any(isinstance(works[j], _PostFailed) for j in order)  # a post failed: no more
        try:
            for k, i in enumerate(order):
                while posted < len(order) and not stop_posting.is_set():
                    j = order[posted]
                    if isinstance(works[j], Unposted):
                        rate = received / max(time.monotonic() - since, 1e-6) if received else 0.0
                        if broken or (posted > k and in_flight >= max(2 * sizes[j], rate * WINDOW_S)):
                            break
                        with _POSTING:  # (the caller may regroup before this call's poll)
                            if stop_posting.is_set() or interrupt():
                                stop_posting.set()
                                break
                            broken = not post(j)
                    in_flight += sizes.get(j, 0)
                    posted += 1
                if works[i] is _DROPPED or isinstance(works[i], Unposted):  # never sent:
                    raise MembershipChanged(  # abandoned (told by the caller, or seen here first)
                        "the group lost a member while a point-to-point transfer waited"
                    )
                plain_wait(works[i], timeout)
                in_flight -= sizes.get(i, 0)
                if i in sizes:
                    works[i] = _DONE  # nor kept (its work holds its tensor, a copy or a view)
                    if since:
                        received += sizes[i]
                    else:  # the first: the rate's clock starts
                        since = time.monotonic()
                if done is not None:
                    done(i)
        except BaseException as e:  # the transfer's own error (or its lane's stop), raised by the caller
            failed.append(e)
        finally:
            left.release()

    threads = [
        threading.Thread(target=waiter, args=(order,), name="geotrain-transfers", daemon=True)
        for order in by_lane.values()
    ]
    for thread in threads:
        thread.start()
    finished = 0
    try:
        while finished < len(threads):
            # A lane's error (a lost peer's connection closed) ends that lane only: the others'
            # transfers are waited for, so that a retry keeps what they bring.
            if left.acquire(timeout=INTERRUPT_POLL.total_seconds()):
                finished += 1
                continue
            if interrupt():
                with _POSTING:  # a transfer being posted is posted on this group, none after
                    stop_posting.set()
                retire((threads, works))
                raise MembershipChanged("the group lost a member while a point-to-point transfer waited")
    finally:  # (every way out: nothing is posted after it)
        with _POSTING:
            stop_posting.set()
            for i in range(len(works)):  # nor kept: their tensors may go (a slice of a state pins
                if isinstance(works[i], Unposted):  # the whole state), the works are retired
                    works[i] = _DROPPED
    if failed:  # a lost member first: the regroup's, where a transfer's own error comes with it
        raise next((e for e in failed if isinstance(e, MembershipChanged)), failed[0])


class Handle:
    """An in-flight collective. ``wait()`` blocks, counts the time blocked, and finishes a mean."""

    def __init__(
        self,
        comm: Communicator,
        work,
        tensor,
        divide_by: int,
        launched: float,
        op: str = "",
        nbytes: int = 0,
        finish: Callable[[], None] | None = None,
        transfer: bool = False,
        timeout: timedelta | None = None,
    ):
        # A send or receive: waited on as ``wait_transfers`` does (never a timed poll, which
        # gloo takes for a failed transfer), with its timeout (``plain_wait``)
        self._transfer, self._timeout = transfer, timeout
        self._comm = comm
        self._finish = finish  # what turns the collective's output into the result (a robust mean)
        self._op, self._nbytes = op, nbytes
        # One collective, or several (an uneven gather is one broadcast per worker).
        self._works = [w for w in (work if isinstance(work, list) else [work]) if w is not None]
        self._tensor = tensor
        self._divide_by = divide_by
        self._launched = launched
        self._done = False
        self._interrupt = comm.interrupt_after_now()
        # A checked mean whose verdict left a contribution out takes the mean again. Where the
        # wait runs on a thread of its own (DDP's buckets), a collective issued there could
        # cross the backward's next launches in another order on another worker: with
        # ``defer_redo`` the mean is left in ``redo``, for the training thread to call.
        self.defer_redo = False
        self.redo: Callable[[], torch.Tensor] | None = None

    @property
    def tensor(self) -> torch.Tensor:
        return self._tensor

    def is_completed(self) -> bool:
        """Done, as ``wait`` would see it: every work completed and the emulated latency
        (``min_collective_s``) past."""
        if self._done:
            return True
        if time.perf_counter() < self._launched + self._comm.min_collective_s:
            return False
        return all(w.is_completed() for w in self._works)

    def wait(self) -> torch.Tensor:
        if self._done:
            return self._tensor
        start = time.perf_counter()
        with self._comm.naming_timeouts(self._op, self._nbytes):
            if self._transfer:
                wait_transfers(self._works, self._interrupt, self._timeout)
            else:
                for work in self._works:
                    wait_work(work, self._interrupt, not self._comm.nccl)
        remaining = self._launched + self._comm.min_collective_s - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        self._comm.stats.blocked_s += time.perf_counter() - start
        if self._finish is not None:
            self._finish()
        if self._divide_by > 1:
            self._tensor.div_(self._divide_by)
        self._done = True
        return self._tensor
