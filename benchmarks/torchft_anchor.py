"""torchft's recovery time for DiLoCo on CPU: an outside anchor for geotrain's elastic recovery.

    .venv/bin/pip install torchft==0.2.0          # keeps the installed torch
    .venv/bin/python benchmarks/torchft_anchor.py --replicas 3 --steps 120 --sync-every 5 \\
        --kill-at-step 42 --kill-replica 1 --restart-after 3 --out runs/torchft-anchor/r1.json

One torchft LighthouseServer (in this process) and ``--replicas`` replica groups, each one
process with its own TCPStore, a torchft ``Manager`` (synchronous quorum, as DiLoCo requires),
``ProcessGroupGloo`` and torchft's ``DiLoCo`` wrapper: H inner AdamW steps, outer SGD (nesterov,
lr 0.7, momentum 0.9). The model is geotrain's tiny GPT on geotrain's corpus, every replica its own
shard. Each inner step may be padded with sleep to ``--step-time`` so that the timeline is readable
and the CPU stays idle (the tiny GPT's step takes ~10 ms).

At inner step ``--kill-at-step`` of replica ``--kill-replica`` that process is SIGKILLed; a fresh
process for the same replica is started ``--restart-after`` seconds later and must heal from its
peers through torchft (a checkpoint over torchft's HTTP transport). Each replica logs one JSON
line per inner step; from them this script reports:

  (a) stall: the survivors' longest gap between consecutive steps from the kill to their first
      sync without the dead replica, minus their normal (median, pre-kill) step time;
  (b) continue: seconds from the kill until the survivors commit an outer sync without it;
  (c) heal: seconds from the replacement's start (Popen) to its first committed outer sync with
      the group, and whether its parameters (and outer optimizer state) then hash equal to the
      survivors' at the same outer step;
  (d) exits: every process's exit status (the SIGKILLed one excepted), fatal markers on stderr
      (segfault, abort, Rust panic) and any output after the worker's last line (a crash at
      interpreter exit). Tracebacks that torchft logs while handling a failed collective are
      counted separately: they are expected.

``--kill-in-sync`` kills the victim instead ``--kill-delay`` seconds after it enters the outer
sync ending at inner step ``--kill-at-step`` (a multiple of H), i.e. during the quorum or the
pseudo-gradient all-reduce; a survivor blocked in a gloo recv then waits for ``--timeout``.

Lighthouse settings (defaults in torchft 0.2.0: heartbeat_timeout_ms 5000, join_timeout_ms
60000, quorum_tick_ms 100; the Manager heartbeats every 100 ms): a killed replica stays
"healthy" to the lighthouse until its last heartbeat is heartbeat_timeout_ms old, and a quorum
that is not a "fast quorum" (all of the previous members back) waits up to join_timeout_ms for
healthy stragglers, so the survivors' detection time is bounded by
min(heartbeat_timeout_ms, join_timeout_ms) after they reach their next sync.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------------
# worker: one replica group (one process)
# --------------------------------------------------------------------------------------------


RETURNED = "TORCHFT_ANCHOR_WORKER_RETURNED"


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def worker(a: argparse.Namespace) -> int:
    t_main = time.time()
    import logging
    from datetime import timedelta

    import torch

    torch.set_num_threads(1)
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    from geotrain.data.corpus import BatchSampler, load_corpus
    from geotrain.models.gpt import GPT, gpt_config

    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s.%(msecs)03d %(name)s %(message)s",
        datefmt="%H:%M:%S",
    )
    t_imported = time.time()

    corpus = load_corpus()
    cfg = gpt_config("tiny", corpus.vocab_size)
    torch.manual_seed(0)  # the same initial weights everywhere (init_sync also aligns them)
    model = GPT(cfg)
    sampler = BatchSampler(corpus, cfg.block_size, a.batch_size, a.replica, a.replicas, a.attempt)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)

    def state_dict():
        return {"model": model.state_dict(), "inner_optim": inner.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner_optim"])

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=a.timeout)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=a.min_replicas,
        use_async_quorum=False,  # DiLoCo refuses the asynchronous quorum
        timeout=timeout,
        quorum_timeout=timedelta(seconds=a.quorum_timeout),
        connect_timeout=timedelta(seconds=10),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=a.lighthouse,
        replica_id=f"replica_{a.replica}",
        hostname="127.0.0.1",
        heartbeat_interval=timedelta(milliseconds=a.heartbeat_interval_ms),
    )
    t_manager = time.time()

    out = open(a.log, "a", buffering=1)  # noqa: SIM115 (open for the whole run)

    def log(rec: dict) -> None:
        rec.update(replica=a.replica, attempt=a.attempt)
        out.write(json.dumps(rec) + "\n")

    log({"event": "start", "t": t_main, "t_imported": t_imported, "t_manager": t_manager})

    if a.attempt == 0 and a.ready_dir:  # a start barrier, so the first quorum has everyone
        Path(a.ready_dir, f"{a.replica}").touch()
        deadline = time.time() + 120
        while len(list(Path(a.ready_dir).iterdir())) < a.replicas:
            if time.time() > deadline:
                raise SystemExit("start barrier timed out")
            time.sleep(0.02)
    log({"event": "go", "t": time.time()})

    outer_target = a.steps // a.sync_every
    n_inner = 0
    with DiLoCo(
        manager,
        [model],
        inner,
        outer,
        sync_every=a.sync_every,
        backup_device=torch.device("cpu"),
        pin_memory=False,
    ) as diloco:
        while manager.current_step() < outer_target:
            t0 = time.time()
            x, y = sampler.next_train()
            inner.zero_grad()
            _, loss = model(x, y)
            loss.backward()
            pad = a.step_time - (time.time() - t0)
            if pad > 0:
                time.sleep(pad)
            before = manager.current_step()
            if diloco._local_step == a.sync_every - 1:
                log({"event": "presync", "t": time.time(), "inner": n_inner + 1, "mstep": before})
            t_sync0 = time.time()
            inner.step()  # DiLoCo's post hook: the quorum, pseudo-gradient all-reduce, outer step
            n_inner += 1
            synced = diloco._local_step == 0
            after = manager.current_step()
            rec = {
                "event": "step",
                "t": time.time(),
                "inner": n_inner,
                "mstep": after,
                "loss": round(loss.item(), 4),
                "sync": synced,
            }
            if synced:
                rec.update(
                    committed=after > before,
                    healed=after > before + 1,
                    mstep_before=before,
                    sync_s=round(time.time() - t_sync0, 4),
                    t_sync0=t_sync0,
                    participants=manager.num_participants(),
                    quorum_id=manager._quorum_id,
                    hash=_digest(p for p in model.parameters()),
                    outer_hash=_digest(
                        outer.state[p]["momentum_buffer"]
                        for p in model.parameters()
                        if "momentum_buffer" in outer.state.get(p, {})
                    ),
                )
            log(rec)
    log({"event": "done", "t": time.time(), "mstep": manager.current_step()})
    out.close()
    manager.shutdown(wait=False)
    sys.stderr.flush()
    print(RETURNED, file=sys.stderr, flush=True)  # what follows on stderr came at interpreter exit
    return 0


# --------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------


def read_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    recs = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a line cut by SIGKILL
            recs.append(json.loads(line))
    return recs


def last_inner(path: Path, event: str = "step") -> int:
    recs = [r for r in read_log(path) if r.get("event") == event]
    return recs[-1]["inner"] if recs else 0


def lighthouse_quorums(path: Path) -> list[tuple[float, int, int]]:
    """(time, quorum_id, participants) of every quorum the lighthouse issued, from its log."""
    out = []
    if not path.exists():
        return out
    for line in path.read_text(errors="replace").splitlines():
        m = re.match(r"(\S+) \[INFO\] \[torchft::lighthouse\] - Quorum! Quorum \{ quorum_id: (\d+)", line)
        if m:
            t = datetime.datetime.fromisoformat(m.group(1)).timestamp()  # the lighthouse logs local time
            out.append((t, int(m.group(2)), line.count("QuorumMember {")))
    return out


FATAL_MARKS = (
    "Segmentation fault",
    "terminate called",
    "Fatal Python error",
    "core dumped",
    "Aborted",
    "panicked at",
)


def analyse(a, procs, kill_t, restart_t, workdir: Path) -> dict:
    logs = {name: read_log(workdir / f"{name}.jsonl") for name in procs}
    victim = f"r{a.kill_replica}a0"
    repl = f"r{a.kill_replica}a1"
    survivors = [f"r{i}a0" for i in range(a.replicas) if i != a.kill_replica]
    res: dict = {}

    def steps(name):
        return [r for r in logs.get(name, []) if r.get("event") == "step"]

    # normal step time: median gap before the kill, over the survivors
    gaps_before = []
    for s in survivors:
        st = steps(s)
        gaps_before += [b["t"] - p["t"] for p, b in zip(st, st[1:], strict=False) if b["t"] < kill_t]
    normal = statistics.median(gaps_before) if gaps_before else float("nan")
    sync_before = [
        r["sync_s"]
        for s in survivors
        for r in steps(s)
        if r["sync"] and r["t"] < kill_t and r["mstep_before"] > 0
    ]
    res["normal_step_s"] = round(normal, 4)
    res["normal_sync_s_median"] = round(statistics.median(sync_before), 4) if sync_before else None

    if kill_t is None:
        res["error"] = "the kill never happened"
        return res
    # (b) first committed sync after the kill without the dead replica, per survivor
    # A new quorum (its id above the one at the kill) cannot hold the dead process; the
    # replacement may already be in it.
    cont, stall = {}, {}
    for s in survivors:
        st = steps(s)
        q_kill = max((r["quorum_id"] for r in st if r["sync"] and r["t"] <= kill_t), default=0)
        first = next(
            (
                r
                for r in st
                if r["t"] > kill_t and r["sync"] and r.get("committed") and r["quorum_id"] > q_kill
            ),
            None,
        )
        if first is None:
            cont[s] = None
            continue
        cont[s] = round(first["t"] - kill_t, 3)
        window = [
            (p, b) for p, b in zip(st, st[1:], strict=False) if b["t"] > kill_t and p["t"] <= first["t"]
        ]
        longest = max((b["t"] - max(p["t"], kill_t) for p, b in window), default=0.0)
        stall[s] = round(longest - normal, 3)
    res["survivor_stall_s"] = stall
    lq = lighthouse_quorums(workdir / "lighthouse.log")
    new_q = next(((t, q, n) for t, q, n in lq if t > kill_t and n == a.replicas - 1), None)
    if new_q is not None:
        res["kill_to_lighthouse_quorum_without_dead_s"] = round(new_q[0] - kill_t, 3)
    arrive = {}
    for s in survivors:
        first = next((r for r in steps(s) if r["t"] > kill_t and r["sync"]), None)
        if first is not None:
            arrive[s] = round(first["t_sync0"] - kill_t, 3)
    res["kill_to_survivors_at_next_sync_s"] = arrive
    res["kill_to_continue_s"] = cont
    failed_syncs = [
        {"replica": s, "t_after_kill": round(r["t"] - kill_t, 3), "mstep": r["mstep"]}
        for s in survivors
        for r in steps(s)
        if r["t"] > kill_t and r["sync"] and not r.get("committed")
    ]
    res["survivor_failed_syncs_after_kill"] = failed_syncs
    res["survivors_healed_after_kill"] = [
        {
            "replica": s,
            "t_after_kill": round(r["t"] - kill_t, 3),
            "mstep_before_after": [r["mstep_before"], r["mstep"]],
        }
        for s in survivors
        for r in steps(s)
        if r["t"] > kill_t and r["sync"] and r.get("healed")
    ]
    res["participants_at_continue"] = {
        s: next(
            (
                r["participants"]
                for r in steps(s)
                if cont.get(s) is not None and abs(r["t"] - kill_t - cont[s]) < 1e-3 and r["sync"]
            ),
            None,
        )
        for s in survivors
    }

    # (c) the replacement
    if restart_t is not None:
        rl = logs.get(repl, [])
        start = next((r for r in rl if r.get("event") == "start"), None)
        first = next((r for r in rl if r.get("event") == "step" and r["sync"] and r.get("committed")), None)
        rr: dict = {"popen_after_kill_s": round(restart_t - kill_t, 3)}
        if start:
            rr["python_main_after_popen_s"] = round(start["t"] - restart_t, 3)
            rr["manager_up_after_popen_s"] = round(start["t_manager"] - restart_t, 3)
        if first is None:
            rr["healed"] = False
            rr["error"] = "no committed sync in the replacement's log"
        else:
            rr["first_committed_sync_after_popen_s"] = round(first["t"] - restart_t, 3)
            rr["healed"] = bool(first.get("healed"))
            rr["participants"] = first["participants"]
            rr["mstep_before_after"] = [first["mstep_before"], first["mstep"]]
            rr["wasted_inner_steps_before_heal"] = first["inner"]
            same = {}
            for s in survivors:
                peer = next(
                    (
                        r
                        for r in steps(s)
                        if r["sync"] and r.get("committed") and r["mstep"] == first["mstep"]
                    ),
                    None,
                )
                same[s] = (
                    None
                    if peer is None
                    else {
                        "params_equal": peer["hash"] == first["hash"],
                        "outer_state_equal": peer["outer_hash"] == first["outer_hash"],
                        "participants": peer["participants"],
                    }
                )
            rr["equal_to_survivors_at_first_sync"] = same
            # every later committed sync too
            later = []
            for r in steps(repl):
                if not (r["sync"] and r.get("committed")) or r["mstep"] <= first["mstep"]:
                    continue
                for s in survivors:
                    peer = next(
                        (
                            q
                            for q in steps(s)
                            if q["sync"] and q.get("committed") and q["mstep"] == r["mstep"]
                        ),
                        None,
                    )
                    if peer is not None:
                        later.append(peer["hash"] == r["hash"])
            rr["later_syncs_equal"] = f"{sum(later)}/{len(later)}"
            # the survivors' stall when the replacement joined
            join_stall = {}
            for s in survivors:
                st = steps(s)
                peer = next(
                    (r for r in st if r["sync"] and r.get("committed") and r["mstep"] == first["mstep"]), None
                )
                if peer is not None:
                    join_stall[s] = round(peer["sync_s"], 3)
            rr["survivor_sync_s_at_join"] = join_stall
        res["replacement"] = rr

    # final agreement
    finals = {}
    for name, recs in logs.items():
        sy = [r for r in recs if r.get("event") == "step" and r["sync"] and r.get("committed")]
        if sy and name != victim:
            finals[name] = (sy[-1]["mstep"], sy[-1]["hash"])
    res["final_mstep_hash"] = finals
    res["final_all_equal"] = len({v for v in finals.values()}) == 1
    return res


def driver(a: argparse.Namespace) -> int:
    try:
        from torchft.coordination import LighthouseServer
    except ImportError:
        print("torchft is not installed: .venv/bin/pip install torchft==0.2.0", file=sys.stderr)
        return 2

    workdir = Path(tempfile.mkdtemp(prefix="torchft-anchor-"))
    ready = workdir / "ready"
    ready.mkdir()
    saved_fd2 = os.dup(2)
    lh_log = open(workdir / "lighthouse.log", "w")  # noqa: SIM115
    os.dup2(lh_log.fileno(), 2)  # the Rust lighthouse logs every quorum to stderr
    lighthouse = LighthouseServer(
        bind="[::]:0",
        min_replicas=a.min_replicas,
        join_timeout_ms=a.join_timeout_ms,
        quorum_tick_ms=a.quorum_tick_ms,
        heartbeat_timeout_ms=a.heartbeat_timeout_ms,
    )
    lh_addr = lighthouse.address()
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    procs: dict[str, subprocess.Popen] = {}
    popen_t: dict[str, float] = {}
    files = []

    def spawn(replica: int, attempt: int) -> str:
        name = f"r{replica}a{attempt}"
        err = open(workdir / f"{name}.stderr", "w")  # noqa: SIM115
        files.append(err)
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            "--replica",
            str(replica),
            "--attempt",
            str(attempt),
            "--replicas",
            str(a.replicas),
            "--steps",
            str(a.steps),
            "--sync-every",
            str(a.sync_every),
            "--step-time",
            str(a.step_time),
            "--batch-size",
            str(a.batch_size),
            "--min-replicas",
            str(a.min_replicas),
            "--timeout",
            str(a.timeout),
            "--quorum-timeout",
            str(a.quorum_timeout),
            "--heartbeat-interval-ms",
            str(a.heartbeat_interval_ms),
            "--lighthouse",
            lh_addr,
            "--log",
            str(workdir / f"{name}.jsonl"),
            "--ready-dir",
            str(ready),
        ]
        popen_t[name] = time.time()
        procs[name] = subprocess.Popen(
            cmd, env=env, stdout=err, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
        )
        return name

    kill_t = restart_t = None
    t0 = time.time()
    result: dict = {"args": vars(a), "workdir": str(workdir), "lighthouse": lh_addr}
    try:
        for i in range(a.replicas):
            spawn(i, 0)
        victim = f"r{a.kill_replica}a0"
        while True:
            time.sleep(0.005)
            trigger = "presync" if a.kill_in_sync else "step"
            if kill_t is None and last_inner(workdir / f"{victim}.jsonl", trigger) >= a.kill_at_step:
                if a.kill_in_sync:
                    time.sleep(a.kill_delay)
                os.kill(procs[victim].pid, signal.SIGKILL)
                kill_t = time.time()
                print(
                    f"[driver] SIGKILL {victim} at its inner step {a.kill_at_step}"
                    f"{f' (in its sync, +{a.kill_delay}s)' if a.kill_in_sync else ''}, t={kill_t - t0:.2f}s",
                    flush=True,
                )
            if (
                kill_t is not None
                and restart_t is None
                and a.restart_after >= 0
                and time.time() - kill_t >= a.restart_after
            ):
                spawn(a.kill_replica, 1)
                restart_t = popen_t[f"r{a.kill_replica}a1"]
                print(f"[driver] restarted replica {a.kill_replica} t={restart_t - t0:.2f}s", flush=True)
            live = [n for n, p in procs.items() if p.poll() is None]
            if not live:
                break
            # the survivors are done: give a stray replacement a little time, then stop it
            others_done = all(procs[n].poll() is not None for n in procs if n != f"r{a.kill_replica}a1")
            if others_done and live and time.time() - max(popen_t.values()) > 5:
                done_t = max(time.time(), 0)
                while time.time() - done_t < 10 and any(procs[n].poll() is None for n in live):
                    time.sleep(0.1)
                break
            if time.time() - t0 > a.max_seconds:
                result["error"] = f"run exceeded --max-seconds {a.max_seconds}"
                break
    finally:
        for name, p in procs.items():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                result.setdefault("killed_at_end", []).append(name)
        for f in files:
            f.close()
        lighthouse.shutdown()
        sys.stderr.flush()
        os.dup2(saved_fd2, 2)
        lh_log.close()

    exits = {n: p.returncode for n, p in procs.items()}
    crashes, handled = {}, {}
    for n in procs:
        text = (workdir / f"{n}.stderr").read_text(errors="replace")
        during, returned, at_exit = text.partition(RETURNED)
        hits = [m for m in FATAL_MARKS if m in text]
        if returned and at_exit.strip():
            hits.append("output at interpreter exit: " + at_exit.strip()[-300:])
        if hits:
            crashes[n] = hits
        if during.count("Traceback (most recent call last)"):
            handled[n] = during.count("Traceback (most recent call last)")
    result["tracebacks_logged_by_torchft_during_run"] = handled
    victim = f"r{a.kill_replica}a0"
    result["exit_codes"] = exits
    result["crashes"] = crashes
    result["all_exit_0"] = all(rc == 0 for n, rc in exits.items() if n != victim) and exits.get(victim) == -9
    result["wall_s"] = round(time.time() - t0, 2)
    result.update(analyse(a, procs, kill_t, restart_t, workdir))

    print(json.dumps({k: v for k, v in result.items() if k != "args"}, indent=1))
    rr = result.get("replacement", {})
    eq = rr.get("equal_to_survivors_at_first_sync", {})
    summary = {
        "stall_s": result.get("survivor_stall_s"),
        "kill_to_quorum_without_dead_s": result.get("kill_to_lighthouse_quorum_without_dead_s"),
        "kill_to_continue_s": result.get("kill_to_continue_s"),
        "failed_syncs": len(result.get("survivor_failed_syncs_after_kill", [])),
        "survivors_healed": len(result.get("survivors_healed_after_kill", [])),
        "replacement_popen_to_healed_sync_s": rr.get("first_committed_sync_after_popen_s"),
        "replacement_manager_up_s": rr.get("manager_up_after_popen_s"),
        "healed": rr.get("healed"),
        "healed_vs_survivors_compared": sum(v is not None for v in eq.values()),
        "bitwise_equal_params": all(v["params_equal"] for v in eq.values() if v) if eq else None,
        "bitwise_equal_outer_state": all(v["outer_state_equal"] for v in eq.values() if v) if eq else None,
        "later_syncs_equal": rr.get("later_syncs_equal"),
        "final_all_equal": result.get("final_all_equal"),
        "exit_codes": result["exit_codes"],
        "all_exit_ok": result["all_exit_0"] and not crashes,
    }
    result["summary"] = summary
    print("SUMMARY " + json.dumps(summary))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1))
        print(f"[driver] wrote {a.out}; logs in {workdir}")
    ok = result["all_exit_0"] and not result.get("error") and not crashes
    return 0 if ok else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--steps", type=int, default=120, help="inner steps in all (outer steps: steps // H)")
    p.add_argument("--sync-every", type=int, default=5, help="H, inner steps per outer sync")
    p.add_argument("--kill-at-step", type=int, default=42, help="the victim's inner step after which it dies")
    p.add_argument("--kill-replica", type=int, default=1)
    p.add_argument(
        "--kill-in-sync",
        action="store_true",
        help="kill when the victim enters the outer sync "
        "that ends at --kill-at-step (which should then be a multiple of H), after --kill-delay",
    )
    p.add_argument("--kill-delay", type=float, default=0.03)
    p.add_argument("--restart-after", type=float, default=3.0, help="seconds; < 0: no replacement")
    p.add_argument("--step-time", type=float, default=0.1, help="pad each inner step to this many seconds")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument(
        "--min-replicas",
        type=int,
        default=0,
        help="lighthouse min_replicas and the Manager's min_replica_size (0: replicas - 1)",
    )
    p.add_argument("--heartbeat-timeout-ms", type=int, default=1000)
    p.add_argument("--join-timeout-ms", type=int, default=1000)
    p.add_argument("--quorum-tick-ms", type=int, default=100)
    p.add_argument("--heartbeat-interval-ms", type=int, default=100)
    p.add_argument("--timeout", type=float, default=10.0, help="Manager and gloo timeout, seconds")
    p.add_argument("--quorum-timeout", type=float, default=60.0)
    p.add_argument("--max-seconds", type=float, default=300.0)
    p.add_argument("--out", default="")
    # worker-only
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--replica", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--attempt", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--lighthouse", default="", help=argparse.SUPPRESS)
    p.add_argument("--log", default="", help=argparse.SUPPRESS)
    p.add_argument("--ready-dir", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.min_replicas <= 0:
        a.min_replicas = max(1, a.replicas - 1)
    if a.worker:
        return worker(a)
    return driver(a)


if __name__ == "__main__":
    sys.exit(main())
