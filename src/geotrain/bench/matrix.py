"""``geotrain bench``: a matrix of algorithms x link bandwidths x worker counts, side by side.

Every cell trains the same model on the same data with the same seed for the same number of
tokens, on the emulated cluster, and is written to ``cells/<W>x<bandwidth>/<algo>/``. A cell whose
``summary.json`` exists is finished and is skipped by a rerun, so an interrupted bench resumes.

For each (workers, bandwidth) group: the target loss is the loss ``ddp`` reaches at the token
budget (or ``--target-loss``); each algorithm's time to it is read from its validation curve; the
efficiency is ``nosync``'s step time over the algorithm's. ``dreamddp`` is profiled and planned
once per group (``--choose``). Predictions: one profile per bandwidth, taken on the smallest
worker count, is scaled to every group by the network model, and compared with the measured step
times; on this emulated cluster compute times are scaled by the workers' share of the cores.

An algorithm entry may name a codec: ``ssgd+int8``, ``ssgd+acpsgd:rank=4``, ``diloco+int4``
(several codec parameters are separated by ``;`` since ``,`` separates entries).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from geotrain.api import LR_SCALE_DEFAULT, checked_lr_scale
from geotrain.bench.curves import (
    Curve,
    agreement,
    compose,
    final_loss,
    read_curve,
    step_times,
    time_to_target,
    tokens_to_target,
)
from geotrain.compress import run_codec
from geotrain.launch.disk import drop_states
from geotrain.launch.local import LaunchConfig, RunFailed, run_local_cluster
from geotrain.metrics import read_metrics
from geotrain.netem.cluster import netem_unavailable_reason
from geotrain.netem.links import parse_bandwidths
from geotrain.plan.codec_time import codec_key
from geotrain.plan.gather import stands_for_bps
from geotrain.plan.planner import (
    CODEC_ALGOS,
    PREDICTED,
    ChooseConfig,
    codec_priced,
    make_plan,
    predict_algo,
    retarget,
    shared_cores,
)
from geotrain.plan.schedule import schedule_from_json
from geotrain.sync import ALGORITHMS, ConfigError, sync_config
from geotrain.train_config import AUTO_WARMUP, TrainConfig, warmup_for


def split_entry(entry: str) -> tuple[str, str]:
    """``"ssgd+acpsgd:rank=4;seed=1"`` -> ``("ssgd", "acpsgd:rank=4,seed=1")``."""
    algo, _, codec = entry.partition("+")
    return algo, codec.replace(";", ",")


def cell_name(entry: str) -> str:
    """A directory name for an entry (codec specs hold ``:`` and ``=``)."""
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", entry)


DEFAULT_ALGOS = (
    "nosync",
    "ddp",
    "ddp_powersgd",
    "ssgd",
    "localsgd",
    "diloco",
    "dreamddp",
    "sparseloco",
    "demo",
    "streaming",
    "co2",
)
# 3.5 Mbit/s and 350 kbit/s are where the frontier methods matter: W1 there stands for an H100 on
# about 100 and 10 Mbit/s (plan/gather.py); the dense methods' cells there mostly exceed the
# cell budget and are reported as predicted, not run.
DEFAULT_BANDWIDTHS = ("1gbit", "100mbit", "20mbit", "3.5mbit", "350kbit")


@dataclass
class BenchConfig:
    algos: list[str] = field(default_factory=lambda: list(DEFAULT_ALGOS))
    bandwidths: list[str] = field(default_factory=lambda: list(DEFAULT_BANDWIDTHS))
    workers: list[int] = field(default_factory=lambda: [4])
    model: str = "tiny"
    model_config: str = ""  # NAME=VALUE,... resizing the model (geotrain run --model-config)
    lora: str = ""  # r=8,alpha=16,targets=...: fine-tune adapters only (geotrain run --lora)
    lora_fa: bool = False
    data: str = ""  # "": the standard library's sources
    tokenizer: str = ""
    steps: int = 120
    batch_size: int = 16
    eval_every: int = 10
    H: int = 8
    max_H: int = 16
    seed: int = 0
    target_loss: float | None = None
    netem: bool = True
    smooth: int = 3  # evaluations in the centred moving mean every curve is read through
    lr_schedule: str = "constant"  # the same for every cell: constant or cosine (over the horizon)
    warmup: int = AUTO_WARMUP  # every cell's warm-up (auto: geotrain run's, over the horizon with one)
    horizon: int = 0  # > 0: learning curves from runs of this many steps on loopback (composed)
    # A shaped cell predicted to take longer than this (seconds) is not run; the report gives its
    # predicted step time. 0: run every cell.
    cell_budget_s: float = 300.0
    # Each cell's saved states (snapshots, checkpoint) are removed once it has finished: the
    # report reads metrics. True keeps them (to resume or export a cell).
    keep_states: bool = False

    def __post_init__(self) -> None:
        for entry in self.algos:
            algo, codec = split_entry(entry)
            if algo not in ALGORITHMS:
                raise ConfigError(f"unknown algorithm {algo!r}; accepted: {', '.join(ALGORITHMS)}")
            # the codec, that algo takes one, and that --H suits it (streaming: H / fragments > tau)
            sync_config(algo, {"compress": codec, "H": self.H})
        if len({cell_name(a) for a in self.algos}) < len(self.algos):
            raise ConfigError(f"the algorithm entries repeat: {', '.join(self.algos)}")
        if not self.algos or not self.bandwidths or not self.workers:
            raise ConfigError("the matrix needs at least one algorithm, bandwidth and worker count")
        for w in self.workers:
            if not 1 <= w <= 64:
                raise ConfigError(f"bench worker counts must be 1 to 64, got {w}")
            for bw in self.bandwidths:
                parse_bandwidths(bw, w)
        if self.horizon and self.horizon < self.steps:
            raise ConfigError(
                f"--horizon ({self.horizon}) must be at least --steps ({self.steps}), the shaped runs' length"
            )
        if not self.cell_budget_s >= 0:
            raise ConfigError(
                f"--cell-budget must be >= 0 seconds (0: run every cell), got {self.cell_budget_s}"
            )
        if self.smooth < 1 or self.smooth % 2 == 0:
            raise ConfigError(f"--smooth must be an odd number of evaluations >= 1, got {self.smooth}")
        if self.eval_every < 1 or self.steps < self.eval_every:
            raise ConfigError(f"--eval-every must be 1 to --steps ({self.steps}), got {self.eval_every}")
        job = {"model": self.model, "steps": self.steps, "batch_size": self.batch_size, "H": self.H}
        model = {"model_config": self.model_config, "lora": self.lora, "lora_fa": self.lora_fa}
        TrainConfig(**job, **model, lr_schedule=self.lr_schedule)  # validates

    def groups(self) -> list[tuple[int, str]]:
        return [(w, bw) for w in self.workers for bw in self.bandwidths]

    def train_config(self, entry: str) -> TrainConfig:
        algo, codec = split_entry(entry)
        return TrainConfig(
            algo=algo,
            compress=codec,
            model=self.model,
            model_config=self.model_config,
            lora=self.lora,
            lora_fa=self.lora_fa,
            data=self.data,
            tokenizer=self.tokenizer,
            steps=self.steps,
            batch_size=self.batch_size,
            eval_every=self.eval_every,
            H=self.H,
            seed=self.seed,
            lr_schedule=self.lr_schedule,
            warmup=self.warmup,
            # With a horizon the shaped runs follow the first part of the long runs' schedule, so
            # their curves can be checked against the composed ones step for step.
            lr_steps=self.horizon,
            progress=False,
            replan_threshold=0.0,
        )


def _warmup_steps(cfg: dict[str, Any]) -> int:
    """The warm-up a bench config gives its cells (auto resolved over its horizon or steps)."""
    warmup = int(cfg.get("warmup", 0))
    return warmup_for(cfg.get("horizon") or cfg["steps"]) if warmup == AUTO_WARMUP else warmup


def group_dir(out: Path, workers: int, bandwidth: str) -> Path:
    return out / "cells" / f"{workers}x{bandwidth}"


def compute_share(workers: int, cores: int | None = None) -> float:
    """How many workers share each core on this machine (>= 1)."""
    return max(1.0, workers / (cores or os.cpu_count() or 1))


class Bench:
    def __init__(self, cfg: BenchConfig, out: Path, echo=print) -> None:
        self.cfg = cfg
        self.out = out
        self.echo = echo
        self._said_untimed: set[Path] = set()  # profiles already said to lack a cell's codec times

    def cells(self) -> list[tuple[int, str, str]]:
        return [(w, bw, algo) for w, bw in self.cfg.groups() for algo in self.cfg.algos]

    def finished(self, w: int, bw: str, algo: str) -> bool:
        return (group_dir(self.out, w, bw) / cell_name(algo) / "summary.json").exists()

    def curve_dir(self, w: int, bw: str, algo: str) -> Path:
        """Where the long loopback run for a cell goes. Its learning curve does not depend on the
        link, so cells of other bandwidths share it; dreamddp's does (its plan is made for the
        link), so it has one per bandwidth."""
        name = cell_name(algo) + (f"@{bw}" if split_entry(algo)[0] == "dreamddp" else "")
        return self.out / "curves" / f"{w}x{self.cfg.horizon}steps" / name

    def curve_runs(self) -> list[tuple[int, str, str]]:
        if not self.cfg.horizon:
            return []
        runs, seen = [], set()
        for w, bw, algo in self.cells():
            if self.curve_dir(w, bw, algo) not in seen:
                seen.add(self.curve_dir(w, bw, algo))
                runs.append((w, bw, algo))
        return runs

    def curve_unused(self, w: int, bw: str, algo: str) -> bool:
        """Whether every cell that would read this long run was skipped (predicted over budget)."""
        mine = self.curve_dir(w, bw, algo)
        readers = [(w2, bw2, a) for w2, bw2, a in self.cells() if self.curve_dir(w2, bw2, a) == mine]
        return all(self.skipped(w2, bw2, a) for w2, bw2, a in readers)

    def skipped(self, w: int, bw: str, algo: str) -> bool:
        """A cell not run, its prediction over the budget (and not run since, with a larger one)."""
        cell = group_dir(self.out, w, bw) / cell_name(algo)
        return not (cell / "summary.json").exists() and (cell / "skipped.json").exists()

    def run_curve(self, w: int, bw: str, algo: str) -> None:
        """The cell's configuration for ``horizon`` steps on loopback, unshaped."""
        cfg = replace(self.cfg.train_config(algo), steps=self.cfg.horizon)
        if cfg.algo == "dreamddp" and cfg.compress != "auto":  # auto: the run chooses, and plans
            cfg = replace(cfg, plan=str(self.plan(w, bw).resolve()))
        launch = replace(self._launch(w, bw, self.curve_dir(w, bw, algo)), rates_bps=None, netem=False)
        run_local_cluster(replace(launch, timeout_s=7 * 24 * 3600.0), cfg)
        self._drop_states(launch.run_dir)

    def _launch(self, w: int, bw: str, run_dir: Path) -> LaunchConfig:
        return LaunchConfig(
            w,
            parse_bandwidths(bw, w) if self.cfg.netem else None,
            run_dir,
            netem=self.cfg.netem,
            echo=False,
            timeout_s=3600,
            # A cell measures an algorithm, not fault tolerance: a fault fails it, and no
            # membership machinery is in its timings.
            on_failure="stop",
        )

    def priced_codecs(self) -> list[str]:
        """The codecs of the cells the planner prices with one (``predict_step``): the profile
        times their encoding and decoding per layer, as a run with the codec spends them."""
        entries = (split_entry(entry) for entry in self.cfg.algos)
        specs = (run_codec(algo, codec) for algo, codec in entries if codec != "auto" and algo in CODEC_ALGOS)
        return list(dict.fromkeys(spec for spec in specs if spec))  # "" and "none": fp32

    def profile(self, w: int, bw: str) -> dict[str, Any]:
        path = group_dir(self.out, w, bw) / "profile.json"
        if not path.exists():
            cfg = replace(
                self.cfg.train_config("nosync"),
                profile_out=str(path.resolve()),
                profile_codecs=";".join(self.priced_codecs()),
            )
            run_local_cluster(self._launch(w, bw, group_dir(self.out, w, bw) / "profile-run"), cfg)
        profile = json.loads(path.read_text())
        untimed = [c for c in self.priced_codecs() if codec_key(c) not in profile.get("codecs", {})]
        if untimed and path not in self._said_untimed:  # a rerun that added codec cells
            self._said_untimed.add(path)
            self.echo(
                f"{path} does not time {', '.join(untimed)}: those cells are priced on their bytes "
                "alone (delete it to profile again)"
            )
        return profile

    def plan(self, w: int, bw: str) -> Path:
        path = group_dir(self.out, w, bw) / "plan.json"
        if not path.exists():
            choose = ChooseConfig(max_H=self.cfg.max_H)
            path.write_text(json.dumps(make_plan(self.profile(w, bw), None, choose), indent=2))
        return path

    def predict_step(self, w: int, bw: str, entry: str, profiled_at: int | None = None) -> float | None:
        """The planner's step time for a cell, from the profile taken on its link at ``profiled_at``
        workers (default: the cell's own), moved to the cell's processes per core (``shared_cores``); None
        for an algorithm the planner does not price (a codec, ddp_powersgd) or a dreamddp cell
        whose plan is not made yet. A codec is priced where the algorithm takes one (``codec_priced``:
        its wire bytes and phases, and its encoding and decoding as the profile timed them; a
        profile taken before it timed them prices none)."""
        algo, codec = split_entry(entry)
        if algo not in PREDICTED or (codec and algo not in CODEC_ALGOS) or codec == "auto":
            return None  # (auto: what the run will choose is its own start-up profile's to say)
        codec = run_codec(algo, codec) if algo in CODEC_ALGOS else ""  # diloco: int4 by default
        base = profiled_at or w
        profile = self.profile(base, bw)
        compute, link = retarget(profile, w, parse_bandwidths(bw, w))
        compute, link = shared_cores(compute, link, compute_share(w), compute_share(base), algo != "nosync")
        if codec:
            try:
                compute = codec_priced(profile, compute, codec, w)[0]
            except ValueError:  # a low-rank codec on a profile without shapes
                return None
        schedule = None
        if algo == "dreamddp":
            plan_path = group_dir(self.out, w, bw) / "plan.json"
            if not plan_path.exists():
                return None
            schedule, _ = schedule_from_json(json.loads(plan_path.read_text())["schedule"])
        return predict_algo(algo, compute, link, self.cfg.H, w, schedule)

    def over_budget(self, w: int, bw: str, algo: str) -> bool:
        """Whether a shaped cell is predicted to outlast ``cell_budget_s``; if so, its prediction
        goes to ``skipped.json`` in its directory (a rerun with a larger budget runs it)."""
        # nosync is every group's bound (efficiency, what a link stands for): it always runs.
        if not self.cfg.netem or not self.cfg.cell_budget_s or algo == "nosync" or netem_unavailable_reason():
            return False
        try:
            if split_entry(algo)[0] == "dreamddp":
                self.plan(w, bw)
            step = self.predict_step(w, bw, algo)
        except (ValueError, RunFailed) as e:  # no profile to predict from: run the cell
            self.echo(f"no prediction for {algo} on {w}x{bw} ({e}); running it")
            return False
        if step is None or step * self.cfg.steps <= self.cfg.cell_budget_s:
            return False
        run_dir = group_dir(self.out, w, bw) / cell_name(algo)
        run_dir.mkdir(parents=True, exist_ok=True)
        total = step * self.cfg.steps
        skipped = {"predicted_step_s": step, "predicted_run_s": total, "budget_s": self.cfg.cell_budget_s}
        (run_dir / "skipped.json").write_text(json.dumps(skipped) + "\n")
        self.echo(
            f"not running {algo} on {w}x{bw}: predicted {step:.2f} s/step, {total / 60:.0f} min for "
            f"{self.cfg.steps} steps, over --cell-budget {self.cfg.cell_budget_s:.0f} s"
        )
        return True

    def run_cell(self, w: int, bw: str, algo: str) -> None:
        run_dir = group_dir(self.out, w, bw) / cell_name(algo)
        cfg = self.cfg.train_config(algo)
        if cfg.algo == "dreamddp" and cfg.compress != "auto":  # auto: the run chooses, and plans
            cfg = replace(cfg, plan=str(self.plan(w, bw).resolve()))
        run_local_cluster(self._launch(w, bw, run_dir), cfg)
        self._drop_states(run_dir)

    def _drop_states(self, run_dir: Path) -> None:
        if not self.cfg.keep_states:
            drop_states(run_dir)

    def run(self) -> dict[str, Any]:
        from tqdm import tqdm

        self.out.mkdir(parents=True, exist_ok=True)
        self.check_reuse()
        (self.out / "config.json").write_text(json.dumps(self.recorded(), indent=2))
        cells = [(run, "cell") for run in self.cells()] + [(run, "curve") for run in self.curve_runs()]
        todo = [
            (c, kind)
            for c, kind in cells
            if not (self.finished(*c) if kind == "cell" else (self.curve_dir(*c) / "summary.json").exists())
        ]
        if len(todo) < len(cells):
            self.echo(f"resuming: {len(cells) - len(todo)} of {len(cells)} runs already finished")
        with tqdm(total=len(cells), initial=len(cells) - len(todo), unit="run", desc="bench") as bar:
            for (w, bw, algo), kind in todo:
                if kind == "cell":
                    bar.set_postfix_str(f"{algo} {w}x{bw}")
                    if not self.over_budget(w, bw, algo):
                        self.run_cell(w, bw, algo)
                elif not self.curve_unused(w, bw, algo):
                    bar.set_postfix_str(f"{algo} {w} workers, {self.cfg.horizon} steps on loopback")
                    self.run_curve(w, bw, algo)
                bar.update(1)
        results = self.collect()
        (self.out / "bench.json").write_text(json.dumps(results, indent=2) + "\n")
        return results

    def recorded(self) -> dict[str, Any]:
        """The config a bench directory keeps, with what its cells ran at that is not a field:
        each algorithm's local learning-rate scale (its own default, as ``geotrain run``'s)."""
        algos = [split_entry(entry)[0] for entry in self.cfg.algos]
        scales = {algo: checked_lr_scale(LR_SCALE_DEFAULT, algo) for algo in algos}
        codecs = {algo: codec for algo in algos if (codec := run_codec(algo, ""))}
        return {**asdict(self.cfg), "lr_scales": scales, "default_codecs": codecs}

    def check_reuse(self) -> None:
        """A rerun keeps the finished runs of the directory: refuse it where they were made
        differently (they would be compared with runs they do not compare with). The matrix may
        grow (algorithms, links, worker counts, a horizon), and the reading may change."""
        path = self.out / "config.json"
        if not path.exists():
            return
        old, new = json.loads(path.read_text()), self.recorded()
        # A bench made without the record ran every cell at 1 (dreamddp's was auto for one stop).
        was_scales, now_scales = old.pop("lr_scales", {}), new.pop("lr_scales")
        differ = sorted(a for a in now_scales if was_scales.get(a, "1") != now_scales[a])
        if differ and set(differ) & {split_entry(e)[0] for e in old.get("algos", [])}:
            raise ConfigError(
                f"{self.out} holds {', '.join(differ)} runs made at --lr-scale "
                f"{was_scales.get(differ[0], '1')}, where its default now is {now_scales[differ[0]]}: "
                "they would not compare with these; use another --out"
            )
        # A bench made before diloco's default was int4 ran it in fp32 (no record: none).
        was_codecs, now_codecs = old.pop("default_codecs", {}), new.pop("default_codecs")
        ran = {split_entry(e)[0] for e in old.get("algos", []) if not split_entry(e)[1]}
        moved = sorted(a for a in now_codecs if a in ran and was_codecs.get(a, "") != now_codecs[a])
        if moved:
            raise ConfigError(
                f"{self.out} holds {', '.join(moved)} runs made with {was_codecs.get(moved[0]) or 'fp32'}, "
                f"where its default now is {now_codecs[moved[0]]}: they would not compare with these; "
                f"use another --out, or name the codec ({moved[0]}+none)"
            )
        # Compared as the steps it gives: auto's follow the horizon (a bench made before the
        # warm-up's default was auto had none).
        was, now = _warmup_steps({"warmup": 0, **old}), _warmup_steps(new)
        if was != now:
            raise ConfigError(
                f"{self.out} holds runs made with {was} warm-up steps, not {now}; they would not "
                f"compare with these: use another --out (or --warmup {was})"
            )
        free = {
            "algos",
            "bandwidths",
            "workers",
            "smooth",
            "target_loss",
            "horizon",
            "cell_budget_s",
            "warmup",
        }
        if new["lr_schedule"] != "constant":
            free.discard("horizon")  # the cells' schedule is planned over the horizon
        # A key an older bench did not record had its field's default then.
        defaults = {f.name: f.default for f in fields(BenchConfig) if f.default is not MISSING}
        old = {**{k: v for k, v in defaults.items() if k not in old}, **old}
        changed = sorted(k for k in new if k not in free and k in old and old[k] != new[k])
        if changed:
            was = ", ".join(f"{k}={old[k]!r}" for k in changed)
            raise ConfigError(
                f"{self.out} holds runs made with {was}; they would not compare with these: "
                "use another --out (or the same flags to resume it)"
            )

    # -- numbers -------------------------------------------------------------------------------
    def collect(self) -> dict[str, Any]:
        groups = []
        for w, bw in self.cfg.groups():
            rows, skipped = {}, {}
            for algo in self.cfg.algos:
                run_dir = group_dir(self.out, w, bw) / cell_name(algo)
                if self.skipped(w, bw, algo):
                    skipped[algo] = json.loads((run_dir / "skipped.json").read_text())
                    continue
                summary = json.loads((run_dir / "summary.json").read_text())
                curve = read_curve(run_dir)
                rows[algo] = {"summary": summary, "curve": asdict(curve)}
                if self.cfg.horizon:
                    long_dir = self.curve_dir(w, bw, algo)
                    records = [
                        r for r in read_metrics(long_dir / "metrics" / "rank0.jsonl") if not r.get("final")
                    ]
                    timing = step_times(read_metrics(run_dir / "metrics" / "rank0.jsonl"))
                    synced = [r["synced"] for r in records]
                    composed = compose(read_curve(long_dir), synced, timing)
                    # The check compares like with like: a shaped run scores the replicas (one
                    # that fell back to loopback, without root, the mean, as the long run does).
                    shaped = summary.get("network_mode") != "loopback"
                    same_scoring = compose(read_curve(long_dir, replicas=shaped), synced, timing)
                    rows[algo] |= {
                        "curve": asdict(composed),
                        "measured_curve": asdict(curve),
                        "horizon_summary": json.loads((long_dir / "summary.json").read_text()),
                        "agreement": agreement(same_scoring, curve),
                    }
            groups.append(self._group(w, bw, rows, skipped))
        return {"config": asdict(self.cfg), "groups": groups, "scale": self._scale_check(groups)}

    def _group(self, w: int, bw: str, rows: dict[str, Any], skipped: dict[str, Any]) -> dict[str, Any]:
        """A group's figures, the cells not run (predicted) and what its link stands for on an
        H100 (``plan/gather.py``, from nosync's measured step here)."""
        group = self._derive(w, bw, rows)
        nosync = rows.get("nosync", {}).get("step_s")
        for row in skipped.values():
            row["efficiency"] = nosync / row["predicted_step_s"] if nosync else None
        group["skipped"] = skipped
        group["stands_for_bps"] = None
        if nosync and self.cfg.netem:
            params = rows["nosync"]["summary"]["parameters"]
            group["stands_for_bps"] = stands_for_bps(min(parse_bandwidths(bw, w)), nosync, params)
        return group

    def _derive(self, w: int, bw: str, rows: dict[str, Any]) -> dict[str, Any]:
        window = self.cfg.smooth
        target = self.cfg.target_loss
        if target is None and "ddp" in rows:
            target = final_loss(Curve(**rows["ddp"]["curve"]), window)
        nosync = rows.get("nosync", {}).get("summary", {}).get("step_s_mean")
        ddp_step = rows.get("ddp", {}).get("summary", {}).get("step_s_mean")
        # ddp's loss is often reached by no periodic method within a short budget; the loosest
        # final loss of the real algorithms (nosync is a bound, not one) is reached by all of them,
        # so time to it ranks every algorithm.
        finals = [final_loss(Curve(**r["curve"]), window) for a, r in rows.items() if a != "nosync"]
        common = max((f for f in finals if f is not None), default=None)
        ddp_ttt = ddp_common = None
        for algo, row in rows.items():
            s, curve = row["summary"], Curve(**row["curve"])
            reached = target is not None
            row["time_to_target_s"] = time_to_target(curve, target, window) if reached else None
            row["tokens_to_target"] = tokens_to_target(curve, target, window) if reached else None
            row["time_to_common_s"] = time_to_target(curve, common, window) if common is not None else None
            if algo == "ddp":
                ddp_ttt = row["time_to_target_s"]
                ddp_common = row["time_to_common_s"]
        for row in rows.values():
            s = row["summary"]
            step = s["step_s_mean"]
            blocked = s["blocked_s_mean"]
            row["step_s"] = step
            row["exposed_comm_s"] = blocked if blocked is not None else (step - nosync if nosync else None)
            row["exposed_comm_measured"] = blocked is not None
            # Where communication is not measurable, compute is what the exposed part leaves.
            row["compute_s"] = (
                s["compute_s_mean"] if blocked is not None or nosync is None else step - row["exposed_comm_s"]
            )
            row["tokens_per_s"] = s["tokens_per_s"]
            row["sent_bytes_per_step"] = s["sent_bytes_per_step"]
            row["final_val_loss"] = row.get("horizon_summary", s)["final_val_loss"]
            row["efficiency"] = nosync / step if nosync else None
            row["step_speedup_vs_ddp"] = ddp_step / step if ddp_step else None
            ttt = row["time_to_target_s"]
            row["time_speedup_vs_ddp"] = ddp_ttt / ttt if (ddp_ttt and ttt) else None
            tc = row["time_to_common_s"]
            row["common_speedup_vs_ddp"] = ddp_common / tc if (ddp_common and tc) else None
        return {
            "workers": w,
            "bandwidth": bw,
            "target_loss": target,
            "common_loss": common,
            "composed": self.cfg.horizon or None,  # curves: loopback runs of this many steps
            "network_mode": next((r["summary"]["network_mode"] for r in rows.values()), None),
            "algos": rows,
        }

    def _scale_check(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Predicted vs measured step time, from one profile per bandwidth at the fewest workers."""
        if not self.cfg.netem or len(self.cfg.workers) < 2:
            return []
        base_w = min(self.cfg.workers)
        checks = []
        for g in groups:
            w, bw = g["workers"], g["bandwidth"]
            try:
                self.profile(base_w, bw)
            except Exception as e:  # a failed profile leaves the bench's measurements intact
                self.echo(f"scale check skipped for {bw}: {e}")
                continue
            for algo, row in g["algos"].items():
                pred = self.predict_step(w, bw, algo, profiled_at=base_w)
                if pred is None:
                    continue
                measured = row["step_s"]
                checks.append(
                    {
                        "workers": w,
                        "bandwidth": bw,
                        "algo": algo,
                        "predicted_s": pred,
                        "measured_s": measured,
                        "error": (pred - measured) / measured,
                        "profiled_at": base_w,
                    }
                )
        return checks
