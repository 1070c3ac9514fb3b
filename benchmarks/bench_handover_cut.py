"""A hand-over cut short, and its retry, on one emulated slow link.

Two hosts on links shaped to ``--bandwidth``. Host 1 receives ``--chunks`` chunks of 64 KB from
host 0 by ``Communicator.exchange`` (the transfer a joiner's hand-over makes, ``ft/handover.py``);
``--cut-s`` seconds in, a lost member is published (as the coordinator would) and both abandon
it. After ``--regroup-s`` (the time a regroup takes to form its new group) they form a new
group, host 1 says which chunks it holds (those that arrived, also after the cut), and host 0
sends the rest: the retry. Printed: the time from the cut to the whole part held, the bytes
host 0 put on its link against the part's, and how many of its sends were still pending on the
retired group when the new group formed (each holding its chunk until that group's timeout).

    python benchmarks/bench_handover_cut.py [--bandwidth 300kbit] [--chunks 24]

What it measures: what a cut transfer leaves on the link. gloo sends a message only once its
receive is posted, and a transfer abandoned on a retired group goes on (its connections are
never closed: ``ft/membership.py``), so receives posted beyond what arrives before the cut keep
the link busy under the retry, and arrive after the retry has asked for them again.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

CHUNK = 64 * 1024
PORT = 29613


class _Cut:
    """A membership whose epoch loses a member ``cut_s`` after ``start``."""

    def __init__(self, start: float, cut_s: float) -> None:
        self.epoch, self.start, self.cut_s = 0, start, cut_s

    @property
    def published_leave(self) -> int:
        return 1 if time.monotonic() - self.start > self.cut_s else 0


def _pending_on_retired() -> int:
    """The transfers the cut left posted and not done on the retired group (what their tensors
    hold there: before windows, every chunk's)."""
    from geotrain.comm import waits  # noqa: PLC0415
    from geotrain.ft.membership import RETIRED  # noqa: PLC0415

    works = RETIRED[-1][1] if RETIRED and isinstance(RETIRED[-1], tuple) else []
    gone = (getattr(waits, "_DONE", None), getattr(waits, "_DROPPED", None))
    return sum(1 for w in works if w not in gone and not isinstance(w, getattr(waits, "Unposted", ())))


def worker(rank: int, host0: str, ifname: str, chunks: int, cut_s: float, regroup_s: float, out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = ifname
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    from geotrain.comm.communicator import Communicator  # noqa: PLC0415
    from geotrain.ft.membership import MembershipChanged, retire  # noqa: PLC0415

    store = dist.TCPStore(host0, PORT, 2, rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=dist.PrefixStore("first", store), rank=rank, world_size=2)
    payload = torch.arange(chunks * CHUNK, dtype=torch.int64).to(torch.uint8)
    inbox = torch.zeros_like(payload)
    flags = [False] * chunks
    parts = [(payload if rank == 0 else inbox)[i * CHUNK : (i + 1) * CHUNK] for i in range(chunks)]
    dist.barrier()
    start = time.monotonic()
    comm = Communicator(membership=_Cut(start, cut_s), timeout_s=600)
    try:
        if rank == 0:
            comm.exchange([(p, 1, i) for i, p in enumerate(parts)], [])
        else:
            comm.exchange([], [(p, 0, i) for i, p in enumerate(parts)], flags)
        cut = None
    except MembershipChanged:
        cut = time.monotonic() - start
    at_cut = sum(flags)

    retire(dist.group.WORLD)
    dist.destroy_process_group()
    if cut is not None:
        time.sleep(max(0.0, start + cut_s + regroup_s - time.monotonic()))
    pending = _pending_on_retired() if cut is not None else 0  # once what was asked for came
    dist.init_process_group("gloo", store=dist.PrefixStore("retry", store), rank=rank, world_size=2)
    held = [flags] if rank == 1 else [None]
    dist.broadcast_object_list(held, src=1)
    missing = [i for i, f in enumerate(held[0]) if not f]
    comm = Communicator(timeout_s=600)
    if rank == 0:
        comm.exchange([(parts[i], 1, i) for i in missing], [])
    else:
        again = [False] * len(missing)
        comm.exchange([], [(torch.empty(CHUNK, dtype=torch.uint8), 0, i) for i in missing], again)
        for i in missing:  # the retry's copy (equal bytes: the same payload)
            flags[i] = True
    done = time.monotonic() - start
    dist.barrier()
    if rank == 0:
        Path(out + ".sender").write_text(json.dumps({"pending": pending}))
    if rank == 1:
        held_at_retry = chunks - len(missing)
        result = {"cut_s": cut, "held_at_cut": at_cut, "held_at_retry": held_at_retry, "done_s": done}
        Path(out).write_text(json.dumps(result))
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bandwidth", default="300kbit")
    parser.add_argument("--chunks", type=int, default=24)
    parser.add_argument("--cut-s", type=float, default=6.0)
    parser.add_argument("--regroup-s", type=float, default=4.0)
    args = parser.parse_args()
    from geotrain.netem.cluster import IFNAME, EmulatedCluster  # noqa: PLC0415
    from geotrain.netem.links import parse_bandwidth  # noqa: PLC0415

    bps = parse_bandwidth(args.bandwidth)
    out = f"/tmp/bench_handover_cut_{os.getpid()}.json"
    with EmulatedCluster([bps, bps]) as cluster:
        before = cluster.traffic()["host_sent"][0]
        cmd = [sys.executable, __file__, "--worker"]
        procs = [
            subprocess.Popen(
                [
                    *cluster.exec_prefix(r),
                    *cmd,
                    str(r),
                    cluster.host_ip(0),
                    IFNAME,
                    str(args.chunks),
                    str(args.cut_s),
                    str(args.regroup_s),
                    out,
                ],
                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                stderr=subprocess.DEVNULL,
            )  # fmt: skip
            for r in range(2)
        ]
        for p in procs:
            p.wait(timeout=900)
        sent = cluster.traffic()["host_sent"][0] - before
    result = json.loads(Path(out).read_text())
    sender = json.loads(Path(out + ".sender").read_text())
    Path(out).unlink()
    Path(out + ".sender").unlink()
    part = args.chunks * CHUNK
    cut = (
        f"cut at {result['cut_s']:.1f} s, retried {args.regroup_s:g} s later: {result['held_at_cut']} "
        f"chunks held at the cut, {result['held_at_retry']} at the retry, {sender['pending']} of host "
        "0's sends still pending on the retired group then; "
        if result["cut_s"] is not None
        else "not cut: "
    )
    print(
        f"{args.bandwidth}, a part of {part:,} bytes in {args.chunks} chunks, {cut}whole part held "
        f"{result['done_s']:.1f} s after the start; host 0 sent {sent:,} bytes ({sent / part:.2f}x the part)"
    )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]), float(sys.argv[6]),
               float(sys.argv[7]), sys.argv[8])  # fmt: skip
    else:
        main()
