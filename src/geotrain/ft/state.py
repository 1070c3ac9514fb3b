"""A worker's whole training state as one verifiable blob, split into shared and unique parts.

Exact resume needs everything that decides the next step: the model, the (inner) optimizer, the
sync algorithm's state (DiLoCo's outer parameters and momentum, DreamDDP's schedule and position
in its period, a codec's residuals and warm-start factors), every random generator (the global one
and each data sampler's), and the step with the time spent so far. ``capture`` takes a deep CPU
copy of all of it (the only part of a snapshot on the training thread's critical path); ``encode``
turns it into bytes framed with a magic, a length and a sha256, so a truncated or corrupted blob
is detected before it is used.

Replicas share a lot: right after a synchronisation, synchronous methods hold equal parameters and
optimizer moments on every worker; periodic methods equal parameters (and DiLoCo its anchor and
outer momentum). Each algorithm names the parts that are equal on every worker at a given step
(``SyncAlgorithm.replicated_parts``); only the rest is *unique* and needs protecting on peers. A
lost worker is rebuilt from its unique part (from peers' copies or stripes) and the shared part of
any survivor at the same step, checked against the digests the lost worker recorded.
"""

from __future__ import annotations

import hashlib
import io
import os
import struct
from pathlib import Path
from typing import Any

import torch

MAGIC = b"GEOSNAP1"
_HEADER = struct.Struct("<8sQ32s")  # magic, payload length, sha256 of the payload
PARTS = ("model", "optimizer", "sync", "codec", "rng", "progress")


class CorruptSnapshot(ValueError):
    """A snapshot blob that is truncated or fails its checksum."""


def clone_tree(obj: Any, into: Any = None) -> Any:
    """A deep copy in which every tensor is a CPU tensor (the device-to-host copy).

    Tensors are copied into ``into``'s where it has a tensor of the same shape and dtype at the
    same place (an earlier copy no longer in use): fresh memory costs a page fault per 4 KB, which
    on a shared CPU costs more than the copy itself."""
    if isinstance(obj, torch.Tensor):
        src = obj.detach()
        if isinstance(into, torch.Tensor) and into.shape == src.shape and into.dtype == src.dtype:
            return into.copy_(src)
        return src.to("cpu", copy=True)
    if isinstance(obj, dict):
        into = into if isinstance(into, dict) else {}
        return {k: clone_tree(v, into.get(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        into = into if isinstance(into, (list, tuple)) and len(into) == len(obj) else [None] * len(obj)
        out = [clone_tree(v, w) for v, w in zip(obj, into, strict=True)]
        return out if isinstance(obj, list) else tuple(out)
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
        t = t.detach().to("cpu").contiguous()
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def encode(obj: Any) -> memoryview:
    """``obj`` (tensors, dicts, lists, numbers, strings) as framed, checksummed bytes.

    Serialised once, in place behind its header: a snapshot of hundreds of MB is not copied again
    (the buffer is returned as a view; ``bytes(view)`` when a copy is needed)."""
    buf = io.BytesIO()
    buf.write(bytes(_HEADER.size))
    # Protocol 4 pickles ``bytes`` as they are; torch's default (2) inflates them 1.5x via latin-1.
    torch.save(obj, buf, pickle_protocol=4)
    view = buf.getbuffer()
    payload = view[_HEADER.size :]
    view[: _HEADER.size] = _HEADER.pack(MAGIC, len(payload), hashlib.sha256(payload).digest())
    return view


def decode(blob: bytes | memoryview, what: str = "snapshot") -> Any:
    """The object ``encode`` framed; ``CorruptSnapshot`` if it is truncated or fails its checksum."""
    blob = memoryview(blob)
    if len(blob) < _HEADER.size:
        raise CorruptSnapshot(f"{what} is truncated ({len(blob)} bytes, no header)")
    magic, length, digest = _HEADER.unpack(blob[: _HEADER.size])
    if magic != MAGIC:
        raise CorruptSnapshot(f"{what} is not a geotrain snapshot (bad magic)")
    payload = blob[_HEADER.size :]
    if len(payload) != length:
        raise CorruptSnapshot(f"{what} is truncated ({len(payload)} of {length} bytes)")
    if hashlib.sha256(payload).digest() != digest:
        raise CorruptSnapshot(f"{what} fails its checksum")
    return torch.load(io.BytesIO(payload), weights_only=False)


def verify(blob: bytes | memoryview) -> bool:
    """Whether the blob's length and checksum are right (without unpickling it)."""
    blob = memoryview(blob)
    if len(blob) < _HEADER.size:
        return False
    magic, length, digest = _HEADER.unpack(blob[: _HEADER.size])
    payload = blob[_HEADER.size :]
    return magic == MAGIC and len(payload) == length and hashlib.sha256(payload).digest() == digest


def write_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary file in the same folder, fsync, then rename: readers never see half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
    reuse: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A deep CPU copy of everything the next step depends on, with the names of the parts that
    are equal on every worker at this step (``replicated``) and a digest of each of those.

    ``reuse``: an earlier capture nobody reads any more, whose tensors are overwritten."""
    sync_state = sync.state_dict()
    codec_state = sync_state.pop("codec", None)
    old = (reuse or {}).get("parts", {})
    parts = {
        "model": clone_tree(model.state_dict(), old.get("model")),
        "optimizer": clone_tree(optimizer.state_dict(), old.get("optimizer")),
        "sync": clone_tree(sync_state, old.get("sync")),
        "codec": clone_tree(codec_state, old.get("codec")),
        "rng": {
            "torch": torch.get_rng_state(),
            **({"cuda": torch.cuda.get_rng_state_all()} if torch.cuda.is_available() else {}),
            **{name: g.get_state() for name, g in generators.items()},
        },
        "progress": dict(progress, step=step),
    }
    shared = sorted(p for p in replicated if p in parts)
    return {
        "step": step,
        "parts": parts,
        "shared": shared,
        "shared_digest": {p: tensor_digest(parts[p]) for p in shared},
    }


def split(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(shared, unique): the parts every worker holds equal at this step, and the rest."""
    shared = {p: state["parts"][p] for p in state["shared"]}
    unique = {
        "step": state["step"],
        "shared": state["shared"],
        "shared_digest": state["shared_digest"],
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
    return {
        "step": unique["step"],
        "parts": parts,
        "shared": unique["shared"],
        "shared_digest": unique["shared_digest"],
    }


def restore(
    state: dict[str, Any],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    sync: Any,
    generators: dict[str, torch.Generator],
) -> dict[str, Any]:
    """Load a captured state into live objects; returns its ``progress`` record."""
    parts = state["parts"]
    model.load_state_dict(parts["model"])
    optimizer.load_state_dict(parts["optimizer"])
    sync_state = dict(parts["sync"])
    if parts["codec"] is not None:
        sync_state["codec"] = parts["codec"]
    sync.load_state_dict(sync_state)
    torch.set_rng_state(parts["rng"]["torch"])
    if "cuda" in parts["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(parts["rng"]["cuda"])
    for name, g in generators.items():
        g.set_state(parts["rng"][name])
    return parts["progress"]
