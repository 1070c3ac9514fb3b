"""Metrics: per-worker JSON lines, the run summary, and its table.

Each worker appends one JSON object per step to ``metrics/rank{R}.jsonl`` (step, tokens, train
loss, validation loss when evaluated, wall/compute/blocked-communication time, bytes). Rank 0
writes ``summary.json`` with numbers averaged over workers and prints them as a table.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, TextIO

from geotrain.ft.atomic import write_atomic


class MetricsWriter:
    def __init__(self, run_dir: Path | None, rank: int) -> None:
        self._file: TextIO | None = None
        if run_dir is not None:
            path = Path(run_dir) / "metrics" / f"rank{rank}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", buffering=1)  # line-buffered: a crash loses at most a line

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000
    return f"{n:.1f} GB"


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return format(value, spec)


def summary_table(summary: dict[str, Any]) -> str:
    """A two-column table of the run's headline numbers."""
    rows = [
        ("algorithm", f"{summary['algo']} {summary.get('algo_config', '')}".strip()),
        ("model", f"{summary['model']} ({summary['parameters'] / 1e6:.2f}M parameters)"),
        *(
            [("  trained and synced", f"{summary['trainable_parameters']:,} parameters ({summary['lora']})")]
            if summary.get("lora")
            else []
        ),
        ("workers x link", f"{summary['workers']} x {summary['link']}"),
        ("steps / tokens", f"{summary['steps']} / {summary['tokens']:,}"),
        (
            "train loss",
            f"{_fmt(summary['first_train_loss'], '.3f')} -> {_fmt(summary['final_train_loss'], '.3f')}",
        ),
        ("validation loss", _fmt(summary["final_val_loss"], ".4f")),
        ("step time (mean)", f"{_fmt(summary['step_s_mean'], '.3f')} s"),
        ("  compute", f"{_fmt(summary['compute_s_mean'], '.3f')} s"),
        ("  blocked on comm", f"{_fmt(summary['blocked_s_mean'], '.3f')} s"),
        ("tokens/s (all workers)", _fmt(summary["tokens_per_s"], ",.0f")),
        ("sent per step per worker", format_bytes(summary["sent_bytes_per_step"])),
        ("link use (mean)", f"{_fmt(summary['link_mbit_s'], '.1f')} Mbit/s"),
        ("syncs", str(summary["syncs"])),
        *([("codec", summary["codec_info"])] if summary.get("codec_info") else []),
        ("wall time", f"{summary['wall_s']:.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 3 + max(len(v) for _, v in rows))
    body = "\n".join(f"{k:<{width}} | {v}" for k, v in rows)
    return f"{line}\n{body}\n{line}"


def metrics_up_to(run_dir: Path | None, rank: int, step: int) -> list[dict[str, Any]]:
    """Cut a worker's metrics file back to steps 1..step and return them (a run rolled back or
    resumed from a snapshot drops what came after it)."""
    if run_dir is None:
        return []
    path = Path(run_dir) / "metrics" / f"rank{rank}.jsonl"
    if not path.exists():
        return []
    kept = [r for r in read_metrics(path) if r["step"] <= step and not r.get("final")]
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept).encode())
    return kept
