"""What one SparseLoCo outer step costs the CPU, without the link.

    python benchmarks/bench_outer_step.py [--model mini] [--H 5] [--calls 6]

``SparseLoCo.outer_step()`` on a group of one worker (the gather returns its own message at
once), one thread, denormals flushed, synchronous and overlapped (the mean of the last outer
step landing at this one): the error-feedback buffer, the chunked top-k and its packing, the
mean of the gathered messages and the moves between the model and the flat layout, each a pass
over the model's values. On W1 four workers share two cores, so an outer step costs about twice
this on the wall, every H steps. The parameters move between calls as a local step would move
them. Prints each call's milliseconds and their median after the first (which touches its
memory). The third line times a landing inside a period (``--tau 1``): the mean of the
outer step just made lands in the anchor, the start and the parameters.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from geotrain.comm.communicator import Communicator
from geotrain.models.gpt import GPT, gpt_config
from geotrain.sync import build_sync


def time_outer_steps(model_name: str, H: int, overlap: bool, calls: int, tau: int = 0) -> list[float]:
    """Each outer step's seconds; with ``tau``, each landing's (``tau`` steps into the period)."""
    torch.manual_seed(0)
    model = GPT(gpt_config(model_name, 256))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    options = {"H": H, "overlap": overlap, **({"tau": tau} if tau else {})}
    sync = build_sync("sparseloco", model, optimizer, Communicator(), options)
    gen = torch.Generator().manual_seed(1)
    times = []
    try:
        for _ in range(calls):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=gen), alpha=1e-3)
            started = time.perf_counter()
            sync.outer_step()
            if tau:
                started = time.perf_counter()
                sync._land_early()
            times.append(time.perf_counter() - started)
    finally:
        sync.close()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mini")
    p.add_argument("--H", type=int, default=5)
    p.add_argument("--calls", type=int, default=6)
    args = p.parse_args()
    if args.calls < 2:
        raise SystemExit("--calls: at least 2 (the first is left out of the median)")
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    cells = [("outer step, synchronous", False, 0), ("outer step, overlapped", True, 0)]
    cells.append(("landing 1 step into a period", True, 1))
    for what, overlap, tau in cells:
        times = time_outer_steps(args.model, args.H, overlap, args.calls, tau)
        each = " ".join(f"{1000 * t:.0f}" for t in times)
        median = 1000 * statistics.median(times[1:])
        print(f"{args.model} H={args.H} {what}: {median:.0f} ms median (each: {each})")


if __name__ == "__main__":
    main()
