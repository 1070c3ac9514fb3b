"""Pure logic: a fake communicator, parsing, data, model sizes, configs. No processes, no network."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from geotrain.comm.buckets import make_buckets, reduce_tensors
from geotrain.comm.communicator import Communicator, Handle
from geotrain.data.corpus import BatchSampler, DataError, TokenCorpus, load_corpus
from geotrain.metrics import summary_table
from geotrain.models.gpt import GPT, gpt_config
from geotrain.netem.links import (
    LinkSpecError,
    describe_links,
    parse_bandwidth,
    parse_bandwidths,
    parse_latency,
)
from geotrain.sync import ConfigError, build_sync, sync_config
from geotrain.train import TrainConfig


class FakeCommunicator(Communicator):
    """Pretends to be one of ``world_size`` identical replicas: a mean returns the input unchanged.

    Records every collective with the number of gradient hooks that had fired by then, so tests
    can see when communication was launched.
    """

    def __init__(self, world_size: int = 2) -> None:
        super().__init__()
        self.world_size, self.rank, self.distributed = world_size, 0, False
        self.log: list[tuple[str, int]] = []

    def all_reduce(self, tensor, op="mean", async_op=False):
        self._account(tensor.numel() * tensor.element_size())
        self.log.append(("all_reduce", tensor.numel()))
        tensor.mul_(self.world_size)  # the sum over identical replicas
        handle = Handle(self, None, tensor, self.world_size if op == "mean" else 1, 0.0)
        return handle if async_op else handle.wait()

    def broadcast(self, tensor, src=0):
        self.log.append(("broadcast", tensor.numel()))
        return tensor

    def max_scalars(self, values):
        return list(values)  # identical replicas


def _tiny():
    torch.manual_seed(0)
    return GPT(gpt_config("tiny", 256, 16))


def _step(sync, opt, seed):
    g = torch.Generator().manual_seed(seed)
    xy = torch.randint(0, 256, (2, 17), generator=g)
    _, loss = sync.model(xy[:, :-1], xy[:, 1:])
    loss.backward()
    sync.before_step()
    opt.step()
    opt.zero_grad()
    return sync.after_step()


@pytest.mark.parametrize("algo", ["localsgd", "diloco"])
def test_periodic_algorithms_sync_every_H_steps_and_on_finalize(algo):
    model = _tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    comm = FakeCommunicator()
    sync = build_sync(algo, model, opt, comm, {"H": 3})
    synced = [_step(sync, opt, s) for s in range(7)]
    assert synced == [False, False, True, False, False, True, False]
    assert sync.syncs == 2
    sync.finalize()  # step 7 is not on a period boundary
    assert sync.syncs == 3
    n_param_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert comm.stats.payload_bytes == 3 * n_param_bytes


def test_diloco_outer_step_with_identical_replicas_is_nesterov_on_the_local_update():
    model = _tiny()
    start = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = build_sync(
        "diloco", model, opt, FakeCommunicator(), {"H": 1, "outer_lr": 0.5, "outer_momentum": 0.9}
    )
    before = [p.detach().clone() for p in model.parameters()]
    _step(sync, opt, 0)  # inner step then outer step
    assert all(torch.equal(a, b) for a, b in zip(start, before, strict=True))
    # The first Nesterov step with buffer b = delta: theta - lr * (delta + 0.9 * delta).
    model2 = _tiny()
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    _step(build_sync("nosync", model2, opt2, FakeCommunicator(), {}), opt2, 0)
    for p0, p_local, p in zip(start, model2.parameters(), model.parameters(), strict=True):
        delta = p0 - p_local.detach()
        torch.testing.assert_close(p.detach(), p0 - 0.5 * 1.9 * delta)


def test_ssgd_launches_all_reduces_during_backward():
    model = _tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    comm = FakeCommunicator()
    sync = build_sync("ssgd", model, opt, comm, {"bucket_mb": 0.02})
    comm.log.clear()
    xy = torch.randint(0, 256, (2, 17))
    _, loss = sync.model(xy[:, :-1], xy[:, 1:])
    loss.backward()
    launched_in_backward = len(comm.log)
    n_buckets = len(sync._buckets)
    assert n_buckets > 2
    assert launched_in_backward == n_buckets  # every bucket went out before backward returned
    sync.before_step()
    assert len(comm.log) == n_buckets  # nothing left to send after backward
    sync.close()


def test_nosync_never_communicates():
    model = _tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    comm = FakeCommunicator()
    sync = build_sync("nosync", model, opt, comm, {})
    for s in range(3):
        _step(sync, opt, s)
    sync.finalize()
    assert comm.log == [] and comm.stats.payload_bytes == 0


def test_world_of_one_moves_nothing():
    comm = Communicator()
    t = torch.ones(5)
    assert comm.all_reduce(t) is t and comm.stats.calls == 0
    reduce_tensors(comm, [t])
    assert comm.stats.payload_bytes == 0


@pytest.mark.parametrize(
    "name,options,message",
    [
        ("localsgd", {"H": 0}, "H (steps between syncs) must be an integer >= 1"),
        ("diloco", {"H": -3}, "must be an integer >= 1"),
        ("diloco", {"outer_momentum": 1.0}, "outer_momentum must be in [0, 1)"),
        ("ssgd", {"bucket_mb": -1}, "bucket_mb must be > 0"),
        (
            "adam",
            {},
            "unknown algorithm 'adam'; accepted: ssgd, ddp, ddp_powersgd, localsgd, diloco, dreamddp, "
            "sparseloco, demo, nosync",
        ),
    ],
)
def test_sync_configs_reject_bad_values_with_what_is_accepted(name, options, message):
    with pytest.raises(ConfigError) as e:
        sync_config(name, options)
    assert message in str(e.value)


def test_buckets_keep_order_and_cap():
    tensors = [torch.zeros(n) for n in (10, 10, 300_000, 10, 10)]
    buckets = make_buckets(tensors, cap_mb=1.0)
    assert [i for b in buckets for i in b] == list(range(5))
    assert buckets == [[0, 1], [2], [3, 4]]  # the 1.2 MB tensor exceeds the cap: a bucket alone
    assert make_buckets(tensors, cap_mb=1e-6) == [[i] for i in range(5)]
    with pytest.raises(ValueError):
        make_buckets(tensors, cap_mb=0)


@pytest.mark.parametrize(
    "text,bps", [("100mbit", 10**8), ("20MBIT", 2 * 10**7), ("1.5gbit", 15 * 10**8), ("64kbit", 64_000)]
)
def test_parse_bandwidth(text, bps):
    assert parse_bandwidth(text) == bps


@pytest.mark.parametrize("text", ["100mbps", "-5mbit", "fast", "100", "0mbit", "1000gbit", ""])
def test_parse_bandwidth_rejects(text):
    with pytest.raises(LinkSpecError, match="bit"):
        parse_bandwidth(text)


def test_parse_bandwidths_per_host_and_latency():
    assert parse_bandwidths("100mbit", 3) == [10**8] * 3
    assert parse_bandwidths("100mbit,20mbit", 2) == [10**8, 2 * 10**7]
    with pytest.raises(LinkSpecError, match="2 rates for 3 workers"):
        parse_bandwidths("100mbit,20mbit", 3)
    assert describe_links([10**8, 10**8]) == "100mbit"
    assert describe_links([10**8, 10**9]) == "100mbit,1gbit"
    assert parse_latency("50ms") == pytest.approx(0.05)
    assert parse_latency("1s") == 1.0
    with pytest.raises(LinkSpecError):
        parse_latency("50")


def test_model_sizes():
    assert _tiny().num_parameters() < 1_000_000
    mini = GPT(gpt_config("mini"))
    assert 9e6 < mini.num_parameters() < 12e6
    assert (mini.cfg.n_layer, mini.cfg.n_embd, mini.cfg.block_size) == (6, 384, 128)
    small = gpt_config("small", vocab_size=50304)
    assert (small.n_layer, small.n_embd, small.block_size) == (12, 768, 1024)
    with pytest.raises(ValueError, match="accepted: tiny, mini, small"):
        gpt_config("huge")


def test_stdlib_corpus_shards_are_disjoint_and_deterministic():
    corpus = load_corpus(None)
    assert corpus.vocab_size == 256 and len(corpus.train) > 1_000_000
    a0 = BatchSampler(corpus, 32, 4, rank=0, world_size=2, seed=1)
    a1 = BatchSampler(corpus, 32, 4, rank=1, world_size=2, seed=1)
    again = BatchSampler(corpus, 32, 4, rank=0, world_size=2, seed=1)
    x0, y0 = a0.next_train()
    assert torch.equal(x0, again.next_train()[0])
    assert torch.equal(x0[:, 1:], y0[:, :-1])  # targets are the next tokens
    # shard 0 ends where shard 1 begins
    n = len(corpus.train) // 2
    assert np.array_equal(np.asarray(a0.shard[-5:]), np.asarray(corpus.train[n - 5 : n]))
    assert np.array_equal(np.asarray(a1.shard[:5]), np.asarray(corpus.train[n : n + 5]))
    v0, v1 = a0.val_batches(2), a1.val_batches(2)
    assert all(torch.equal(p[0], q[0]) for p, q in zip(v0, v1, strict=True))  # same validation on all


def test_corpus_from_folder_and_bin(tmp_path):
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("hello world " * 1000)
    (tmp_path / "text" / "blob").write_bytes(b"\0\1\2" * 100)  # binary: skipped
    corpus = load_corpus(str(tmp_path / "text"))
    assert len(corpus.train) + len(corpus.val) == 12000
    tokens = np.arange(5000, dtype=np.uint16) % 1000
    tokens.tofile(tmp_path / "data.bin")
    corpus = load_corpus(str(tmp_path / "data.bin"))
    assert corpus.vocab_size == 1024 and corpus.train.dtype == np.uint16


@pytest.mark.parametrize(
    "setup,message",
    [
        (lambda p: None, "no such file or directory"),
        (lambda p: p.mkdir(), "no text found"),
        (lambda p: p.write_bytes(b""), "a file must be uint16 tokens named *.bin"),
    ],
)
def test_corpus_errors(tmp_path, setup, message):
    path = tmp_path / "data"
    setup(path)
    with pytest.raises(DataError, match=message.replace("*", r"\*")):
        load_corpus(str(path))


def test_corpus_too_small_for_workers():
    corpus = TokenCorpus(np.zeros(100, np.uint8), np.zeros(100, np.uint8), 256, "x")
    with pytest.raises(DataError, match="too few"):
        corpus.check_fits(64, 4)


def test_train_config_round_trips_through_argv():
    from geotrain.train import config_from_args, train_parser

    cfg = TrainConfig(
        algo="localsgd", model="tiny", H=5, steps=7, progress=False, data="/x", resume=True, keeper="/k.sock"
    )
    assert config_from_args(train_parser().parse_args(cfg.to_argv())) == cfg


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"model": "huge"}, "unknown model size 'huge'"),
        ({"steps": 0}, "--steps must be >= 1"),
        ({"algo": "x"}, "unknown algorithm 'x'"),
        ({"H": -1, "algo": "diloco"}, "H (inner steps between outer steps) must be an integer >= 1"),
        ({"optimizer": "lion"}, "accepted: adamw, sgd"),
    ],
)
def test_train_config_validation(kwargs, message):
    with pytest.raises(ConfigError) as e:
        TrainConfig(**kwargs)
    assert message in str(e.value)


def test_summary_table_shows_na_for_unmeasured_blocked_time():
    summary = {
        "algo": "ddp",
        "model": "tiny",
        "parameters": 1000,
        "workers": 2,
        "link": "20mbit",
        "steps": 3,
        "tokens": 300,
        "first_train_loss": 5.0,
        "final_train_loss": 4.0,
        "final_val_loss": 4.1,
        "step_s_mean": 0.5,
        "compute_s_mean": 0.5,
        "blocked_s_mean": None,
        "tokens_per_s": 600.0,
        "sent_bytes_per_step": 2e6,
        "link_mbit_s": 32.0,
        "syncs": 3,
        "wall_s": 1.5,
    }
    table = summary_table(summary)
    assert "blocked on comm        | n/a" in table and "2.0 MB" in table
