"""The measurement commands, ``geotrain bench`` (algorithms x links x workers: ``bench/matrix.py``)
and ``geotrain soak`` (training through faults: ``bench/soak.py``), and ``geotrain sweep``, which
removes what crashed runs of any command left behind (namespaces, bridges, lingering keepers).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from geotrain.cli_common import Parser, UsageError, attach_dash_values, check_disk, check_model_and_data
from geotrain.data.corpus import DataError
from geotrain.ft.chaos import ChaosError, parse_chaos
from geotrain.models import ModelError
from geotrain.netem.cluster import sweep_stale
from geotrain.netem.links import LinkSpecError
from geotrain.sync import ConfigError


def cmd_bench(argv: list[str]) -> int:
    from geotrain.bench.matrix import DEFAULT_ALGOS, DEFAULT_BANDWIDTHS, Bench, BenchConfig
    from geotrain.bench.report import markdown_table, scale_table, write_report
    from geotrain.launch.disk import state_copies
    from geotrain.launch.local import RunFailed
    from geotrain.train_config import warmup_arg

    p = Parser(
        prog="geotrain bench",
        description="Algorithms x links x workers on the emulated cluster: "
        "time to loss, step-time breakdown, plots and a report.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--quick", action="store_true", help="a small matrix for CI: 2 workers, 100mbit, 4 algorithms"
    )
    p.add_argument(
        "--algos",
        default=",".join(DEFAULT_ALGOS),
        help="algorithms, each optionally with a codec: ssgd+int8, ssgd+acpsgd:rank=4, diloco+int4 "
        "(codec parameters separated by ';')",
    )
    p.add_argument(
        "--bandwidths",
        default=",".join(DEFAULT_BANDWIDTHS),
        help="link rates, one matrix column each; the report says what each stands for on an H100",
    )
    p.add_argument(
        "--workers", default="4", help="worker counts, e.g. 2,4,8 (several: predictions are checked)"
    )
    p.add_argument("--model", default="tiny", help="tiny, mini, small, hf:DIR or hf:TYPE (as geotrain run)")
    p.add_argument("--model-config", dest="model_config", default="", help="NAME=VALUE,... (as geotrain run)")
    p.add_argument("--lora", default="", help="r=8,alpha=16,targets=q_proj,v_proj (as geotrain run)")
    p.add_argument("--lora-fa", dest="lora_fa", action="store_true", help="LoRA-FA (as geotrain run)")
    p.add_argument("--data", default="", help="as geotrain run (empty: the standard library's sources)")
    p.add_argument("--tokenizer", default="", help="as geotrain run: --data tokenized once, cached")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch-size", dest="batch_size", type=int, default=32)
    p.add_argument("--eval-every", dest="eval_every", type=int, default=15)
    p.add_argument("--H", type=int, default=8, help="localsgd and diloco period (dreamddp plans its own)")
    p.add_argument("--max-H", dest="max_H", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--target-loss",
        dest="target_loss",
        type=float,
        default=None,
        help="default: the loss ddp reaches at the token budget",
    )
    p.add_argument(
        "--smooth",
        type=int,
        default=3,
        help="evaluations in the centred moving mean each validation curve is read through (odd; 1: raw)",
    )
    p.add_argument(
        "--lr-schedule",
        dest="lr_schedule",
        default="constant",
        help="every cell's learning rate: constant, or cosine over --steps (over --horizon with one)",
    )
    p.add_argument(
        "--warmup",
        type=warmup_arg,
        default="auto",
        help="every cell's learning-rate warm-up in steps; auto: a tenth of the planned steps "
        "(--horizon or --steps), at most 100 (demo: none), as geotrain run's",
    )
    p.add_argument(
        "--horizon",
        type=int,
        default=0,
        help="time to the loss of a run this many steps long: each cell's learning curve comes from "
        "a run of HORIZON steps on loopback (same workers, seeds, batches), its time from the "
        "step time of the --steps run on the shaped link (composed; the report says so and checks "
        "the two curves against each other over --steps)",
    )
    p.add_argument(
        "--cell-budget",
        dest="cell_budget",
        type=float,
        default=300.0,
        help="seconds: a shaped cell the planner predicts to run longer is not run, and the report "
        "gives its predicted step time (0: run every cell)",
    )
    p.add_argument("--no-netem", action="store_true", help="loopback, unshaped (no predictions checked)")
    p.add_argument(
        "--keep-states",
        action="store_true",
        help="keep each cell's saved states (snapshots/, checkpoint.pt: 0.6-1.1 GB a cell of mini on "
        "4 hosts); by default they are removed once the cell has finished, the report reads metrics",
    )
    p.add_argument(
        "--out", default="", help="the bench directory (a rerun resumes it); default runs/bench-<time>"
    )
    args = p.parse_args(attach_dash_values(argv, ("--H", "--steps", "--workers")))
    if args.quick:
        args.workers, args.bandwidths, args.algos = "2", "100mbit", "nosync,ddp,localsgd,dreamddp"
        args.steps, args.eval_every, args.batch_size = 30, 10, 16
    try:
        workers = [int(w) for w in args.workers.split(",")]
    except ValueError:
        raise UsageError(f"--workers takes comma-separated integers, got {args.workers!r}") from None
    try:
        cfg = BenchConfig(
            algos=args.algos.split(","),
            bandwidths=args.bandwidths.split(","),
            workers=workers,
            model=args.model,
            model_config=args.model_config,
            lora=args.lora,
            lora_fa=args.lora_fa,
            data=args.data,
            tokenizer=args.tokenizer,
            steps=args.steps,
            batch_size=args.batch_size,
            eval_every=args.eval_every,
            H=args.H,
            max_H=args.max_H,
            seed=args.seed,
            target_loss=args.target_loss,
            netem=not args.no_netem,
            smooth=args.smooth,
            lr_schedule=args.lr_schedule,
            warmup=args.warmup,
            horizon=args.horizon,
            cell_budget_s=args.cell_budget,
            keep_states=args.keep_states,
        )
        # The model and data every cell will use, checked (and text tokenized) once, here.
        check_model_and_data(cfg.train_config("nosync"), max(cfg.workers))
        # Room for the largest cell's states (removed once it has finished, but --keep-states).
        cells = [cfg.train_config(entry) for entry in cfg.algos]
        largest = max(cells, key=lambda c: state_copies(c.algo, c.compress, bool(c.lora)))
        check_disk(Path(args.out or "runs"), largest, max(cfg.workers))
    except (ConfigError, DataError, LinkSpecError, ModelError) as e:
        raise UsageError(str(e)) from None
    out = Path(args.out or f"runs/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    bench = Bench(cfg, out, echo=lambda msg: print(f"geotrain: {msg}", file=sys.stderr))
    try:
        results = bench.run()
    except ConfigError as e:
        raise UsageError(str(e)) from None
    except RunFailed as e:
        print(
            f"geotrain: bench cell failed: {e}\ngeotrain: rerun the same command to resume", file=sys.stderr
        )
        return 1
    except KeyboardInterrupt:
        print(
            f"\ngeotrain: interrupted; finished cells are kept. Resume: geotrain bench ... --out {out}",
            file=sys.stderr,
        )
        return 130
    report = write_report(results, out)
    print(markdown_table(results))
    if results["scale"]:
        print("\n" + scale_table(results))
    print(f"\nreport: {report['html']}\nnumbers: {out / 'bench.json'}")
    return 0


def _soak_H(text: str) -> int | str:
    """``--H`` of a soak: a period, or ``auto`` passed on as it is."""
    from geotrain.train_config import AUTO_H, H_arg

    return "auto" if H_arg(text) == AUTO_H else H_arg(text)


def cmd_soak(argv: list[str]) -> int:
    from geotrain.bench.soak import SoakJob, soak

    p = Parser(
        prog="geotrain soak",
        description="Train under a fault every so often and compare with the same run undisturbed.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    job = SoakJob()
    p.add_argument("--workers", type=int, default=job.workers)
    p.add_argument("--bandwidth", default=job.bandwidth)
    p.add_argument("--model", default=job.model)
    p.add_argument("--algo", default=job.algo)
    p.add_argument("--H", type=_soak_H, default=job.H, help="the period, or auto (as geotrain run)")
    p.add_argument("--batch-size", dest="batch_size", type=int, default=job.batch_size)
    p.add_argument(
        "--steps",
        type=int,
        default=job.steps,
        help="steps of each run (4 mini hosts at 100mbit, diloco: ~19 a minute undisturbed)",
    )
    p.add_argument("--eval-every", dest="eval_every", type=int, default=job.eval_every)
    p.add_argument(
        "--kill-every", dest="kill_every", default="60s", help="a random worker SIGKILLed this often"
    )
    p.add_argument(
        "--restart", default="5", help="seconds until a replacement joins (0: none; the run shrinks)"
    )
    p.add_argument("--fault-timeout", dest="fault_timeout", type=float, default=job.fault_timeout)
    p.add_argument(
        "--spares", type=int, default=0, help="hosts waiting in a backup pool to replace the killed at once"
    )
    p.add_argument("--model-config", dest="model_config", default="", help="NAME=VALUE,... (as geotrain run)")
    p.add_argument("--lora", default="", help="r=8,alpha=16,targets=q_proj,v_proj (as geotrain run)")
    p.add_argument("--lora-fa", dest="lora_fa", action="store_true", help="LoRA-FA (as geotrain run)")
    p.add_argument("--out", default="runs/soak")
    args = p.parse_args(argv)
    from geotrain.train_config import TrainConfig

    try:  # refused here in one line, not after the first run has started
        TrainConfig(model=args.model, model_config=args.model_config, lora=args.lora, lora_fa=args.lora_fa)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    extra = ["--model-config", args.model_config] if args.model_config else []
    extra += ["--lora", args.lora] if args.lora else []
    extra += ["--lora-fa"] if args.lora_fa else []
    restart = f",restart={args.restart}" if args.restart not in ("", "0") else ""
    chaos = f"kill:every={args.kill_every}{restart}"
    try:
        parse_chaos(chaos, args.workers)
    except ChaosError as e:
        raise UsageError(str(e)) from None
    if args.spares < 0:
        raise UsageError(f"--spares must be >= 0, got {args.spares}")
    for name in ("workers", "H", "batch_size", "steps", "eval_every"):
        if name == "H" and getattr(args, name) in ("auto", 0):  # 0: the algorithm's default
            continue
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    job = SoakJob(
        **{k: getattr(args, k) for k in SoakJob.__dataclass_fields__ if k not in ("extra", "on_failure")},
        extra=tuple(extra),
    )
    try:
        soak(job, chaos, Path(args.out))
    except RuntimeError as e:
        print(f"geotrain soak: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_sweep(argv: list[str]) -> int:
    from geotrain.launch.keepers import stop_lingering_keepers

    p = Parser(prog="geotrain sweep", description="Remove namespaces and bridges of dead geotrain runs.")
    p.add_argument(
        "--keepers",
        action="store_true",
        help="also stop keepers whose launcher is gone (their snapshots in memory are lost; disk stays)",
    )
    args = p.parse_args(argv)
    removed = sweep_stale()
    print(f"removed {len(removed)}: {' '.join(removed)}" if removed else "nothing to remove")
    if args.keepers:
        stopped = stop_lingering_keepers()
        print(f"stopped {len(stopped)} keepers" if stopped else "no lingering keepers")
    return 0
