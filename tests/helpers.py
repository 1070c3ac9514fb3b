"""Run a function on N real gloo processes and collect what each returns.

A ``FileStore`` rendezvous uses no port, each process gets one thread, and a run that exceeds its
timeout is killed with all its children, so a hung collective fails one test instead of the suite.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import textwrap
import traceback
from pathlib import Path

import torch


def _entry(fn, rank: int, world_size: int, store: str, out: str, args: tuple) -> None:
    import torch.distributed as dist

    from geotrain.launch.dist import shutdown_distributed

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # As the trainer leaves: together, with what holds a group collected before it goes (one
        # freed at interpreter exit aborts the process: "terminate called").
        shutdown_distributed(together=True)
        torch.save({"ok": result}, out)
    except BaseException:
        torch.save({"error": traceback.format_exc()}, out)
        raise


# Workers fork from a server that imported torch, its compiler (which the first optimizer built
# imports) and geotrain once per session: a spawned worker spent about 5 s of CPU importing
# them, most of a small group's time on 2 cores. The server has run nothing (no threads to
# fork), and each worker is a fresh fork of it. A fork ends with os._exit, not an interpreter's
# shutdown: a crash there (gloo's abort when a group is freed at exit) shows only in the CLI
# tests' trainers, which torchrun starts as interpreters of their own.
CONTEXT = mp.get_context("forkserver")
CONTEXT.set_forkserver_preload(["torch", "torch._dynamo", "geotrain.train", "helpers"])


def run_workers(fn, world_size: int, *args, timeout: float = 120.0) -> list:
    """``fn(rank, world_size, *args)`` on ``world_size`` processes; returns the results by rank."""
    ctx = CONTEXT
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
            if procs[r].exitcode != 0:  # a crash after the result (see CONTEXT) fails users and CI alike
                raise RuntimeError(f"rank {r} returned its result, then exited with code {procs[r].exitcode}")
            results.append(got["ok"])
        return results


def _each_case(rank: int, world_size: int, fn, cases: list[tuple]) -> list:
    # No case's error is caught: its peers would wait in that case's collectives while this
    # rank went on to the next case's. The group fails as a whole, and every test of it with it.
    return [fn(rank, world_size, *args) for args in cases]


class Cases:
    """Many calls of ``fn(rank, world_size, *args)`` on one gloo group of ``world_size``, run
    together on first use: a group per call spent most of its time starting processes (each
    imports torch). ``get(*args)`` returns that call's results by rank; if the group failed,
    every ``get`` raises its error (once run, never again)."""

    def __init__(self, fn, world_size: int, cases: list[tuple], timeout: float = 300.0) -> None:
        self.fn, self.world_size, self.cases, self.timeout = fn, world_size, cases, timeout
        self._results: list | None = None
        self._error: BaseException | None = None

    def get(self, *args) -> list:
        keys = [repr(c) for c in self.cases]
        if repr(args) not in keys:
            raise KeyError(f"{args!r} is not among the cases of this group: add it to the list")
        if self._results is None and self._error is None:
            try:
                self._results = run_workers(
                    _each_case, self.world_size, self.fn, self.cases, timeout=self.timeout
                )
            except BaseException as e:
                self._error = e
        if self._error is not None:
            raise RuntimeError(f"the group of {len(self.cases)} cases failed") from self._error
        i = keys.index(repr(args))
        return [r[i] for r in self._results]


# -- transfers between emulated hosts ------------------------------------------------------------
RECEIVER = textwrap.dedent(
    """
    import socket, sys
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], 5601)); s.listen(1); print("ready", flush=True)
    c, _ = s.accept(); n = 0
    while (b := c.recv(1 << 20)):
        n += len(b)
    c.sendall(b"k"); print(n, flush=True)
    """
)
SENDER = textwrap.dedent(
    """
    import socket, sys, time
    c = socket.create_connection((sys.argv[1], 5601)); t = time.perf_counter()
    c.sendall(b"x" * int(sys.argv[2])); c.shutdown(socket.SHUT_WR); c.recv(1)
    print(time.perf_counter() - t)
    """
)


def transfers(cluster, pairs, nbytes: int) -> list[float]:
    """Send ``nbytes`` from each (source, destination) host pair of an emulated ``cluster`` at once,
    with plain TCP sockets inside the namespaces; the seconds each took."""
    rxs = [
        subprocess.Popen(
            cluster.exec_prefix(d) + [sys.executable, "-c", RECEIVER, cluster.host_ip(d)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _, d in pairs
    ]
    try:
        for rx in rxs:
            assert rx.stdout.readline().strip() == "ready"
        txs = [
            subprocess.Popen(
                cluster.exec_prefix(s) + [sys.executable, "-c", SENDER, cluster.host_ip(d), str(nbytes)],
                stdout=subprocess.PIPE,
                text=True,
            )
            for s, d in pairs
        ]
        took = [float(tx.communicate(timeout=60)[0]) for tx in txs]
        assert [int(rx.stdout.readline()) for rx in rxs] == [nbytes] * len(pairs)
        return took
    finally:
        for rx in rxs:
            rx.kill()
            rx.wait()


def geotrain(
    args: list[str], timeout: float = 300.0, env: dict | None = None, cwd: str | Path | None = None
) -> subprocess.CompletedProcess:
    """``geotrain ARGS`` as a user runs it, returned as ``subprocess.run`` returns it, but with
    the launcher in this process: a new interpreter spent about 3 s of CPU importing torch
    before it started anything, alone on the machine (the hosts, the coordinator and the
    keepers are processes of their own all the same). ``env`` is the whole environment, as
    ``subprocess.run``'s; past ``timeout`` the run gets a Ctrl-C (the launcher stops its hosts)
    and ``TimeoutExpired`` is raised; a Ctrl-C of the user's, or pytest's own timeout, goes
    through. A run's exit at interpreter exit is tested in test_resume_cli.py with a real
    process."""
    import io
    import signal
    import threading

    from geotrain.cli import main

    out, err = io.BytesIO(), io.BytesIO()
    streams = sys.stdout, sys.stderr
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    fired, over, lock = threading.Event(), threading.Event(), threading.Lock()

    def interrupt() -> None:
        with lock:  # never once the run is over: a late Ctrl-C would land in pytest
            if not over.is_set():
                fired.set()
                os.kill(os.getpid(), signal.SIGINT)

    def on_sigint(signum, frame) -> None:  # outside the launcher's own handler
        if not (fired.is_set() and over.is_set()):
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    timer = threading.Timer(timeout, interrupt)
    wrappers = [io.TextIOWrapper(b, write_through=True) for b in (out, err)]
    sys.stdout, sys.stderr = wrappers
    code = 1
    try:
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        if cwd is not None:
            os.chdir(cwd)
        timer.start()
        try:
            code = main(list(args))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except KeyboardInterrupt:
            if not fired.is_set():
                raise
            code = 130
        except Exception:
            traceback.print_exc()
            code = 1
    finally:
        with lock:
            over.set()
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
        sys.stdout, sys.stderr = streams
        for w in wrappers:  # a pump thread still writing finds a wrapper, not a closed file
            w.flush()
        os.chdir(saved_cwd)
        if env is not None:
            os.environ.clear()
            os.environ.update(saved_env)
    said = [b.getvalue().decode(errors="replace") for b in (out, err)]
    for w in wrappers:  # a collected wrapper would close its buffer under a late writer
        w.detach()
    result = subprocess.CompletedProcess(["geotrain", *args], code, *said)
    if fired.is_set():
        raise subprocess.TimeoutExpired(result.args, timeout, result.stdout, result.stderr)
    return result


def refused(args: list[str]) -> str:
    """``geotrain ARGS`` refused, as the CLI's refusals happen before anything starts: asserts
    exit 2 with one line on stderr and returns that line."""
    proc = geotrain(args, timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, (
        proc.returncode,
        proc.stderr,
    )
    return lines[0]


def owners_means(
    rank: int, world_size: int, spec: str, how: str, ratio: float, spoiled: int = 1, device: str = "cpu"
) -> dict:
    """Three messages (``spoiled`` + 1 where more than one is spoiled) through a quantised codec
    (``owners=1`` or ``2``) on ``device``, worker 2 spoiling its shard of the first ``spoiled``
    means as ``how`` says ("-": honest; "equivocate": it sends shard 0's two owners different
    rows; "forget": a spoiled copy, then worker 0 rebuilt with empty codec state; "stamp": it
    sends every message under a false owners' stamp); the check on
    where ``ratio`` > 0. The vectors are drawn on the CPU, so every device averages the same."""
    from geotrain.comm.communicator import Communicator
    from geotrain.compress.codec import make_codec

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    comm = Communicator(max_norm_ratio=ratio)
    codec = make_codec(spec)
    gen = torch.Generator().manual_seed(rank)
    honest = [torch.randn(5000, generator=gen) for _ in range(max(3, spoiled + 1))]
    means, offsets, devices = [], [], set()
    if rank == 2 and how == "equivocate":  # a hostile sender: worker 0 gets another row of shard 0
        sent = {"messages": 0}
        real = comm.all_to_all

        def equivocating(data, **kwargs):
            if sent["messages"] < spoiled:
                data = data.clone()
                data[0, :256] ^= 0x77  # shard 0's row for its owner, not for its second owner
            sent["messages"] += 1
            return real(data, **kwargs)

        comm.all_to_all = equivocating
    for i, v in enumerate(honest):
        if rank == 2 and how == "stamp":  # second owners two on: its rows rolled unlike the others'
            codec.state("g")["second_stamp"] = torch.tensor([2, 7], dtype=torch.int32)
        elif rank == 2 and how not in ("-", "equivocate") and i < spoiled:
            comm.corrupt_shard = "signflip" if how == "forget" else how
        if rank == 0 and how == "forget" and i == spoiled:  # a host rebuilt with empty codec state
            codec.load_state_dict({"spec": codec.spec(), "streams": []})
        offsets.append(int(codec.state("g").get("second_stamp", torch.tensor([1, 0]))[0]))
        mean = v.to(dev, copy=True)
        codec.reduce(comm, "g", [mean]).wait()
        devices.add(str(mean.device))
        means.append(mean.cpu())
    return {
        "honest": honest,
        "means": means,
        "devices": sorted(devices),
        "rejected": dict(comm.rejected_by_rank),
        "disputed": dict(comm.disputed_shards),
        "offsets": offsets,
        "sent": comm.stats.sent_bytes,
        "wire": len(honest) * codec.wire_bytes([(5000,)], comm.world_size),
        "shard": codec.layout(5000, comm.world_size)[1],
    }
