"""Bucketing: many small tensors travel as a few flat messages.

One all-reduce per tensor pays the link's latency per tensor; one for the whole model cannot
start until the last gradient exists. Buckets of a few MB in backward order (DDP's choice) give
both few messages and overlap. ``reduce_tensors`` averages a list of tensors with all buckets in
flight at once, which is how periodic (parameter) averaging is pipelined.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Reversible, Sequence
from typing import Any

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from geotrain.comm.communicator import Communicator

DEFAULT_BUCKET_MB = 4.0


def make_buckets(tensors: Sequence[torch.Tensor], cap_mb: float = DEFAULT_BUCKET_MB) -> list[list[int]]:
    """Group tensor indices, in the given order, into buckets of at most ``cap_mb`` (>= 1 tensor each)."""
    if cap_mb <= 0:
        raise ValueError(f"bucket cap must be > 0 MB, got {cap_mb}")
    cap = cap_mb * 2**20
    buckets: list[list[int]] = []
    size = 0.0
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        if buckets and size + nbytes <= cap and t.dtype == tensors[buckets[-1][0]].dtype:
            buckets[-1].append(i)
            size += nbytes
        else:
            buckets.append([i])
            size = nbytes
    return buckets


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors as one flat tensor: a new one, but one contiguous tensor flattens to a view of
    itself (a collective run on it in place then writes the tensor directly)."""
    return _flatten_dense_tensors(list(tensors))


def flat_copy(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``flatten``, always a new tensor: for a value kept while the tensors go on changing (a
    message in flight, a replica's parameters at a launch)."""
    flat = flatten(tensors)
    return flat.clone() if len(tensors) == 1 and flat.data_ptr() == tensors[0].data_ptr() else flat


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    for dst, src in zip(tensors, _unflatten_dense_tensors(flat, list(tensors)), strict=True):
        dst.copy_(src)


class Pending:
    """A mean in flight. ``wait()`` finishes it and writes the mean into the tensors it was taken of.

    A mean of two collectives, the second computed from the first (a quantised codec's
    all-gather of the re-quantised shards, PowerSGD's Q), gives the part up to launching the
    second as ``advance``: ``advance()`` runs it (it waits for the first collective), and leaves
    the second on the link for ``wait()``. Whoever holds several means advances them all before
    waiting for any (``wait_all``), so their second collectives queue back to back rather than
    each one waited for before the next is launched; DreamDDP advances its averages before the
    update and waits for each at its layer's next forward. After ``advance`` a codec's ``wait``
    issues no collective (a checked plain mean may take its mean again in the wait: DreamDDP
    lands a checked codec's averages at once). ``abandon``: what to undo when a failure leaves
    the mean unfinished (a left-out copy's error feedback, ``Codec.reduce``).
    """

    def __init__(
        self,
        finish: Callable[[], None],
        advance: Callable[[], None] | None = None,
        abandon: Callable[[], None] | None = None,
    ) -> None:
        self._finish = finish
        self._advance = advance
        self._abandon = abandon
        self._done = False

    @property
    def advanced(self) -> bool:
        """Whether its second collective (if it has one) is launched: ``wait`` issues none."""
        return self._advance is None or self._done

    def advance(self) -> None:
        if self._advance is not None and not self._done:
            self._advance()
            self._advance = None  # once it succeeded: a failed one is not half done

    def wait(self) -> None:
        if not self._done:
            self.advance()
            self._finish()
            self._done = True

    def abandon(self) -> None:
        if not self._done and self._abandon is not None:
            self._abandon()
        self._done = True


def wait_all(pending: Sequence[Pending]) -> None:
    """Finish ``pending`` in order, every one advanced (its second collective launched) before
    the first is waited for to the end. A failure abandons the ones left unfinished."""
    try:
        for message in pending:
            message.advance()
        for message in pending:
            message.wait()
    except BaseException:
        for message in pending:
            message.abandon()
        raise


def advance_behind(
    launched: Reversible[Any], depth: int, pending: Callable[[Any], Pending] = lambda m: m
) -> None:
    """Before the next message is launched under backward, advance the one launched ``depth``
    launches before it (``plan.cost.ADVANCE_DEPTH``; ``launched`` in launch order, each entry's
    mean given by ``pending``): its first
    phase has had some of backward to finish under, and its second goes out under the rest,
    not all of them after backward. A fixed one, not any found finished: every worker must
    issue its collectives in one order, and the order of launches is the backward's, the same
    everywhere (``ssgd``'s buckets, ``ddp``'s codec hook, DreamDDP's layers;
    ``plan.cost.advanced_under_backward`` prices it)."""
    behind = next(itertools.islice(reversed(launched), depth - 1, None), None)
    if behind is not None:
        pending(behind).advance()


def mean_async(comm: Communicator, tensors: Sequence[torch.Tensor]) -> Pending:
    """Launch the plain (uncompressed) mean of ``tensors`` as one flat all-reduce. Where it may
    be taken again (checked, or leaving a copy out: the redo is a collective) it is waited for
    by ``advance``, with the other collectives, not later by ``wait``."""
    handle = comm.all_reduce(flatten(tensors), op="mean", async_op=True)
    if not comm.screening:
        return Pending(lambda: unflatten_into(handle.wait(), tensors))
    mean: list[torch.Tensor] = []
    return Pending(lambda: unflatten_into(mean.pop(), tensors), lambda: mean.append(handle.wait()))


def reduce_tensors(
    comm: Communicator,
    tensors: Sequence[torch.Tensor],
    cap_mb: float = DEFAULT_BUCKET_MB,
    codec=None,
    key: str = "",
) -> None:
    """Average ``tensors`` in place, every bucket launched before the first is waited for.

    With a ``codec`` (``geotrain.compress``), each bucket's mean is taken compressed, its stream
    named ``(key, bucket index)`` for the codec's error feedback.
    """
    if comm.world_size == 1 or not tensors:
        return
    tensors = list(tensors)
    pending = []
    for b, idx in enumerate(make_buckets(tensors, cap_mb)):
        group = [tensors[i] for i in idx]
        pending.append(codec.reduce(comm, (key, b), group) if codec is not None else mean_async(comm, group))
    wait_all(pending)
