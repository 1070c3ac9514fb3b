"""What one SparseLoCo outer step costs the CPU, without the link.

    python benchmarks/bench_outer_step.py [--model mini] [--H 5] [--calls 6] [--workers 4]

``SparseLoCo.outer_step()`` on one worker whose gather returns at once its own message and
``--workers`` - 1 others (each the message of a random vector: other entries than its own, as
another worker's), one thread, denormals flushed, synchronous and overlapped (the mean of the last outer
step landing at this one): the error-feedback buffer, the chunked top-k and its packing, the
mean of the gathered messages and the moves between the model and the flat layout, each a pass
over the model's values. On W1 four workers share two cores, so an outer step costs about twice
this on the wall, every H steps. The parameters move between calls as a local step would move
them. Prints each call's milliseconds and their median after the first (which touches its
memory). The last lines time a landing inside a period (``--tau 1``): the mean of the
outer step just made lands in the anchor, the start and the parameters, at the entries the
messages name and in passes over the whole vector (``SparseLoCo._in_passes`` chooses).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import geotrain.sync.sparseloco as sparseloco_module
from geotrain.comm.communicator import Communicator
from geotrain.comm.waits import Handle
from geotrain.models.gpt import GPT, gpt_config
from geotrain.sync import build_sync


class Gathers(Communicator):
    """A group of one whose gather hands back ``workers`` messages: its own and others'."""

    def __init__(self, workers: int) -> None:
        super().__init__()
        self.workers = workers
        self.others: list[torch.Tensor] = []  # set once the codec and the vector's size are known

    def all_gather(self, tensor, async_op=False, control_bytes=0):
        gathered = torch.stack([tensor, *self.others[: self.workers - 1]])
        handle = Handle(self, None, gathered, 1, time.perf_counter())
        return handle if async_op else handle.wait()


def time_outer_steps(
    model_name: str, H: int, overlap: bool, calls: int, tau: int = 0, workers: int = 1
) -> list[float]:
    """Each outer step's seconds; with ``tau``, each landing's (``tau`` steps into the period)."""
    torch.manual_seed(0)
    model = GPT(gpt_config(model_name, 256))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    options = {"H": H, "overlap": overlap, **({"tau": tau} if tau else {})}
    comm = Gathers(workers)
    sync = build_sync("sparseloco", model, optimizer, comm, options)
    gen = torch.Generator().manual_seed(2)
    comm.others = [
        sync.chunker.encode_sparse(1e-3 * torch.randn(sync.n, generator=gen))[0] for _ in range(workers - 1)
    ]
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
    p.add_argument("--workers", type=int, default=4, help="messages each gather returns (W1: 4)")
    args = p.parse_args()
    if args.calls < 2:
        raise SystemExit("--calls: at least 2 (the first is left out of the median)")
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    cells = [("outer step, synchronous", False, 0, None), ("outer step, overlapped", True, 0, None)]
    cells.append(("landing 1 step into a period, at the entries named", True, 1, 1.0))
    cells.append(("landing 1 step into a period, in passes", True, 1, 0.0))
    chosen = sparseloco_module.DENSE_ABOVE
    for what, overlap, tau, dense_above in cells:
        sparseloco_module.DENSE_ABOVE = chosen if dense_above is None else dense_above
        times = time_outer_steps(args.model, args.H, overlap, args.calls, tau, args.workers)
        each = " ".join(f"{1000 * t:.0f}" for t in times)
        median = 1000 * statistics.median(times[1:])
        print(
            f"{args.model} H={args.H} {args.workers} workers, {what}: {median:.0f} ms median (each: {each})"
        )


if __name__ == "__main__":
    main()
