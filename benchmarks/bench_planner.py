"""The planner's error: predicted against measured step time, per algorithm and codec, in one session.

    python benchmarks/bench_planner.py --model mini --workers 4 --bandwidth 100mbit --steps 20 \\
        --algos nosync,ssgd,localsgd,diloco+none,dreamddp,ssgd+int4,localsgd+int4,diloco,dreamddp+int4

A profile on the cluster per codec (``geotrain profile``), then for each entry the plan that prices it
(``geotrain plan --H H [--compress CODEC]``: dreamddp runs that plan, searched on its codec's
messages, with re-planning off so the plan measured is the plan predicted), and the run
(``geotrain run``, the same job for every entry, one after another). The table gives each
entry's predicted and measured mean step and the error (predicted - measured) / measured.
Each codec's entries are planned from a profile taken with it (``geotrain profile --compress``),
which times its encoding and decoding per layer; the plan prices them as compute.

A plan predicts the steady step. So each run is ``--steps`` + 3 steps long, and the measured
mean is over ``--steps`` of them (whole periods when ``--steps`` is a multiple of H): the first
two (the first allocations, each about 1.4x a steady step on ``mini``) and the last (the
end-of-run snapshot and average, once per run) are left out. The run's mean over every step is
in the table too.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from bench_algorithms import add_job_arguments, job_args, run_one


def geotrain(cmd: list[str]) -> str:
    proc = subprocess.run([sys.executable, "-m", "geotrain", *cmd], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"geotrain {cmd[0]} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def steady_step_s(run_dir: Path, first: int, last: int) -> float:
    """The mean step time over steps ``first`` to ``last`` (inclusive), averaged over workers."""
    means = []
    for metrics in sorted((run_dir / "metrics").glob("rank*.jsonl")):
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        steps = [r["step_s"] for r in rows if "step_s" in r and first <= r["step"] <= last]
        if len(steps) != last - first + 1:
            raise SystemExit(f"{metrics}: {len(steps)} steps from {first} to {last}, not {last - first + 1}")
        means.append(sum(steps) / len(steps))
    return sum(means) / len(means)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_job_arguments(p, 20, "the period of localsgd, diloco and dreamddp")
    p.add_argument(
        "--algos",
        default="nosync,ssgd,localsgd,diloco+none,dreamddp,ssgd+int4,localsgd+int4,diloco,dreamddp+int4",
        help="entries ALGO or ALGO+CODEC",
    )
    p.add_argument("--out", default="")
    args = p.parse_args()
    out = Path(args.out or f"runs/planner-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for entry in args.algos.split(","):
        algo, _, codec = entry.partition("+")
        compress = ["--compress", codec] if codec else []
        tag = (codec or "fp32").replace(":", "_")
        # a profile per codec: each times its codec's encoding (and the same steps and link)
        profile = out / f"profile-{tag}.json"
        if not profile.exists():
            print(f"profiling ({codec or 'no codec'}) ...", file=sys.stderr, flush=True)
            run_dir = ["--run-dir", str(out / f"profile-run-{tag}")]
            geotrain(["profile", *job_args(args), *compress, "--out", str(profile), *run_dir])
        plan = out / f"plan-{tag}.json"
        if not plan.exists():
            geotrain(["plan", "--profile", str(profile), "--H", str(args.H), "--out", str(plan), *compress])
        predicted = json.loads(plan.read_text())["predicted_s"][algo]
        extra = ["--compress", codec] if codec else []
        if algo == "dreamddp":
            extra += ["--plan", str(plan), "--replan-threshold", "0"]
        print(f"running {entry} ...", file=sys.stderr, flush=True)
        name = entry.replace(":", "_")
        longer = argparse.Namespace(**{**vars(args), "steps": args.steps + 3})
        summary = run_one(algo, longer, out, extra, name)
        measured = steady_step_s(out / name, first=3, last=args.steps + 2)
        error = (predicted - measured) / measured
        rows.append({"entry": entry, "predicted_s": predicted, "measured_s": measured,
                     "run_mean_s": summary["step_s_mean"], "error": error})  # fmt: skip
    (out / "planner.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")
    print(
        f"\n{args.model}, {args.workers} workers x {args.bandwidth}, steps 3 to {args.steps + 2} of "
        f"{args.steps + 3}, H={args.H}\n"
    )
    print("| entry | predicted s | measured s | error | the run's mean s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['entry']} | {r['predicted_s']:.3f} | {r['measured_s']:.3f} | {r['error']:+.1%} "
            f"| {r['run_mean_s']:.3f} |"
        )
    mean_abs = sum(abs(r["error"]) for r in rows) / len(rows)
    print(f"\nmean absolute error {mean_abs:.1%}; results: {out / 'planner.json'}")


if __name__ == "__main__":
    main()
