"""A worker's whole training state as one verifiable blob, split into shared and unique parts.

Exact resume needs everything that decides the next step: the model, the (inner) optimizer, the
sync algorithm's state (DiLoCo's outer parameters and momentum, DreamDDP's schedule and position
in its period, a codec's residuals and warm-start factors), every random generator (the global one
and each data sampler's), and the step with the time spent so far. ``capture`` takes a deep CPU
copy of all of it (the only part of a snapshot on the training thread's critical path); ``encode``
turns it into bytes framed with a magic, a length and a checksum, so a truncated or corrupted
blob is detected before it is used: a sha256 where equal headers must mean equal bytes (the
hand-over's stripes, ``ft/handover.py``), a CRC32 on the snapshots a worker takes every period
(``encode_to_memfd``), where a sha256 of ``mini``'s 131 MB state took 1.7 s of a background
thread and slowed the next step of every worker sharing the cores.

Replicas share a lot: right after a synchronisation, synchronous methods hold equal parameters and
optimizer moments on every worker; periodic methods equal parameters (and DiLoCo its anchor and
outer momentum). Each algorithm names the parts that are equal on every worker at a given step
(``SyncAlgorithm.replicated_parts``); only the rest is *unique* and needs protecting on peers. A
lost worker is rebuilt from its unique part (from peers' copies or stripes) and the shared part of
any survivor at the same step, checked against the digests the lost worker recorded.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import mmap
import os
import struct
import sys
import zlib
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch

from geotrain.compress.codec import shared_entries

MAGIC = b"GEOSNAP1"  # the checksum is the payload's sha256
MAGIC_CRC = b"GEOSNAP2"  # the checksum is the payload's CRC32 (little-endian, zero-padded)
_HEADER = struct.Struct("<8sQ32s")  # magic, payload length, checksum of the payload
HEADER_BYTES = _HEADER.size
PARTS = ("model", "optimizer", "sync", "codec", "codec_shared", "own", "rng", "progress")
# What a joiner may get: never codec residuals, but the codec's entries every worker should hold
# equal ("codec_shared": ACP-SGD's turn, low-rank factors, a warm-up's count). A part of their
# own, never counted as equal: a sync redone on one survivor and met by another from its own
# step counts a message twice on the first, which sends nothing different past a warm-up.
HANDED_OVER = ("model", "optimizer", "sync", "codec_shared")


def _checksum(magic: bytes, payload: memoryview) -> bytes:
    """The header's checksum field for ``payload`` under ``magic``; both release the GIL."""
    if magic == MAGIC_CRC:
        return zlib.crc32(payload).to_bytes(4, "little") + bytes(28)
    return hashlib.sha256(payload).digest()


def handed_over(shared_optimizer: bool) -> list[str]:
    """The parts a joiner gets from the members (``ft/elastic.py``; a host a resume rebuilds, in
    ``ft/snapshots.py``): the optimizer only where every worker's is the same (S-SGD, DDP), since
    under the local methods each worker's inner optimizer is its own."""
    return [p for p in HANDED_OVER if p != "optimizer" or shared_optimizer]


class CorruptSnapshot(ValueError):
    """A snapshot blob that is truncated or fails its checksum."""


def clone_tree(obj: Any) -> Any:
    """A deep copy in which every tensor is a fresh CPU tensor (the device-to-host copy)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clone_tree(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(clone_tree(v) for v in obj)
    return obj


def tensor_digest(obj: Any, h: Any = None) -> str:
    """sha256 over the tensors (bytes, dtype, shape) and plain values of a tree, in order."""
    top = h is None
    h = h or hashlib.sha256()
    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu").contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, dict):
        for k in obj:
            h.update(repr(k).encode())
            tensor_digest(obj[k], h)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            tensor_digest(v, h)
    else:
        h.update(repr(obj).encode())
    return h.hexdigest() if top else ""


def param_digest(model: torch.nn.Module) -> str:
    """sha256 of the model's parameters and buffers in state-dict order: equal iff bitwise equal."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        _hash_tensor(h, t)
    return h.hexdigest()


def tensors_digest(tensors: list[torch.Tensor]) -> str:
    """sha256 of ``tensors`` in order: equal iff bitwise equal (``SyncAlgorithm.shared_state``)."""
    h = hashlib.sha256()
    for t in tensors:
        _hash_tensor(h, t)
    return h.hexdigest()


def entry_digests(model: torch.nn.Module, skip: Collection[str] = ()) -> dict[str, str]:
    """sha256 of each entry of the model's state (its dtype, shape and bytes), by name, but
    those in ``skip``: which entries two workers hold bitwise equal (a hand-over leaves those
    out, ``ft/handover.py``)."""
    return {name: _entry_digest(t) for name, t in model.state_dict().items() if name not in skip}


