"""The block quantisers' compute per sync, side by side with an older revision's, in one process.

    python benchmarks/bench_codecs.py                       # int8, int4, sign on 4.5M values
    python benchmarks/bench_codecs.py --against f052f03     # and the same codecs as of that commit

What a worker computes for one compressed mean of ``--values`` values among ``--workers``
(``geotrain.compress.quantize``): encoding its message with the error feedback's residual (what
the receivers will decode, subtracted from what was meant), then, as the owner of a shard,
decoding the workers' rows, requantising their mean with its residual, and decoding the gathered
shards. One thread, denormals flushed, the median of ``--repeat`` rounds; the older revision's
module is loaded from ``git show REV:src/geotrain/compress/quantize.py`` beside today's. 4.5M
values is W1's (``mini``) half-model: what DreamDDP at H=2 sends in a step.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def load_revision(rev: str, module: str = "quantize"):
    """``geotrain.compress.MODULE`` as of git revision ``rev``, as a module of its own."""
    text = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:src/geotrain/compress/{module}.py"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / f"{module}_{rev}.py"
    path.write_text(text)
    name = f"{module}_{rev}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def one_sync(codec, v: torch.Tensor, world: int) -> dict[str, float]:
    """Seconds for a worker's share of one compressed mean, by phase."""
    block, chunk = codec.layout(v.numel(), world)
    v = torch.cat([v, torch.zeros(world * chunk - v.numel())])  # whole chunks, as _reduce pads
    rows = v.reshape(world, chunk)
    t0 = time.perf_counter()
    if hasattr(codec, "encode_with_values"):
        data, decoded = codec.encode_with_values(rows, block)
        residual = v - decoded.reshape(-1)
    else:  # before: the residual from decoding what was encoded
        data = codec.encode(rows, block)
        residual = v - codec.decode(data, chunk, block).reshape(-1)
    t1 = time.perf_counter()
    mean = codec.decode(data, chunk, block).mean(dim=0)  # the owner's rows (here: its own)
    if hasattr(codec, "encode_with_values"):
        mine, decoded_mine = codec.encode_with_values(mean.unsqueeze(0), block)
    else:
        mine = codec.encode(mean.unsqueeze(0), block)
        decoded_mine = codec.decode(mine, chunk, block)
    server_residual = mean - decoded_mine[0]
    everyone = codec.decode(mine.expand(world, -1).contiguous(), chunk, block)
    t2 = time.perf_counter()
    del residual, server_residual, everyone
    return {"encode": t1 - t0, "owner": t2 - t1}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--values", type=int, default=4_500_000)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--codecs", default="int8,int4,sign")
    p.add_argument("--against", default="", help="a git revision to time beside today's")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    from geotrain.compress import quantize as today

    versions = {"today": today}
    if args.against:
        versions[args.against] = load_revision(args.against)
    v = torch.randn(args.values, generator=torch.Generator().manual_seed(0))
    names = {"int8": "Int8", "int4": "Int4", "sign": "Sign"}
    print(f"{args.values:,} values, {args.workers} workers, 1 thread, median of {args.repeat} (ms)")
    head = f"{'codec':6} {'version':10} {'encode+residual':>16} {'owner+decode':>13}"
    print(f"{head} {'total':>8} {'x today':>8}")
    for spec in args.codecs.split(","):
        totals = {}
        for label, module in versions.items():
            codec = getattr(module, names[spec])()
            one_sync(codec, v, args.workers)  # the first allocations
            rounds = [one_sync(codec, v, args.workers) for _ in range(args.repeat)]
            enc = statistics.median(r["encode"] for r in rounds) * 1e3
            own = statistics.median(r["owner"] for r in rounds) * 1e3
            totals[label] = enc + own
            ratio = totals[label] / totals["today"]
            print(f"{spec:6} {label:10} {enc:16.1f} {own:13.1f} {enc + own:8.1f} {ratio:8.2f}")


if __name__ == "__main__":
    main()
