"""What int4's compressed mean costs a GPU besides the link: the quantiser's work per message and
``owners=2``'s digest, which is taken on the host (issue 16).

    python benchmarks/gpu_codec_cost.py                # on the GPU where one is visible
    python benchmarks/gpu_codec_cost.py --params 25e6 --device cpu

For a model of P parameters averaged over N workers, one worker's share of one message is:
encode its N rows (phase 1), decode the N rows it receives for its shard, sum them and encode
the shard's mean (phase 2), then decode the N gathered shards of the mean. With ``owners=2`` it
also digests the N rows its shard came from and the N rows of the shard it owns second (BLAKE3
on the host, the rows copied there through a pinned buffer: ``geotrain.comm.digest``). The bytes
are what one worker sends per message with ``owners=2`` (both phases, ``wire_bytes``). Each
figure is the median of ``--repeat`` timed runs after two warm-ups, read after the GPU has
finished its queued work.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from geotrain.compress.owners import digest
from geotrain.compress.quantize import Int4


def _timed(fn, device: torch.device, repeat: int) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(2):
        fn()
    times = []
    for _ in range(repeat):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(params: int, workers: int, device: torch.device, repeat: int) -> dict[str, float]:
    codec = Int4()
    block, chunk = codec.layout(params, workers)
    gen = torch.Generator(device=device).manual_seed(0)
    rows = torch.randn(workers, chunk, generator=gen, device=device)
    sent, _ = codec.encode_with_values(rows, block)
    received = sent.clone()  # the N rows of this worker's shard, as they arrive

    def phase1() -> None:
        codec.encode_with_values(rows, block)

    def phase2() -> None:
        mean = codec.decode(received, chunk, block).sum(dim=0, keepdim=True) / workers
        codec.encode_with_values(mean, block)

    def gathered() -> None:
        codec.decode(received, chunk, block)

    def digests() -> None:  # owners=2: this worker's own shard's rows and the one it owns second
        digest(received, None)
        digest(received, None)

    steps = {"encode": phase1, "shard mean": phase2, "decode mean": gathered, "owners=2 digests": digests}
    return {name: _timed(fn, device, repeat) for name, fn in steps.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, nargs="+", default=[124e6, 1.3e9], help="model sizes")
    parser.add_argument("--workers", type=int, default=8, help="N, the workers averaged over")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    if args.workers < 2:
        parser.error("--workers takes 2 or more: a mean over one worker sends nothing")
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"int4 (block {Int4().block}) over {args.workers} workers on {name}, torch {torch.__version__}")
    columns = ["encode", "shard mean", "decode mean", "owners=2 digests"]
    print(" | ".join([f"{'params':>8}", *(f"{c:>10}" for c in columns), "sent (owners=2)"]))
    for p in args.params:
        params = int(p)
        t = measure(params, args.workers, device, args.repeat)
        wire = Int4(owners=2).wire_bytes([(params,)], args.workers)
        cells = [f"{1e3 * t[c]:>{max(10, len(c)) - 3}.2f} ms" for c in columns]
        print(" | ".join([f"{params / 1e6:>7.0f}M", *cells, f"{wire / 1e6:.0f} MB"]))


if __name__ == "__main__":
    main()
