"""Pure logic: a fake communicator, parsing, data, model sizes, configs. No processes, no network."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from geotrain.comm.buckets import Pending, make_buckets, reduce_tensors, wait_all
from geotrain.comm.communicator import Communicator, Handle
from geotrain.data.corpus import BatchSampler, DataError, TokenCorpus, load_corpus
from geotrain.metrics import summary_table
from geotrain.models.gpt import GPT, GPTConfig, gpt_config
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
    sync = build_sync(algo, model, opt, comm, {"H": 3, "compress": "none"})  # the fake has no all-to-all
    synced = [_step(sync, opt, s) for s in range(7)]
    assert synced == [False, False, True, False, False, True, False]
    assert sync.syncs == 2
    sync.finalize()  # step 7 is not on a period boundary
    assert sync.syncs == 3
    n_param_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert comm.stats.payload_bytes == 3 * n_param_bytes


@pytest.mark.parametrize("algo", ["localsgd", "diloco"])
def test_a_warm_start_synchronises_every_step_then_at_the_multiples_of_H(algo):
    model = _tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    comm = FakeCommunicator()
    sync = build_sync(algo, model, opt, comm, {"H": 3, "warm_start": 4, "compress": "none"})
    synced, periods, shared = [], [], []
    for s in range(10):
        periods.append(sync.sync_period())  # what the membership layer sees before the step
        synced.append(_step(sync, opt, s))
        shared.append("optimizer" in sync.replicated_parts())
    assert synced == [True] * 4 + [False, True, False, False, True, False]
    # lock-stepped through the warm start (a survivor behind adopts the leader's state), and
    # everything equal on every replica (a joiner gets the optimizer too)
    assert periods == [1] * 4 + [3] * 6
    assert shared == [True] * 4 + [False] * 6
    sync.finalize()
    assert sync.syncs == 4 + 2 + 1
    n_param_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert comm.stats.payload_bytes == 7 * n_param_bytes  # 4 gradients, then 3 models or changes
    with pytest.raises(ConfigError, match="warm_start .* must be an integer >= 0, got -1"):
        sync_config(algo, {"warm_start": -1})
    # a parameter this step's graph did not use sends zeros: every worker's buckets stay alike
    warm = build_sync(algo, model, opt, FakeCommunicator(), {"H": 3, "warm_start": 4})
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    unused = next(iter(model.parameters()))
    unused.grad = None
    warm.before_step()
    assert warm.comm.stats.payload_bytes == n_param_bytes
    assert torch.equal(unused.grad, torch.zeros_like(unused))


def test_only_periodic_methods_take_a_warm_start():
    with pytest.raises(ConfigError, match="ssgd does not take --warm-start .* that do: localsgd, diloco"):
        sync_config("ssgd", {"warm_start": 5})
    assert TrainConfig(algo="diloco", warm_start=5).sync_config().warm_start == 5


def test_diloco_outer_momentum_follows_H_unless_set():
    from geotrain.sync.diloco import outer_momentum_for

    # outer_lr / (1 - momentum): 1 at H <= 2, 1.4 at 3 <= H <= 10, the paper's 7 (0.7 / 0.1) at H >= 500
    assert [outer_momentum_for(h) for h in (1, 2, 3, 10, 50, 500, 5000)] == [
        0.3,
        0.3,
        0.5,
        0.5,
        0.74,
        0.9,
        0.9,
    ]
    assert outer_momentum_for(10, outer_lr=1.0) == 0.29  # the same multiple with a larger step
    assert all(outer_momentum_for(h) <= outer_momentum_for(h + 1) for h in range(1, 600))
    # none given: up to H=2 the plain average (Local SGD's outer step), the paper's lr beyond
    for H, lr, momentum in ((1, 1.0, 0.0), (2, 1.0, 0.0), (3, 0.7, 0.5), (10, 0.7, 0.5)):
        config = sync_config("diloco", {"H": H})
        assert (config.outer_lr, config.outer_momentum) == (lr, momentum)
    assert sync_config("diloco", {"H": 2, "outer_lr": 0.7}).outer_momentum == 0.3  # the multiple 1
    assert TrainConfig(algo="diloco", H=2).sync_config().outer_lr == 1.0
    assert sync_config("diloco", {"H": 50}).outer_momentum == 0.74
    assert sync_config("diloco", {"H": 50, "outer_momentum": 0.9}).outer_momentum == 0.9
    assert TrainConfig(algo="diloco", H=500).sync_config().outer_momentum == 0.9
    assert TrainConfig(algo="diloco", outer_momentum=0.0).sync_config().outer_momentum == 0.0


def test_diloco_outer_momentum_rises_from_its_H_value_to_the_papers_over_the_ramp():
    """Where the momentum follows H it starts at the H value and rises linearly to 0.9 over
    ``momentum_ramp`` outer steps, counted after a warm start's synchronous steps and from the
    step and sync counts a snapshot holds; a momentum given, or a ramp of 0, stays as it is."""
    from geotrain.sync.diloco import ramped_momentum

    assert [ramped_momentum(0.5, k, 4) for k in range(6)] == pytest.approx([0.5, 0.6, 0.7, 0.8, 0.9, 0.9])
    assert ramped_momentum(0.5, 3, 0) == 0.5 and ramped_momentum(0.95, 0, 4) == 0.95
    assert sync_config("diloco", {}).momentum_ramp == 0  # off by default (docs/reaching-ddp-loss.md: mini)

    def momenta(options, steps=8):
        model = _tiny()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sync = build_sync("diloco", model, opt, FakeCommunicator(), options | {"compress": "none"})
        seen = []
        for s in range(steps):
            if _step(sync, opt, s) and s + 1 > options.get("warm_start", 0):
                seen.append(sync.outer_optimizer.param_groups[0]["momentum"])
        return sync, seen

    # (at H=1 the momentum that follows H is 0, with the plain average's outer lr of 1)
    sync, seen = momenta({"H": 1, "momentum_ramp": 4, "warm_start": 2})
    assert seen == pytest.approx([0.0, 0.225, 0.45, 0.675, 0.9, 0.9])  # outer steps at 3 to 8
    again = build_sync(
        "diloco",
        _tiny(),
        torch.optim.SGD(_tiny().parameters(), lr=0.1),
        FakeCommunicator(),
        {"H": 1, "momentum_ramp": 4, "warm_start": 2},
    )
    again.load_state_dict(sync.state_dict())
    assert again.outer_steps == sync.outer_steps == 6
    assert momenta({"H": 1, "momentum_ramp": 0}, 3)[1] == [0.0, 0.0, 0.0]
    assert momenta({"H": 1, "outer_lr": 0.7}, 3)[1] == [0.3, 0.3, 0.3]  # the multiple 1
    assert momenta({"H": 1, "outer_momentum": 0.3}, 3)[1] == [0.3, 0.3, 0.3]
    with pytest.raises(
        ConfigError, match="localsgd does not take --momentum-ramp; algorithms that do: diloco"
    ):
        sync_config("localsgd", {"momentum_ramp": 0})
    with pytest.raises(ConfigError, match="must be an integer >= 0"):
        sync_config("diloco", {"momentum_ramp": -2})
    with pytest.raises(ValueError, match="--outer-momentum 0.9 fixes it: give one of the two"):
        TrainConfig(algo="diloco", outer_momentum=0.9, momentum_ramp=5)
    assert TrainConfig(algo="diloco", momentum_ramp=0).sync_config().momentum_ramp == 0


def test_a_diloco_run_goes_on_sending_what_it_sent_whatever_the_default():
    """DiLoCo sends int4 by default; a run saved in fp32 (before that default, or with
    --compress none) and resumed at the default goes on in fp32, and an int4 run stays int4."""
    torch.manual_seed(0)
    model = _tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fp32 = build_sync("diloco", model, opt, FakeCommunicator(), {"H": 2, "compress": "none"})
    default = build_sync("diloco", _tiny(), opt, FakeCommunicator(), {"H": 2})
    assert fp32.codec is None and default.codec is not None and default.codec.name == "int4"
    default.load_state_dict(fp32.state_dict())
    assert default.codec is None and default.config.compress == ""
    int4 = build_sync("diloco", _tiny(), opt, FakeCommunicator(), {"H": 2})
    again = build_sync("diloco", _tiny(), opt, FakeCommunicator(), {"H": 2})
    again.load_state_dict(int4.state_dict())
    assert again.codec is not None and again.codec.spec() == int4.codec.spec()


def test_diloco_outer_step_with_identical_replicas_is_nesterov_on_the_local_update():
    model = _tiny()
    start = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = build_sync(
        "diloco",
        model,
        opt,
        FakeCommunicator(),
        {"H": 1, "outer_lr": 0.5, "outer_momentum": 0.9, "compress": "none"},
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
            "sparseloco, demo, streaming, co2, nosync",
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


def test_wait_all_launches_every_second_phase_first_and_abandons_what_a_failure_leaves():
    log: list[str] = []

    def pending(name: str, fail: bool = False) -> Pending:
        def advance() -> None:
            if fail:
                raise RuntimeError("the group failed")
            log.append(f"advance {name}")

        return Pending(lambda: log.append(f"finish {name}"), advance, lambda: log.append(f"abandon {name}"))

    wait_all([pending("a"), pending("b"), Pending(lambda: log.append("finish c"))])
    assert log == ["advance a", "advance b", "finish a", "finish b", "finish c"]
    log.clear()
    done = pending("done")
    done.wait()
    with pytest.raises(RuntimeError):
        wait_all([done, pending("x"), pending("y", fail=True), pending("z")])
    # every one not finished is abandoned (a left-out copy's feedback restored), once
    assert log == ["advance done", "finish done", "advance x", "abandon x", "abandon y", "abandon z"]
    failed = pending("again", fail=True)
    with pytest.raises(RuntimeError):
        failed.advance()
    with pytest.raises(RuntimeError):  # a failed advance is tried again, not taken as done
        failed.wait()


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


@pytest.mark.parametrize(
    "cfg",
    [gpt_config("tiny"), gpt_config("mini"), gpt_config("tiny", vocab_size=300, block_size=17),
     GPTConfig(n_layer=3, n_head=3, n_embd=48, block_size=40, vocab_size=1000)],
)  # fmt: skip
def test_a_gpts_parameter_count_from_its_config_is_the_models(cfg):
    """What the launcher's timeout and the planner read without building the model."""
    assert cfg.num_parameters() == GPT(cfg).num_parameters()


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
        ({"model": "huge"}, "unknown model 'huge'"),
        ({"steps": 0}, "--steps must be >= 1"),
        ({"algo": "x"}, "unknown algorithm 'x'"),
        ({"H": -3, "algo": "diloco"}, "--H must be >= 0 (0: the algorithm's default) or auto, got -3"),
        ({"optimizer": "lion"}, "accepted: adamw, sgd"),
        ({"lr_schedule": "linear"}, "unknown --lr-schedule 'linear'; accepted: constant, cosine"),
        ({"min_lr_ratio": 1.5}, "--min-lr-ratio must be in [0, 1], got 1.5"),
        ({"eval_model": "mean"}, "unknown --eval-model 'mean'; accepted: auto, average, replicas"),
        ({"outer_momentum": -0.5}, "--outer-momentum must be in [0, 1), or -1 to follow H, got -0.5"),
    ],
)
def test_train_config_validation(kwargs, message):
    with pytest.raises(ConfigError) as e:
        TrainConfig(**kwargs)
    assert message in str(e.value)


