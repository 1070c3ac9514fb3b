"""W1's headline: how soon each algorithm's defaults reach DDP's loss, link by link.

    python benchmarks/w1_headline.py                          # 100 and 20 Mbit/s, ~25 minutes
    python benchmarks/w1_headline.py --bandwidths 3.5mbit --algos nosync,sparseloco,diloco
    python benchmarks/w1_headline.py --algos sparseloco:H=5,diloco:H=2   # a setting beside the defaults
    python benchmarks/w1_headline.py --plot docs/w1-headline.png          # and draw what it measured

Time to a loss is tokens to that loss times time per token. The two are measured apart, as
``geotrain bench --horizon`` composes them, because a 2,000-step run on shaped links takes hours
here:

- **tokens**: each default's 2,000-step validation curve on loopback (W1: ``mini``, 4 workers,
  batch 8 x 128, the same seeds and batches), kept in ``benchmarks/curves/`` and read by
  ``w1_curves.py``: the tokens it needs to reach DDP's final loss, over DDP's (``~``: read where
  the curve ends above it, on DDP's curve);
- **time per step**: each default run on the emulated links for ``--steps`` steps (every
  algorithm at its own defaults: no ``--H``, no ``--compress``), one after another in one
  session, beside ``nosync`` (no communication) before and after; the mean of steps 3 to the
  last but one, on rank 0.

The composed figure is tokens x step / nosync's step: how many of nosync's step-times the
algorithm needs per DDP step's worth of progress towards DDP's loss (DDP's own is its step over
nosync's). Lower is sooner; "vs ddp" is DDP's figure over the algorithm's. A rerun with the same
``--out`` skips the runs already finished.

``--plot PNG`` draws it: each cell's kept curve against tokens, then, one panel per rate, the
same curves against time in nosync's step-times (each step stretched by the cell's measured step
over nosync's, on a log scale), where the curve furthest left reaches a loss soonest.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from w1_curves import HERE, read_csv, table  # noqa: E402

from geotrain.compress import run_codec  # noqa: E402
from geotrain.launch.disk import drop_states  # noqa: E402

# each algorithm's defaults, and the curve that measured them over 2,000 steps (None: the run
# chooses its period, --H auto, and the curve is the one kept at that period: ``curve_of``)
CURVES: dict[str, str | None] = {
    "ddp": "w1-ddp",
    "localsgd": "w1-localsgd-H10",
    "diloco": "w1-diloco-int4-H10",
    "dreamddp": "w1-dreamddp-int4-H2-lr1",
    "sparseloco": None,
    "streaming": "w1-streaming-carry-H20",  # --carry, its default since; w1-streaming-H20: the mix
    "co2": None,  # --tau auto: the curve of the landing it chooses (``curve_of``)
}
ALGOS = ["nosync", *CURVES]


def cell(spec: str) -> tuple[str, list[str], str | None]:
    """``ALGO`` (its defaults) or ``ALGO:H=N[,compress=C][,bits=B][,tau=T]`` (a setting beside
    them): the algorithm, the run's extra flags, and the kept curve that measured it
    (``w1-ALGO[-C]-HN[-tauT]``, C the codec the run sends, the algorithm's default where none is
    given; None for ``H=auto``, whose curve is the one of the period it chooses: ``curve_of``,
    and for ``tau=auto``, whose tau depends on the link)."""
    algo, _, rest = spec.partition(":")
    if algo not in ALGOS:
        raise SystemExit(f"--algos: {algo!r} is not one of {', '.join(ALGOS)}")
    if not rest:
        return algo, [], CURVES.get(algo)
    opts = dict(kv.partition("=")[::2] for kv in rest.split(","))
    unknown = set(opts) - {"H", "compress", "bits", "tau"}
    if unknown or not (opts.get("H", "").isdigit() or opts.get("H") == "auto"):
        raise SystemExit(
            f"--algos: {spec!r}: give ALGO:H=N[,compress=C][,bits=B][,tau=T] (N a period or auto)"
        )
    flags = ["--H", opts["H"]] + (["--compress", opts["compress"]] if "compress" in opts else [])
    flags += ["--bits", opts["bits"]] if "bits" in opts else []
    flags += ["--tau", opts["tau"]] if "tau" in opts else []
    codec = run_codec(algo, opts.get("compress", ""))  # diloco's default: int4
    if opts.get("bits") in ("4", "8"):  # co2's and streaming's own messages
        codec = f"int{opts['bits']}"
    codec = f"-{codec}" if codec and codec != "none" else ""
    tau = f"-tau{opts['tau']}" if "tau" in opts else ""
    auto = "auto" in (opts["H"], opts.get("tau"))
    return algo, flags, None if auto else f"w1-{algo}{codec}-H{opts['H']}{tau}"


def curve_of(algo: str, curve: str | None, result: dict) -> str | None:
    """The kept curve of a run: its cell's, or where the run chose its own period (``--H auto``),
    the curve measured at that period (``w1-ALGO-HN``) where one is kept; for DreamDDP's default
    (``--compress auto``), the curve of the codec it chose (``w1-dreamddp-CODEC-H2``; int4's is
    ``CURVES``'s); for CO2's (``--tau auto``), the curve of the landing it chose
    (``w1-co2-int4-H10-tauT``; a period late, ``w1-co2-int4-H10``)."""
    config = str(result.get("algo_config", ""))
    chosen_tau = re.search(r"tau=auto \([^:]*: (\d+)\)", config)
    if algo == "co2" and curve is None and chosen_tau:  # CO2's default: where it chose to land
        H = re.search(r"\bH=(\d+)", config)[1]
        kept = f"w1-co2-int4-H{H}" + ("" if chosen_tau[1] == H else f"-tau{chosen_tau[1]}")
        return kept if (HERE / f"{kept}.csv").exists() else None
    chosen_codec = re.search(r"compress=auto \((\w+)", config)
    if algo == "dreamddp" and curve == CURVES["dreamddp"] and chosen_codec and chosen_codec[1] != "int4":
        kept = f"w1-dreamddp-{chosen_codec[1]}-H2"
        return kept if (HERE / f"{kept}.csv").exists() else None
    period = str(result.get("periods", ""))
    if curve is not None or not (period.startswith("H=") and period[2:].isdigit()):
        return curve
    chosen = f"w1-{algo}-H{period[2:]}"
    return chosen if (HERE / f"{chosen}.csv").exists() else None


def tokens_vs_ddp(curves: dict[str, str]) -> dict[str, tuple[float, str]]:
    """Per cell whose curve is kept (cell -> curve name): its tokens to DDP's final loss over
    DDP's, and how the figure reads (``~``: approximate)."""
    kept = {curve for curve in curves.values() if (HERE / f"{curve}.csv").exists()}
    rows = table({curve: read_csv(HERE / f"{curve}.csv") for curve in {"w1-ddp", *kept}})
    # "not reached", "to step N": no ratio
    by_curve = {row["curve"]: (row["ratio"], str(row["tokens_vs_ddp"])) for row in rows if row.get("ratio")}
    return {name: by_curve[curve] for name, curve in curves.items() if curve in by_curve}


def mean_step(run_dir: Path) -> float:
    """Rank 0's mean step time over steps 3 to the last but one (the first pay for warm-up, the
    last for the final average and snapshot)."""
    records = [json.loads(x) for x in (run_dir / "metrics" / "rank0.jsonl").read_text().splitlines()]
    timed = {r["step"]: r["step_s"] for r in records if "step_s" in r}
    return statistics.fmean(t for step, t in timed.items() if 3 <= step < max(timed))


def run(
    algo: str, bandwidth: str, steps: int, out: Path, name: str, model: str = "mini", flags: tuple = ()
) -> dict:
    run_dir = out / bandwidth / name
    done = run_dir / "headline.json"
    if done.exists():
        return json.loads(done.read_text())
    cmd = [sys.executable, "-m", "geotrain", "run", "--workers", "4", "--bandwidth", bandwidth,
           "--model", model, "--batch-size", "8", "--steps", str(steps), "--algo", algo,
           "--run-dir", str(run_dir), "--no-progress", *flags]  # fmt: skip
    print(f"w1_headline: {bandwidth} {name} ({steps} steps)", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{algo} at {bandwidth} failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    result = {
        "step_s": mean_step(run_dir),
        "sent_mb_per_step": summary.get("sent_bytes_per_step", 0) / 1e6,
        "algo_config": summary.get("algo_config", ""),
        "codec": summary.get("codec_info", ""),
        "periods": summary.get("periods", ""),
    }
    drop_states(run_dir)
    done.write_text(json.dumps(result))
    return result


def plot(measured: dict[str, dict], out: Path) -> None:
    """``measured``: per rate, the cells' curves and step times over nosync's (``main``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from w1_curves import DDP_FINAL

    rates = list(measured)
    fig, axes = plt.subplots(1, 1 + len(rates), figsize=(5.2 * (1 + len(rates)), 4.6), sharey=True)
    first = measured[rates[0]]
    for name, (curve, _) in first.items():
        steps, losses = read_csv(HERE / f"{curve}.csv")
        axes[0].plot([s * 4096 / 1e6 for s in steps], losses, lw=2.2 if name == "ddp" else 1.3, label=name)
    axes[0].set_xlabel("tokens (millions)")
    axes[0].set_title("per token (2,000-step curves on loopback)")
    for ax, rate in zip(axes[1:], rates, strict=True):
        for name, (curve, stretch) in measured[rate].items():
            steps, losses = read_csv(HERE / f"{curve}.csv")
            ax.plot([s * stretch for s in steps], losses, lw=2.2 if name == "ddp" else 1.3, label=name)
        ax.set_xlabel("time, in nosync's step-times (log)")
        ax.set_xscale("log")
        ax.set_xlim(100, None)
        ax.set_title(f"per unit of time at {rate}")
    for ax in axes:
        ax.axhline(DDP_FINAL, color="grey", ls=":", lw=1)
        ax.set_ylim(0.95, 2.2)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("validation loss (W1: mini, 4 workers, 8 x 128)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(f"w1_headline: drew {out}", file=sys.stderr)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bandwidths", default="100mbit,20mbit")
    p.add_argument("--algos", default=",".join(ALGOS), help="nosync runs first and last whatever is given")
    p.add_argument("--steps", type=int, default=23, help="steps per run (H=20's period fits in 3 to 22)")
    p.add_argument("--ddp-steps", type=int, default=8, help="ddp's steps (a step of 7-32 s here)")
    p.add_argument("--out", type=Path, default=Path("runs/w1-headline"))
    p.add_argument("--model", default="mini", help="W1's; another only to try the script out")
    p.add_argument("--plot", type=Path, default=None, help="draw the curves per token and per unit of time")
    args = p.parse_args()
    drawn: dict[str, dict] = {}
    specs = [a for a in re.split(r",(?![^:,]*=)", args.algos) if a and a != "nosync"]
    cells = {spec: cell(spec) for spec in specs}
    for bandwidth in args.bandwidths.split(","):
        results = {
            "nosync-before": run("nosync", bandwidth, args.steps, args.out, "nosync-before", args.model)
        }
        for spec, (algo, flags, _) in cells.items():
            steps = args.ddp_steps if algo == "ddp" else args.steps
            name = spec.replace(":", "-").replace(",", "-").replace("=", "")
            results[spec] = run(algo, bandwidth, steps, args.out, name, args.model, flags)
        results["nosync-after"] = run("nosync", bandwidth, args.steps, args.out, "nosync-after", args.model)
        nosync = statistics.fmean([results["nosync-before"]["step_s"], results["nosync-after"]["step_s"]])
        curves = {spec: curve_of(algo, curve, results[spec]) for spec, (algo, _, curve) in cells.items()}
        tokens = tokens_vs_ddp({spec: curve for spec, curve in curves.items() if curve})
        drawn[bandwidth] = {
            spec: (curve, results[spec]["step_s"] / nosync)
            for spec, curve in curves.items()
            if curve and (HERE / f"{curve}.csv").exists()
        }
        print(f"\n{bandwidth}: nosync {results['nosync-before']['step_s']:.3f} s before, "
              f"{results['nosync-after']['step_s']:.3f} s after (mean {nosync:.3f})\n")  # fmt: skip
        print("| algorithm (defaults) | step s | nosync / step | sent MB/step | tokens to ddp's loss "
              "| nosync step-times per ddp step | vs ddp |")  # fmt: skip
        print("|---|---|---|---|---|---|---|")
        ddp_composed = results["ddp"]["step_s"] / nosync if "ddp" in results else None
        for algo in cells:
            r = results[algo]
            ratio, text = tokens.get(algo, (None, "-"))
            composed = None if ratio is None else ratio * r["step_s"] / nosync
            vs = f"{ddp_composed / composed:.1f}x" if composed and ddp_composed else "-"
            shown = "-" if composed is None else f"{ratio:.2f} x {r['step_s'] / nosync:.2f} = {composed:.2f}"
            name = f"{algo} ({r['periods']})" if r.get("periods") and r["periods"] != "-" else algo
            print(f"| {name} | {r['step_s']:.3f} | {nosync / r['step_s']:.2f} | {r['sent_mb_per_step']:.2f} "
                  f"| {text} | {shown} | {vs} |")  # fmt: skip
    if args.plot:
        plot(drawn, args.plot)


if __name__ == "__main__":
    main()
