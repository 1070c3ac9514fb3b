"""The run token: a worker proves it holds the run's secret before it is let in.

Anyone who can reach a run's coordinator (``geotrain broker`` on real machines) could otherwise
join it as a replacement or a spare, and be averaged into every replica. With a token (the
environment's ``GEOTRAIN_TOKEN``, or ``--token-file``; ``geotrain run`` makes one per run) the
coordinator lets in only workers that answer its challenge:

    worker       -> store: auth/hello/{i} = "host:nonce_w"        (i from the counter auth/n)
    coordinator  -> store: auth/challenge/{i} = nonce_c
    worker       -> store: auth/proof/{i} = HMAC(token, "admit|i|host|nonce_w|nonce_c")
    coordinator  -> store: auth/verdict/{i} = "ok:" + HMAC(token, "ok|i|host|nonce_w|nonce_c")
                                             or "refused"

Both nonces are fresh, so a proof seen on the wire cannot be replayed, and the secret itself is
never sent; the worker checks the coordinator's answer too, so a forged "ok" in the store is not
taken for one, and a worker that holds a token takes no "nothing to prove" for an answer. What a
proven worker then asks for is bound to its proof: a join request for host h is
``i:HMAC(token, "join|i|h|nonce_w|nonce_c")`` and is taken once; a spare's registration is
``i:HMAC(token, "spare|i|...")``. A refused worker exits with one line; the run goes on.

What it does not do: the coordinator's store itself is not authenticated (heartbeats, epochs and
gloo's rendezvous go through it), so whoever reaches its port can still disturb a run, though not
join it; and the collectives (gloo, NCCL) are neither encrypted nor authenticated. Run on a
private network or a VPN (WireGuard).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

TOKEN_ENV = "GEOTRAIN_TOKEN"
POLL_S = 0.02
GIVE_UP_S = 120.0  # a number whose hello or proof has not come by then is done with
SCAN_PER_TICK = 256  # the newest proof numbers looked at per tick: a bumped counter cannot stall it


class Refused(RuntimeError):
    """This worker's proof was not accepted (or the coordinator's answer was not genuine)."""


def new_token() -> str:
    return secrets.token_hex(32)


def read_token(token_file: str = "") -> str:
    """The run's secret: ``token_file``'s first line, else ``GEOTRAIN_TOKEN``, else "" (none)."""
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as e:
            raise ValueError(f"--token-file {token_file}: cannot be read ({e.strerror})") from None
        if not token:
            raise ValueError(f"--token-file {token_file} is empty")
        return token
    return os.environ.get(TOKEN_ENV, "").strip()


def write_token(path: Path) -> str:
    """A new token in ``path`` (readable by its owner only), or the one already there (a resume)."""
    if path.exists():
        return path.read_text().strip()
    token = new_token()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def _mac(token: str, *parts: object) -> str:
    message = "|".join(str(p) for p in parts).encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def _same(a: str, b: str) -> bool:
    try:
        return hmac.compare_digest(a, b)
    except TypeError:  # not ASCII: not a MAC of ours
        return False


def _number(text: str) -> int | None:
    return int(text) if re.fullmatch(r"[0-9]{1,12}", text, re.ASCII) else None


@dataclass(frozen=True)
class Pass:
    """A proof that passed: what a worker signs its requests with."""

    number: int
    host: int
    mine: str
    theirs: str

    def sign(self, token: str, what: str, target: int) -> str:
        """``number:HMAC(...)`` for ``what`` (join, spare) about host ``target``."""
        return f"{self.number}:{_mac(token, what, self.number, target, self.mine, self.theirs)}"


def eviction(token: str, host: int, asker: int, epoch: int) -> str:
    """Member ``asker``'s signed request, in epoch ``epoch``, to drop ``host``
    (``--max-rejections``). The coordinator drops it when most members ask; a request is good
    for its epoch only."""
    return _mac(token, "evict", host, asker, epoch)


def check_eviction(token: str, host: int, asker: int, epoch: int, signature: str) -> bool:
    return _same(signature, eviction(token, host, asker, epoch))


def prove(store, token: str, host: int, timeout_s: float = 30.0) -> Pass:
    """Answer the coordinator's challenge as ``host``. Raises ``Refused``."""
    try:
        i = int(store.add("auth/n", 1))
        mine = secrets.token_hex(16)
        store.set(f"auth/hello/{i}", f"{host}:{mine}")
        deadline = time.monotonic() + timeout_s
        challenge = _wait(store, f"auth/challenge/{i}", deadline)
        if challenge == "none":  # the coordinator has no token: nothing to prove
            if token:
                raise Refused(
                    "the run's coordinator asks for no proof, but this worker holds a token: it is "
                    f"not the run's coordinator, or it was started without the token ({TOKEN_ENV})"
                )
            return Pass(i, host, mine, challenge)
        store.set(f"auth/proof/{i}", _mac(token, "admit", i, host, mine, challenge))
        verdict = _wait(store, f"auth/verdict/{i}", deadline)
    except Refused:
        raise
    except Exception as e:  # the store went away, or answered nonsense
        raise Refused(f"the run's coordinator stopped answering its challenge ({type(e).__name__})") from None
    if verdict.startswith("ok:") and _same(verdict[3:], _mac(token, "ok", i, host, mine, challenge)):
        return Pass(i, host, mine, challenge)
    if verdict == "refused":
        raise Refused(
            f"refused by the run: this worker's token ({TOKEN_ENV} or --token-file) is not the run's"
        )
    raise Refused(
        "the coordinator's answer does not match this worker's token: it is not the run's coordinator"
    )