def test_learning_rate_warms_up_then_holds_or_follows_a_cosine_to_its_floor():
    from geotrain.train import lr_at

    constant = TrainConfig(lr=1e-3, warmup=4, steps=14)
    assert [lr_at(s, constant) for s in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    cosine = TrainConfig(lr=1e-3, warmup=4, steps=14, lr_schedule="cosine", min_lr_ratio=0.1)
    lrs = [lr_at(s, cosine) for s in range(14)]
    assert lrs[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    # steps 4 .. 13 span the decay's 9 intervals: step 8 is 4/9 of the way from peak to floor
    assert lrs[4] == pytest.approx(1e-3) and lrs[13] == pytest.approx(1e-4)
    mid = 1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 4 / 9))
    assert lrs[8] == pytest.approx(mid)
    assert all(a > b for a, b in zip(lrs[4:], lrs[5:], strict=False))
    assert lr_at(100, cosine) == pytest.approx(1e-4)  # past the plan (a longer resumed run): the floor
    assert lr_at(0, TrainConfig(steps=1, lr_schedule="cosine", lr=2e-3)) == pytest.approx(2e-3)
    # a run resumed for more steps keeps the schedule it trained under (cli pins --lr-steps)
    longer = TrainConfig(lr=1e-3, warmup=4, steps=30, lr_schedule="cosine", lr_steps=14)
    assert [lr_at(s, longer) for s in (8, 13, 20)] == pytest.approx([mid, 1e-4, 1e-4])
    # a warm-up as long as the plan: the peak once, then the floor (not the peak for ever)
    short = TrainConfig(lr=1e-3, warmup=10, steps=20, lr_schedule="cosine", lr_steps=5)
    assert [lr_at(s, short) for s in (9, 10, 11, 19)] == pytest.approx([1e-3, 1e-3, 1e-4, 1e-4])


