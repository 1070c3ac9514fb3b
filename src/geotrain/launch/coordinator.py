"""The coordinator: a small process that is not a trainer and watches every host's heartbeat.

A gloo collective on a peer that has gone silent (a frozen process, a cut link, a host that lost
power) returns only at the group's timeout, because no reset ever arrives. So failures are not
found by collectives: each trainer runs a heartbeat thread that bumps a counter in the
coordinator's store (torch's ``TCPStore``, reached over the host's own link, so a cut link stops
it), and the coordinator declares a host failed when its counter has not moved for
``--fault-timeout`` seconds. The heartbeat thread beats while the training thread sits in a long
collective (torch releases the GIL there), so the timeout need not cover the slowest collective.

The coordinator runs in a namespace of its own on the emulated cluster (``geotrain run``), on
loopback without namespaces. It writes each verdict as one JSON line to ``control/verdicts.jsonl``
in the run directory, which the launcher watches; the launcher tells it the current launch
attempt through ``control/attempt`` (each attempt's trainers beat under keys of their own).

Heartbeat keys: ``hb/{attempt}/{host}``, and ``bye/{attempt}/{host}`` once a trainer exits in
order. The trainer side is :class:`Heartbeat`.

With ``--elastic`` (``--on-failure continue``) the coordinator also owns the membership: a host
found silent, or named by the launcher in ``control/dead-{host}`` (its trainer exited with an
error), leaves, and the coordinator publishes the next epoch (``ft/membership.py``). Epochs are
appended to ``control/epochs.jsonl``; a restarted coordinator reads them back and publishes them
again in its fresh store, so the survivors' next regroup finds them. Losing the coordinator
stops nothing: training does not touch it between failures, and the launcher restarts it on the
same port within a second (a failure in that second is found after it restarts). It also keeps
the backup pool (:class:`Pool`): spares that wait to take a lost host's place.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from geotrain.launch.admission import TOKEN_ENV, Door, check_eviction, read_token

BEAT_S = 0.5  # a trainer's heartbeat period
EPOCH_POLL_S = 0.1  # how often an elastic trainer asks for the newest epoch


def _store(host: str, port: int, master: bool, timeout_s: float, listen_fd: int | None = None):
    from torch.distributed import TCPStore

    return TCPStore(
        host, port, is_master=master, wait_for_workers=False, timeout=timedelta(seconds=timeout_s),
        master_listen_fd=listen_fd,
    )  # fmt: skip


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file appended to as things happen (none if it is not there; a
    line cut short by a crash is skipped)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


class Epochs:
    """The membership the coordinator publishes (``--elastic``)."""

    def __init__(self, store, control_dir: Path, hosts: int) -> None:
        self.store, self.path = store, control_dir / "epochs.jsonl"
        self.epoch, self.live = 0, list(range(hosts))
        for e in read_jsonl(self.path):  # a restarted coordinator publishes them again
            self.epoch, self.live = int(e["epoch"]), list(e["members"])
            store.set(f"kind/{self.epoch}", "join" if e.get("joined") else "leave")
            if "site" in e:  # the site of the machine that joined (with --topology and --spares)
                store.set(f"site/{e['joined'][0]}", str(e["site"]))
            store.set(f"members/{self.epoch}", ",".join(map(str, self.live)))
        store.set("members/0", ",".join(map(str, range(hosts))))
        store.add("epoch", self.epoch - store.add("epoch", 0))

    def _publish(self, kind: str, why: str, **change: list[int] | int) -> None:
        self.epoch += 1
        # Members and kind first: a trainer that sees the counter move reads them at once.
        self.store.set(f"kind/{self.epoch}", kind)
        self.store.set(f"members/{self.epoch}", ",".join(map(str, self.live)))
        self.store.add("epoch", 1)
        line = {"epoch": self.epoch, "members": self.live, **change, "why": why, "at": time.time()}
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")

    def leave(self, gone: set[int], why: str) -> None:
        gone = gone & set(self.live)
        if gone:
            # Their ready marks are void: an epoch would look complete with a member that is
            # gone (a joiner is ready long before it is admitted), and its group never forms.
            for e in range(1, self.epoch + 1):
                for h in gone:
                    self.store.delete_key(f"ready/{e}/{h}")
            self.live = [h for h in self.live if h not in gone]
            self._publish("leave", why, left=sorted(gone))

    def join(self, host: int, site: int | None = None) -> None:
        """Admit a joiner: last in rank order, so rank 0 stays a survivor's (it writes the run's
        summary from its whole history). ``site``: the site of the machine that joins as
        ``host`` (a spare of another site's), published before the epoch so that every member
        forms the new epoch's site groups with it (``Membership.join``)."""
        if host not in self.live:
            self.live = [*self.live, host]
            if site is not None:
                self.store.set(f"site/{host}", str(site))
            self._publish("join", "requested", joined=[host], **({"site": site} if site is not None else {}))


class Pool:
    """The backup pool (``--spares``, ``geotrain join --spare``; FusionAI's backup providers).

    A spare registers as ``spare/{i}`` (``i`` from the counter ``spares``; its value is the
    machine's label), beats under ``poolhb/{i}``, and is given the place of a lost host by
    ``assign/{i}`` = that host (and ``placed/{h}``, which turns away another replacement): the
    lowest vacant host goes to the spare that registered first and still beats. The spare claims
    it (``claim/{i}``: "taken", set once) and asks to join as that host, like any replacement.
    One that goes silent before it is admitted (neither its pool beat nor its beat as the host
    moves for ``timeout_s``) loses the place to the next spare: if it had not claimed it yet,
    the claim is closed ("revoked") so it never goes on as that host. Each hand-out and revocation
    is appended to ``control/spares.jsonl``: the launcher moves the spare's process into the
    host's place, or stops it. A restarted coordinator rebuilds the pool from that file.

    ``site_of`` (the site of each machine label, hosts and spares; ``geotrain run --topology``
    with ``--spares``): a vacancy goes first to a waiting spare of the lost host's own site, so
    the replacement sits behind the same uplink and its two-level groups are the right ones;
    to another site's spare only where its own site has none."""

    def __init__(
        self,
        store,
        control_dir: Path,
        hosts: int,
        timeout_s: float,
        live: list[int],
        clock=time.monotonic,
        door: Door | None = None,
        site_of: list[int] | None = None,
    ) -> None:
        self.store, self.hosts, self.timeout_s, self.clock, self.door = store, hosts, timeout_s, clock, door
        self.site_of = site_of
        self.path, self.issued_path = control_dir / "spares.jsonl", control_dir / "spares-issued"
        self.beats: dict[int, tuple[int, float]] = {}  # spare -> (beats, when they last moved)
        self.placed: dict[int, int] = {}  # host -> the spare given its place, until admitted
        self.done: set[int] = set()  # spares admitted, revoked or gone
        self.issued = 0
        self.labels: dict[int, int] = {}  # spare -> its machine's label, as it was placed
        latest: dict[int, dict] = {}
        for line in read_jsonl(self.path):  # a restarted coordinator: the pool as it was
            self.done.add(int(line["spare"]))
            latest[int(line["host"])] = line
            if "label" in line:  # a spare placed before the restart does not register again
                self.labels[int(line["spare"])] = int(line["label"])
        with contextlib.suppress(OSError, ValueError):
            self.issued = int(self.issued_path.read_text())
        self.issued = max([self.issued, *self.done])
        # Ids are never issued twice: a spare still waiting re-registers under its own.
        store.add("spares", max(0, self.issued - int(store.add("spares", 0))))
        for h, line in latest.items():
            if h not in live and not line.get("revoked"):  # placed, not admitted yet
                i = int(line["spare"])
                self.placed[h] = i
                self.done.discard(i)
                store.set(f"assign/{i}", str(h))
                store.set(f"placed/{h}", str(i))
                store.compare_set(f"claim/{i}", "", "taken")  # it may have claimed it already

    def _alive(self, i: int, now: float, attempt: int) -> bool:
        beats = int(self.store.add(f"poolhb/{i}", 0))
        host = self.store.get(f"assign/{i}").decode() if self.store.check([f"assign/{i}"]) else ""
        if host and self.store.check([f"hb/{attempt}/{host}"]):  # its beat as the host counts too
            beats += int(self.store.add(f"hb/{attempt}/{host}", 0))
        if i not in self.beats or self.beats[i][0] != beats:
            self.beats[i] = (beats, now)
        return now - self.beats[i][1] <= self.timeout_s

    def _record(self, **line) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({**line, "at": time.time()}) + "\n")

    def release(self, host: int) -> None:
        """The spare placed at ``host`` exited (the launcher's deathrattle): the place is free."""
        i = self.placed.pop(host, None)
        if i is not None:
            self.done.add(i)
            self.store.delete_key(f"placed/{host}")

    def tick(self, live: list[int], attempt: int, run_over: bool) -> None:
        now = self.clock()
        for h, i in list(self.placed.items()):
            if h in live:  # admitted: an ordinary member from here on
                del self.placed[h]
                self.done.add(i)
                self.store.delete_key(f"placed/{h}")
            elif not self._alive(i, now, attempt):
                claimed = self.store.compare_set(f"claim/{i}", "", "revoked") == b"taken"
                del self.placed[h]
                self.done.add(i)
                self.store.delete_key(f"assign/{i}")
                self.store.delete_key(f"placed/{h}")
                self._record(spare=i, label=self._label(i), host=h, revoked=True, claimed=claimed)
        registered = int(self.store.add("spares", 0))
        if registered > self.issued:
            self.issued = registered
            with contextlib.suppress(OSError):
                self.issued_path.write_text(str(registered))
        if run_over:
            return
        waiting = [
            i for i in range(1, registered + 1)
            if i not in self.done and i not in self.placed.values() and self.store.check([f"spare/{i}"])
        ]  # fmt: skip
        waiting = [i for i in waiting if self._alive(i, now, attempt) and self._proven(i)]
        vacant = [
            h for h in range(self.hosts)
            if h not in live and h not in self.placed and not self.store.check([f"join/{h}"])
        ]  # fmt: skip
        # Spares of each vacancy's own site first, then what is left, in host order.
        for h, i in self._match(vacant, waiting):
            self.placed[h] = i
            self.store.set(f"placed/{h}", str(i))
            self.store.set(f"assign/{i}", str(h))
            self._record(spare=i, label=self._label(i), host=h)

    def _match(self, vacant: list[int], waiting: list[int]) -> list[tuple[int, int]]:
        """(host, spare) pairs: each vacancy takes the first waiting spare of its own site (with
        ``site_of``), then the vacancies left take the spares left, first come first served."""
        waiting, pairs, left = list(waiting), [], []

        def site(machine: int) -> int | None:
            return self.site_of[machine] if self.site_of and 0 <= machine < len(self.site_of) else None

        for h in vacant:
            same = [i for i in waiting if site(h) is not None and site(self._label(i)) == site(h)]
            if same:
                waiting.remove(same[0])
                pairs.append((h, same[0]))
            else:
                left.append(h)
        pairs += list(zip(left, waiting, strict=False))
        return sorted(pairs)

    def site_of_joiner(self, host: int) -> int | None:
        """The site of the machine that joins as ``host`` (with ``site_of``): the spare's placed
        there, else the host's own machine's (a replacement on the same machine)."""
        if not self.site_of:
            return None
        machine = self._label(self.placed[host]) if host in self.placed else host
        return self.site_of[machine] if 0 <= machine < len(self.site_of) else None

    def _proven(self, i: int) -> bool:
        """A spare is given a place only with a proof of the run token (``sparepass/{i}``)."""
        if self.door is None or not self.door.token:
            return True
        key = f"sparepass/{i}"
        if not self.store.check([key]):
            return False
        return self.door.signed("spare", self.store.get(key).decode(errors="replace"), i) is not None

    def _label(self, i: int) -> int:
        if i not in self.labels and self.store.check([f"spare/{i}"]):
            self.labels[i] = int(self.store.get(f"spare/{i}"))
        return self.labels.get(i, i)


