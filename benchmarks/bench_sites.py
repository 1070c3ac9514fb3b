"""Workload W2: sites and stragglers, side by side with no communication at all, in one session.

    python benchmarks/bench_sites.py --steps 40            # W2 and W2 with host 3 2x slower
    python benchmarks/bench_sites.py --cells "nosync,diloco two-level" --no-straggler
    python benchmarks/bench_sites.py --cells "nosync,diloco two-level site-H" --straggler-only

W2 is GPT ``mini`` (batch 8 x 128, one thread per host) on ``--topology 2x2,lan=1gbit,wan=20mbit``:
2 sites of 2 hosts, each site behind one 20 Mbit/s uplink. Every cell runs the same job through
``geotrain run`` on the emulated cluster: ``nosync`` (the bound, first and last), periodic
DiLoCo on a flat ring and on two levels (``--hierarchy sites``), two levels with the sites
averaging inside every ``--site-H`` steps, Streaming DiLoCo, CO2 and SparseLoCo (flat: they hide
their exchange under compute; ``sparseloco`` at H=20; ``sparseloco auto``, named in ``--cells``,
at the period its ``--H auto`` default chooses). With a straggler (``--slow 3:2``, on by default as a second
block) the periodic cells run again paced by steps and by time (``--pace time``). ``ddp`` is
left out unless named in ``--cells``: one all-reduce of ``mini`` across the uplinks takes about
30 s, so 40 steps of it are 20 minutes.

The table gives each cell's mean step as a ratio to ``nosync`` in the same block (1.0: the sites'
links cost nothing), the bytes per step that crossed the uplinks and stayed on the LANs (from the
kernel's counters), the tokens trained, and the validation loss at the end (the replicas' own, on
shaped links). Ratios, not seconds, are the result: this machine is shared and noisy. A cell
whose ``summary.json`` exists is reused, so an interrupted benchmark resumes.
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

TOPOLOGY = "2x2,lan=1gbit,wan=20mbit"
CELLS = {  # name: extra flags
    "nosync": ["--algo", "nosync"],
    "ddp": ["--algo", "ddp"],
    # fp32, as measured in docs/sites.md (diloco sends int4 by default since; a codec's all-to-all
    # runs flat, so the two levels are those of the fp32 all-reduce)
    "diloco flat": ["--algo", "diloco", "--compress", "none"],
    "diloco two-level": ["--algo", "diloco", "--compress", "none", "--hierarchy", "sites"],
    "diloco two-level site-H": [
        *("--algo", "diloco", "--compress", "none", "--hierarchy", "sites", "--site-H", "{site_H}")
    ],
    "streaming": ["--algo", "streaming", "--H", "20"],
    "co2": ["--algo", "co2", "--H", "20"],
    "co2 two-level": ["--algo", "co2", "--H", "20", "--hierarchy", "sites"],
    "sparseloco": ["--algo", "sparseloco", "--H", "20"],
    "sparseloco auto": ["--algo", "sparseloco", "--H", "auto"],  # its default: the period the link asks for
    # its gather in two levels: each message carried across by its own host
    "sparseloco auto two-level": ["--algo", "sparseloco", "--H", "auto", "--hierarchy", "sites"],
    # H=5 (DDP's loss at 1.01x its tokens on W1, synchronous), each outer step landing one step
    # late: its gather hidden under the next step's compute
    "sparseloco H5 tau1": ["--algo", "sparseloco", "--H", "5", "--overlap", "--tau", "1"],
    "sparseloco H5 tau1 two-level": [
        *("--algo", "sparseloco", "--H", "5", "--overlap", "--tau", "1", "--hierarchy", "sites")
    ],
}
DEFAULT = "nosync,diloco flat,diloco two-level,diloco two-level site-H,streaming,co2,sparseloco"
PACED = ("diloco flat", "diloco two-level", "diloco two-level site-H")  # again with --pace time, straggling


def run_cell(out: Path, block: str, name: str, flags: list[str], args: argparse.Namespace) -> dict:
    run_dir = out / block / name.replace(" ", "_")
    if (run_dir / "summary.json").exists():
        return json.loads((run_dir / "summary.json").read_text())
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "geotrain", "run", "--topology", args.topology, "--model", args.model,
           "--batch-size", str(args.batch_size), "--steps", str(args.steps), "--H", str(args.H),
           "--on-failure", "stop", "--no-progress", "--run-dir", str(run_dir), *flags]  # fmt: skip
    print(f"{time.strftime('%H:%M:%S')} {block}: {name} ...", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{block} {name} failed:\n{proc.stderr[-3000:]}")
    if not args.keep_states:
        drop_states(run_dir)
    return json.loads((run_dir / "summary.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--topology", default=TOPOLOGY)
    p.add_argument("--model", default="mini")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--keep-states", action="store_true", help="keep each cell's snapshots and checkpoint")
    p.add_argument("--H", type=int, default=10, help="the period of the diloco cells")
    p.add_argument("--site-H", dest="site_H", type=int, default=1, help="the site period of its cell")
    p.add_argument("--cells", default=DEFAULT, help=f"comma-separated, of: {', '.join(CELLS)}")
    p.add_argument("--slow", default="3:2", help="the straggler of the second block (HOST:FACTOR)")
    p.add_argument("--no-straggler", dest="straggler", action="store_false", help="the first block only")
    p.add_argument("--straggler-only", dest="plain", action="store_false", help="the second block only")
    p.add_argument("--out", default="runs/bench_sites")
    args = p.parse_args()
    names = [c.strip() for c in args.cells.split(",") if c.strip()]
    unknown = [c for c in names if c not in CELLS]
    if unknown:
        raise SystemExit(f"unknown cell {unknown[0]!r}; cells: {', '.join(CELLS)}")
    names = ["nosync"] + [c for c in names if c != "nosync"]
    blocks = [("W2", [])] if args.plain else []
    blocks += [(f"W2 --slow {args.slow}", ["--slow", args.slow])] if args.straggler else []
    out = Path(args.out)
    rows = []
    for block, extra in blocks:
        plan = [(n, [f.format(site_H=args.site_H) for f in CELLS[n]]) for n in names]
        if extra:
            plan += [(f"{n} --pace time", [*flags, "--pace", "time"]) for n, flags in plan if n in PACED]
        plan.append(("nosync (again)", CELLS["nosync"]))
        results = {n: run_cell(out, block, n, [*flags, *extra], args) for n, flags in plan}
        bound = (results["nosync"]["step_s_mean"] + results["nosync (again)"]["step_s_mean"]) / 2
        for n, s in results.items():
            rows.append((block, n, s, bound))
    print(f"\n{args.model}, {args.topology}, {args.steps} steps, H {args.H} (sites' periodic cells)\n")
    print("| block | cell | step s | nosync / cell | WAN MB/step | LAN MB/step | tokens | val loss |")
    print("|---|---|---|---|---|---|---|---|")
    for block, n, s, bound in rows:
        wan, lan = (s.get("wan_bytes_per_step") or 0) / 1e6, (s.get("lan_bytes_per_step") or 0) / 1e6
        ratio = bound / s["step_s_mean"]
        print(
            f"| {block} | {n} | {s['step_s_mean']:.3f} | {ratio:.2f} | {wan:.2f} | {lan:.2f} "
            f"| {s['tokens']:,} | {s['final_val_loss']:.4f} |"
        )


if __name__ == "__main__":
    main()
