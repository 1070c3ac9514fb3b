"""Side-by-side step times of the baseline algorithms on the emulated cluster, in one session.

    python benchmarks/bench_foundation.py --model mini --workers 4 --bandwidth 100mbit --steps 30

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

ALGOS = ["nosync", "ddp", "ssgd", "localsgd", "diloco"]


def run_one(algo: str, args: argparse.Namespace, out: Path) -> dict:
    run_dir = out / algo
    cmd = [
        sys.executable,
        "-m",
        "geotrain",
        "run",
        "--workers",
        str(args.workers),
        "--bandwidth",
        args.bandwidth,
        "--model",
        args.model,
        "--algo",
        algo,
        "--H",
        str(args.H),
        "--steps",
        str(args.steps),
        "--batch-size",
        str(args.batch_size),
        "--seed",
        str(args.seed),
        "--run-dir",
        str(run_dir),
        "--no-progress",
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{algo} failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["bench_wall_s"] = time.perf_counter() - t0
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="mini")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--bandwidth", default="100mbit")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--H", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--algos", default=",".join(ALGOS))
    p.add_argument("--out", default="")
    args = p.parse_args()
    out = Path(args.out or f"runs/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for algo in args.algos.split(","):
        print(f"running {algo} ...", file=sys.stderr, flush=True)
        results[algo] = run_one(algo, args, out)
    (out / "bench.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=2) + "\n")

    base = results.get("nosync", {}).get("step_s_mean")
    ddp = results.get("ddp", {}).get("step_s_mean")
    mode = {r["network_mode"] for r in results.values()}
    print(
        f"\n{args.model}, {args.workers} workers x {args.bandwidth} ({', '.join(mode)}), batch "
        f"{args.batch_size} per worker, {args.steps} steps, H={args.H}\n"
    )
    print("| algo | step s (mean) | x nosync | ddp / algo | tokens/s | blocked s | sent MB/step | val loss |")
    print("|---|---|---|---|---|---|---|---|")
    for algo, r in results.items():
        step = r["step_s_mean"]
        blocked = r["blocked_s_mean"]
        print(
            f"| {algo} | {step:.3f} | {step / base:.2f} | {ddp / step:.2f} | {r['tokens_per_s']:,.0f} | "
            f"{'n/a' if blocked is None else f'{blocked:.3f}'} | {r['sent_bytes_per_step'] / 1e6:.2f} | "
            f"{r['final_val_loss']:.4f} |"
            if base and ddp
            else f"| {algo} | {step:.3f} |"
        )
    print(f"\nresults: {out / 'bench.json'}")


if __name__ == "__main__":
    main()
