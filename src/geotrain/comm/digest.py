"""Collision-resistant digests of a tensor's bytes, wherever the tensor lives.

Workers compare digests instead of tensors: the second owners of a quantised codec's shard
(``compress/owners.py``) digest the rows each copy was computed from, and
``Communicator.same_everywhere`` digests a replica. Each digest is BLAKE3 (a well-kept
library, multi-threaded on large inputs). A GPU tensor reaches the host through a small pinned
buffer, a chunk at a time, instead of one pageable ``.cpu()`` copy of the whole.

Why, measured on an H200's host on 64 MiB: a pageable
``.cpu()`` took 44 ms and a copy into pinned memory 1.2 ms; ``hashlib.blake2b`` hashed it in
116 ms and BLAKE3 in 14 ms on one thread, 1.1 ms on the machine's 16. With pageable copies and
BLAKE2b, ``int4:owners=2``'s two digests per message cost 318 ms for a 124M-parameter model over
8 workers, 50 times the quantiser's own work; 11 ms now (``benchmarks/gpu_codec_cost.py``).

Every worker of a run must digest with this same function: its bytes are compared across
workers, so it has no fallback that could hash differently.
"""

from __future__ import annotations

import threading

import blake3
import torch

# the pinned buffer a GPU tensor is copied through, a chunk at a time
CHUNK_BYTES = 16 * 2**20
# below this many bytes one thread hashes faster than a pool starts
THREADED_FROM = 2**20

_pinned: torch.Tensor | None = None
_pinned_lock = threading.Lock()  # one buffer per process; a codec's gathers can finish on threads


def bytes_digest(tensor: torch.Tensor, size: int = 32, extra: bytes = b"") -> bytes:
    """``size`` bytes of BLAKE3 over ``tensor``'s bytes in row-major order (a strided view as
    its contiguous copy), then ``extra``. The same bytes give the same digest on any device, and
    on any number of threads (BLAKE3 is a tree hash)."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    threads = blake3.blake3.AUTO if data.numel() >= THREADED_FROM else 1
    hasher = blake3.blake3(max_threads=threads)
    if data.device.type == "cpu":
        hasher.update(data.numpy())  # its buffer, no copy
    else:
        _hash_through_pinned(hasher, data)
    hasher.update(extra)
    return hasher.digest(length=size)


def _hash_through_pinned(hasher: blake3.blake3, data: torch.Tensor) -> None:
    global _pinned
    with _pinned_lock:
        if _pinned is None:
            try:
                _pinned = torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True)
            except RuntimeError:  # no page-locked memory to be had (a low ulimit -l): pageable
                _pinned = torch.empty(CHUNK_BYTES, dtype=torch.uint8)
        for start in range(0, data.numel(), CHUNK_BYTES):
            part = data[start : start + CHUNK_BYTES]
            host = _pinned[: part.numel()]
            host.copy_(part)  # blocking: the bytes are on the host when it returns
            hasher.update(host.numpy())
