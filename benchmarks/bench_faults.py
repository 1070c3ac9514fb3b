"""Training through faults, side by side with the same run undisturbed.

    python benchmarks/bench_faults.py                          # --on-failure continue (default)
    python benchmarks/bench_faults.py --on-failure rollback --chaos kill:every=60s

``continue``: the survivors regroup and go on with fewer workers; by default one worker is
SIGKILLed a third of the way in and another freezes (SIGSTOP, found only by its silent heartbeat)
two thirds of the way in. Reported per fault: the seconds until it was found, the steps the
survivors redid, the seconds from detection to the first new step, the regroup itself; overall,
the wall time, the tokens trained and the final validation loss, next to the undisturbed run's
validation loss at the same number of tokens (from its evaluation curve).

``rollback``: every worker returns to the newest common snapshot and a replacement takes the
dead one's place, so the run must end bitwise as the undisturbed one (``param_digest``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from geotrain.bench.soak import SoakJob, fault_table, run_job, val_at_tokens


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
    p.add_argument("--eval-every", dest="eval_every", type=int, default=10)
    p.add_argument("--on-failure", dest="on_failure", default="continue", choices=("continue", "rollback"))
    p.add_argument("--fault-timeout", dest="fault_timeout", type=float, default=10.0)
    p.add_argument("--chaos", default="", help="default: two faults (continue) or kill:every=60s (rollback)")
    args = p.parse_args()
    if not args.chaos:
        third = args.steps // 3
        args.chaos = (
            f"kill:step={third},rank=1;stop:step={2 * third},rank=2"
            if args.on_failure == "continue"
            else "kill:every=60s"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    job = SoakJob(
        workers=args.workers, bandwidth=args.bandwidth, model=args.model, algo=args.algo, H=args.H,
        batch_size=args.batch_size, steps=args.steps, eval_every=args.eval_every,
        on_failure=args.on_failure, fault_timeout=args.fault_timeout,
    )  # fmt: skip
    calm = run_job(job, out / "undisturbed", [])
    faulty = run_job(job, out / "faulty", ["--chaos", args.chaos, "--max-faults", "100"])
    print(f"chaos: {args.chaos} (--on-failure {args.on_failure}, --fault-timeout {args.fault_timeout:g})\n")
    print(fault_table(faulty))
    rows = {"undisturbed": calm, "faulty": faulty}
    print("\n| run | faults | workers at the end | elapsed s | x undisturbed | tokens | final val loss |"
          " undisturbed val loss at these tokens | param digest |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for name, s in rows.items():
        x = s["elapsed_s"] / calm["elapsed_s"]
        ref = val_at_tokens(out / "undisturbed", s["tokens"]) if name == "faulty" else s["final_val_loss"]
        ref_text = f"{ref:.4f}" if ref is not None else "-"
        digest = s["param_digest"][:12]
        print(f"| {name} | {len(s.get('faults', []))} | {s['workers']} | {s['elapsed_s']:.0f} | {x:.2f} | "
              f"{s['tokens']:,} | {s['final_val_loss']:.4f} | {ref_text} | {digest} |")  # fmt: skip
    same = faulty["param_digest"] == calm["param_digest"]
    result = {"faults": faulty["faults"], "membership": faulty.get("membership"), "equal": same}
    (out / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
    if args.on_failure == "rollback":
        print(f"\nfinal parameters bitwise equal: {same}")
        return 0 if same else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
