"""Training through faults: a run under a worker SIGKILLed every T seconds against the same run
undisturbed, side by side (``--on-failure rollback``).

    python benchmarks/bench_faults.py [--minutes 6] [--kill-every 60s] [--bandwidth 100mbit]

Both runs take the same steps over the same data; the faulty one redoes the steps after its last
snapshot at each fault. Reported: per fault, the seconds until the launcher noticed it, the steps
redone, the seconds from detection to the first new step; overall, the final validation loss of
each run (rollback is exact, so they must agree to the bit: ``param_digest``) and the wall time
the faults cost.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

GEOTRAIN = [sys.executable, "-m", "geotrain"]


def run(args: argparse.Namespace, run_dir: Path, extra: list[str]) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [*GEOTRAIN, "run", "--workers", str(args.workers), "--bandwidth", args.bandwidth]
    cmd += ["--model", args.model, "--algo", args.algo, "--H", str(args.H), "--steps", str(args.steps)]
    cmd += ["--batch-size", str(args.batch_size), "--no-progress", "--run-dir", str(run_dir), *extra]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    elapsed = time.monotonic() - t0  # the launcher's time, faults included (the summary's wall_s is not)
    if proc.returncode != 0:
        raise SystemExit(f"{run_dir.name} failed:\n{proc.stderr[-3000:]}")
    return json.loads((run_dir / "summary.json").read_text()) | {"elapsed_s": elapsed}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/bench-faults")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--bandwidth", default="100mbit")
    p.add_argument("--model", default="mini")
    p.add_argument("--algo", default="diloco")
    p.add_argument("--H", type=int, default=10)
    p.add_argument("--batch-size", dest="batch_size", type=int, default=8)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--kill-every", dest="kill_every", default="60s")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    calm = run(args, out / "undisturbed", [])
    faulty = run(args, out / "faulty", ["--chaos", f"kill:every={args.kill_every}", "--max-faults", "100"])
    print("| fault | kind | rank | at step | detected s | steps redone | recover s | restored from |")
    print("|---|---|---|---|---|---|---|---|")
    for i, f in enumerate(faulty["faults"], 1):
        recover = f"{f['recover_s']:.1f}" if f["recover_s"] is not None else "-"
        sources = ",".join(sorted(set(f["sources"] or ["start"])))
        print(f"| {i} | {f['kind']} | {f['rank']} | {f['at_step']} | {f['detected_s']:.1f} | "
              f"{f['steps_lost']} | {recover} | {sources} |")  # fmt: skip
    rows = {"undisturbed": calm, "faulty": faulty}
    print("\n| run | faults | elapsed s | x undisturbed | final val loss | param digest |")
    print("|---|---|---|---|---|---|")
    for name, s in rows.items():
        x = s["elapsed_s"] / calm["elapsed_s"]
        print(f"| {name} | {len(s.get('faults', []))} | {s['elapsed_s']:.0f} | {x:.2f} | "
              f"{s['final_val_loss']:.4f} | {s['param_digest'][:12]} |")  # fmt: skip
    same = faulty["param_digest"] == calm["param_digest"]
    print(f"\nfinal parameters bitwise equal: {same}")
    (out / "bench.json").write_text(json.dumps({"faults": faulty["faults"], "equal": same}, indent=2) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
