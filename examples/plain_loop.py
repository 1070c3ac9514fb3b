"""A plain PyTorch training loop spread over workers with geotrain.wrap.

    torchrun --nproc-per-node 2 examples/plain_loop.py --algo diloco --H 5
    torchrun --nproc-per-node 2 examples/plain_loop.py --algo diloco --pace time --slow 1

With ``--pace time`` (localsgd, diloco) a period lasts the fastest worker's H steps: a slower
worker (``--slow RANK`` makes one sleep 20 ms per step) skips its last steps of each period,
and the average weighs each worker by the steps it computed.

Each worker fits the same small regression model to its own shard of data. geotrain averages
them as the algorithm says; at the end every worker holds the same model, and every rank prints
its loss, the bytes it sent and a digest of the parameters (equal on every rank).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import geotrain
import geotrain.api
from geotrain.launch.dist import device_and_backend, uses_nccl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algo", default="diloco")
    parser.add_argument("--H", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--pace", default="steps", help="localsgd, diloco: steps or time")
    parser.add_argument("--slow", type=int, default=-1, help="this rank sleeps 20 ms per step")
    parser.add_argument(
        "--backend", default="auto", help="auto (NCCL where each worker has a GPU of its own), nccl or gloo"
    )
    parser.add_argument("--autocast", action="store_true", help="forward passes in bf16 (torch.autocast)")
    args = parser.parse_args()

    # This worker's GPU (else the CPU); NCCL for CUDA tensors paired with gloo for the few CPU
    # numbers geotrain exchanges, or gloo alone; torchrun sets the rendezvous.
    device, backend = device_and_backend(args.backend)
    dist.init_process_group(backend, device_id=device if uses_nccl(backend) else None)
    rank = dist.get_rank()
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same model everywhere (wrap starts all from rank 0's anyway)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1 + rank)  # this worker's shard
    true_w = torch.linspace(-1, 1, 8)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(16, 8, generator=data)
        return x, (x @ true_w).unsqueeze(1) + 0.1 * torch.randn(16, 1, generator=data)

    # Each algorithm's own options (geotrain.api.accepted_options(algo) lists them).
    options = {"H": args.H} if "H" in geotrain.api.accepted_options(args.algo) else {}
    if args.algo == "streaming":
        options["fragments"] = 2  # this model has two layers with parameters
    if args.pace != "steps":
        options["pace"] = args.pace
    if args.algo == "sparseloco":
        options |= {"chunk": 64, "k": 8}  # its default chunk is larger than this model
    # dreamddp plans its layer schedule from the first steps of this loop, timed as they run
    # (or pass plan="plan.json" from `geotrain plan`, or profile=a function returning a loss).
    sync = geotrain.wrap(model, optimizer, algo=args.algo, **options)

    skipped = 0
    for _ in range(args.steps):
        if not sync.computes():  # a straggler's skipped step (pace="time"); always True otherwise
            sync.skip()
            skipped += 1
            continue
        if rank == args.slow:
            time.sleep(0.02)
        x, y = (t.to(device) for t in batch())
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.autocast):
            loss = nn.functional.mse_loss(sync.model(x).float(), y)
        loss.backward()
        sync.step()
        sync.zero_grad()
    sync.finish()

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    digest = hashlib.sha256(flat.cpu().numpy().tobytes()).hexdigest()[:16]
    # One write per line: both ranks share torchrun's stdout, and print's separate write of the
    # newline (unbuffered under PYTHONUNBUFFERED) lets the other rank's line land mid-line.
    sys.stdout.write(
        f"rank {rank}: loss {loss.item():.4f} sent {sync.stats['sent_bytes']} bytes digest {digest} "
        f"skipped {skipped}\n"
    )
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