def test_the_warm_up_is_a_tenth_of_the_planned_steps_by_default_at_most_100():
    import argparse

    from geotrain.train import add_train_arguments

    assert [TrainConfig(steps=s).warmup for s in (1, 9, 10, 400, 1000, 5000)] == [0, 0, 1, 40, 100, 100]
    assert TrainConfig(steps=400, lr_steps=2000).warmup == 100  # over the schedule's planned steps
    assert TrainConfig(steps=400, warmup=0).warmup == 0 and TrainConfig(steps=400, warmup=7).warmup == 7
    assert TrainConfig(algo="demo", steps=400).warmup == 0  # its signed steps did worse with one
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    assert parser.parse_args(["--warmup", "auto"]).warmup == -1
    assert parser.parse_args(["--warmup", "12"]).warmup == 12
    with pytest.raises(ConfigError, match="--warmup must be >= 0 or auto, got -2"):
        TrainConfig(warmup=-2)


def test_H_auto_is_dreamddps_and_round_trips_to_a_worker():
    import argparse

    from geotrain.train import AUTO_H, add_train_arguments, train_parser

    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    assert parser.parse_args(["--H", "auto"]).H == AUTO_H and parser.parse_args(["--H", "7"]).H == 7
    cfg = TrainConfig(algo="dreamddp", H=AUTO_H)
    assert cfg.sync_options()["H"] == "auto" and cfg.sync_config().H == "auto"
    assert train_parser().parse_args(cfg.to_argv()).H == AUTO_H  # the launcher's argv for a worker
    with pytest.raises(
        ConfigError, match="--H auto is dreamddp's and sparseloco's .* give localsgd a period >= 1"
    ):
        TrainConfig(algo="localsgd", H=AUTO_H)
    assert TrainConfig(algo="sparseloco", H=AUTO_H).sync_config().H == "auto"
    with pytest.raises(ConfigError, match="or auto, got -2"):
        TrainConfig(algo="dreamddp", H=-2)
    with pytest.raises(ConfigError, match="a --plan brings its own"):
        TrainConfig(algo="dreamddp", H=AUTO_H, plan=__file__)
    assert "--H auto" in " ".join(cfg.to_argv())
    with pytest.raises(ConfigError, match="must be an integer >= 1 or 'auto', got 'often'"):
        sync_config("dreamddp", {"H": "often"})


