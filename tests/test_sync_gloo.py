"""Real gloo groups of 2-4 processes, checked against single-process references and closed forms."""

from __future__ import annotations

import pytest
import torch

from geotrain.comm.communicator import Communicator
from geotrain.models.gpt import GPT, gpt_config
from geotrain.sync import build_sync
from helpers import Cases, run_workers

STEPS = 4
BATCH, BLOCK = 2, 16


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    xy = torch.randint(0, 256, (BATCH, BLOCK + 1), generator=g)
    return xy[:, :-1], xy[:, 1:]


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(gpt_config("tiny", 256, BLOCK))


def _optimizer(model, kind: str):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1)
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(rank, world_size, algo, options, opt_kind, steps=STEPS, record_syncs=False):
    """Train ``steps`` steps with ``algo``; returns final parameters (and parameters after each sync)."""
    model = _model()
    opt = _optimizer(model, opt_kind)
    comm = Communicator()
    sync = build_sync(algo, model, opt, comm, options)
    after_sync = []
    for step in range(steps):
        x, y = _batch(rank, step)
        _, loss = sync.model(x, y)
        loss.backward()
        sync.before_step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        synced = sync.after_step()
        if record_syncs and (synced or algo == "ssgd"):
            after_sync.append([p.detach().clone() for p in model.parameters()])
    sync.close()
    params = [p.detach().clone() for p in model.parameters()]
    return {"params": params, "after_sync": after_sync, "stats": comm.stats.as_dict()}


def _reference_union(world_size: int, opt_kind: str, steps=STEPS):
    """One process training on the union of all workers' batches each step."""
    model = _model()
    opt = _optimizer(model, opt_kind)
    for step in range(steps):
        xs, ys = zip(*(_batch(r, step) for r in range(world_size)), strict=True)
        _, loss = model(torch.cat(xs), torch.cat(ys))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


def _assert_close(a, b, atol=2e-6, rtol=1e-5):
    for pa, pb in zip(a, b, strict=True):
        torch.testing.assert_close(pa, pb, atol=atol, rtol=rtol)


SMALL_BUCKETS = {"bucket_mb": 0.05}
TRAINED = {  # every training call below, one gloo group per world size
    2: Cases(
        _train,
        2,
        [
            ("ssgd", SMALL_BUCKETS, "sgd"),
            ("ssgd", SMALL_BUCKETS, "adamw"),
            ("ddp", {}, "sgd"),
            ("localsgd", {"H": 1}, "sgd"),
            ("ssgd", {}, "sgd"),
            ("diloco", {"H": 2, "outer_lr": 1.0, "outer_momentum": 0.0, "compress": "none"}, "sgd"),
            ("localsgd", {"H": 2}, "sgd"),
            ("nosync", {}, "sgd"),
            ("ssgd", SMALL_BUCKETS, "sgd", 3),
            ("ddp_powersgd", {"start_iter": 2, "rank": 2}, "sgd", 4),
        ],
    ),
    3: Cases(
        _train,
        3,
        [
            ("ssgd", SMALL_BUCKETS, "sgd"),
            ("ssgd", SMALL_BUCKETS, "adamw"),
            ("ssgd", SMALL_BUCKETS, "adamw", 6, True),
            ("localsgd", {"H": 2}, "adamw", 6, True),
            ("diloco", {"H": 2}, "adamw", 6, True),
            ("diloco", {"H": 2, "warm_start": 4}, "adamw", 6, True),
            ("localsgd", {"H": 3, "warm_start": 2}, "adamw", 6, True),
        ],
    ),
}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("opt_kind", ["sgd", "adamw"])
def test_ssgd_matches_single_process_on_union_of_batches(world_size, opt_kind):
    # Small buckets so several all-reduces overlap with backward.
    results = TRAINED[world_size].get("ssgd", SMALL_BUCKETS, opt_kind)
    reference = _reference_union(world_size, opt_kind)
    # SGD is linear in the gradient: the mean of per-worker gradients matches the union's gradient
    # to float rounding. Adam divides by sqrt(v), so a rounding-level difference in a near-zero
    # gradient moves its update by up to lr; allow 1% of the step (lr=1e-2) there.
    atol = 2e-6 if opt_kind == "sgd" else 1e-4
    for r in results:
        _assert_close(r["params"], reference, atol=atol)


def test_ddp_matches_single_process_on_union_of_batches():
    results = TRAINED[2].get("ddp", {}, "sgd")
    _assert_close(results[0]["params"], _reference_union(2, "sgd"))