def _entry_digest(t: torch.Tensor) -> str:
    """sha256 of one tensor: its dtype, shape and bytes."""
    h = hashlib.sha256(f"{t.dtype} {tuple(t.shape)}".encode())
    _hash_tensor(h, t)
    return h.hexdigest()


MIN_LEAF_BYTES = 1024  # smaller tensors of a state go as they are (not worth a digest)


@dataclass(frozen=True)
class Held:
    """A tensor a hand-over leaves out of a part, at ``path`` in its tree: the receiver holds
    it bitwise equal already (``leaf_digests``) and puts its own back (``with_leaves``)."""

    path: tuple


def _leaves(obj: Any, path: tuple = ()):
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif type(obj) in (dict, OrderedDict):
        for k, v in obj.items():
            yield from _leaves(v, (*path, k))
    elif type(obj) in (list, tuple):
        for i, v in enumerate(obj):
            yield from _leaves(v, (*path, i))


def leaf_digests(obj: Any) -> dict[tuple, str]:
    """sha256 of each tensor of a state's tree (its dtype, shape and bytes) of at least
    ``MIN_LEAF_BYTES``, by its path (the keys and indices down to it)."""
    return {
        path: _entry_digest(t) for path, t in _leaves(obj) if t.numel() * t.element_size() >= MIN_LEAF_BYTES
    }


def without_leaves(obj: Any, paths: Collection[tuple], path: tuple = ()) -> Any:
    """``obj`` with the tensors at ``paths`` replaced by ``Held`` markers."""
    if path in paths and isinstance(obj, torch.Tensor):
        return Held(canonical(path))  # (its strings interned: equal states, equal bytes)
    if type(obj) in (dict, OrderedDict):
        return _like(obj, {k: without_leaves(v, paths, (*path, k)) for k, v in obj.items()})
    if type(obj) in (list, tuple):
        return type(obj)(without_leaves(v, paths, (*path, i)) for i, v in enumerate(obj))
    return obj


def map_leaves(obj: Any, fn) -> Any:
    """``obj`` with ``fn`` applied to every leaf of its tree (what is not a dict, list or tuple)."""
    if type(obj) in (dict, OrderedDict):
        return _like(obj, {k: map_leaves(v, fn) for k, v in obj.items()})
    if type(obj) in (list, tuple):
        return type(obj)(map_leaves(v, fn) for v in obj)
    return fn(obj)


def _like(obj: dict, out: dict) -> dict:
    """``out`` as the kind of mapping ``obj`` is (a module's ``OrderedDict`` keeps its versions)."""
    if type(obj) is not OrderedDict:
        return out
    ordered = OrderedDict(out)
    if hasattr(obj, "_metadata"):
        ordered._metadata = obj._metadata  # type: ignore[attr-defined]
    return ordered


def with_leaves(obj: Any, own: Any) -> Any:
    """``obj`` with each ``Held`` marker replaced by a copy of the tensor at its path in ``own``
    (this worker's tree, which holds it bitwise equal to the sender's)."""
    if isinstance(obj, Held):
        t = own
        try:
            for key in obj.path:
                t = t[key]
        except (KeyError, IndexError, TypeError) as e:
            raise CorruptSnapshot(f"a hand-over left out {obj.path}, which this worker lacks") from e
        return t.detach().clone()
    if type(obj) in (dict, OrderedDict):
        return _like(obj, {k: with_leaves(v, own) for k, v in obj.items()})
    if type(obj) in (list, tuple):
        return type(obj)(with_leaves(v, own) for v in obj)
    return obj


def _hash_tensor(h, t: torch.Tensor) -> None:
    t = t.detach().to("cpu").contiguous()
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # (its buffer, not a copy of it)