def test_lr_scale_left_out_is_the_algorithms_own(monkeypatch):
    """Each algorithm's own (1 for every one today: dreamddp's auto measured worse on W1), here
    with dreamddp's set to auto to see it carried through the config, a worker's flags and wrap."""
    from geotrain.api import Sync
    from geotrain.sync.dreamddp import DreamDDPConfig
    from geotrain.train import train_parser

    assert TrainConfig(algo="dreamddp").lr_scale == "1"
    monkeypatch.setattr(DreamDDPConfig, "default_lr_scale", "auto")
    for algo, own in [("dreamddp", "auto"), ("localsgd", "1"), ("diloco", "1"), ("ddp", "1")]:
        cfg = TrainConfig(algo=algo)
        assert cfg.lr_scale == own
        assert train_parser().parse_args(cfg.to_argv()).lr_scale == own  # a worker gets the name
    assert TrainConfig(algo="dreamddp", lr_scale="1").lr_scale == "1"  # off when asked
    model = _tiny()
    opt = torch.optim.AdamW(model.parameters())
    dream = Sync(build_sync("dreamddp", model, opt, FakeCommunicator(world_size=4), {}), opt)
    assert dream.lr_scale == "auto" and dream.algorithm.noise is not None  # it measures the noise
    plain = Sync(build_sync("dreamddp", _tiny(), opt, FakeCommunicator(world_size=4), {}), opt, "1")
    assert plain.lr_scale == "1" and plain.algorithm.noise is None
    local = Sync(build_sync("localsgd", _tiny(), opt, FakeCommunicator(world_size=4), {}), opt)
    assert local.lr_scale == "1" and local.algorithm.noise is None