def test_localsgd_h1_sgd_matches_ssgd():
    local = TRAINED[2].get("localsgd", {"H": 1}, "sgd")
    ssgd = TRAINED[2].get("ssgd", {}, "sgd")
    _assert_close(local[0]["params"], ssgd[0]["params"])


@pytest.mark.parametrize(
    "algo, options, syncs",
    [("diloco", {"H": 2, "warm_start": 4}, 5), ("localsgd", {"H": 3, "warm_start": 2}, 4)],
)
def test_a_warm_start_is_synchronous_sgd_then_periodic(algo, options, syncs):
    """Through the warm start each step equals synchronous SGD's (Adam, 3 workers), every
    replica the same bitwise; then the syncs come at the multiples of H only (steps 6; 3 and 6)."""
    ssgd = TRAINED[3].get("ssgd", SMALL_BUCKETS, "adamw", 6, True)[0]["after_sync"]
    results = TRAINED[3].get(algo, options, "adamw", 6, True)
    warm = options["warm_start"]
    for r in results:
        assert len(r["after_sync"]) == syncs
        for mine, reference in zip(r["after_sync"][:warm], ssgd[:warm], strict=True):
            _assert_close(mine, reference, atol=1e-4)
    for i in range(syncs):
        first = results[0]["after_sync"][i]
        assert all(all(map(torch.equal, first, r["after_sync"][i])) for r in results[1:])
    # after the warm start the replicas drift apart between syncs: no longer synchronous SGD
    final = zip(results[0]["params"], ssgd[-1], strict=True)
    assert any(not torch.allclose(a, b, atol=1e-4) for a, b in final)


def test_diloco_outer_lr1_no_momentum_matches_localsgd():
    # Plain SGD inside: theta_outer - (theta_outer - mean) equals the mean only to an ulp, which
    # Adam would amplify in later steps (see the ssgd test); SGD keeps the comparison tight.
    diloco = TRAINED[2].get(
        "diloco", {"H": 2, "outer_lr": 1.0, "outer_momentum": 0.0, "compress": "none"}, "sgd"
    )
    local = TRAINED[2].get("localsgd", {"H": 2}, "sgd")
    _assert_close(diloco[0]["params"], local[0]["params"], atol=1e-6)
    # and it is not a trivially-equal comparison: the replicas did train apart between syncs
    nosync = TRAINED[2].get("nosync", {}, "sgd")
    assert not torch.equal(nosync[0]["params"][0], nosync[1]["params"][0])


@pytest.mark.parametrize(
    "algo,options",
    [("ssgd", SMALL_BUCKETS), ("localsgd", {"H": 2}), ("diloco", {"H": 2})],
)
def test_replicas_bitwise_identical_after_every_sync(algo, options):
    results = TRAINED[3].get(algo, options, "adamw", 6, True)
    syncs = results[0]["after_sync"]
    assert len(syncs) == (6 if algo == "ssgd" else 3)
    for other in results[1:]:
        for mine, theirs in zip(syncs, other["after_sync"], strict=True):
            for a, b in zip(mine, theirs, strict=True):
                assert torch.equal(a, b)


