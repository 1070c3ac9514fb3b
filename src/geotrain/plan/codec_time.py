"""A codec's compute, timed per layer: what its encoding and decoding add to a step.

The link's line (``plan.profile``) prices the bytes a codec puts on the wire, not the work of
making them: int4 on W1's ``mini`` (11M parameters, 4 workers on 2 cores) spends about 0.4 s of
CPU per step quantising, averaging the decoded rows, quantising the mean again and decoding what
is gathered, about a quarter of the step, and a plan that leaves it out is that much too fast.

``time_codec`` runs the codec's own ``reduce`` on each layer's shapes against an
``EchoCommunicator``: a stand-in for ``world_size`` identical replicas whose collectives return
at once with what every replica would have sent, so every encode, decode and mean a worker of a
real group does is done, and nothing waits on a link. Every worker times at once after a barrier
(``plan.profile.build_profile``), so the time is the one a run's workers see, sharing what they
share. The cost model adds it to the step as compute (``cost.ComputeModel.codec_s``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from geotrain.comm.communicator import Communicator, Handle


class EchoCommunicator(Communicator):
    """Rank 0 of ``world_size`` identical replicas, whose collectives finish at once: a mean is
    the tensor; an all-to-all returns row 0 from each of them; a gather, ``world_size`` copies,
    which is right where every replica sends the same and, for a part that depends on the rank
    (a quantised codec's shard of the mean), rank 0's part in every place: the same work, not
    the same values. For timing what a codec computes; nothing is counted as sent."""

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"an echo of replicas needs world_size >= 1, got {world_size}")
        super().__init__()
        self.world_size, self.rank, self.distributed = world_size, 0, False

    def _done(self, tensor, async_op: bool, divide_by: int = 1):
        handle = Handle(self, None, tensor, divide_by, time.perf_counter())
        return handle if async_op else handle.wait()

    def all_reduce(self, tensor, op="mean", async_op=False):
        tensor.mul_(self.world_size)  # the sum over identical replicas
        return self._done(tensor, async_op, self.world_size if op == "mean" else 1)

    def all_to_all(self, tensor, async_op=False, control_bytes=0):
        # Part j goes to worker j: rank 0 gets every replica's part 0, its own
        rows = tensor.reshape(self.world_size, -1)[:1].expand(self.world_size, -1)
        return self._done(rows.reshape(tensor.shape).clone(), async_op)

    def all_gather(self, tensor, async_op=False, control_bytes=0):
        copies = tensor.unsqueeze(0).expand(self.world_size, *tensor.shape).clone()
        return self._done(copies, async_op)

    def all_gather_uneven(self, tensor, sizes, async_op=False):
        # Each replica's part cut or padded to the size it announced.
        parts = [torch.cat([tensor, tensor.new_zeros(max(0, s - tensor.numel()))])[:s] for s in sizes]
        return self._done(parts, async_op)

    def compare_shards(self, shards, second, offset, same_inputs):
        return []  # the copies of a shard (owners=2) are compared, not counted: echoes differ

    def probe_broadcast_s(self, nbytes: int) -> list[float]:
        return [1.0] * self.world_size  # equal links: an adaptive codec sends its mean ratio

    def broadcast(self, tensor, src=0):
        return tensor

    def barrier(self) -> None:
        pass


def time_codec(
    spec: str,
    layer_shapes: Sequence[Sequence[tuple[int, ...]]],
    world_size: int,
    reps: int = 2,
    device: torch.device | str = "cpu",
    barrier: Callable[[], None] | None = None,
) -> list[float]:
    """Seconds one ``reduce`` of the codec ``spec`` takes per layer (one message of the layer's
    parameters, as DreamDDP sends it), among ``world_size`` workers: 1 warm-up (the codec's
    state allocated) and ``reps`` timed, on random values. One layer's state at a time is kept,
    so the memory taken is the largest layer's few copies, not the model's."""
    from geotrain.compress.codec import make_codec

    if reps < 1:
        raise ValueError(f"timing a codec needs at least one timed message (reps >= 1), got {reps}")
    codec = make_codec(spec)  # a bad spec: ConfigError, which says what is accepted
    codec.warmup = 0  # its uncompressed first messages are not what a run sends for long
    comm = EchoCommunicator(world_size)
    cuda = torch.device(device).type == "cuda"
    generator = torch.Generator(device=device).manual_seed(0)
    if barrier is not None:
        barrier()
    out = []
    for i, shapes in enumerate(layer_shapes):
        tensors = [torch.randn(s, generator=generator, device=device) for s in shapes]
        times = []
        for rep in range(reps + 1):
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            codec.reduce(comm, i, tensors).wait()
            if cuda:
                torch.cuda.synchronize(device)
            if rep:
                times.append(time.perf_counter() - start)
        codec.state(i).clear()
        out.append(statistics.fmean(times))
    return out


def codec_key(spec: str) -> str:
    """The spec with every parameter spelled out (but one added later, at its default:
    ``Codec.spec``): ``int4`` and ``int4:block=256,warmup=0`` are one codec, timed once and found
    under one key."""
    from geotrain.compress.codec import make_codec

    return make_codec(spec).spec()
