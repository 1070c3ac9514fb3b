"""The soak's picture: the validation loss of the faulty run over the undisturbed one's, with every
fault and every admission drawn where it happened, and the live workers underneath.

``geotrain soak`` writes ``soak.png`` and ``report.html`` (the picture and its tables, one
self-contained file) next to ``soak.json``. Times are wall-clock seconds from each run's first
step, read from the metrics every host writes (``at``), so a host that was killed or joined late
still lands where it belongs; the loss is the mean over the replicas that evaluated it.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display here; files only
import matplotlib.pyplot as plt  # noqa: E402

from geotrain.bench.report import html_table  # noqa: E402
from geotrain.metrics import read_metrics  # noqa: E402


def run_curves(run_dir: Path) -> dict[str, list]:
    """One run's curves from every host's metrics: validation loss by time and by tokens (one
    point per evaluated step), the live workers by time, and the time of its first step."""
    records = [
        r
        for path in sorted((run_dir / "metrics").glob("rank*.jsonl"))
        for r in read_metrics(path)
        if not r.get("final") and "at" in r
    ]
    if not records:
        raise ValueError(f"{run_dir}: no step metrics with times (metrics/rank*.jsonl)")
    t0 = min(r["at"] - r["step_s"] for r in records)
    val: dict[int, dict] = {}
    for r in records:
        if r.get("val_loss") is not None:
            val.setdefault(r["step"], r)
    points = sorted(val.values(), key=lambda r: r["step"])
    by_step: dict[int, dict] = {}
    for r in records:  # one record per step (members at a step agree on how many they are)
        by_step.setdefault(r["step"], r)
    workers = sorted(((r["at"] - t0, r.get("workers", 0)) for r in by_step.values()), key=lambda p: p[0])
    return {
        "t0": [t0],
        "val_time": [(r["at"] - t0, r["val_loss"]) for r in points],
        "val_tokens": [(r["tokens"], r["val_loss"]) for r in points],
        "workers": workers,
    }


def plot_soak(
    calm_dir: Path, faulty_dir: Path, faults: list[dict], membership: list[dict], path: Path
) -> None:
    calm, faulty = run_curves(calm_dir), run_curves(faulty_dir)
    t0 = faulty["t0"][0]
    fig, (ax_t, ax_n, ax_w) = plt.subplots(
        3, 1, figsize=(10, 9), gridspec_kw={"height_ratios": [3, 3, 1.2]}, constrained_layout=True
    )
    for curves, name, style in ((calm, "undisturbed", "--"), (faulty, "under faults", "-")):
        if curves["val_time"]:
            ax_t.plot(*zip(*[(t / 60, v) for t, v in curves["val_time"]], strict=True), style, label=name)
            ax_n.plot(*zip(*[(n / 1e6, v) for n, v in curves["val_tokens"]], strict=True), style, label=name)
    for i, f in enumerate(faults):
        at = (f.get("detected_at") or 0) - t0
        label = "fault (detected)" if i == 0 else None
        ax_t.axvline(at / 60, color="tab:red", alpha=0.5, lw=1, label=label)
        ax_w.axvline(at / 60, color="tab:red", alpha=0.5, lw=1)
        ax_t.annotate(f"h{f['rank']}", (at / 60, 1.0), xycoords=("data", "axes fraction"), fontsize=7,
                      color="tab:red", ha="center", va="bottom")  # fmt: skip
    admitted = [e for e in membership if e.get("joined")]
    for i, e in enumerate(admitted):
        at = e["at"] - t0
        ax_t.axvline(
            at / 60, color="tab:green", alpha=0.5, lw=1, ls=":", label="admission" if i == 0 else None
        )
        ax_w.axvline(at / 60, color="tab:green", alpha=0.5, lw=1, ls=":")
    if faulty["workers"]:
        ax_w.step(*zip(*[(t / 60, w) for t, w in faulty["workers"]], strict=True), where="post", color="k")
    ax_t.set(xlabel="minutes from the first step", ylabel="validation loss")
    ax_t.set_title("loss over time, faults marked", pad=16)  # above the hosts' labels
    ax_n.set(xlabel="tokens (millions)", ylabel="validation loss", title="loss at equal tokens")
    ax_w.set(xlabel="minutes from the first step", ylabel="workers")
    ax_w.yaxis.get_major_locator().set_params(integer=True)
    for ax in (ax_t, ax_n):
        ax.legend(loc="upper right", fontsize=8)
        ax.grid(alpha=0.3)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_soak_report(out: Path, result: dict[str, Any], tables: list[str]) -> dict[str, Path]:
    """``soak.png`` and a self-contained ``report.html`` (the picture, then ``tables``) in ``out``."""
    png = out / "soak.png"
    plot_soak(
        out / "undisturbed", out / "faulty", result.get("faults") or [], result.get("membership") or [], png
    )
    job = {k: html.escape(str(v)) for k, v in result["job"].items()}
    chaos = html.escape(result["chaos"])
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>geotrain soak</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1200px}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}} img{{max-width:100%}}</style></head>
<body><h1>geotrain soak</h1>
<p>{job["workers"]} {job["model"]} hosts at {job["bandwidth"]}, {job["algo"]} H={job["H"]},
{job["steps"]} steps, under <code>--chaos {chaos}</code> (--on-failure {job["on_failure"]}),
against the same run undisturbed.</p>
<img alt="soak" src="data:image/png;base64,{base64.b64encode(png.read_bytes()).decode()}">
{"".join(html_table(t) for t in tables)}
</body></html>
"""
    (out / "report.html").write_text(page)
    return {"png": png, "html": out / "report.html"}
