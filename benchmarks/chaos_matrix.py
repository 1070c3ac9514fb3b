"""Every algorithm, and the options that change what a fault meets, through kills and rejoins:
one line per run, to find the combination that does not go on.

    python benchmarks/chaos_matrix.py                          # every cell, about 25 minutes here
    python benchmarks/chaos_matrix.py --cells ssgd-acpsgd,diloco-pace

Each cell is one ``geotrain run`` of GPT ``tiny`` on 4 loopback hosts, 800 steps, with host 1
SIGKILLed after step 150 and host 0 (the leader) after step 450, each replaced a second later
(``--on-failure continue``); a few cells fault otherwise (two at once, one every 12 s, a
corrupted message). Per cell: the exit code, the launcher's seconds, the faults and the
admissions, the longest regroup that admitted a joiner, the logs holding a traceback or an
abort, and whether the replicas end as one model (every rank's final parameter digest equal;
``nosync``'s are its own). Exit 1 if any cell exited non-zero, lost a trainer the chaos did not kill,
logged a traceback or an abort, or ended with replicas apart where they should be one.

The suite tests each path on gloo groups; this runs them end to end, in combinations no test
names (it found a joiner under ``ssgd`` with ACP-SGD sending P where the members sent Q; one with
AdaTopK probing its links alone).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

from geotrain.bench.soak import GEOTRAIN

BASE = ["--workers", "4", "--no-netem", "--model", "tiny", "--steps", "800", "--eval-every", "200"]
TWO_KILLS = "kill:step=150,rank=1,restart=1;kill:step=450,rank=0,restart=1"

ALGORITHMS = ["ssgd", "ddp", "localsgd", "diloco", "dreamddp", "sparseloco", "demo", "streaming"]
ALGORITHMS += ["co2", "nosync"]
# name: (geotrain run options, chaos)
CELLS: dict[str, tuple[list[str], str]] = {
    **{f"{algo}-k2": (["--algo", algo], TWO_KILLS) for algo in ALGORITHMS},
    "ssgd-acpsgd": (["--algo", "ssgd", "--compress", "acpsgd:rank=4"], TWO_KILLS),
    "ddp-powersgd": (["--algo", "ddp", "--compress", "powersgd:rank=4"], TWO_KILLS),
    "ssgd-warmup": (["--algo", "ssgd", "--compress", "int8:warmup=100"], TWO_KILLS),
    "ssgd-adatopk": (["--algo", "ssgd", "--compress", "adatopk"], TWO_KILLS),
    "dreamddp-int4": (["--algo", "dreamddp", "--compress", "int4"], TWO_KILLS),
    "diloco-warm": (
        ["--algo", "diloco", "--warm-start", "100"],
        "kill:step=50,rank=2,restart=1;kill:step=450,rank=0,restart=1",
    ),
    "diloco-pace": (["--algo", "diloco", "--pace", "time", "--slow", "1:2"], TWO_KILLS),
    "diloco-hsched": (["--algo", "diloco", "--H-schedule", "grow"], TWO_KILLS),
    "sparseloco-overlap": (["--algo", "sparseloco", "--H", "10", "--overlap", "--tau", "5"], TWO_KILLS),
    "streaming-tau0": (["--algo", "streaming", "--tau", "0"], TWO_KILLS),
    "localsgd-spares": (["--algo", "localsgd", "--spares", "1"], TWO_KILLS),
    "diloco-twoatonce": (
        ["--algo", "diloco"],
        "kill:step=150,rank=1,restart=1;kill:step=150,rank=2,restart=1",
    ),
    "co2-corrupt": (["--algo", "co2"], "corrupt:every=50,rank=2;kill:step=300,rank=3,restart=1"),
    "diloco-every": (
        ["--algo", "diloco", "--steps", "1500", "--max-faults", "100"],
        "kill:every=12s,restart=2",
    ),
    # a codec whose entries every worker holds equal, through many kills at any point of a step
    "ssgd-acpsgd-every": (
        ["--algo", "ssgd", "--compress", "acpsgd:rank=4", "--steps", "1500", "--max-faults", "100"],
        "kill:every=12s,restart=2",
    ),
    "dreamddp-acpsgd": (["--algo", "dreamddp", "--compress", "acpsgd:rank=4"], TWO_KILLS),
    # late means in flight at every step boundary inside a period: an admission lands them
    "dreamddp-lag1": (["--algo", "dreamddp", "--compress", "none", "--lag", "1"], TWO_KILLS),
}


def final_digests(run_dir: Path) -> list[str]:
    """Each rank's last parameter digest (ranks of the first epoch; one not training at the
    end has none)."""
    digests = []
    for path in sorted((run_dir / "metrics").glob("rank*.jsonl")):
        last = None
        for line in path.read_text().splitlines():
            digest = json.loads(line).get("param_digest")
            last = digest or last
        if last:
            digests.append(last)
    return digests


def run_cell(name: str, out: Path, timeout_s: float) -> dict:
    options, chaos = CELLS[name]
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    argv = [*GEOTRAIN, "run", *BASE, *options, "--on-failure", "continue", "--no-progress"]
    argv += ["--run-dir", str(run_dir), "--chaos", chaos]
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        code: int | str = proc.returncode
    except subprocess.TimeoutExpired:  # stopped as Ctrl-C stops it: its hosts and namespaces too
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate()
        code = "timeout"
    elapsed = time.monotonic() - t0
    (out / f"{name}.out").write_text(output)
    logs = sorted((run_dir / "logs").glob("*.log")) if (run_dir / "logs").is_dir() else []
    # a Python traceback, or a C++ abort (gloo's "terminate called after throwing ...")
    tracebacks = [
        p.name
        for p in logs
        if any(m in p.read_text(errors="replace") for m in ("Traceback", "terminate called"))
    ]
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    admissions = [e for e in summary.get("membership") or [] if e.get("joined")]
    digests = final_digests(run_dir) if (run_dir / "metrics").is_dir() else []
    one_model = len(set(digests)) == 1 if digests else None
    # faults the chaos did not inject: a trainer that exited on its own (a crash)
    unplanned = [f for f in summary.get("faults") or [] if f.get("kind") != "kill"]
    ok = code == 0 and not tracebacks and not unplanned and (one_model or options[:2] == ["--algo", "nosync"])
    return {
        "cell": name,
        "exit": code,
        "elapsed_s": round(elapsed, 1),
        "steps": summary.get("steps"),
        "faults": len(summary.get("faults") or []),
        "unplanned_faults": len(unplanned),
        "admissions": len(admissions),
        "longest_admission_s": max((e["regroup_s"] for e in admissions), default=None),
        "tracebacks": tracebacks,
        "one_model": one_model,
        "final_val_loss": summary.get("final_val_loss"),
        "ok": bool(ok),
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| cell | exit | s | steps | faults (not injected) | admitted | longest admission s | logs with a "
        "traceback or abort | one model | val loss |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        longest = "-" if r["longest_admission_s"] is None else f"{r['longest_admission_s']:.2f}"
        val = "-" if r["final_val_loss"] is None else f"{r['final_val_loss']:.4f}"
        lines.append(
            f"| {r['cell']} | {r['exit']} | {r['elapsed_s']:.0f} | {r['steps']} | {r['faults']} "
            f"({r['unplanned_faults']}) | "
            f"{r['admissions']} | {longest} | {', '.join(r['tracebacks']) or 0} | {r['one_model']} | {val} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cells", default="", help=f"comma-separated, of: {', '.join(CELLS)} (default: all)")
    p.add_argument("--out", default="runs/chaos-matrix")
    p.add_argument("--timeout-s", dest="timeout_s", type=float, default=600.0, help="per cell")
    args = p.parse_args()
    names = [c for c in args.cells.split(",") if c] or list(CELLS)
    unknown = [c for c in names if c not in CELLS]
    if unknown:
        p.error(f"unknown cell {unknown[0]!r}; the cells are: {', '.join(CELLS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, name in enumerate(names, 1):
        print(f"chaos_matrix: {i}/{len(names)} {name} ...", flush=True)
        rows.append(run_cell(name, out, args.timeout_s))
        (out / "matrix.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))
    failed = [r["cell"] for r in rows if not r["ok"]]
    went_on = f"chaos_matrix: {len(rows) - len(failed)} of {len(rows)} cells went on"
    print(went_on + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
