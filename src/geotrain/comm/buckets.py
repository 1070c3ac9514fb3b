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


def reduce_tensors(
    comm: Communicator,
    tensors: Sequence[torch.Tensor],
    cap_mb: float = DEFAULT_BUCKET_MB,
    op: str = "mean",
    codec=None,
    key: str = "",
) -> None:
    """All-reduce ``tensors`` in place, every bucket launched before the first is waited for.

    With a ``codec`` (``geotrain.compress``), each bucket's mean is taken compressed, its stream
    named ``(key, bucket index)`` for the codec's error feedback.
    """
    if comm.world_size == 1 or not tensors:
        return
    tensors = list(tensors)
    if codec is not None:
        if op != "mean":
            raise ValueError("a codec averages; op must be 'mean'")
        messages = [
            codec.reduce(comm, (key, b), [tensors[i] for i in idx])
            for b, idx in enumerate(make_buckets(tensors, cap_mb))
        ]
        for message in messages:
            message.wait()
        return
    pending = []
    for idx in make_buckets(tensors, cap_mb):
        group = [tensors[i] for i in idx]
        pending.append((group, comm.all_reduce(flatten(group), op=op, async_op=True)))
    for group, handle in pending:
        unflatten_into(handle.wait(), group)
