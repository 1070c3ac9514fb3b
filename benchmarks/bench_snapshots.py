"""What snapshots and redundancy cost, and how long each restore path takes, side by side.

    python benchmarks/bench_snapshots.py --out runs/bench-snapshots            # ~20 min
    python benchmarks/bench_snapshots.py --bandwidths 100mbit --steps 30       # shorter

For each link rate the same job (``mini``, 4 emulated hosts, DiLoCo H=10, batch 8 x 128) runs
``geotrain run`` once per snapshot setting, one after another:

- ``final only``: ``--snapshot-every`` beyond the run, so only the final snapshot is taken (the
  bound: what training costs without in-memory snapshots);
- ``default``: a snapshot into the host's keeper at the first sync boundary at least 50 steps on
  (every 5th at H=10), no redundancy;
- ``ring`` and ``ec:2/3``: the same, and each worker's unique state shipped to its peers.

Reported per cell: mean step time and its ratio to ``final only`` (both runs minutes apart on a
shared machine: differences of a few percent are noise, so each cell also reports the training
thread's own measured share, ``critical``: the copy of the state and any wait, for all snapshots
and for the periodic ones alone, the final one being common to every setting), bytes shipped
per step, the unique and full state sizes, and how many snapshots reached the peers.

Restore paths, each timed by the resumed run itself (``resumed_from.restore_s``, the slowest
worker's wall time to have its state back): a run killed after step 25 resumes at step 20 from
its keepers' memory; the same with host 3's keeper gone too (its state rebuilt from peers);
and with every keeper gone (from disk, ``--checkpoint-every 10``). The memory each keeper holds
is read from the keepers of the killed run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from geotrain.ft.keeper import KeeperClient
from geotrain.launch.disk import drop_states
from geotrain.launch.keepers import keeper_socket, stop_keepers

GEOTRAIN = [sys.executable, "-m", "geotrain"]


def _geotrain(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([*GEOTRAIN, *args], capture_output=True, text=True)


def job(args: argparse.Namespace, bandwidth: str) -> list[str]:
    return ["--workers", str(args.workers), "--bandwidth", bandwidth, "--model", args.model,
            "--algo", "diloco", "--H", str(args.H), "--batch-size", str(args.batch_size),
            "--no-progress"]  # fmt: skip


def run_cell(args, bandwidth: str, name: str, extra: list[str], out: Path) -> dict:
    run_dir = out / f"{bandwidth}-{name.replace(':', '_').replace('/', '-').replace(' ', '_')}"
    if (run_dir / "summary.json").exists():
        return json.loads((run_dir / "summary.json").read_text())
    shutil.rmtree(run_dir, ignore_errors=True)
    proc = _geotrain(
        ["run", *job(args, bandwidth), "--steps", str(args.steps), "--run-dir", str(run_dir), *extra]
    )
    if proc.returncode != 0:
        raise SystemExit(f"{name} at {bandwidth} failed:\n{proc.stderr[-3000:]}")
    if not args.keep_states:
        drop_states(run_dir)
    return json.loads((run_dir / "summary.json").read_text())


def restore_paths(args, bandwidth: str, out: Path) -> list[dict]:
    rows = []
    for path, redundancy in (("keeper", "off"), ("peers", "ring"), ("disk", "off")):
        run_dir = out / f"restore-{path}"
        shutil.rmtree(run_dir, ignore_errors=True)
        extra = [
            "--redundancy",
            redundancy,
            "--checkpoint-every",
            "10",
            "--chaos",
            "kill:step=25,rank=1",
            "--on-failure",
            "stop",
        ]
        proc = _geotrain(["run", *job(args, bandwidth), "--steps", "40", "--run-dir", str(run_dir), *extra])
        if proc.returncode != 1:
            raise SystemExit(f"the chaos run for {path} did not fail as planned:\n{proc.stderr[-2000:]}")
        held = [KeeperClient(keeper_socket(run_dir, i)).held_bytes() for i in range(args.workers)]
        if path == "peers":  # the last host is gone: its keeper and its disk
            KeeperClient(keeper_socket(run_dir, args.workers - 1)).stop()
            shutil.rmtree(run_dir / "snapshots" / f"rank{args.workers - 1}")
        if path == "disk":
            stop_keepers(run_dir, args.workers)
        proc = _geotrain(["run", "--resume", str(run_dir), "--resume-step", "10", "--steps", "20"])
        stop_keepers(run_dir, args.workers)
        if proc.returncode != 0:
            raise SystemExit(f"resume from {path} failed:\n{proc.stderr[-3000:]}")
        resumed = json.loads((run_dir / "summary.json").read_text())["resumed_from"]
        rows.append({"path": path, "redundancy": redundancy, "held_mb": [h / 1e6 for h in held], **resumed})
    return rows


def print_cells(rows: list[dict]) -> None:
    print("| link | snapshots | step s | x final-only | critical % (all) | critical % (periodic) "
          "| shipped MB/step | unique MB | full MB | taken | shipped |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['link']} | {r['snapshots']} | {r['step_s']:.3f} | {r['x_final_only']:.3f} | "
              f"{r['critical_pct']:.2f} | {r['periodic_pct']:.2f} | {r['shipped_mb_per_step']:.2f} | "
              f"{r['unique_mb']:.1f} | {r['full_mb']:.1f} | {r['taken']} | {r['shipped']} |")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/bench-snapshots")
    p.add_argument("--bandwidths", default="100mbit,20mbit")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--model", default="mini")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--keep-states", action="store_true", help="keep each cell's snapshots and checkpoint")
    p.add_argument("--H", type=int, default=10)
    p.add_argument("--batch-size", dest="batch_size", type=int, default=8)
    p.add_argument("--no-restore", action="store_true", help="skip the restore-path timings")
    p.add_argument("--restore-only", action="store_true", help="time only the restore paths")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = [
        ("final only", ["--snapshot-every", str(10 * args.steps)]),
        ("default", []),
        ("ring", ["--redundancy", "ring"]),
        ("ec:2/3", ["--redundancy", "ec:2/3"]),
    ]
    rows = []
    for bw in [] if args.restore_only else args.bandwidths.split(","):
        base = None
        for name, extra in settings:
            s = run_cell(args, bw, name, extra, out)
            base = base or s["step_s_mean"]
            rows.append(
                {
                    "link": bw,
                    "snapshots": name,
                    "step_s": s["step_s_mean"],
                    "x_final_only": s["step_s_mean"] / base,
                    "critical_pct": 100 * s["snapshot_critical_s_per_step"] / s["step_s_mean"],
                    # The snapshots a run takes besides the final one (which every setting takes)
                    "periodic_pct": 100
                    * sum(w + c for step, w, c in s["snapshot_each"] if step != s["steps"])
                    / s["steps"]
                    / s["step_s_mean"],
                    "shipped_mb_per_step": s["snapshot_bytes_per_step"] / 1e6,
                    "unique_mb": s["snapshot_unique_bytes"] / 1e6,
                    "full_mb": s["snapshot_full_bytes"] / 1e6,
                    "taken": s["snapshots"],
                    "shipped": s.get("snapshots_shipped", 0),
                }
            )
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if rows:
        print_cells(rows)
    result = {"cells": rows}
    if not args.no_restore:
        restores = restore_paths(args, args.bandwidths.split(",")[0], out)
        result["restores"] = restores
        print("\n| restore from | redundancy | restore s | sources | keeper memory MB (per host) |")
        print("|---|---|---|---|---|")
        for r in restores:
            print(f"| {r['path']} | {r['redundancy']} | {r['restore_s']:.2f} | {','.join(r['sources'])} | "
                  f"{' '.join(f'{h:.0f}' for h in r['held_mb'])} |")  # fmt: skip
    (out / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
