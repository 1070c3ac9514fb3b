"""Side-by-side step times of the baseline algorithms on the emulated cluster, in one session.

    python benchmarks/bench_algorithms.py --model mini --workers 4 --bandwidth 100mbit --steps 30

Every algorithm runs the same job through ``geotrain run`` (same model, data, seed, steps), one
after another, and the table reports each one's mean step time as a ratio to ``nosync``
(no communication at all) and to PyTorch ``ddp``. Ratios, not seconds, are the result: this
machine is shared and noisy, and ratios measured minutes apart in one session are comparable.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from geotrain.launch.disk import drop_states

ALGOS = ["nosync", "ddp", "ssgd", "localsgd", "diloco"]


def job_args(args: argparse.Namespace) -> list[str]:
    """The cluster and job every run of one benchmark shares."""
    return ["--workers", str(args.workers), "--bandwidth", args.bandwidth, "--model", args.model,
            "--batch-size", str(args.batch_size), "--seed", str(args.seed)]  # fmt: skip


def plan_dreamddp(args: argparse.Namespace, out: Path) -> Path:
    """Profile on the same cluster, then let the planner choose H; returns the plan's path."""
    profile, plan = out / "profile.json", out / "plan.json"
    for cmd in (
        ["profile", *job_args(args), "--out", str(profile), "--run-dir", str(out / "profile-run")],
        [
            "plan",
            "--profile",
            str(profile),
            "--out",
            str(plan),
            *(["--choose", "--max-H", str(args.max_H)] if args.H == 0 else ["--H", str(args.H)]),
        ],
    ):
        proc = subprocess.run([sys.executable, "-m", "geotrain", *cmd], capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{cmd[0]} failed:\n{proc.stderr[-3000:]}")
        print(proc.stdout, file=sys.stderr)
    return plan


def run_one(
    algo: str, args: argparse.Namespace, out: Path, extra: list[str] | None = None, name: str = ""
) -> dict:
    run_dir = out / (name or algo)
    if (run_dir / "summary.json").exists():  # finished in an earlier, interrupted invocation
        return json.loads((run_dir / "summary.json").read_text())
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    cmd = [sys.executable, "-m", "geotrain", "run", *job_args(args), "--algo", algo, "--H", str(args.H),
           "--steps", str(args.steps), "--run-dir", str(run_dir), "--no-progress",
           *(extra or [])]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{algo} failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["bench_wall_s"] = time.perf_counter() - t0
    if not args.keep_states:
        drop_states(run_dir)
    return summary


def print_table(results: dict, args: argparse.Namespace, predicted: dict) -> None:
    base = results.get("nosync", {}).get("step_s_mean")
    ddp = results.get("ddp", {}).get("step_s_mean")
    sync_ref = results.get("ssgd") or results.get("ddp")  # fully synchronous: the convergence reference
    mode = ", ".join(sorted({r["network_mode"] for r in results.values()}))
    print(
        f"\n{args.model}, {args.workers} workers x {args.bandwidth} ({mode}), batch {args.batch_size} x "
        f"block per worker, {args.steps} steps, H={args.H}\n"
    )
    print(
        "| algo | step s | x nosync | ddp / algo | predicted s | blocked s | sent MB/step "
        "| val loss | vs sync |"
    )
    print("|---|---|---|---|---|---|---|---|---|")

    def ratio(a, b, fmt=".2f"):
        return format(a / b, fmt) if a and b else "-"

    for algo, r in results.items():
        step, blocked, pred = r["step_s_mean"], r["blocked_s_mean"], predicted.get(algo)
        vs = (r["final_val_loss"] / sync_ref["final_val_loss"] - 1) * 100 if sync_ref else None
        print(
            f"| {algo} | {step:.3f} | {ratio(step, base)} | {ratio(ddp, step)} | "
            f"{'-' if pred is None else f'{pred:.3f}'} | {'n/a' if blocked is None else f'{blocked:.3f}'} | "
            f"{r['sent_bytes_per_step'] / 1e6:.2f} | {r['final_val_loss']:.4f} | "
            f"{'-' if vs is None else f'{vs:+.1f}%'} |"
        )


def add_job_arguments(p: argparse.ArgumentParser, steps: int, H_help: str) -> None:
    """The job flags every benchmark here shares (``job_args`` passes them on)."""
    p.add_argument("--model", default="mini")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--bandwidth", default="100mbit")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--H", type=int, default=10, help=H_help)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-states", action="store_true", help="keep each cell's snapshots and checkpoint")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_job_arguments(
        p, 30, "period of localsgd/diloco/dreamddp; 0: dreamddp's planner chooses it, the others use the same"
    )
    p.add_argument("--max-H", dest="max_H", type=int, default=40)
    p.add_argument("--algos", default=",".join(ALGOS))
    p.add_argument("--out", default="")
    args = p.parse_args()
    out = Path(args.out or f"runs/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    algos = args.algos.split(",")
    extra: dict[str, list[str]] = {}
    if "dreamddp" in algos:
        plan = out / "plan.json" if (out / "plan.json").exists() else plan_dreamddp(args, out)
        planned = json.loads(plan.read_text())
        args.H = planned["H"]
        extra["dreamddp"] = ["--plan", str(plan), "--replan-threshold", "0"]
        (out / "predicted.json").write_text(json.dumps(planned["predicted_s"], indent=2))
    for algo in algos:
        print(f"running {algo} ...", file=sys.stderr, flush=True)
        results[algo] = run_one(algo, args, out, extra.get(algo))
    (out / "bench.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=2) + "\n")

    predicted = json.loads((out / "predicted.json").read_text()) if (out / "predicted.json").exists() else {}
    print_table(results, args, predicted)
    print(f"\nresults: {out / 'bench.json'}")


if __name__ == "__main__":
    main()