def test_overlap_is_on_off_or_auto_and_auto_is_what_leaving_it_out_means(capsys):
    import argparse

    from geotrain.train import add_train_arguments, train_parser

    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    cases = {(): None, ("--overlap",): True, ("--no-overlap",): False, ("--overlap", "auto"): None}
    for argv, overlap in cases.items():
        assert parser.parse_args(list(argv)).overlap is overlap, argv
    assert parser.parse_args(["--overlap", "--steps", "3"]).overlap is True  # no value taken
    # what a worker is handed (to_argv) rebuilds the same config
    for overlap in (True, False, None):
        argv = TrainConfig(overlap=overlap).to_argv()
        assert train_parser().parse_args(argv).overlap is overlap
    with pytest.raises(SystemExit):
        parser.parse_args(["--overlap", "yes"])
    assert "takes no value (on), or 'auto'; --no-overlap is off; got 'yes'" in capsys.readouterr().err


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


def test_a_run_saved_before_algorithm_defaults_resumes_with_them():
    """Configs saved before ``link_rate`` existed carry overlap=True (the one default then; DeMo's
    is now off) and the fixed 600 s timeout (now derived): a resume reads them in today's terms,
    and leaves a choice the user made (overlap off, another timeout) and newer configs alone."""
    from geotrain.cli import saved_train_config

    # and a config saved before --lr-scale ran its local steps at the rate given: "1"
    old = {"algo": "demo", "overlap": True, "timeout_s": 600.0}
    assert saved_train_config(old) == {"algo": "demo", "overlap": None, "timeout_s": 0.0, "lr_scale": "1"}
    chosen = {"algo": "sparseloco", "overlap": False, "timeout_s": 900.0, "lr_scale": "auto"}
    # saved before --mean-over: sparseloco averaged over every worker, and goes on doing so
    assert saved_train_config(chosen) == chosen | {"mean_over": "workers"}
    chosen["mean_over"] = ""  # saved since: the algorithm's default (auto), left alone
    assert saved_train_config(chosen) == chosen
    new = {"algo": "demo", "overlap": True, "timeout_s": 600.0, "link_rate": "", "lr_scale": "sqrt"}
    assert saved_train_config(new) == new
    # saved before --carry: streaming merged with the mix, and goes on doing so
    streaming = {"algo": "streaming", "link_rate": "", "lr_scale": "1"}
    assert saved_train_config(streaming) == streaming | {"carry": False}
    streaming["carry"] = None  # saved since: the default (carry), left alone
    assert saved_train_config(streaming) == streaming