def _collectives(rank, world_size, sizes, latency_s=0.0):
    import time

    comm = Communicator(latency_s=latency_s)
    handles = []
    tensors = [torch.full((n,), float(rank + 1)) for n in sizes]
    t0 = time.perf_counter()
    for t in tensors:
        handles.append(comm.all_reduce(t, op="mean", async_op=True))
    for h in handles:
        h.wait()
    elapsed = time.perf_counter() - t0
    summed = comm.all_reduce(torch.ones(3, dtype=torch.float64), op="sum")
    b = comm.broadcast(torch.full((10,), float(rank)), src=0)
    return {
        "stats": comm.stats.as_dict(),
        "means": [t[0].item() for t in tensors],
        "sum": summed.tolist(),
        "bcast": b.tolist(),
        "elapsed": elapsed,
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_communicator_counts_bytes_of_tensors_reduced(world_size):
    sizes = [1, 1000, 12345]
    results = run_workers(_collectives, world_size, sizes)
    expected_mean = sum(range(1, world_size + 1)) / world_size
    payload = sum(4 * n for n in sizes) + 3 * 8  # float32 tensors, then one float64 sum
    ring = (
        sum(2 * (world_size - 1) * (4 * n) // world_size for n in sizes)
        + 2 * (world_size - 1) * 24 // world_size
    )
    for rank, r in enumerate(results):
        assert r["means"] == [expected_mean] * len(sizes)
        assert r["sum"] == [float(world_size)] * 3
        assert r["bcast"] == [0.0] * 10
        s = r["stats"]
        assert s["calls"] == len(sizes) + 2
        assert s["payload_bytes"] == payload + 40
        assert s["sent_bytes"] == ring + (40 if rank == 0 else 0)
        assert s["recv_bytes"] == ring + (0 if rank == 0 else 40)
        assert s["blocked_s"] > 0


def test_communicator_emulated_latency_sets_a_floor_per_collective():
    (r, _) = run_workers(_collectives, 2, [10], 0.05)
    assert r["elapsed"] >= 2 * (2 - 1) * 0.05


def _late_peer(rank: int, world_size: int) -> dict:
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from geotrain.comm.communicator import CollectiveTimeout

    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=1))
    comm = Communicator(group=group, timeout_s=1, link="2 x 350kbit")
    if rank == 1:
        time.sleep(3)  # past the group's timeout: rank 0 gives up first
    try:
        comm.all_reduce(torch.ones(1000))
    except CollectiveTimeout as e:
        return {"timeout": str(e)}
    except RuntimeError as e:  # the peer that gave up closed its connections
        return {"error": type(e).__name__}
    return {}


def test_a_collective_past_the_groups_timeout_ends_in_one_line_naming_it():
    """gloo's "Timed out waiting 1000ms for recv" becomes one line: the collective, its bytes,
    the links and the option to change (a run at 350 kbit/s once ended in 274 lines of
    tracebacks). It is not a RuntimeError, which the elastic paths take for a lost member."""
    first, _ = run_workers(_late_peer, 2, timeout=60)
    line = first["timeout"]
    assert "\n" not in line
    assert "the all-reduce of 4,000 bytes among 2 workers" in line
    assert "collective timeout of 1 s on 2 x 350kbit" in line and "raise --timeout-s" in line


def test_the_collective_timeout_follows_the_model_and_the_slowest_link():
    from geotrain.plan.network import collective_timeout_s
    from geotrain.train import TrainConfig

    with torch.device("meta"):
        mini = 4 * sum(p.numel() for p in GPT(gpt_config("mini")).parameters())
    # Three copies of mini's 43.6 MB, twice, at 350 kbit/s: 1.7 hours, not 600 s.
    assert collective_timeout_s(mini, 350e3) == round(6 * mini * 8 / 350e3 + 60)
    assert 5900 < collective_timeout_s(mini, 350e3) < 6100
    assert collective_timeout_s(mini, 10e9) == collective_timeout_s(mini, 0) == 600
    # A rate not known (real machines without --link-rate) is taken as 10 Mbit/s, the slowest
    # link the library is built for: a 1B model's hand-over (~55 minutes there) is not cut at 600 s.
    assert collective_timeout_s(4e9, 0) == collective_timeout_s(4e9, 10e6) == round(6 * 4e9 * 8 / 10e6 + 60)
    derived = TrainConfig(model="mini", algo="diloco", link_rate="350kbit")
    assert derived.collective_timeout_s() == collective_timeout_s(mini, 350e3)
    assert TrainConfig(model="mini", timeout_s=30, link_rate="350kbit").collective_timeout_s() == 30


def test_ssgd_moves_every_gradient_byte_each_step():
    results = TRAINED[2].get("ssgd", SMALL_BUCKETS, "sgd", 3)
    n_bytes = sum(p.numel() * 4 for p in _model().parameters())
    # 3 steps of gradients; replicas built from one seed compare digests instead of a broadcast
    assert results[0]["stats"]["payload_bytes"] == 3 * n_bytes


def test_ddp_powersgd_sends_fewer_bytes_after_start_and_keeps_replicas_equal():
    results = TRAINED[2].get("ddp_powersgd", {"start_iter": 2, "rank": 2}, "sgd", 4)
    n_bytes = sum(p.numel() * 4 for p in _model().parameters())
    payload = results[0]["stats"]["payload_bytes"]
    # steps 1-2: plain all-reduce of every gradient; steps 3-4: P and Q of each matrix (rank 2), plus vectors
    low_rank = 0
    for p in _model().parameters():
        if p.dim() <= 1:
            low_rank += p.numel()
        else:
            rows, cols = p.shape[0], p.numel() // p.shape[0]
            compressed = (rows + cols) * 2  # P (rows x 2) and Q (cols x 2)
            # PyTorch compresses a matrix when it shrinks by more than min_compression_rate (2)
            low_rank += compressed if compressed * 2.0 < rows * cols else rows * cols
    assert payload == 2 * n_bytes + 2 * low_rank * 4
    assert low_rank * 4 < n_bytes / 4
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(a, b)


