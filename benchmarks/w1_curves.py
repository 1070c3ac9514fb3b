"""W1's long-horizon validation curves, kept in the repository, and tokens to DDP's loss read from them.

    python benchmarks/w1_curves.py                                  # the table, from benchmarks/curves/
    python benchmarks/w1_curves.py --save NAME=RUN_DIR              # keep a finished run's curve
    python benchmarks/w1_curves.py --plot docs/w1-2000steps.png     # and draw them

Issue 13's target is read here: on W1 (``mini``, 4 workers on loopback, batch 8 x 128, the same
seeds and batches for every run, ``--steps 2000 --eval-every 50``) a configuration should reach
DDP's validation loss at 2,000 steps within 1.05x DDP's tokens. DDP's final loss, smoothed over 3
evaluations as ``geotrain bench`` reads a crossing (``geotrain.bench.curves``), is 1.0406 (its
dense curve is lost; ``curves/w1-ddp.csv`` holds its 200-step points). For each curve the table
gives:

- the step at which its curve, smoothed the same way, reaches 1.0406; its tokens over DDP's are
  that step over 2,000 (every step is 4 x 8 x 128 tokens in every run);
- where it does not get there, DDP's step at this curve's final (smoothed) loss, on DDP's curve
  interpolated linearly between its 200-step points, and the ratio 2,000 over that step: an
  approximation, marked ``~``.

A curve saved from a run is dense (every 50 steps); a curve kept from the tables in docs/ has
200-step points only, and its crossing is read on those, unsmoothed, marked ``~`` too. A run
stopped before 2,000 steps (to be resumed) gets no ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from geotrain.bench.curves import crossing, read_curve, smooth
from geotrain.compress import run_codec

HERE = Path(__file__).resolve().parent / "curves"
DDP_FINAL = 1.0406  # DDP's dense curve at step 2,000, smoothed over 3 evaluations
STEPS = 2000
WINDOW = 3


def read_csv(path: Path) -> tuple[list[int], list[float]]:
    steps, losses = [], []
    for line in path.read_text().splitlines():
        if line and not line.startswith(("#", "step")):
            step, loss = line.split(",")
            steps.append(int(step))
            losses.append(float(loss))
    return steps, losses


def dense(steps: list[int]) -> bool:
    """Saved from a run (a point every 50 steps), not kept from a table in docs/ (every 200)."""
    return len(steps) > 1 and steps[1] - steps[0] < 200


def save(name: str, run_dir: Path) -> Path:
    """The run's validation curve (rank 0's record: every worker's mean) as curves/NAME.csv, with
    the command that made it in its header."""
    curve = read_curve(run_dir)
    if not curve.val_loss:
        raise SystemExit(f"{run_dir}: no validation points in metrics/rank0.jsonl")
    train = json.loads((run_dir / "config.json").read_text())["train"]
    summary = run_dir / "summary.json"
    lines = [f"# saved from {run_dir} by benchmarks/w1_curves.py"]
    lines.append(
        f"# algo={train.get('algo')} H={train.get('H')} "
        f"compress={run_codec(train.get('algo', ''), train.get('compress', '')) or 'none'}"
        f" lr_scale={train.get('lr_scale')} seed={train.get('seed')} steps={train.get('steps')}"
    )
    if summary.exists():
        s = json.loads(summary.read_text())
        factor = s.get("local_lr_factor")
        lines.append(f"# summary: algo_config={s.get('algo_config')} local_lr_factor={factor}")
    lines.append("step,val_loss")
    lines += [f"{step},{loss:.4f}" for step, loss in zip(curve.steps, curve.val_loss, strict=True)]
    out = HERE / f"{name}.csv"
    out.write_text("\n".join(lines) + "\n")
    return out


def table(curves: dict[str, tuple[list[int], list[float]]]) -> list[dict]:
    ddp_steps, ddp_losses = curves["w1-ddp"]
    rows = []
    for name, (steps, losses) in curves.items():
        read = smooth(losses, WINDOW) if dense(steps) else losses
        approx = "" if dense(steps) else "~"
        row = {"curve": name, "points": len(steps), "final": losses[-1], "final_smoothed": read[-1]}
        at = crossing([float(s) for s in steps], read, DDP_FINAL)
        if name == "w1-ddp":
            row.update(step_at_target=STEPS, tokens_vs_ddp="1.00", ratio=1.0)
        elif at is not None:
            row.update(step_at_target=round(at), tokens_vs_ddp=f"{approx}{at / STEPS:.2f}", ratio=at / STEPS)
        elif steps[-1] < STEPS:  # stopped early: its last loss says nothing of 2,000 steps
            row.update(step_at_target=None, tokens_vs_ddp=f"to step {steps[-1]}")
        else:
            # Where it ends, it is where DDP was at ddp_at: its last step over that. A curve run on
            # past DDP's steps without reaching its loss has also measured a floor.
            ddp_at = crossing([float(s) for s in ddp_steps], ddp_losses, read[-1])
            floor = f" (>{steps[-1] / STEPS:.2f})" if steps[-1] > STEPS else ""
            ratio = None if ddp_at is None else steps[-1] / ddp_at
            row.update(
                step_at_target=None,
                ddp_step_at_its_final=None if ddp_at is None else round(ddp_at),
                tokens_vs_ddp=f"not reached{floor}" if ratio is None else f"~{ratio:.2f}{floor}",
                ratio=ratio,
            )
        rows.append(row)
    return rows


def plot(curves: dict[str, tuple[list[int], list[float]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, (steps, losses) in curves.items():
        ax.plot(
            [s * 4096 / 1e6 for s in steps],
            losses,
            marker="" if dense(steps) else "o",
            lw=2.2 if name == "w1-ddp" else 1.4,
            label=name.removeprefix("w1-"),
        )
    ax.axhline(DDP_FINAL, color="grey", ls=":", lw=1, label=f"ddp's final loss ({DDP_FINAL})")
    ax.set_xlabel("tokens (millions)")
    ax.set_ylabel("validation loss")
    ax.set_ylim(0.95, 2.3)
    ax.set_title("W1: mini, 4 workers, batch 8x128, 2,000 steps")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--save",
        action="append",
        default=[],
        metavar="NAME=RUN_DIR",
        help="keep a finished run's validation curve as curves/NAME.csv",
    )
    p.add_argument("--plot", default="", help="draw every kept curve into this PNG")
    p.add_argument("--only", default="", help="comma-separated curve names to show (ddp's is always read)")
    args = p.parse_args()
    for spec in args.save:
        name, sep, run_dir = spec.partition("=")
        if not sep or not name or not Path(run_dir, "metrics").is_dir():
            raise SystemExit(f"--save takes NAME=RUN_DIR with RUN_DIR a run's directory, got {spec!r}")
        print(f"saved {save(name, Path(run_dir))}", file=sys.stderr)
    curves = {}
    for path in sorted(HERE.glob("w1-*.csv")):
        curves[path.stem] = read_csv(path)
    if "w1-ddp" not in curves:
        raise SystemExit(f"{HERE}/w1-ddp.csv is missing: every ratio is read against it")
    if args.only:
        keep = {"w1-ddp", *(f"w1-{n.removeprefix('w1-')}" for n in args.only.split(","))}
        curves = {k: v for k, v in curves.items() if k in keep}
    rows = table(curves)
    print(f"{'curve':42} {'points':>6} {'final':>7} {'smoothed':>8} {'at 1.0406':>9} {'tokens/ddp':>11}")
    for r in rows:
        at = r["step_at_target"] if r["step_at_target"] is not None else "-"
        print(
            f"{r['curve']:42} {r['points']:>6} {r['final']:>7.4f} {r['final_smoothed']:>8.4f} {at!s:>9} "
            f"{r['tokens_vs_ddp']:>11}"
        )
    if args.plot:
        plot(curves, Path(args.plot))
        print(f"wrote {args.plot}", file=sys.stderr)


if __name__ == "__main__":
    main()
