"""What the chunked top-k costs a worker per message, as DreamDDP sends it, beside an older revision.

    python benchmarks/bench_chunked_codec.py                     # W1's model, every layer once
    python benchmarks/bench_chunked_codec.py --against 1359e77   # and that commit's codec

DreamDDP with ``--compress chunktopk`` sends each layer of its iteration through the codec's
``reduce`` (``geotrain.compress.chunked.ChunkTopK``): the error feedback added to the layer's
change, the top-k of each chunk, the packing, then, from the gathered messages of ``--workers``
workers, their unpacking and their mean written back into the layer. This times that, every
layer of the model (``plan.layers.layer_groups``) once (at H=2 a step sends about half of it),
with a communicator whose gather returns the worker's own message ``--workers`` times at once:
the link is left out. One thread, denormals flushed, the median of ``--rounds`` rounds after a
first that touches the memory. On W1 four workers share two cores, so a message costs about
twice this on the wall. The older revision's module is loaded from ``git show
REV:src/geotrain/compress/chunked.py`` beside today's (``bench_codecs.load_revision``), and both
runs must leave the same residuals and means (the check prints whether they do).
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch
from bench_codecs import load_revision

from geotrain.comm.communicator import Communicator
from geotrain.models.gpt import GPT, gpt_config
from geotrain.plan.layers import layer_groups


class Gathered(Communicator):
    """A gather that returns this worker's message from every one of ``world`` workers."""

    def __init__(self, world: int) -> None:
        super().__init__()
        self.world_size, self.rank, self.distributed = world, 0, False

    def all_gather(self, tensor, async_op=False, control_bytes=0):
        gathered = tensor.unsqueeze(0).expand(self.world_size, *tensor.shape)
        return SimpleNamespace(wait=lambda: gathered) if async_op else gathered


def time_rounds(
    codec_cls, model_name: str, world: int, rounds: int
) -> tuple[list[float], list[torch.Tensor]]:
    """Each round's seconds for one message of every layer, and the last round's means."""
    torch.manual_seed(0)
    layers = layer_groups(GPT(gpt_config(model_name, 256, 128)))
    gen = torch.Generator().manual_seed(1)
    changes = [[torch.randn(p.shape, generator=gen) * 1e-3 for p in layer.params] for layer in layers]
    work = [[c.clone() for c in layer] for layer in changes]
    codec, comm = codec_cls(), Gathered(world)
    seconds = []
    for _ in range(rounds + 1):
        total = 0.0
        for i, (layer, buffers) in enumerate(zip(changes, work, strict=True)):
            for b, c in zip(buffers, layer, strict=True):
                b.copy_(c)  # this step's change (outside the timer: DreamDDP makes it anyway)
            start = time.perf_counter()
            codec.reduce(comm, i, buffers).wait()
            total += time.perf_counter() - start
        seconds.append(total)
    return seconds, [t for layer in work for t in layer] + [
        codec.state(i)["residual"] for i in range(len(work))
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="mini")
    p.add_argument("--workers", type=int, default=4, help="messages gathered per layer")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--against", default="", help="a git revision whose codec is timed beside today's")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    from geotrain.compress.chunked import ChunkTopK

    cells = [("today", ChunkTopK)]
    if args.against:
        cells.insert(0, (args.against, load_revision(args.against, "chunked").ChunkTopK))
    results = {}
    for _ in range(2):  # each cell twice, interleaved: the machine drifts
        for label, cls in cells:
            seconds, out = time_rounds(cls, args.model, args.workers, args.rounds)
            results.setdefault(label, []).extend(seconds[1:])
            results[f"{label} out"] = out
    for label, _ in cells:
        ms = [1e3 * s for s in results[label]]
        print(f"{label:>10}: {statistics.median(ms):7.1f} ms a model (rounds {min(ms):.1f}-{max(ms):.1f})")
    if args.against:
        same = all(
            torch.equal(a, b)
            for a, b in zip(results[f"{args.against} out"], results["today out"], strict=True)
        )
        print(f"same residuals and means: {same}")


if __name__ == "__main__":
    main()