def read_epochs(control_dir: Path) -> list[dict]:
    """The epochs published so far (after the first), oldest first."""
    return read_jsonl(control_dir / "epochs.jsonl")


def serve(
    control_dir: Path,
    hosts: int,
    fault_timeout_s: float,
    bind: str,
    port: int = 0,
    elastic: bool = False,
    until_done: bool = False,
    token: str = "",
    restarted: bool = False,
    listen_fd: int | None = None,
    site_of: list[int] | None = None,
) -> dict | None:
    """Host the store, write its port to ``control/port``, watch heartbeats until told to stop
    (``until_done``, a broker: until every member has left in order or failed).
    A restarted coordinator takes its predecessor's port: the trainers reconnect on their own."""
    store = _store(bind, port, True, 30.0, listen_fd)  # listen_fd: a socket the launcher bound
    door = Door(store, control_dir, token)  # the run token: who may come in (launch/admission.py)
    epochs = Epochs(store, control_dir, hosts) if elastic else None
    pool = None
    if epochs is not None:
        pool = Pool(store, control_dir, hosts, fault_timeout_s, epochs.live, door=door, site_of=site_of)
    (control_dir / "port.tmp").write_text(str(store.port))
    os.replace(control_dir / "port.tmp", control_dir / "port")
    verdicts = (control_dir / "verdicts.jsonl").open("a", buffering=1)
    evict_seen = 0  # requests to drop a host seen (the counter evict/n)
    attempt = -1
    last: dict[int, tuple[int, float]] = {}  # host -> (beats, when they last moved)
    reported: set[int] = set()
    while not (control_dir / "stop").exists():
        for key in ("finished", "stopped"):  # kept in files too: a restarted broker knows them
            if store.check([key]) and not (control_dir / key).exists():
                (control_dir / key).touch()
        if until_done and epochs is not None and attempt >= 0 and set(epochs.live) <= reported:
            # Every member said goodbye or failed: the run is over. Did it finish its steps?
            door.close()
            return {"finished": store.check(["finished"]), "stopped": store.check(["stopped"])}
        time.sleep(0.2)
        with contextlib.suppress(OSError, ValueError):
            now_attempt = int((control_dir / "attempt").read_text())
            if now_attempt != attempt:
                # A restart takes over an attempt whose hosts were beating already: one that never
                # beats again (frozen meanwhile) must still be found. Later attempts start afresh.
                taking_over = restarted and attempt == -1
                attempt, last, reported = now_attempt, {}, set()
                if epochs is not None:  # hosts gone in an earlier epoch are not watched
                    reported = set(range(hosts)) - set(epochs.live)
                if taking_over:  # only the hosts that had begun to beat: others may be starting
                    last = {
                        h: (-1, time.monotonic())
                        for h in range(hosts)
                        if (control_dir / f"beating-{attempt}-{h}").exists()
                    }
                    # Those that had left in order stay gone, and the run's end is remembered.
                    reported |= {h for h in range(hosts) if (control_dir / f"bye-{attempt}-{h}").exists()}
                    for key in ("finished", "stopped"):
                        if (control_dir / key).exists():
                            store.set(key, "1")
        if attempt < 0:
            continue
        if epochs is not None:  # the launcher's deathrattles: trainers that exited with an error
            files = list(control_dir.glob("dead-*"))
            dead = {int(f.name.split("-")[1]) for f in files}
            reported |= dead
            epochs.leave(dead, "exited")
            for f in files:  # taken: the same host may come back as a joiner
                f.unlink(missing_ok=True)
            for h in dead:  # a joiner that died before its request was taken
                store.delete_key(f"join/{h}")
                pool.release(h)  # type: ignore[union-attr]
            asked = int(store.add("evict/n", 0))  # --max-rejections: most other members ask to drop h
            for h in list(epochs.live) if asked != evict_seen else []:
                askers = [
                    m
                    for m in epochs.live
                    if m != h
                    and store.check([f"evict/{h}/{m}"])
                    and check_eviction(
                        token, h, m, epochs.epoch, store.get(f"evict/{h}/{m}").decode(errors="replace")
                    )
                ]
                if askers and 2 * len(askers) > len(epochs.live) - 1:
                    door.record({"host": h, "evicted": True, "askers": askers, "epoch": epochs.epoch})
                    reported.add(h)
                    epochs.leave({h}, "rejected")
            evict_seen = asked
            for h in range(hosts):
                if h not in epochs.live and store.check([f"join/{h}"]) and not store.check(["finished"]):
                    request = store.get(f"join/{h}").decode(errors="replace")
                    store.delete_key(f"join/{h}")
                    if not door.use(request, h):
                        door.record({"host": h, "join_refused": request[:80]})
                        # Said to the asker (by its proof's number), so it need not wait it out.
                        store.set(f"joinrefused/{h}/{request.partition(':')[0][:12]}", "1")
                        continue  # a request without a proof of the token (or one used before)
                    # Watched afresh: its beats restart from where its predecessor's stopped.
                    store.delete_key(f"bye/{attempt}/{h}")
                    store.delete_key(f"failed/{attempt}/{h}")
                    reported.discard(h)
                    last.pop(h, None)
                    epochs.join(h, pool.site_of_joiner(h) if pool is not None else None)
            pool.tick(epochs.live, attempt, store.check(["finished"]))  # type: ignore[union-attr]
        now = time.monotonic()
        for h in range(hosts):
            key, bye = f"hb/{attempt}/{h}", f"bye/{attempt}/{h}"
            if h in reported:
                continue
            if store.check([bye]):
                (control_dir / f"bye-{attempt}-{h}").touch()  # exited in order: not a failure
                reported.add(h)
                continue
            if epochs is not None and store.check([f"failed/{attempt}/{h}"]):
                reported.add(h)  # its trainer ended with an error: it leaves now
                store.delete_key(f"failed/{attempt}/{h}")
                epochs.leave({h}, "exited")
                continue
            if store.check([key]):
                beats = store.add(key, 0)
            elif h in last:
                beats = -1
            else:
                continue  # not started yet: a host that never comes up fails its rendezvous instead
            if h not in last or last[h][0] != beats:
                if h not in last or last[h][0] == -1:
                    (control_dir / f"beating-{attempt}-{h}").touch()
                last[h] = (beats, now)
            elif now - last[h][1] > fault_timeout_s:
                reported.add(h)
                silent = round(now - last[h][1], 2)
                verdict = {"attempt": attempt, "host": h, "silent_s": silent, "at": time.time()}
                verdicts.write(json.dumps(verdict) + "\n")
                if epochs is not None:
                    epochs.leave({h}, "silent")
    door.close()
    return None