def canonical(obj: Any) -> Any:
    """``obj`` rebuilt so that equal states pickle to equal bytes on every worker.

    Pickle refers back to an object it has written once (its memo) by identity: an optimizer
    whose state a joiner loaded holds its own copies of the key strings that the original holds
    once, so the same numbers pickled to different bytes, and members could not stripe a hand-over
    (nor a snapshot's replicated part) from each other's copies. Plain containers are rebuilt
    fresh and strings interned; anything else (tensors, numbers) is kept as it is."""
    if type(obj) is str:  # not a subclass: sys.intern refuses those
        return sys.intern(obj)
    if type(obj) is dict:
        return {canonical(k): canonical(v) for k, v in obj.items()}
    if type(obj) is OrderedDict:  # a module's state_dict, with the versions its loader reads
        out = OrderedDict((canonical(k), canonical(v)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):
            out._metadata = canonical(obj._metadata)  # type: ignore[attr-defined]
        return out
    if type(obj) is list:
        return [canonical(v) for v in obj]
    if type(obj) is tuple:
        return tuple(canonical(v) for v in obj)
    return obj


@contextlib.contextmanager
def _without_record_crc():
    """``torch.save`` without its CRC32 of every record: the frames here carry their own checksum
    (a CRC32 or a sha256 over the whole payload), and torch's, taken on the training thread, cost
    as much as the copy itself. torch's setting is per thread; this thread's is restored."""
    saved = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(saved)


def encode(obj: Any) -> memoryview:
    """``obj`` (tensors, dicts, lists, numbers, strings) as framed, checksummed bytes.

    Serialised once, in place behind its header: a snapshot of hundreds of MB is not copied again
    (the buffer is returned as a view; ``bytes(view)`` when a copy is needed)."""
    buf = io.BytesIO()
    buf.write(bytes(_HEADER.size))
    # Protocol 4 pickles ``bytes`` as they are; torch's default (2) inflates them 1.5x via latin-1.
    with _without_record_crc():
        torch.save(canonical(obj), buf, pickle_protocol=4)
    view = buf.getbuffer()
    payload = view[_HEADER.size :]
    view[: _HEADER.size] = _HEADER.pack(MAGIC, len(payload), hashlib.sha256(payload).digest())
    return view


def decode(blob: bytes | memoryview, what: str = "snapshot") -> Any:
    """The object ``encode`` framed; ``CorruptSnapshot`` if it is truncated or fails its checksum."""
    with memoryview(blob) as view, view[_HEADER.size :] as payload:  # released however it ends
        if len(view) < _HEADER.size:
            raise CorruptSnapshot(f"{what} is truncated ({len(view)} bytes, no header)")
        magic, length, digest = _HEADER.unpack(view[: _HEADER.size])
        if magic not in (MAGIC, MAGIC_CRC):
            raise CorruptSnapshot(f"{what} is not a geotrain snapshot (bad magic)")
        if len(payload) != length:
            raise CorruptSnapshot(f"{what} is truncated ({len(payload)} of {length} bytes)")
        if _checksum(magic, payload) != digest:
            raise CorruptSnapshot(f"{what} fails its checksum")
        return torch.load(io.BytesIO(payload), weights_only=False)


def verify(blob: bytes | memoryview) -> bool:
    """Whether the blob's length and checksum are right (without unpickling it)."""
    blob = memoryview(blob)
    if len(blob) < _HEADER.size:
        return False
    magic, length, digest = _HEADER.unpack(blob[: _HEADER.size])
    payload = blob[_HEADER.size :]
    return magic in (MAGIC, MAGIC_CRC) and len(payload) == length and _checksum(magic, payload) == digest


# -- a worker's state ---------------------------------------------------------------------------
def capture(
    *,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    sync: Any,
    generators: dict[str, torch.Generator],
    progress: dict[str, Any],
    replicated: set[str],
    copy: bool = True,
) -> dict[str, Any]:
    """Everything the next step depends on, with the names of the parts that are equal on every
    worker at this step (``replicated``).

    ``copy``: a deep CPU copy; without it the tensors are the live ones, for a caller that
    serialises them at once (``encode_to_memfd``), which is then the only copy."""
    sync_state = sync.state_dict()
    codec_state = sync_state.pop("codec", None)
    own_state = sync_state.pop("own", None)  # this worker's alone besides its codec's (noise.py)
    tree = clone_tree if copy else (lambda obj: obj)
    parts = {
        "model": tree(model.state_dict()),
        "optimizer": tree(optimizer.state_dict()),
        "sync": tree(sync_state),
        "codec": tree(codec_state),
        "codec_shared": tree(shared_entries(codec_state)),  # (a few KB: counters and factors)
        "own": tree(own_state),
        "rng": {
            "torch": torch.get_rng_state(),
            **({"cuda": torch.cuda.get_rng_state_all()} if torch.cuda.is_available() else {}),
            **{name: g.get_state() for name, g in generators.items()},
        },
        "progress": dict(progress, step=step),
    }
    return {"step": step, "parts": parts, "shared": sorted(p for p in replicated if p in parts)}


def split(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(shared, unique): the parts every worker holds equal at this step, and the rest, which
    records a digest of each shared part so a rebuild can check the survivor's against it."""
    shared = {p: state["parts"][p] for p in state["shared"]}
    unique = {
        "step": state["step"],
        "shared": state["shared"],
        "shared_digest": {p: tensor_digest(v) for p, v in shared.items()},
        "parts": {p: v for p, v in state["parts"].items() if p not in state["shared"]},
    }
    return shared, unique


def join(unique: dict[str, Any], shared_from_peer: dict[str, Any]) -> dict[str, Any]:
    """A whole state from a worker's unique part and a peer's shared part at the same step.

    Refuses a peer whose shared parts differ from what the worker recorded (then they were not
    really equal, and the rebuilt state would be wrong)."""
    for p in unique["shared"]:
        got = tensor_digest(shared_from_peer[p])
        if got != unique["shared_digest"][p]:
            raise CorruptSnapshot(f"the peer's '{p}' differs from the lost worker's at step {unique['step']}")
    parts = dict(unique["parts"])
    parts.update({p: shared_from_peer[p] for p in unique["shared"]})
    return {"step": unique["step"], "parts": parts, "shared": unique["shared"]}


# -- zero-copy hand-over to a keeper ------------------------------------------------------------
def new_memfd(name: str, reserve: int = 0) -> int:
    """An anonymous memory file, with ``reserve`` bytes of pages allocated now.

    The pages are zeroed at their first write, and on a virtual machine that hands freed memory
    back to its host (free page reporting) faulted in by the hypervisor too: 229 MB took 0.9-1.6
    s to write here, against 0.1-0.2 s into pages written before. Touching them in advance in a
    background thread only moved that CPU time into the next step (measured: 4.1 s against 2.4),
    so after the first few snapshots a worker writes into the pages of one its keeper let go
    (``ft.keeper``'s recycling) and fresh pages are not needed."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    if reserve:
        os.posix_fallocate(fd, 0, reserve)
    return fd


def encode_to_memfd(obj: Any, name: str, fd: int | None = None) -> tuple[int, int]:
    """Serialise ``obj`` into an anonymous memory file (``fd``, else a new one), behind a blank
    header: (fd, size).

    The serialisation is the only copy of the state: the file's pages are what a keeper will hold
    once it has the descriptor (passed over its Unix socket), so no byte is copied again. The
    header (length, CRC32) is written by ``seal_memfd``, off the training thread. ``fd`` may be
    a file an earlier snapshot was written into (``ft.keeper``'s recycling): it is overwritten."""
    fd = new_memfd(name) if fd is None else fd
    os.lseek(fd, 0, os.SEEK_SET)  # a recycled file's offset is where its last writer stopped
    with os.fdopen(os.dup(fd), "wb") as f:
        f.write(bytes(_HEADER.size))
        with _without_record_crc():
            torch.save(canonical(obj), f, pickle_protocol=4)
        size = f.tell()
    os.ftruncate(fd, size)  # pages reserved beyond the snapshot go back
    return fd, size


def seal_memfd(fd: int, size: int) -> None:
    """Write the header (magic, length, CRC32 of the payload) into a file from ``encode_to_memfd``."""
    with mmap.mmap(fd, size) as mm, memoryview(mm) as view:
        digest = _checksum(MAGIC_CRC, view[_HEADER.size :])
        view[: _HEADER.size] = _HEADER.pack(MAGIC_CRC, size - _HEADER.size, digest)


def decode_memfd(fd: int, size: int, what: str = "snapshot") -> Any:
    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mm:
        return decode(mm, what)


def sync_state_of(parts: dict[str, Any]) -> dict[str, Any]:
    """The algorithm's state from a captured state's parts, with the codec's (this worker's own,
    or, handed over, only the entries every worker holds equal; a snapshot taken before those
    were saved apart has none) and its own sample where the parts hold them."""
    sync_state = dict(parts["sync"])
    for part in ("codec", "codec_shared", "own"):
        if parts.get(part) is not None:
            sync_state[part] = parts[part]
    return sync_state


def restore(
    state: dict[str, Any],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    sync: Any,
    generators: dict[str, torch.Generator],
) -> dict[str, Any]:
    """Load a captured state into live objects; returns its ``progress`` record.

    A state another worker handed over (``ft.snapshots.admitted_state``: no optimizer where each
    worker's is its own, no codec residuals, no random streams) leaves those parts as they are,
    and the algorithm drops what belonged to that worker alone."""
    parts = state["parts"]
    model.load_state_dict(parts["model"])
    if "optimizer" in parts:
        optimizer.load_state_dict(parts["optimizer"])
    sync.load_state_dict(sync_state_of(parts))
    if state.get("admitted"):
        sync.adopted_state()
    if "rng" in parts:
        torch.set_rng_state(parts["rng"]["torch"])
        if "cuda" in parts["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(parts["rng"]["cuda"])
        for name, g in generators.items():
            g.set_state(parts["rng"][name])
    return parts["progress"]