class _RecordingSGD(torch.optim.SGD):
    """SGD that notes the learning rate each of its steps ran at."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.rates: list[float] = []

    def step(self, closure=None):
        self.rates.append(self.param_groups[0]["lr"])
        return super().step(closure)


@pytest.mark.parametrize(
    "algo, options, local",
    [
        ("localsgd", {"H": 3, "warm_start": 2}, [False, False, True, True, True]),
        ("diloco", {"H": 3, "compress": "none"}, [True] * 5),
        ("ssgd", {}, [False] * 5),
        ("nosync", {}, [False] * 5),
    ],
)
def test_lr_scale_sqrt_runs_a_local_methods_own_steps_at_sqrt_n_times_the_rate(algo, options, local):
    """lr_scale "sqrt" among 4: each worker's own optimizer step (not a warm start's averaged
    gradient, not ssgd's shared update) at 2x the rate the caller set, which
    is put back after the step (a schedule that reads it sees its own value)."""
    from geotrain.api import Sync

    model = _tiny()
    opt = _RecordingSGD(model.parameters(), lr=0.1)
    stepper = Sync(build_sync(algo, model, opt, FakeCommunicator(world_size=4), options), opt, "sqrt")
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        xy = torch.randint(0, 256, (2, 17), generator=g)
        stepper.model(xy[:, :-1], xy[:, 1:])[1].backward()
        stepper.step()
        stepper.zero_grad()
        assert opt.param_groups[0]["lr"] == 0.1
    assert opt.rates == [0.2 if is_local else 0.1 for is_local in local]
    if any(local):  # a step hook that sets the rate keeps it (unscaled); weight decay is held
        group = opt.param_groups[0]
        group["weight_decay"] = 0.01
        seen = []
        hook = opt.register_step_post_hook(lambda o, *_: seen.append(o.param_groups[0]["weight_decay"]))
        stepper.model(xy[:, :-1], xy[:, 1:])[1].backward()
        stepper.step()
        assert set(seen) == {0.005} and group["weight_decay"] == 0.01 and group["lr"] == 0.1
        hook.remove()
        opt.register_step_post_hook(lambda o, *_: o.param_groups[0].update(lr=0.4))  # a scheduler's
        stepper.model(xy[:, :-1], xy[:, 1:])[1].backward()
        stepper.step()
        assert group["lr"] == 0.2 and opt.rates[-1] == 0.2  # its 0.4 was the scaled rate: 0.2 given
    plain = _RecordingSGD(model.parameters(), lr=0.1)
    unscaled = Sync(build_sync(algo, model, plain, FakeCommunicator(world_size=4), options), plain)
    assert unscaled.lr_factor() == 1  # lr_scale "1", the default
    with pytest.raises(ConfigError, match="lr_scale takes 'auto' or 'sqrt' or '1', got 'cube'"):
        Sync(build_sync(algo, model, plain, FakeCommunicator(), options), plain, "cube")


def test_the_local_methods_are_those_whose_workers_step_on_their_own_gradients():
    from geotrain.sync import ALGORITHMS

    local = {name for name, (cls, _) in ALGORITHMS.items() if cls.local_steps}
    assert local == {"localsgd", "diloco", "dreamddp", "streaming", "co2", "sparseloco"}
