"""Room on disk for what a run writes, checked before any process starts.

A run writes each host's final state (model, optimizer, the algorithm's own copies) under
``RUN_DIR/snapshots`` and the final ``checkpoint.pt``; a run that stops unfinished has every
keeper write the two newest states it holds. Where the disk fills instead, the trained model is
lost at the last step: a run of GPT ``mini`` here trained its 43 steps, then died writing its
checkpoint in a chain of ``No space left on device`` tracebacks. So the launcher estimates those
bytes from the model's parameter count and refuses to start without room for a finished run's,
and warns where a stopped run's would not fit.

The estimate counts fp32 copies of the parameters in one state: the model, AdamW's two moments,
and what the algorithm and its codec keep (measured on GPT ``mini``: 3.0 copies for ``nosync``
and ``dreamddp``, 4.8 for ``diloco --compress none``, 6.0 for ``diloco`` with int4, its
default). With LoRA the optimizer and the algorithm hold the adapters only: the frozen base is
one copy.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from geotrain.compress import plain_spec
from geotrain.metrics import format_bytes

# fp32 copies of the model an algorithm keeps besides the parameters and the optimizer's moments
ALGORITHM_COPIES = {"diloco": 2, "sparseloco": 2, "streaming": 3, "co2": 3, "demo": 1}
KEEP = 2  # the states each keeper writes where a run stops unfinished (``Keeper.persist``)


@dataclass(frozen=True)
class DiskNeed:
    state_bytes: int  # one host's state
    hosts: int
    periodic: bool = False  # --checkpoint-every: the keepers keep two states each on disk

    @property
    def finished(self) -> int:
        """A finished run: each host's final state (and the one before, with --checkpoint-every)
        and the checkpoint."""
        return self.state_bytes * ((KEEP if self.periodic else 1) * self.hosts + 1)

    @property
    def stopped(self) -> int:
        """A run stopped unfinished: the keepers' two newest states per host, and a checkpoint."""
        return self.state_bytes * (KEEP * self.hosts + 1)


def state_copies(algo: str, compress: str = "", lora: bool = False, bits: int = 0) -> float:
    """fp32 copies of the parameters in one host's saved state (``bits``: co2's or streaming's,
    0 its default)."""
    if lora:
        return 1.0
    copies = 3 + ALGORITHM_COPIES.get(algo, 0)
    if algo == "co2":
        from geotrain.sync.co2 import CO2Config

        copies += 1  # where the period started
        if (bits or CO2Config.bits) < 32:  # its error feedback; its message an eighth
            copies += 0.125
    if algo == "streaming":
        from geotrain.sync.streaming import StreamingConfig

        if (bits or StreamingConfig.bits) < 32:  # each fragment's error feedback
            copies += 1
        default = StreamingConfig()
        if default.carry:  # the fragment in flight at its launch
            copies += 1 / default.fragments
    if not compress:  # the algorithm's default: dreamddp's chooses one (--compress auto)
        from geotrain.sync import ALGORITHMS

        compress = getattr(ALGORITHMS[algo][1](), "compress", "") if algo in ALGORITHMS else ""
    if plain_spec(compress):
        copies += 1  # the codec's error-feedback residual
        if algo == "dreamddp":
            copies += 1  # each layer's reference point for the codec's deltas
    return float(copies)


def disk_need(
    n_params: int,
    hosts: int,
    algo: str,
    compress: str = "",
    lora: bool = False,
    periodic: bool = False,
    bits: int = 0,
) -> DiskNeed:
    return DiskNeed(int(4 * n_params * state_copies(algo, compress, lora, bits)), hosts, periodic)


def free_bytes(path: Path) -> int:
    """Free bytes on the disk that holds ``path`` (or would: its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def check_room(run_dir: Path, need: DiskNeed, free: int | None = None) -> str:
    """Raise ``NoRoom`` where a finished run's files would not fit on ``run_dir``'s disk; return a
    warning ('' if none) where those of a run stopped unfinished would not."""
    free = free_bytes(run_dir) if free is None else free
    each = f"a {format_bytes(need.state_bytes)} state for each of {need.hosts} hosts"
    if free < need.finished:
        raise NoRoom(
            f"the disk under {run_dir} has {format_bytes(free)} free, and this run writes about "
            f"{format_bytes(need.finished)} ({each} and the final checkpoint): free some space (old run "
            "directories under runs/) or give --run-dir on another disk"
        )
    if free < need.stopped:
        return (
            f"geotrain: warning: the disk under {run_dir} has {format_bytes(free)} free; a run stopped "
            f"unfinished writes up to {format_bytes(need.stopped)} (the two newest states each keeper "
            "holds), more than fits"
        )
    return ""


def drop_states(run_dir: Path) -> int:
    """Remove a finished run's saved states (``snapshots/`` and ``checkpoint.pt``), keeping its
    metrics and summary; the bytes freed. A benchmark's cells are read from their metrics, and
    their states, 0.6-1.1 GB a cell of GPT ``mini`` on 4 hosts, filled this machine's disk."""
    run_dir = Path(run_dir)
    paths = [run_dir / "checkpoint.pt", *(run_dir / "snapshots").rglob("*")]
    freed = sum(p.stat().st_size for p in paths if p.is_file())
    (run_dir / "checkpoint.pt").unlink(missing_ok=True)
    shutil.rmtree(run_dir / "snapshots", ignore_errors=True)
    return freed


class NoRoom(Exception):
    """Not enough free disk for what the run writes."""