def _score_mean_model(rank, world_size):
    from geotrain.train import evaluate, evaluate_run

    model = _model()
    if rank == 1:  # the replicas differ, as a periodic method's do between syncs
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    own = [p.detach().clone() for p in model.parameters()]
    batches = [_batch(99, s) for s in range(2)]
    comm = Communicator()
    before = comm.stats.copy()
    differ = evaluate_run(model, batches, torch.device("cpu"), comm, average=True)
    spent = comm.stats.delta(before)
    restored = all(torch.equal(p, q) for p, q in zip(model.parameters(), own, strict=True))
    # The reference: the mean model built by hand, scored on one process's copy.
    mean = _model()
    with torch.no_grad():
        for p, mine in zip(mean.parameters(), own, strict=True):
            p.copy_(mine)
            torch.distributed.all_reduce(p.data)
            p.data /= world_size
    by_hand = evaluate(mean, batches, torch.device("cpu"))
    replicas_by_hand = evaluate(model, batches, torch.device("cpu"))
    with torch.no_grad():  # now one model: scored once, nothing averaged
        for p, q in zip(model.parameters(), mean.parameters(), strict=True):
            p.copy_(q)
    same = evaluate_run(model, batches, torch.device("cpu"), comm, average=True)
    local_only = evaluate_run(model, batches, torch.device("cpu"), comm, average=False)
    return {
        "differ": differ,
        "restored": restored,
        "by_hand": by_hand,
        "replicas_by_hand": replicas_by_hand,
        "same": same,
        "local_only": local_only,
        "training": (spent.sent_bytes, spent.recv_bytes, spent.calls),
        "mean_loss": evaluate(mean, batches, torch.device("cpu")),
    }


def test_a_validation_scores_the_replicas_mean_model_and_puts_each_replica_back():
    results = run_workers(_score_mean_model, 2)
    replicas_mean = sum(r["replicas_by_hand"] for r in results) / 2
    for r in results:
        mean_loss, replicas = r["differ"]
        assert mean_loss == pytest.approx(r["by_hand"], rel=1e-6)
        assert replicas == pytest.approx(replicas_mean, rel=1e-9)
        assert mean_loss != pytest.approx(replicas, rel=1e-4)  # the two scorings differ here
        assert r["restored"]  # bitwise: training goes on as without the validation
        assert r["same"] == (r["mean_loss"], None)  # one model: no average to take
        assert r["local_only"] == (r["mean_loss"], None)
        assert r["training"] == (0, 0, 0)  # the mean moved, as a measurement, not training traffic


def _ssgd_advanced_after_backward(rank, world_size, compress):
    """Per step: each bucket's message, in launch order, whether its second phase is out when
    backward returns; and the parameters after the steps."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = build_sync("ssgd", model, opt, Communicator(), {"compress": compress, "bucket_mb": 0.01})
    out = []
    for step in range(3):
        x, y = _batch(rank, step)
        sync.model(x, y)[1].backward()
        out.append([sync._launched[b].advanced for b in sync._order])
        sync.before_step()
        opt.step()
        opt.zero_grad()
        sync.after_step()
    sync.close()
    return {"advanced": out, "params": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.parametrize("compress", ["int4", "powersgd:rank=2"])
def test_ssgd_sends_a_codecs_second_phases_under_backward(compress):
    """Each bucket's second phase goes out when the bucket ``ADVANCE_DEPTH`` launches later is
    launched: after backward only the last ``ADVANCE_DEPTH`` are left; replicas stay equal."""
    from geotrain.plan.cost import ADVANCE_DEPTH

    ranks = run_workers(_ssgd_advanced_after_backward, 2, compress)
    assert ranks[0]["advanced"] == ranks[1]["advanced"]
    for step, advanced in enumerate(ranks[0]["advanced"]):
        assert len(advanced) > ADVANCE_DEPTH, f"step {step}: too few buckets to tell"
        assert advanced == [True] * (len(advanced) - ADVANCE_DEPTH) + [False] * ADVANCE_DEPTH
    for a, b in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        assert torch.equal(a, b)
