"""Bucketing: many small tensors travel as a few flat messages.

One all-reduce per tensor pays the link's latency per tensor; one for the whole model cannot
start until the last gradient exists. Buckets of a few MB in backward order (DDP's choice) give
both few messages and overlap. ``reduce_tensors`` averages a list of tensors with all buckets in
flight at once, which is how periodic (parameter) averaging is pipelined.
"""

from __future__ import annotations

from collections.abc import Sequence

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
    return _flatten_dense_tensors(list(tensors))


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    for dst, src in zip(tensors, _unflatten_dense_tensors(flat, list(tensors)), strict=True):
        dst.copy_(src)


class Pending:
    """A mean in flight. ``wait()`` finishes it and writes the mean into the tensors it was taken of."""

    def __init__(self, finish) -> None:
        self._finish = finish
        self._done = False

    def wait(self) -> None:
        if not self._done:
            self._finish()
            self._done = True


def mean_async(comm: Communicator, tensors: Sequence[torch.Tensor]) -> Pending:
    """Launch the plain (uncompressed) mean of ``tensors`` as one flat all-reduce."""
    handle = comm.all_reduce(flatten(tensors), op="mean", async_op=True)
    return Pending(lambda: unflatten_into(handle.wait(), tensors))


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
    for message in pending:
        message.wait()
