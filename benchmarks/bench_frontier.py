"""SparseLoCo and DeMo on a home link, side by side with no communication at all, in one session.

    python benchmarks/bench_frontier.py --bandwidths 350kbit,3.5mbit --steps 80 [--H 20]

On W1 (GPT ``mini``, 4 hosts, batch 8 x 128, one thread each) every cell runs the same job
through ``geotrain run`` on the emulated cluster: ``nosync`` (the bound), ``sparseloco`` with its
defaults (``--overlap auto``: overlapped where that reaches a loss sooner, as
the start-up probe of ``--H auto`` times them, or the first outer step, synchronous, with ``--H
N``), ``sparseloco --overlap`` (always), ``sparseloco --no-overlap``, ``demo`` and ``demo
--overlap`` (fewer steps: ``--demo-steps``), at
each bandwidth, at SparseLoCo's default period (``--H auto``: chosen by the link at start-up; the
table's H column says which) unless ``--H N`` pins one. The table
gives each cell's mean step time as a ratio to ``nosync`` at the same rate (``nosync / algo``:
1.0 is a link as good as none), the bytes each worker sent per step, and what the emulated rate
stands for on an accelerator (``geotrain.plan.gather``: an H100 at 40% of bf16 peak taking
0.5M-token steps unless told otherwise), from ``nosync``'s measured step time.

Ratios, not seconds, are the result: this machine is shared and noisy. ``nosync`` runs first and
last at each rate; the table shows both and takes their mean as the bound. A cell whose
``summary.json`` exists is reused, so an interrupted benchmark resumes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from geotrain.launch.disk import drop_states
from geotrain.metrics import read_metrics
from geotrain.netem.links import parse_bandwidth
from geotrain.plan.gather import Accelerator, format_rate, stands_for_bps

CELLS = {  # name: extra flags
    "nosync": ["--algo", "nosync"],
    "sparseloco": ["--algo", "sparseloco"],
    "sparseloco --overlap": ["--algo", "sparseloco", "--overlap"],
    "sparseloco --no-overlap": ["--algo", "sparseloco", "--no-overlap"],
    "demo": ["--algo", "demo"],
    "demo --overlap": ["--algo", "demo", "--overlap"],
}


def run_cell(out: Path, rate: str, name: str, args: argparse.Namespace) -> dict:
    run_dir = out / rate / name.replace(" ", "_")
    if (run_dir / "summary.json").exists():
        return _summary(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "geotrain", "run", "--workers", str(args.workers), "--model", args.model,
           "--batch-size", str(args.batch_size), "--steps", str(args.steps),
           "--bandwidth", rate, "--no-progress", "--run-dir", str(run_dir),
           *CELLS[name.removesuffix(" (again)")]]  # fmt: skip
    if args.H != "auto" and not name.startswith("nosync"):
        cmd += ["--H", args.H]
    if name.startswith("demo"):  # a gather every step: at 350 kbit/s, 80 of them are 20 minutes
        cmd[cmd.index("--steps") + 1] = str(min(args.steps, args.demo_steps))
    print(f"{time.strftime('%H:%M:%S')} {rate} {name} ...", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{rate} {name} failed:\n{proc.stderr[-3000:]}")
    if not args.keep_states:
        drop_states(run_dir)
    return _summary(run_dir)


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text()) | {"run_dir": str(run_dir)}


def steady_s(summary: dict, after: int) -> float:
    """The mean step over every worker after step ``after`` and before the last, which leaves
    out start-up (a worker's first steps touch their memory; with ``--H N``, ``--overlap
    auto``'s first outer step, run synchronously to be timed) and the run's end (its final
    snapshot, on disk too: 0.8-1.3 s on SparseLoCo's last step at 3.5 Mbit/s, where nosync's
    takes 0.1); one-offs that a few hundred steps in weigh nothing. The whole run's mean where
    no step is that late."""
    run_dir = Path(summary["run_dir"])
    last = summary["steps"]
    steps = [
        record["step_s"]
        for path in sorted((run_dir / "metrics").glob("rank*.jsonl"))
        for record in read_metrics(path)
        if "step_s" in record and after < record.get("step", 0) < last
    ]
    return sum(steps) / len(steps) if steps else summary["step_s_mean"]


def period_of(summary: dict) -> str:
    """The period a cell ran at ('' for a method without one): what ``--H auto`` chose."""
    periods = summary.get("periods") or ""
    return periods.removeprefix("H=") if periods.startswith("H=") else periods


def overlap_verdict(summary: dict) -> str:
    """SparseLoCo's ``--overlap auto`` verdict as its summary records it ('' where none): the last
    one, where it was taken again as the landing moved."""
    info = summary.get("codec_info") or ""
    at = {verdict: info.rfind(f"--overlap auto: {verdict}") for verdict in ("on", "off")}
    last = max(at, key=at.get)
    return last if at[last] >= 0 else ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bandwidths", default="350kbit,3.5mbit")
    p.add_argument("--cells", default=",".join(CELLS), help=f"among: {', '.join(CELLS)}")
    p.add_argument("--model", default="mini")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--keep-states", action="store_true", help="keep each cell's snapshots and checkpoint")
    p.add_argument("--H", default="auto", help="sparseloco's period (auto: its default, chosen by the link)")
    p.add_argument(
        "--steady-after",
        type=int,
        default=0,
        help="steady columns: the steps after this one (0: 20, or a longer period a cell ran at)",
    )
    p.add_argument("--demo-steps", type=int, default=20, help="demo's steps (it is slow on slow links)")
    p.add_argument("--accel-flops", type=float, default=Accelerator().flops, help="peak FLOP/s")
    p.add_argument("--accel-mfu", type=float, default=Accelerator().mfu)
    p.add_argument("--accel-tokens", type=float, default=Accelerator().tokens_per_step, help="per step")
    p.add_argument("--out", default="")
    args = p.parse_args()
    if args.H != "auto" and not (args.H.isdigit() and int(args.H) >= 1):
        p.error(f"--H must be auto or a period >= 1, got {args.H!r}")
    if not 0 <= args.steady_after < args.steps - 1:
        p.error(f"--steady-after must be in [0, --steps - 1) (0: the default), got {args.steady_after}")
    accel = Accelerator(args.accel_flops, args.accel_mfu, args.accel_tokens)
    out = Path(args.out or f"runs/bench-frontier-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    names = [n for n in args.cells.split(",") if n != "nosync"]
    results: dict[str, dict[str, dict]] = {}
    for rate in args.bandwidths.split(","):
        order = ["nosync", *names, "nosync (again)"]
        results[rate] = {name: run_cell(out, rate, name, args) for name in order}

    job = f"{args.model}, {args.workers} workers, batch {args.batch_size}, {args.steps} steps, --H {args.H}"
    print(f"\n{job}\n")
    print(
        "| link here | stands for | algo | H | step s | nosync / algo "
        "| steady from step | step s | nosync / algo | sent KB/step | val loss | overlap auto |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for rate, cells in results.items():
        periods = [int(period_of(r)) for r in cells.values() if period_of(r).isdigit()]
        after = args.steady_after or max([20, *periods])
        for r in cells.values():
            r["steady_s"] = steady_s(r, after)
        bound = (cells["nosync"]["step_s_mean"] + cells["nosync (again)"]["step_s_mean"]) / 2
        steady = (cells["nosync"]["steady_s"] + cells["nosync (again)"]["steady_s"]) / 2
        n_params = cells["nosync"]["parameters"]
        accel_bps = stands_for_bps(parse_bandwidth(rate), bound, n_params, accel)
        for name, r in cells.items():
            print(
                f"| {rate} | {format_rate(accel_bps)} | {name} | {period_of(r)} | {r['step_s_mean']:.3f} | "
                f"{bound / r['step_s_mean']:.2f} | {after + 1} | {r['steady_s']:.3f} | "
                f"{steady / r['steady_s']:.2f} | "
                f"{r['sent_bytes_per_step'] / 1e3:.1f} | "
                f"{r['final_val_loss']:.4f} | {overlap_verdict(r)} |"
            )
    (out / "bench.json").write_text(json.dumps(results, indent=2) + "\n")  # with each cell's steady_s
    print(f"\nresults: {out / 'bench.json'}")


if __name__ == "__main__":
    main()
