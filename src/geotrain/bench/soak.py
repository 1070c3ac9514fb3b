"""Training through faults, side by side with the same run undisturbed (``geotrain soak``).

Two runs of the same job (same workers, links, seeds and steps): one undisturbed, one under chaos,
by default a random worker SIGKILLed every minute and a replacement a few seconds later
(``kill:every=60s,restart=5``). Reported per fault: when, which, the seconds until it was found,
the steps the survivors redid, the seconds from detection to the first new step, and when its
replacement was admitted; overall, the wall time of each run, the tokens trained and the final
validation loss next to the undisturbed run's at the same number of tokens (interpolated on its
evaluation curve), which is the comparison that counts: the faulty run trains fewer tokens while
workers are missing. ``soak.png`` and ``report.html`` draw it (``bench/soak_report.py``).

``benchmarks/bench_faults.py`` runs the same comparison with other defaults (two scripted faults,
or ``--on-failure rollback``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

GEOTRAIN = [sys.executable, "-m", "geotrain"]


@dataclass
class SoakJob:
    workers: int = 4
    bandwidth: str = "100mbit"
    model: str = "mini"
    algo: str = "diloco"
    H: int | str = 10  # or "auto"
    batch_size: int = 8
    steps: int = 600
    eval_every: int = 20
    on_failure: str = "continue"
    fault_timeout: float = 10.0
    spares: int = 0  # the faulty run's backup pool (the undisturbed run needs none)
    extra: tuple[str, ...] = ()  # more `geotrain run` flags, the same for both runs

    def argv(self, run_dir: Path) -> list[str]:
        cmd = ["run", "--workers", str(self.workers), "--bandwidth", self.bandwidth]
        cmd += ["--model", self.model, "--algo", self.algo, "--H", str(self.H), "--steps", str(self.steps)]
        cmd += ["--batch-size", str(self.batch_size), "--no-progress", "--run-dir", str(run_dir)]
        cmd += ["--eval-every", str(self.eval_every), "--on-failure", self.on_failure]
        return [*cmd, "--fault-timeout", str(self.fault_timeout), *self.extra]


def run_job(job: SoakJob, run_dir: Path, extra: list[str]) -> dict:
    """One ``geotrain run``; its summary with ``elapsed_s``, the launcher's time, faults included
    (the summary's ``wall_s`` is the trainers')."""
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.monotonic()
    proc = subprocess.run([*GEOTRAIN, *job.argv(run_dir), *extra], capture_output=True, text=True)
    elapsed = time.monotonic() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{run_dir.name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads((run_dir / "summary.json").read_text()) | {"elapsed_s": elapsed}


def val_at_tokens(run_dir: Path, tokens: int) -> float | None:
    """The run's validation loss at ``tokens``, interpolated between its evaluations."""
    points = []
    for line in (run_dir / "metrics" / "rank0.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("val_loss") is not None:
            points.append((r["tokens"], r["val_loss"]))
    points.sort()
    for (t0, v0), (t1, v1) in zip(points, points[1:], strict=False):
        if t0 <= tokens <= t1:
            return v0 + (v1 - v0) * (tokens - t0) / (t1 - t0)
    return None


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def fault_table(summary: dict) -> str:
    rows = [
        "| fault | kind | rank | at s | at step | detected s | steps redone | recover s | regroup s "
        "| replacement admitted after step | replacement start to admission s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    events = summary.get("membership") or []
    for i, f in enumerate(summary.get("faults", []), 1):
        event = next(
            (e for e in events if f["rank"] not in e["members"] and e["step"] >= f["at_step"] - 1), None
        )
        rows.append(
            f"| {i} | {f['kind']} | {f['rank']} | {f['at_s']:.0f} | {f['at_step']} | {f['detected_s']:.1f} | "
            f"{f['steps_lost']} | {_num(f.get('recover_s'), '.1f')} | "
            f"{_num(event and event['regroup_s'], '.2f')} | {_num(f.get('rejoined_after_step'), 'd')} | "
            f"{_num(f.get('rejoin_s'), '.1f')} |"
        )
    return "\n".join(rows)


def compare(calm: dict, faulty: dict, calm_dir: Path) -> dict:
    """The faulty run against the undisturbed one: elapsed time, and the loss at equal tokens."""
    ref = val_at_tokens(calm_dir, faulty["tokens"])
    admissions = [e for e in faulty.get("membership") or [] if e.get("joined")]
    return {
        "faults": len(faulty.get("faults", [])),
        "elapsed_ratio": faulty["elapsed_s"] / calm["elapsed_s"],
        "tokens_ratio": faulty["tokens"] / calm["tokens"],
        "final_val_loss": faulty["final_val_loss"],
        "undisturbed_val_loss_at_equal_tokens": ref,
        "val_loss_difference": None if ref is None else faulty["final_val_loss"] / ref - 1,
        "undisturbed_final_val_loss": calm["final_val_loss"],
        "admissions": len(admissions),
        # The regroup, and where the joiners were admitted deferred, the members' wait for them
        # at their next sync (what the hand-over took past the members' period)
        "admission_s_mean": (
            sum(e["regroup_s"] + e.get("meeting_wait_s", 0.0) for e in admissions) / len(admissions)
            if admissions
            else None
        ),
        "admissions_deferred": sum(bool(e.get("deferred")) for e in admissions),
        # At each admission every member recorded its parameters' digest and that of what the
        # algorithm holds equal there (the parameters; the anchor where replicas differ between
        # syncs: SparseLoCo under overlap, CO2, Streaming DiLoCo): one each, bitwise equal.
        "admissions_with_members_bitwise_equal": sum(e.get("param_digests") == 1 for e in admissions),
        # None where the algorithm holds nothing equal at a boundary (DreamDDP without a codec)
        "admissions_with_shared_state_bitwise_equal": (
            sum(e.get("shared_digests", e.get("param_digests")) == 1 for e in admissions)
            if not admissions or any(e.get("shared_digests", 0) is not None for e in admissions)
            else None
        ),
    }


def comparison_table(calm: dict, faulty: dict, cmp: dict) -> str:
    rows = [
        "| run | faults | workers start -> end | elapsed s | x undisturbed | tokens | final val loss "
        "| undisturbed val loss at these tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in (("undisturbed", calm), ("faulty", faulty)):
        ref = cmp["undisturbed_val_loss_at_equal_tokens"] if name == "faulty" else s["final_val_loss"]
        rows.append(
            f"| {name} | {len(s.get('faults', []))} | {s['workers_start']} -> {s['workers']} | "
            f"{s['elapsed_s']:.0f} | {s['elapsed_s'] / calm['elapsed_s']:.2f} | {s['tokens']:,} | "
            f"{s['final_val_loss']:.4f} | {_num(ref, '.4f')} |"
        )
    diff = cmp["val_loss_difference"]
    if diff is not None:
        rows.append(f"\nfinal validation loss vs the undisturbed run at equal tokens: {diff:+.2%}")
    if cmp["admissions"]:
        shared = cmp["admissions_with_shared_state_bitwise_equal"]
        audit = (
            f"members' parameters bitwise equal at {cmp['admissions_with_members_bitwise_equal']} of "
            f"them, what the algorithm holds equal at a sync (its parameters or its anchor) at {shared}"
            if shared is not None
            else "the algorithm holds nothing bitwise equal at a sync (DreamDDP averages each layer "
            "at its own iteration)"
        )
        deferred = cmp.get("admissions_deferred", 0)
        how = f", {deferred} of them deferred (with the wait at the sync where the joiner met them)"
        rows.append(
            f"replacements admitted: {cmp['admissions']}{how if deferred else ''}, each stopping the "
            f"members {cmp['admission_s_mean']:.2f} s on average (hand-over included); {audit}"
        )
    return "\n".join(rows)


def soak(job: SoakJob, chaos: str, out: Path, max_faults: int = 1000) -> dict:
    """Both runs, the tables printed, everything written to ``out/soak.json``."""
    out.mkdir(parents=True, exist_ok=True)
    print(f"geotrain soak: undisturbed run ({job.steps} steps) ...", file=sys.stderr, flush=True)
    calm = run_job(job, out / "undisturbed", [])
    print(f"geotrain soak: the same under --chaos {chaos} ...", file=sys.stderr, flush=True)
    pool = ["--spares", str(job.spares)] if job.spares else []
    faulty = run_job(job, out / "faulty", ["--chaos", chaos, "--max-faults", str(max_faults), *pool])
    cmp = compare(calm, faulty, out / "undisturbed")
    spares = f", --spares {job.spares}" if job.spares else ""
    print(f"chaos: {chaos} (--on-failure {job.on_failure}, --fault-timeout {job.fault_timeout:g}{spares})\n")
    print(fault_table(faulty) + "\n")
    print(comparison_table(calm, faulty, cmp))
    result = {
        "job": job.__dict__ | {"extra": list(job.extra)},
        "chaos": chaos,
        "comparison": cmp,
        "faults": faulty.get("faults"),
        "membership": faulty.get("membership"),
    }
    (out / "soak.json").write_text(json.dumps(result, indent=2) + "\n")
    from geotrain.bench.soak_report import write_soak_report

    try:
        report = write_soak_report(out, result, [fault_table(faulty), comparison_table(calm, faulty, cmp)])
        print(
            f"\ngeotrain soak: the picture is {report['png']}, the report {report['html']}", file=sys.stderr
        )
    except (OSError, ValueError) as e:  # the runs and soak.json are there: say what is missing
        print(f"\ngeotrain soak: no picture ({e}); the numbers are in {out}/soak.json", file=sys.stderr)
    return result
