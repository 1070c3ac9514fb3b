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
never sent; the worker checks the coordinator's answer too, so a forged "ok" in the store (which
anyone who reaches it can write) is not taken for one. A joiner's request (``join/{h}``) and a
spare's registration carry the number ``i`` of their proof, and the coordinator acts only on
proven ones. A refused worker exits with one line; the run goes on without it.

What it does not do: encrypt or authenticate the collectives themselves (gloo, NCCL) once a
worker is in. Run those on a private network or a VPN (WireGuard).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import threading
import time
from pathlib import Path

TOKEN_ENV = "GEOTRAIN_TOKEN"
POLL_S = 0.02


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


def prove(store, token: str, host: int, timeout_s: float = 30.0) -> int:
    """Answer the coordinator's challenge as ``host``; returns the proof's number (given with a
    join request or a spare's registration). Raises ``Refused``."""
    i = int(store.add("auth/n", 1))
    mine = secrets.token_hex(16)
    store.set(f"auth/hello/{i}", f"{host}:{mine}")
    deadline = time.monotonic() + timeout_s
    challenge = _wait(store, f"auth/challenge/{i}", deadline)
    if challenge == "none":  # the coordinator has no token: nothing to prove
        return i
    store.set(f"auth/proof/{i}", _mac(token, "admit", i, host, mine, challenge))
    verdict = _wait(store, f"auth/verdict/{i}", deadline)
    genuine = _mac(token, "ok", i, host, mine, challenge)
    if verdict.startswith("ok:") and hmac.compare_digest(verdict[3:], genuine):
        return i
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
    return store.get(key).decode()


class Door:
    """The coordinator's side: answers each hello with a challenge and each proof with a
    verdict, from a thread of its own (so a worker waits milliseconds, not a watch period).
    Without a token every hello is answered "none" and every proof number counts as proven.
    Each verdict is appended to ``control/admissions.jsonl`` (host, proof number, ok or refused),
    so a restarted coordinator still knows them."""

    def __init__(self, store, control_dir: Path, token: str) -> None:
        self.store, self.token = store, token
        self.path = control_dir / "admissions.jsonl"
        self._lock = threading.Lock()
        self._proven: set[int] = set()  # proof numbers that passed
        self._used: set[int] = set()  # ... and were given with a join request
        self.refused: list[dict] = []  # {proof, host}, newest last
        self._answered: set[int] = set()
        self._low = 1  # every number below it is answered
        with contextlib.suppress(OSError):
            for line in self.path.read_text().splitlines():
                with contextlib.suppress(ValueError, KeyError):
                    r = json.loads(line)
                    (self._proven if r["ok"] else self._answered).add(int(r["proof"]))
                    self._used.update([int(r["proof"])] if r.get("used") else [])
        self._pending: dict[int, tuple[int, str, str]] = {}  # number -> (host, worker's, ours)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="geotrain-door", daemon=True)
        self._thread.start()

    def proven(self, proof: int) -> bool:
        """Did proof number ``proof`` pass? (Any does, without a token.)"""
        if not self.token:
            return True
        with self._lock:
            return proof in self._proven

    def use(self, proof: int) -> bool:
        """A join request carrying ``proof``: True once per proof that passed (a proof seen in
        the store cannot be given again with a forged request)."""
        if not self.token:
            return True
        with self._lock:
            if proof not in self._proven or proof in self._used:
                return False
            self._used.add(proof)
        self.record({"proof": proof, "ok": True, "used": True})
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
        issued = int(store.add("auth/n", 0))
        for i in range(self._low, issued + 1):
            if i in self._answered or i in self._proven or i in self._pending:
                continue
            if not store.check([f"auth/hello/{i}"]):
                continue  # its hello is on the way (or its worker died before it)
            host, _, theirs = store.get(f"auth/hello/{i}").decode().partition(":")
            if not self.token:
                store.set(f"auth/challenge/{i}", "none")
                self._answered.add(i)
                continue
            ours = secrets.token_hex(16)
            self._pending[i] = (int(host), theirs, ours)
            store.set(f"auth/challenge/{i}", ours)
        while self._low <= issued and (self._low in self._answered or self._low in self._proven):
            self._low += 1
        for i, (host, theirs, ours) in list(self._pending.items()):
            if not store.check([f"auth/proof/{i}"]):
                continue
            del self._pending[i]
            proof = store.get(f"auth/proof/{i}").decode()
            ok = hmac.compare_digest(proof, _mac(self.token, "admit", i, host, theirs, ours))
            with self._lock:
                (self._proven if ok else self._answered).add(i)
                if not ok:
                    self.refused.append({"proof": i, "host": host})
            self.record({"proof": i, "host": host, "ok": ok})
            answer = "ok:" + _mac(self.token, "ok", i, host, theirs, ours) if ok else "refused"
            store.set(f"auth/verdict/{i}", answer)
