"""Redundancy across hosts: a worker's unique state, held by its peers' keepers.

A whole host can vanish with its keeper. Its shared state (``ft.state``) is on every survivor;
its unique state must be somewhere else too. Two schemes:

- ``ring``: worker r's unique state is copied whole to the keeper of worker r+1. Memory and bytes
  per worker: 1x its unique state; survives any one lost host (and any set of lost hosts no two
  of which are ring neighbours).
- ``ec:K/N``: the unique state is cut by ``zfec`` (Reed-Solomon over GF(2^8)) into K data and N-K
  parity stripes of 1/K its size, held by the keepers of workers r+1 ... r+N; any K rebuild it.
  Memory and bytes: N/K x; survives N-K lost holders. ``ec:1/1`` is ``ring``; ``ec:2/3`` on four
  workers survives two lost hosts at 1.5x, where two ring copies would cost 2x.

Erasure coding saves memory, not bandwidth, and bandwidth is what our links lack: the pieces
travel after the training step that took the snapshot, on a process group of their own (so they
never reorder training collectives), in chunks paced to ``rate_bps``, and their bytes are counted
by that group's ``Communicator`` apart from training traffic.

Every piece is framed with its own checksum (``ft.state.encode``): a corrupted stripe or copy is
detected and not used, and any K good ones still rebuild.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import torch

from geotrain.compress.codec import ConfigError
from geotrain.ft.state import CorruptSnapshot, decode, encode

CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class Redundancy:
    """K of N pieces rebuild a worker's unique state; piece j lives on worker (owner + 1 + j) % W."""

    k: int
    n: int
    spec: str

    def holders(self, owner: int, world_size: int) -> list[int]:
        return [(owner + 1 + j) % world_size for j in range(self.n)]

    def pieces(self, blob: bytes, owner: int, step: int) -> list[bytes]:
        """The N framed pieces of ``blob``."""
        blob = bytes(blob)
        if self.k == 1 and self.n == 1:
            shares, pad = [blob], 0
        else:
            import zfec.easyfec

            shares = zfec.easyfec.Encoder(self.k, self.n).encode(blob)
            pad = -len(blob) % self.k
        return [
            encode(
                {"owner": owner, "step": step, "index": j, "k": self.k, "n": self.n, "pad": pad, "data": s}
            )
            for j, s in enumerate(shares)
        ]

    def rebuild(self, framed: list[bytes]) -> bytes:
        """The blob from any K good framed pieces; corrupted ones are skipped."""
        good = {}
        for blob in framed:
            try:
                piece = decode(blob, "redundancy piece")
            except CorruptSnapshot:
                continue
            good.setdefault(piece["index"], piece)
        if len(good) < self.k:
            raise CorruptSnapshot(f"{len(good)} good pieces of {self.spec}, {self.k} needed")
        chosen = sorted(good)[: self.k]
        if self.k == 1 and self.n == 1:
            return good[chosen[0]]["data"]
        import zfec.easyfec

        pad = good[chosen[0]]["pad"]
        return zfec.easyfec.Decoder(self.k, self.n).decode([good[j]["data"] for j in chosen], chosen, pad)

    def memory_factor(self) -> float:
        return self.n / self.k


def parse_redundancy(spec: str, world_size: int | None = None) -> Redundancy | None:
    """``off``, ``ring`` or ``ec:K/N`` -> a scheme (None for off); ``ConfigError`` says what is wrong."""
    spec = (spec or "off").strip()
    if spec == "off":
        return None
    if spec == "ring":
        r = Redundancy(1, 1, "ring")
    else:
        m = re.fullmatch(r"ec:(\d+)/(\d+)", spec)
        if not m:
            raise ConfigError(f"--redundancy {spec!r}: accepted: off, ring, ec:K/N (e.g. ec:2/3)")
        k, n = int(m.group(1)), int(m.group(2))
        if not 1 <= k <= n <= 256:
            raise ConfigError(f"--redundancy {spec}: need 1 <= K <= N <= 256, got K={k}, N={n}")
        r = Redundancy(k, n, spec)
    if world_size is not None and r.n > world_size - 1:
        raise ConfigError(
            f"--redundancy {spec} places {r.n} pieces on other workers, but there are only "
            f"{world_size - 1}; use fewer pieces or more workers"
        )
    return r


def exchange(comm, scheme: Redundancy, pieces: list[bytes], rate_bps: float = 0.0) -> list[bytes]:
    """Send piece j to worker rank+1+j and receive the pieces of workers rank-1-j, j < N.

    Every worker calls this with its own pieces at the same point. Returns the received framed
    pieces, ``received[j]`` being owner (rank - 1 - j)'s piece j. Paced to ``rate_bps`` (0: as fast
    as the link goes); bytes are counted on ``comm``.
    """
    rank, world = comm.rank, comm.world_size
    sizes = comm.all_gather(torch.tensor([len(p) for p in pieces], dtype=torch.int64)).tolist()
    received: list[bytes] = []
    for j in range(scheme.n):
        dst, src = (rank + 1 + j) % world, (rank - 1 - j) % world
        out = torch.frombuffer(bytearray(pieces[j]), dtype=torch.uint8)
        inp = torch.empty(sizes[src][j], dtype=torch.uint8)
        for lo in range(0, max(len(out), len(inp)), CHUNK_BYTES):
            t0 = time.perf_counter()
            works = []
            if lo < len(out):
                works.append(comm.send_async(out[lo : lo + CHUNK_BYTES], dst))
            if lo < len(inp):
                works.append(comm.recv_async(inp[lo : lo + CHUNK_BYTES], src))
            for w in works:
                w.wait()
            if rate_bps > 0:
                sent = min(CHUNK_BYTES, max(len(out) - lo, 0))
                time.sleep(max(0.0, sent * 8 / rate_bps - (time.perf_counter() - t0)))
        received.append(inp.numpy().tobytes())
    return received


def send_blob(comm, blob: bytes, dst: int) -> None:
    """Point-to-point: a length then the bytes (used when restoring a lost worker)."""
    comm.send_async(torch.tensor([len(blob)], dtype=torch.int64), dst).wait()
    if blob:
        comm.send_async(torch.frombuffer(bytearray(blob), dtype=torch.uint8), dst).wait()


def recv_blob(comm, src: int) -> bytes:
    n = torch.empty(1, dtype=torch.int64)
    comm.recv_async(n, src).wait()
    if not int(n):
        return b""
    data = torch.empty(int(n), dtype=torch.uint8)
    comm.recv_async(data, src).wait()
    return data.numpy().tobytes()