def read_verdicts(control_dir: Path, attempt: int) -> list[dict]:
    """The hosts found silent during launch ``attempt`` (for the launcher)."""
    return [v for v in read_jsonl(control_dir / "verdicts.jsonl") if v.get("attempt") == attempt]


class Heartbeat:
    """In a trainer: beat to the coordinator at ``spec`` = ``ADDR:PORT:ATTEMPT:HOST`` from a
    thread. A coordinator that is unreachable is retried: the trainer never fails because of it
    (a restarted coordinator picks the beats up again). ``close()`` before the interpreter exits:
    a thread still inside the store's C++ client at exit can abort the process."""

    def __init__(self, spec: str) -> None:
        addr, port, attempt, host = spec.rsplit(":", 3)
        self.host = int(host)
        self.address = (addr, int(port))
        self.membership = None  # a Membership whose ``published`` this thread keeps current
        self.join_request = ""  # a joiner's request to be admitted, signed (launch/admission.py)
        self._where, self._key = (addr, int(port)), f"hb/{attempt}/{host}"
        self._stop = threading.Event()
        self._failed = self._silent = False
        self._thread = threading.Thread(target=self._beat, name="geotrain-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        store = None
        next_beat = 0.0
        while not self._stop.is_set():
            try:
                if store is None:
                    store = _store(*self._where, False, 2.0)
                if time.monotonic() >= next_beat:
                    store.add(self._key, 1)
                    next_beat = time.monotonic() + BEAT_S
                membership = self.membership
                if membership is not None:  # a new epoch is news within a tenth of a second
                    membership.observe(store, int(store.add("epoch", 0)))
            except Exception:  # the coordinator is away: keep trying
                store = None
            self._stop.wait(EPOCH_POLL_S if self.membership is not None else BEAT_S)
        # An orderly exit says so: silence after it is not a failure; a failed one says that.
        if store is not None and not self._silent:
            with contextlib.suppress(Exception):
                store.set(self._key.replace("hb/", "failed/" if self._failed else "bye/", 1), "1")

    def close(self, failed: bool = False, silent: bool = False) -> None:
        """Stop beating. ``failed``: the trainer ends with an error, and says so instead of
        goodbye, so that the coordinator lets its host leave at once. ``silent``: it says nothing
        (declared failed, it is not its host any more: a replacement may be)."""
        self._failed, self._silent = failed, silent
        self._stop.set()
        self._thread.join(timeout=10)


def broker(argv: list[str]) -> int:
    """``geotrain broker``: the coordinator of a run across real machines, in the foreground."""
    p = argparse.ArgumentParser(
        prog="geotrain broker",
        description="Coordinate a run across machines: the first rendezvous, heartbeats, membership "
        "epochs (survivors of a failure go on; replacements join with `geotrain join`).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--hosts", type=int, required=True, help="machines the run starts with")
    p.add_argument("--port", type=int, default=29400, help="the port of its store")
    p.add_argument("--bind", default="0.0.0.0", help="the address to listen on")
    p.add_argument("--fault-timeout", dest="fault_timeout", type=float, default=10.0,
                   help="seconds without a heartbeat after which a host has failed")  # fmt: skip
    p.add_argument("--dir", default="broker", help="where epochs.jsonl and verdicts.jsonl go")
    p.add_argument(
        "--restart",
        action="store_true",
        help="take over a broker that died: publish the membership recorded in --dir again",
    )
    p.add_argument(
        "--token-file",
        dest="token_file",
        default="",
        help=f"the run's secret (else ${TOKEN_ENV}): only workers that prove they hold it are let in "
        "(none: anyone who reaches the port may join)",
    )
    args = p.parse_args(argv)
    try:
        token = read_token(args.token_file)
    except ValueError as e:
        p.error(str(e))
    if args.hosts < 1 or not 0 < args.port < 65536 or args.fault_timeout < 2:
        p.error("--hosts must be >= 1, --port in 1..65535, --fault-timeout >= 2 seconds")
    control = Path(args.dir)
    control.mkdir(parents=True, exist_ok=True)
    if read_epochs(control) and not (control / "over").exists() and not args.restart:
        p.error(
            f"{control} holds the membership of a run that is not over (epochs.jsonl): --restart takes "
            "it over (its broker died), a fresh --dir starts a new run"
        )
    if not args.restart:  # a fresh run: nothing of an old one carries over
        for old in ("stop", "over", "finished", "stopped", "epochs.jsonl", "verdicts.jsonl", "port",
                    "beating-*", "bye-*", "dead-*", "spares.jsonl", "spares-issued",
                    "admissions.jsonl"):  # fmt: skip
            for path in control.glob(old):
                path.unlink(missing_ok=True)
    (control / "stop").unlink(missing_ok=True)
    (control / "attempt").write_text("0")
    print(
        f"geotrain broker: {args.hosts} hosts, store on {args.bind}:{args.port}; on machine I run\n"
        f"  geotrain train --broker THIS_ADDR:{args.port} --host I --run-dir DIR [training flags]\n"
        f"and a replacement for a lost machine I with `geotrain join` and the same flags",
        file=sys.stderr,
        flush=True,
    )
    try:
        end = serve(
            control, args.hosts, args.fault_timeout, args.bind, args.port, elastic=True, until_done=True,
            token=token, restarted=args.restart,
        )  # fmt: skip
    except KeyboardInterrupt:
        return 130
    (control / "over").touch()
    changes = f"{len(read_epochs(control))} membership changes, {control}/epochs.jsonl"
    if end and end["finished"] and not end["stopped"]:
        print(f"geotrain broker: the run is over ({changes})", file=sys.stderr)
        return 0
    why = "stopped below --min-workers" if end and end["stopped"] else "ended with every member failed"
    print(f"geotrain broker: the run {why} ({changes}); --resume on each machine goes on", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m geotrain.launch.coordinator")
    p.add_argument("--control-dir", required=True)
    p.add_argument("--hosts", type=int, required=True)
    p.add_argument("--fault-timeout", type=float, required=True)
    p.add_argument("--bind", default="0.0.0.0")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--elastic", action="store_true", help="publish membership epochs")
    p.add_argument("--restart", action="store_true", help="take over from a coordinator that died")
    p.add_argument("--listen-fd", dest="listen_fd", type=int, default=None, help="a bound, listening socket")
    p.add_argument("--machine-sites", dest="machine_sites", default="", help="the site of each machine label")
    args = p.parse_args(argv)
    token = read_token()  # the launcher's, in the environment, never on a command line
    control = Path(args.control_dir)
    serve(
        control, args.hosts, args.fault_timeout, args.bind, args.port, args.elastic, token=token,
        restarted=args.restart, listen_fd=args.listen_fd,
        site_of=[int(x) for x in args.machine_sites.split(",")] if args.machine_sites else None,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
