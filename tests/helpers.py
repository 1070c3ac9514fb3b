"""Run a function on N real gloo processes and collect what each returns.

A ``FileStore`` rendezvous uses no port, each process gets one thread, and a run that exceeds its
timeout is killed with all its children, so a hung collective fails one test instead of the suite.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import traceback
from pathlib import Path

import torch


def _entry(fn, rank: int, world_size: int, store: str, out: str, args: tuple) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        dist.barrier()
        dist.destroy_process_group()
        torch.save({"ok": result}, out)
    except BaseException:
        torch.save({"error": traceback.format_exc()}, out)
        raise


def run_workers(fn, world_size: int, *args, timeout: float = 120.0) -> list:
    """``fn(rank, world_size, *args)`` on ``world_size`` processes; returns the results by rank."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="geotrain-test-") as tmp:
        store = os.path.join(tmp, "store")
        outs = [os.path.join(tmp, f"rank{r}.pt") for r in range(world_size)]
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world_size, store, outs[r], args), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            for p in procs:
                p.join(timeout)
                if p.is_alive():
                    raise TimeoutError(f"worker did not finish within {timeout} s")
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
        results = []
        for r, out in enumerate(outs):
            if not Path(out).exists():
                raise RuntimeError(f"rank {r} exited with code {procs[r].exitcode} and no result")
            got = torch.load(out, weights_only=False)
            if "error" in got:
                raise RuntimeError(f"rank {r} failed:\n{got['error']}")
            results.append(got["ok"])
        return results