def _wait(store, key: str, deadline: float) -> str:
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise Refused(f"no answer from the run's coordinator to its challenge ({key}): is it running?")
        time.sleep(POLL_S)
    return store.get(key).decode(errors="replace")


class Door:
    """The coordinator's side: answers each hello with a challenge and each proof with a
    verdict, from a thread of its own (so a worker waits milliseconds, not a watch period).
    Without a token every hello is answered "none" and any request counts as signed. Each
    verdict is appended to ``control/admissions.jsonl`` (with the nonces, which are not secret),
    so a restarted coordinator still knows who passed."""

    def __init__(self, store, control_dir: Path, token: str) -> None:
        self.store, self.token = store, token
        self.path = control_dir / "admissions.jsonl"
        self._lock = threading.Lock()
        self._passed: dict[int, Pass] = {}  # proofs that passed, by number
        self._used: set[int] = set()  # ... and whose join request was taken
        self._answered: set[int] = set()  # numbers done with (refused, bad, or no token)
        self.refused: list[dict] = []  # {proof, host}, newest last
        with contextlib.suppress(OSError):
            for line in self.path.read_text().splitlines():
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    r = json.loads(line)
                    if r.get("used"):
                        self._used.add(int(r["proof"]))
                    elif r.get("ok"):
                        self._passed[int(r["proof"])] = Pass(
                            int(r["proof"]), int(r["host"]), r["mine"], r["theirs"]
                        )
                    elif "proof" in r:
                        self._answered.add(int(r["proof"]))
        self._pending: dict[int, tuple[int, str, str]] = {}  # number -> (host, worker's, ours)
        self._seen: dict[int, float] = {}  # when a number still waiting was first looked at
        # A restarted coordinator's store counts from 0: numbers already recorded are not given
        # out again (a new proof under an old number would never be answered).
        recorded = max([0, *self._passed, *self._answered, *self._used])
        store.add("auth/n", max(0, recorded - int(store.add("auth/n", 0))))
        self._low = recorded + 1  # every number below it is done with
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="geotrain-door", daemon=True)
        self._thread.start()

    def signed(self, what: str, request: str, target: int) -> Pass | None:
        """The pass behind ``request`` (``number:mac``) for ``what`` about host ``target``, if
        its MAC is right (any, without a token)."""
        number, _, mac = request.partition(":")
        i = _number(number)
        if i is None:
            return None
        with self._lock:
            granted = self._passed.get(i)
        if not self.token:
            return granted or Pass(i, target, "", "")
        if granted is None or not _same(mac, _mac(self.token, what, i, target, granted.mine, granted.theirs)):
            return None
        return granted

    def use(self, request: str, host: int) -> bool:
        """A join request for ``host``: True once per proof, if signed by the one who passed."""
        granted = self.signed("join", request, host)
        if granted is None:
            return False
        if self.token:
            with self._lock:
                if granted.number in self._used:
                    return False
                self._used.add(granted.number)
            self.record({"proof": granted.number, "used": True, "host": host})
        return True

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def record(self, line: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({**line, "at": time.time()}) + "\n")

    def _serve(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # the store goes when the coordinator ends
                self._tick()
            self._stop.wait(POLL_S)

    def _tick(self) -> None:
        store = self.store
        now = time.monotonic()
        for i, (host, theirs, ours) in list(self._pending.items()):  # proofs first: they wait
            if store.check([f"auth/proof/{i}"]):
                del self._pending[i]
                self._judge(i, host, theirs, ours, store.get(f"auth/proof/{i}").decode(errors="replace"))
            elif now - self._seen.setdefault(i, now) > GIVE_UP_S:  # its worker went away
                del self._pending[i]
                self._answered.add(i)
        issued = int(store.add("auth/n", 0))
        # The newest numbers only: an honest worker's hello follows its number at once, and a
        # counter bumped by someone else must not bury it under numbers that never say hello.
        self._low = max(self._low, issued - SCAN_PER_TICK + 1)
        for i in range(self._low, issued + 1):
            if i in self._answered or i in self._passed or i in self._pending:
                continue
            if not store.check([f"auth/hello/{i}"]):
                if now - self._seen.setdefault(i, now) > GIVE_UP_S:  # its worker died before it
                    self._answered.add(i)
                continue  # its hello is on the way
            host_text, _, theirs = store.get(f"auth/hello/{i}").decode(errors="replace").partition(":")
            host = _number(host_text.lstrip("-"))
            if not self.token or host is None:
                store.set(f"auth/challenge/{i}", "none" if not self.token else "malformed")
                self._answered.add(i)
                continue
            ours = secrets.token_hex(16)
            self._pending[i] = (-host if host_text.startswith("-") else host, theirs, ours)
            store.set(f"auth/challenge/{i}", ours)
        while self._low <= issued and (self._low in self._answered or self._low in self._passed):
            self._low += 1  # (numbers still waiting for their hello stay in the window)

    def _judge(self, i: int, host: int, theirs: str, ours: str, proof: str) -> None:
        ok = _same(proof, _mac(self.token, "admit", i, host, theirs, ours))
        with self._lock:
            if ok:
                self._passed[i] = Pass(i, host, theirs, ours)
            else:
                self._answered.add(i)
                self.refused.append({"proof": i, "host": host})
        line = {"proof": i, "host": host, "ok": ok}
        self.record({**line, "mine": theirs, "theirs": ours} if ok else line)
        answer = "ok:" + _mac(self.token, "ok", i, host, theirs, ours) if ok else "refused"
        self.store.set(f"auth/verdict/{i}", answer)
