"""The run token: a challenge against the coordinator's store, the secret never on the wire.

A real TCPStore in this process, the coordinator's ``Door`` on it, and workers proving
themselves with the right token, a wrong one, none; the CLI run uses it end to end in every
launcher test (each trainer proves itself), and test_broker_cli refuses an intruder spare.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from geotrain.launch.admission import Door, Refused, prove, read_token, write_token

SECRET = "run-secret-" + "a" * 40


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def store():
    port = _free_port()
    master = TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    yield master, port


def _client(port: int) -> TCPStore:
    return TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10))


def test_the_right_token_is_let_in_its_requests_signed_a_wrong_or_missing_one_refused(store, tmp_path):
    master, port = store
    door = Door(master, tmp_path, SECRET)
    try:
        first = prove(_client(port), SECRET, host=1, timeout_s=10)
        with pytest.raises(Refused, match="refused by the run: this worker's token"):
            prove(_client(port), "a guess", host=2, timeout_s=10)
        with pytest.raises(Refused, match="asks for no proof|refused by the run"):
            prove(_client(port), "", host=2, timeout_s=10)
        # a join request is the pass's number and a MAC over it, the host and both nonces:
        join = first.sign(SECRET, "join", 4)
        assert not door.use(f"{first.number}:{'0' * 64}", 4)  # the number alone, from the store
        assert not door.use(join, 3)  # signed for another host
        assert not door.use(first.sign("a guess", "join", 4), 4)
        assert door.use(join, 4) and not door.use(join, 4)  # taken once
        assert door.signed("spare", first.sign(SECRET, "spare", 7), 7) == first
        assert door.signed("spare", "x:\u00b2", 7) is None and door.signed("spare", "\u00b2", 7) is None
        # the secret never went through the store: every value the exchange wrote
        c = _client(port)
        for i in range(1, 4):
            for key in ("hello", "challenge", "proof", "verdict"):
                if c.check([f"auth/{key}/{i}"]):
                    assert SECRET not in c.get(f"auth/{key}/{i}").decode()
        assert [r["proof"] for r in door.refused] == [2, 3]
        # junk in the store does not stop the door: a bumped counter, a malformed hello
        c.add("auth/n", 10_000)
        c.set("auth/hello/10004", "not-a-host")
        later = prove(_client(port), SECRET, host=0, timeout_s=10)
        assert door.signed("join", later.sign(SECRET, "join", 0), 0) == later
    finally:
        door.close()
    # a restarted coordinator (a fresh store) knows who passed and which request was taken, and
    # numbers the new proofs after the recorded ones
    port2 = _free_port()
    fresh = TCPStore(
        "127.0.0.1", port2, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    again = Door(fresh, tmp_path, SECRET)
    try:
        assert again.signed("spare", first.sign(SECRET, "spare", 7), 7) == first and not again.use(join, 4)
        newer = prove(_client(port2), SECRET, host=1, timeout_s=10)
        assert newer.number > later.number and again.use(newer.sign(SECRET, "join", 1), 1)
    finally:
        again.close()


def test_a_worker_does_not_take_a_foreign_coordinators_word_nor_a_tokenless_one(store, tmp_path):
    master, port = store
    door = Door(master, tmp_path, "another run's secret")
    try:
        with pytest.raises(Refused):  # refused there; and an "ok" it signed would not verify here
            prove(_client(port), SECRET, host=0, timeout_s=10)
    finally:
        door.close()
    # Without a token the coordinator lets anyone in (what a run without one does), but a worker
    # that holds one does not take "nothing to prove" for an answer: someone else may have answered.
    (tmp_path / "open").mkdir()
    open_door = Door(master, tmp_path / "open", "")
    try:
        with pytest.raises(Refused, match="asks for no proof, but this worker holds a token"):
            prove(_client(port), SECRET, host=0, timeout_s=10)
        tokenless = prove(_client(port), "", host=0, timeout_s=10)
        assert open_door.use(tokenless.sign("", "join", 0), 0)
    finally:
        open_door.close()


def test_tokens_come_from_a_file_or_the_environment_and_a_run_keeps_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv("GEOTRAIN_TOKEN", "from-env")
    assert read_token() == "from-env"
    (tmp_path / "t").write_text("from-file\n")
    assert read_token(str(tmp_path / "t")) == "from-file"
    with pytest.raises(ValueError, match="cannot be read"):
        read_token(str(tmp_path / "missing"))
    token = write_token(tmp_path / "token")
    assert len(token) == 64 and write_token(tmp_path / "token") == token  # a resume keeps it
    assert (tmp_path / "token").stat().st_mode & 0o777 == 0o600


def test_a_refused_join_request_is_answered_so_the_joiner_need_not_wait_it_out(store):
    """The coordinator marks the request it turned down by the asker's proof number; the joiner,
    waiting for an epoch that admits it, stops at once with one line."""
    from geotrain.ft.membership import JoinRefused, Membership

    master, port = store
    master.add("epoch", 0)
    joiner = Membership("127.0.0.1", port, 3, [], timeout_s=20)
    joiner.join_request = "7:" + "0" * 64
    master.set("joinrefused/3/7", "1")
    with pytest.raises(JoinRefused, match="refused this worker's join request"):
        joiner.next_epoch()
