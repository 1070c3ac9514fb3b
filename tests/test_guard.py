"""--max-norm-ratio: contributions that cannot be right are left out of every mean all-reduce.

The verdict first (pure), then a real gloo group of 3 where one worker sends NaN, inf or a
1e6-scaled contribution: the mean is, bitwise, the honest workers' mean, every worker knows who
was left out, and DiLoCo's and CO2's replicas stay finite.
"""

from __future__ import annotations

import pytest
import torch

from geotrain.comm.communicator import Communicator
from geotrain.comm.guard import ROWS_IN_BAND_CODECS, judge, judged_in_rows, parse_aggregate, robust_mean
from geotrain.models.gpt import GPT, gpt_config
from geotrain.plan.layers import layer_groups
from geotrain.sync import build_sync
from helpers import Cases, geotrain, owners_means, refused


def test_the_verdict_leaves_out_what_is_not_finite_or_far_above_the_others_median():
    v = judge([1.0, 2.0, 1.5, 30.0], [True, True, True, True], 10.0)
    assert v.kept == [True, True, True, False] and v.count == 3
    assert "norm 30 > 10 x the others' median 1.5" in v.reasons[3]
    v = judge([1.0, 0.0, 1.2], [True, False, True], 10.0)
    assert v.kept == [True, False, True] and v.reasons[1] == "not finite"
    assert judge([0.0, 0.0, 0.0], [True] * 3, 10.0).count == 3  # nothing moved: all kept
    assert judge([5.0, 1.0], [True, True], 10.0).count == 2  # two workers: each against the other
    assert judge([1.0, 0.0], [True, False], 10.0).kept == [True, False]  # no finite other: any norm
    # Empty contributions (a joiner's stand-in, a layer without gradient) are not in the median:
    # a median of 0 would leave out every honest worker.
    assert judge([2.0, 0.0, 0.0], [True] * 3, 10.0).count == 3
    assert judge([2.0, 0.0, 3.0, 500.0], [True] * 4, 10.0).kept == [True, True, True, False]


def _corrupt(kind: str, v: torch.Tensor) -> torch.Tensor:
    if kind == "nan":
        v = v.clone()
        v[3] = float("nan")
        return v
    if kind == "inf":
        v = v.clone()
        v[0] = float("inf")
        return v
    return v * 1e6  # "scale"


def _case(rank: int, world_size: int, kind: str) -> dict:
    comm = Communicator(max_norm_ratio=10.0)
    if kind.startswith("robust"):  # --aggregate median / trimmed:f=1, worker 2 spoiled by chaos
        _, aggregate, how = kind.split("/")
        robust = Communicator(aggregate=aggregate)
        honest = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
        if rank == 2:
            robust.corrupt_next = how  # what --chaos corrupt sets: the next contribution is spoiled
        mean = robust.all_reduce(honest.clone(), op="mean")
        return {"honest": honest, "mean": mean, "rejected": robust.rejected_by_rank, "sent": robust.stats}
    if kind == "clip":  # --aggregate clip alone: norms 1, 2, 3; the median, 2, bounds each
        clip = Communicator(aggregate="clip")
        v = torch.randn(50, generator=torch.Generator().manual_seed(rank))
        mine = v / v.norm() * (rank + 1)
        return {
            "mine": mine,
            "mean": clip.all_reduce(mine.clone(), op="mean"),
            "rejected": clip.rejected_by_rank,
        }
    if kind == "all":  # every worker's contribution is bad: each keeps its own, nothing averaged
        mine = torch.full((5,), float(rank))
        mine[0] = float("inf")
        return {
            "mine": mine,
            "mean": comm.all_reduce(mine.clone(), op="mean"),
            "rejected": comm.rejected_by_rank,
        }
    if kind.startswith("codec"):  # a codec's own collective, worker 2 spoiled by chaos
        _, spec, how = kind.split("/")
        return _codec_case(rank, spec, how)
    if kind.startswith("algo"):  # sparseloco's and demo's all-gathers
        _, algo, how = kind.split("/")
        return _frontier_case(rank, algo, how)
    if kind == "buffers":  # checked means in flight together, twice: their buffers are reused
        return _buffers_case(rank)
    if kind.startswith("owners"):  # a quantised codec's shards with two owners each
        _, spec, how, ratio, *spoiled = kind.split("/")
        return owners_means(rank, world_size, spec, how, float(ratio), int(spoiled[0]) if spoiled else 1)
    if kind.startswith("leftout"):  # a copy of the leader's state left out of a checked codec's mean
        return _left_out_case(rank, kind.split("/")[1])
    if kind.startswith("inband"):  # ssgd's or DDP's buckets with a NaN or 1e6-scaled worker
        _, algo, how = kind.split("/", 2)
        return _in_band_case(rank, algo, how)
    gen = torch.Generator().manual_seed(rank)
    honest = torch.randn(50, generator=gen)
    mine = _corrupt(kind, honest) if rank == 2 else honest
    out = {"honest": honest, "mean": comm.all_reduce(mine.clone(), op="mean")}
    # A periodic method end to end: worker 2's replica goes bad before DiLoCo's outer step.
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", 256, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = build_sync("diloco", model, opt, comm, {"H": 1, "outer_lr": 1.0, "outer_momentum": 0.0})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.01)
            if rank == 2:
                p.copy_(_corrupt(kind, p.reshape(-1)).reshape(p.shape))
    sync.after_step()
    out["diloco"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    # CO2's mean in flight (a weighted sum) leaves the same worker out.
    co2 = build_sync(
        "co2", model, opt, comm, {"H": 1, "eager": False, "outer_lr": 1.0, "outer_momentum": 0.0, "clip": 0.0}
    )
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(0.01 * (rank + 1))
            if rank == 2:
                p.mul_(float("nan") if kind == "nan" else 1e6)
    co2.after_step()  # launches the step's pseudo-gradient
    co2.finalize()  # lands it
    out["co2"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    out["rejected"] = dict(comm.rejected_by_rank)
    return out


def _in_band_case(rank: int, algo: str, how: str) -> dict:
    """Two steps of ssgd (or DDP, or ssgd with a codec: ``algo`` "ssgd+powersgd:rank=2") over
    several buckets of a tiny GPT, worker 2's gradients spoiled in the first (every bucket) and
    honest in the second, with no round trip before any all-reduce (``Communicator._screen``
    raises if called). Each worker also takes its honest gradients from a model of its own, for
    the expected means."""
    from geotrain.comm import communicator

    def no_round_trip(self, tensor):
        raise AssertionError("a checked mean waited for its verdict before the all-reduce")

    original, communicator.Communicator._screen = communicator.Communicator._screen, no_round_trip
    try:
        return _two_steps(rank, algo, how)
    finally:  # the same worker goes on to the other cases
        communicator.Communicator._screen = original


def _buffers_case(rank: int) -> dict:
    """Two rounds of three checked means in flight at once (two of 1,000 values, one of 500),
    as a step's buckets are; in the second, worker 2's first message is NaN, so that mean is
    taken again. Records the buffers the communicator keeps after each round, and the second
    round's honest messages."""
    comm = Communicator(max_norm_ratio=10.0)
    gen = torch.Generator().manual_seed(rank)
    kept, means = [], []
    for round_ in range(2):
        honest = [torch.randn(n, generator=gen) for n in (1000, 1000, 500)]
        sent = [t.clone() for t in honest]
        if rank == 2 and round_ == 1:
            sent[0][7] = float("nan")
        handles = [comm.all_reduce(t, op="mean", async_op=True) for t in sent]
        means.append([h.wait().clone() for h in handles])
        kept.append({k[0]: sorted(b.data_ptr() for b in v) for k, v in comm._spare_buffers.items()})
    return {"kept": kept, "means": means, "honest": honest, "rejected": dict(comm.rejected_by_rank)}


def _two_steps(rank: int, algo: str, how: str) -> dict:
    comm = Communicator(max_norm_ratio=10.0)
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", 256, 16))
    reference = GPT(gpt_config("tiny", 256, 16))
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the parameters stay put: same grads twice
    algo, _, codec = algo.partition("+")
    sync = build_sync(algo, model, opt, comm, {"bucket_mb": 0.05, **({"compress": codec} if codec else {})})
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank))
    _, loss = reference(x, x)
    loss.backward()
    honest = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    out = {"honest": honest, "buckets": len(getattr(sync, "_buckets", [])), "means": []}
    calls = comm.control_calls  # after the start-up's digest comparison
    for step in range(2):
        _, loss = sync.model(x, x)  # DDP's wrapper, where it has one
        if rank == 2 and step == 0:
            loss = loss * (float("nan") if how == "nan" else 1e6)
        loss.backward()
        sync.before_step()
        out["means"].append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        opt.step()
        sync.after_step()
        opt.zero_grad()
        if step == 0:
            out["rejected_first"] = dict(comm.rejected_by_rank)
    out["rejected"], out["control_calls"] = dict(comm.rejected_by_rank), comm.control_calls - calls
    return out


def _codec_case(rank: int, spec: str, how: str) -> dict:
    from geotrain.compress.codec import make_codec

    comm = Communicator(max_norm_ratio=10.0, aggregate="median" if spec.endswith("+median") else "mean")
    codec = make_codec(spec.removesuffix("+median"))
    honest = torch.randn(5000, generator=torch.Generator().manual_seed(rank))
    if rank == 2 and how.startswith("shard:"):  # its shard of the mean, in the second phase
        comm.corrupt_shard = how.removeprefix("shard:")
    elif rank == 2:
        comm.corrupt_next = how
    out, residuals = [], []
    for _ in range(2):  # a second message: the spoiled worker's residual stayed clean
        mean = honest.clone()
        codec.reduce(comm, "g", [mean]).wait()
        out.append(mean)
        residuals.append(float(codec.state("g").get("residual", torch.zeros(1)).norm()))
    rejected, sent = dict(comm.rejected_by_rank), comm.stats.sent_bytes  # of the two messages
    if how == "nan" and spec in ROWS_IN_BAND_CODECS:  # its own NaN, not one spoiled on the way
        bad = honest.clone()
        bad[rank] = float("nan")  # every worker's: each knows at once it will be left out
        pending = codec.reduce(comm, "g", [bad])
        # dropped before anything arrives: a regroup abandoning the message leaves no NaN behind
        residuals.append(float(codec.state("g").get("residual", torch.zeros(1)).abs().sum()))
        pending.wait()
    return {
        "honest": honest,
        "means": out,
        "rejected": rejected,
        "residuals": residuals,
        "sent": sent,
        "wire": 2 * codec.wire_bytes([(5000,)], comm.world_size),
    }


def _left_out_case(rank: int, spec: str) -> dict:
    """A checked quantised codec's mean with worker 2 left out (``leaving_out``: its contribution
    is a copy of the leader's state), its rows sent with a zero norm: the mean of the other two,
    nobody's rejection, and worker 2's error feedback as it was before the call."""
    from geotrain.compress.codec import make_codec

    comm = Communicator(max_norm_ratio=10.0)
    codec = make_codec(spec)
    gen = torch.Generator().manual_seed(rank)
    codec.reduce(comm, "g", [torch.randn(3000, generator=gen)]).wait()  # some error feedback first
    before = codec.state("g")["residual"].clone()
    honest = torch.randn(3000, generator=gen)
    mean = honest.clone()
    with comm.leaving_out({2}):
        codec.reduce(comm, "g", [mean]).wait()
    return {
        "honest": honest,
        "mean": mean,
        "rejected": dict(comm.rejected_by_rank),
        "residual_kept": torch.equal(before, codec.state("g")["residual"]),
    }


def _frontier_case(rank: int, algo: str, how: str) -> dict:
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", 256, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    comm = Communicator(max_norm_ratio=10.0)
    options = {
        "sparseloco": {"H": 1, "overlap": False},
        "streaming": {"H": 4, "fragments": 2},
        "ddp_powersgd": {"start_iter": 2, "min_compression_rate": 1.0},
    }
    sync = build_sync(algo, model, opt, comm, options.get(algo, {}))
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank))
    spoiled_at = 4 if algo == "ddp_powersgd" else 0  # PowerSGD's own steps, after its warm-up
    for step in range(6):
        if rank == 2 and step == spoiled_at:
            comm.corrupt_next = how
        _, loss = sync.model(x, x)  # DDP's wrapper, where it has one
        loss.backward()
        sync.before_step()
        opt.step()
        sync.after_step()
        opt.zero_grad()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"params": params, "rejected": comm.rejected_by_rank}


CODECS = ["int8", "int4", "sign", "topk:ratio=0.05", "chunktopk:chunk=256,k=16,bits=4", "int8+median"]
FRONTIER = [
    *("algo/sparseloco/nan", "algo/sparseloco/scale=1e6", "algo/demo/nan", "algo/demo/scale=1e6"),
    *("algo/streaming/nan", "algo/streaming/scale=1e6", "algo/ddp/nan", "algo/ddp/scale=1e6"),
    *("algo/ddp_powersgd/nan", "algo/ddp_powersgd/scale=1e6"),
]
SHARDS = [
    ("int8", "shard:scale=1e6"),
    ("int4", "shard:nan"),
    ("sign", "shard:scale=1e6"),
    ("int8+median", "shard:inf"),
]
# (codec, what worker 2 does to its shard of the first mean, --max-norm-ratio)
OWNERS = [
    *(("int4:owners=2", how, 10.0) for how in ("signflip", "scale=3", "-", "nan")),
    ("int4", "signflip", 10.0),  # one owner: the flipped shard goes through
    ("int4", "-", 10.0),
    ("int8:owners=2", "scale=3", 0.0),  # the comparison needs no norm check
    ("sign:owners=2", "-", 0.0),
    ("sign", "-", 0.0),
]
QUANTISED_IN_BAND = ["ssgd+int8/nan", "ssgd+int4/scale", "ssgd+sign/nan"]
MORE_CODECS_IN_BAND = ["ssgd+bf16/nan", "ssgd+acpsgd:rank=2/nan", "ssgd+adatopk:ratio=0.05/nan"]
ROBUST = ["robust/median/signflip", "robust/trimmed:f=1/scale=1e6", "robust/median/nan"]
RUNS = Cases(
    _case,
    3,
    [
        ("nan",), ("inf",), ("scale",), ("all",), ("clip",), ("buffers",), *((k,) for k in ROBUST),
        *((f"inband/{a}/{how}",) for a in ("ssgd", "ddp") for how in ("nan", "scale")),
        ("inband/ssgd+powersgd:rank=2/nan",), ("inband/ssgd+fp16/scale",),
        *((f"inband/{case}",) for case in MORE_CODECS_IN_BAND),
        *((f"inband/{case}",) for case in QUANTISED_IN_BAND),
        ("leftout/int8",), ("leftout/int4",),
        *((f"codec/{c}/{how}",) for c in CODECS for how in ("nan", "scale=1e6", "signflip")),
        *((f"codec/{c}/{how}",) for c, how in SHARDS),
        *((f"owners/{c}/{how}/{ratio}",) for c, how, ratio in OWNERS),
        ("owners/int4:owners=2/signflip/10.0/3",),  # a worker that keeps spoiling its shard
        ("owners/int4:owners=2/equivocate/10.0/3",),  # one that keeps sending owners different rows
        ("owners/int4:owners=2/forget/10.0/1",),  # a spoiled copy, then worker 0 forgets the owners
        ("owners/int4:owners=2/stamp/10.0/3",),  # one that sends false stamps
        *((k,) for k in FRONTIER),
    ],
)  # fmt: skip


@pytest.mark.parametrize("how", ["nan", "scale=1e6", "signflip"])
@pytest.mark.parametrize("spec", CODECS)
def test_a_codecs_own_collective_leaves_a_bad_contribution_out(spec, how):
    """The quantised codecs (a reduce-scatter of rows, checked before), top-k and chunked top-k
    (all-gathers, checked on the decoded messages, with no communication): one of 3 workers'
    message is spoiled. A NaN or 1e6-scaled one is left out, once: the result is finite, the
    same everywhere, and the honest pair's mean (top-k and chunked top-k exactly, the quantised
    codecs within what they keep). A sign-flipped one has an honest norm and is kept (the median
    resists it). Either way the spoiled worker's own error feedback stays what an honest
    message would have left: as small as the others'. A quantised codec's worker whose own
    message is not finite knows at launch that it will be left out, and drops its error
    feedback then, before anything arrives (a message a regroup abandons carries no NaN on);
    the bytes counted are those ``wire_bytes`` predicts, the norms in the rows not among them."""
    ranks = RUNS.get(f"codec/{spec}/{how}")
    pair = (ranks[0]["honest"] + ranks[1]["honest"]) / 2
    first = ranks[0]["means"][0]
    for r in ranks:
        assert torch.isfinite(r["means"][0]).all() and torch.equal(r["means"][0], first)
        assert r["rejected"] == ({} if how == "signflip" else {2: 1})  # the second is honest again
        if judged_in_rows(spec.partition("+")[0]):  # the norms in its rows: not counted
            assert r["sent"] == r["wire"]
        if how == "nan" and spec in ROWS_IN_BAND_CODECS:
            assert r["residuals"][2] == 0.0
        honest_residual = max(ranks[0]["residuals"][0], 1e-3)
        assert r["residuals"][0] <= 2 * honest_residual  # not the spoiled message's (2x or 1e6x v)
    expected = pair
    if how == "signflip":  # kept: the mean of all three, or their coordinate-wise median
        sent = torch.stack([ranks[0]["honest"], ranks[1]["honest"], -ranks[2]["honest"]])
        expected = sent.median(dim=0).values if spec.endswith("+median") else sent.mean(dim=0)
    error = float((first - expected).norm() / expected.norm())
    if spec.startswith("topk"):  # the honest messages' values, averaged over the two kept
        from geotrain.compress.sparse import TopK

        if how != "signflip":
            sent = []
            for r in ranks[:2]:
                values, idx = TopK(ratio=0.05).select(r["honest"], 250)
                sent.append(torch.zeros(5000).index_add_(0, idx.long(), values))
            torch.testing.assert_close(first, (sent[0] + sent[1]) / 2, atol=0, rtol=0)
    elif spec.startswith("chunktopk"):  # the mean of the honest decoded messages, exactly
        from geotrain.compress.chunked import ChunkTopK

        if how != "signflip":
            sent = [ChunkTopK(chunk=256, k=16, bits=4).encode(r["honest"])[1] for r in ranks[:2]]
            torch.testing.assert_close(first, (sent[0] + sent[1]) / 2, atol=0, rtol=0)
    elif spec.startswith("int8"):
        assert error < 0.02, error
    elif spec == "int4":
        assert error < 0.2, error  # a mean over 3 (a NaN or 1e6 counted) would be 0.33 off or worse


@pytest.mark.parametrize(("spec", "how"), SHARDS)
def test_a_spoiled_shard_of_the_mean_is_left_out_in_the_second_phase(spec, how):
    """The quantised codecs average in two phases: a reduce-scatter of every contribution's
    rows (checked before it), then each worker's shard of the mean, re-quantised, all-gathered.
    Worker 2 spoils its shard: every worker finds it above what the first phase's norms allow
    (or not finite), zeroes that shard alike and counts worker 2 once; the other shards are the
    honest mean of all three."""
    from geotrain.compress.codec import make_codec

    ranks = RUNS.get(f"codec/{spec}/{how}")
    first = ranks[0]["means"][0]
    third = make_codec(spec.removesuffix("+median")).layout(first.numel(), 3)[1]
    honest = torch.stack([r["honest"] for r in ranks])
    expected = honest.median(dim=0).values if spec.endswith("+median") else honest.mean(dim=0)
    for r in ranks:
        assert torch.equal(r["means"][0], first) and r["rejected"] == {2: 1}
    assert not first[2 * third :].any()  # worker 2's shard: left out, on every worker
    error = float((first[: 2 * third] - expected[: 2 * third]).norm() / expected[: 2 * third].norm())
    assert error < (0.02 if spec.startswith("int8") else 0.2 if spec == "int4" else 0.9), error


@pytest.mark.parametrize("case", FRONTIER)
def test_the_gathering_methods_and_ddp_leave_a_bad_message_out(case):
    """SparseLoCo's outer step, DeMo's signed step and Streaming DiLoCo's fragment landing judge
    every worker's gathered message on their own (one verdict per worker and sync); PyTorch DDP
    sends its buckets through the checked all-reduce (the mean taken again on the training
    thread); PyTorch's PowerSGD hook gets its bucket judged first. The replicas stay finite and
    equal."""
    ranks = RUNS.get(case)
    for r in ranks:
        assert torch.isfinite(r["params"]).all()
        # Streaming DiLoCo's replicas mix their own parameters in: equal only in the others.
        assert "streaming" in case or torch.equal(r["params"], ranks[0]["params"])
        assert r["rejected"] == {2: 1}


@pytest.mark.parametrize("kind", ["nan", "inf", "scale"])
def test_a_bad_contribution_is_left_out_and_the_mean_is_the_honest_workers(kind):
    ranks = RUNS.get(kind)
    honest_mean = (ranks[0]["honest"] + ranks[1]["honest"]) / 2
    for r in ranks:
        assert torch.equal(r["mean"], honest_mean)  # bitwise: zeros add exactly
        assert r["rejected"] == {2: 3}  # the mean, DiLoCo's outer step, CO2's landing
        assert torch.isfinite(r["diloco"]).all() and torch.isfinite(r["co2"]).all()
        assert torch.equal(r["diloco"], ranks[0]["diloco"]) and torch.equal(r["co2"], ranks[0]["co2"])
    # CO2: the anchor moved by the two honest workers' mean step of 0.01 x (1, 2): 0.015.
    start = ranks[0]["diloco"]
    torch.testing.assert_close(ranks[0]["co2"], start - 0.015, atol=1e-6, rtol=0)


def test_checked_means_in_flight_together_each_hold_a_buffer_and_the_next_step_reuses_them():
    """A checked mean sends its message and the table of norms in one buffer. A fresh one per
    bucket per step was fresh memory to fault in and zero (most of the check's 3.5% of ssgd's
    step on W1), so a finished mean gives its buffer back for the next of its size: the three
    means in flight at once held three (two of 1,000 values and the table's 2 x 3, one of 500),
    the second round took the same three again, a mean taken again after a rejection included."""
    ranks = RUNS.get("buffers")
    for r in ranks:
        first, second = r["kept"]
        assert {n: len(ptrs) for n, ptrs in first.items()} == {1006: 2, 506: 1}
        assert second == first  # the same memory: nothing new allocated, nothing lost on the redo
        pair = (ranks[0]["honest"][0] + ranks[1]["honest"][0]) / 2
        assert torch.equal(r["means"][1][0], pair)  # worker 2's NaN left out: the honest pair's
        trio = sum(x["honest"][2] for x in ranks) / 3
        torch.testing.assert_close(r["means"][1][2], trio, rtol=1e-5, atol=1e-7)
        assert r["rejected"] == {2: 1}


@pytest.mark.parametrize("spec", ["int8", "int4"])
def test_a_copy_left_out_of_a_checked_quantised_mean_weighs_nothing_and_is_not_rejected(spec):
    """With the check's norms in the all-to-all's rows, a copy of the leader's state that a
    redone average leaves out still sends its rows (with a zero norm): every owner drops them,
    the mean is the other two's (within what int8 and int4 keep), the same everywhere, nobody is
    counted as rejected, and the copy's error feedback is as it was."""
    ranks = RUNS.get(f"leftout/{spec}")
    pair = (ranks[0]["honest"] + ranks[1]["honest"]) / 2
    for r in ranks:
        assert torch.equal(r["mean"], ranks[0]["mean"]) and r["rejected"] == {}
        error = float((r["mean"] - pair).norm() / pair.norm())
        assert error < (0.02 if spec == "int8" else 0.3)
    trio = (ranks[0]["honest"] + ranks[1]["honest"] + ranks[2]["honest"]) / 3
    assert float((ranks[0]["mean"] - pair).norm()) < 0.5 * float((ranks[0]["mean"] - trio).norm())
    assert ranks[2]["residual_kept"]


def test_only_cpu_buffers_are_kept_a_gpus_caching_allocator_reuses_its_own():
    comm = Communicator(max_norm_ratio=10.0)
    cpu = comm._take_buffer(10, torch.float32, torch.device("cpu"))
    comm._give_back(cpu)
    assert comm._take_buffer(10, torch.float32, torch.device("cpu")) is cpu
    assert comm._take_buffer(10, torch.float32, torch.device("cpu")) is not cpu  # taken: a new one
    elsewhere = comm._take_buffer(10, torch.float32, torch.device("meta"))  # stands in for a GPU's
    comm._give_back(elsewhere)
    assert comm._spare_buffers == {(10, torch.float32, torch.device("cpu")): []}


@pytest.mark.parametrize("algo", ["ssgd", "ddp"])
@pytest.mark.parametrize("how", ["nan", "scale"])
def test_per_step_buckets_are_checked_with_no_round_trip_before_them(algo, how):
    """ssgd's buckets, launched from backward, and DDP's, through its comm hook, learn their
    verdict beside the sum: no worker waits for it before an all-reduce. When worker 2's
    gradients are spoiled, every bucket's mean is taken again without them (DDP's on the
    training thread, into each parameter's gradient): bitwise the honest pair's mean; the next
    step, all honest, is the mean of all three."""
    ranks = RUNS.get(f"inband/{algo}/{how}")
    pair = (ranks[0]["honest"] + ranks[1]["honest"]) / 2
    trio = (ranks[0]["honest"] + ranks[1]["honest"] + ranks[2]["honest"]) / 3
    for r in ranks:
        assert torch.equal(r["means"][0], pair)
        torch.testing.assert_close(r["means"][1], trio, rtol=1e-5, atol=1e-7)
        assert torch.equal(r["means"][1], ranks[0]["means"][1])
    # every bucket taken again, one table each (DDP puts the tiny model in one at first)
    buckets = ranks[0]["buckets"] if algo == "ssgd" else ranks[0]["rejected"][2]
    assert buckets >= (3 if algo == "ssgd" else 1)
    for r in ranks:
        assert r["rejected"] == {2: buckets}
        assert r["control_calls"] == 2 * buckets if algo == "ssgd" else r["control_calls"] >= 2 * buckets


@pytest.mark.parametrize(
    "case", ["ssgd+powersgd:rank=2/nan", "ssgd+fp16/scale", *QUANTISED_IN_BAND, *MORE_CODECS_IN_BAND]
)
def test_a_codec_whose_collectives_are_means_checks_them_in_band(case):
    """PowerSGD's P and Q (Q's all-reduce issued inside P's wait), fp16's halves, and the
    quantised codecs' all-to-all (each row carries its sender's norm, judged where it arrives):
    worker 2's spoiled step is left out of every collective with no round trip before any; the
    replicas' gradients stay finite and equal, and the next step's too. A quantised codec drops
    the spoiled message's error feedback with it: the next, honest step is not rejected again."""
    ranks = RUNS.get(f"inband/{case}")
    for r in ranks:
        for step in (0, 1):
            assert torch.isfinite(r["means"][step]).all()
            assert torch.equal(r["means"][step], ranks[0]["means"][step])
        assert set(r["rejected"]) == {2} and r["rejected"][2] >= 3
        if case in QUANTISED_IN_BAND:  # once per bucket, in the first step only
            assert r["rejected"][2] == r["buckets"]
        if case.endswith("/nan"):  # no NaN left in error feedback: the honest next step is kept
            assert r["rejected"] == r["rejected_first"], (r["rejected_first"], r["rejected"])


def _pair_case(rank: int, world_size: int, how: str) -> dict:
    """Two workers under auto (the ratio applies from 3): what is not finite is left out, a
    1e6-scaled contribution is not (of two that disagree, neither can be told wrong)."""
    comm = Communicator(max_norm_ratio=10.0, auto_min_workers=3)
    honest = torch.randn(50, generator=torch.Generator().manual_seed(rank))
    if rank == 1:
        comm.corrupt_next = how
    return {
        "honest": honest,
        "mean": comm.all_reduce(honest.clone(), op="mean"),
        "rejected": comm.rejected_by_rank,
    }


PAIRS = Cases(_pair_case, 2, [("nan",), ("scale=1e6",)])


def test_between_two_workers_auto_leaves_out_only_what_is_not_finite():
    nan, scaled = PAIRS.get("nan"), PAIRS.get("scale=1e6")
    for r in nan:
        assert torch.equal(r["mean"], nan[0]["honest"]) and r["rejected"] == {1: 1}  # worker 0's own
    for r in scaled:
        expected = (scaled[0]["honest"] + scaled[1]["honest"] * 1e6) / 2
        torch.testing.assert_close(r["mean"], expected)
        assert r["rejected"] == {}


def test_the_cli_refuses_a_ratio_below_one_and_an_unknown_aggregate():
    err = refused(["run", "--workers", "2", "--no-netem", "--max-norm-ratio", "0.5"])
    assert "--max-norm-ratio must be >= 1 (a multiple of the median norm), 0 for off, or auto" in err
    err = refused(["run", "--workers", "2", "--no-netem", "--aggregate", "mode"])
    assert "unknown --aggregate 'mode'; accepted: mean, clip, trimmed:f=F, median" in err
    err = refused(["run", "--workers", "2", "--no-netem", "--algo", "ddp", "--max-rejections", "2"])
    assert "the check is off here (--max-norm-ratio auto leaves it off for this --algo" in err
    err = refused(["run", "--workers", "3", "--no-netem", "--max-norm-ratio", "0", "--max-rejections", "2"])
    assert (
        "--max-rejections counts what the checks reject, and the check is off here (--max-norm-ratio 0)"
        in err
    )
    err = refused(["run", "--workers", "2", "--no-netem", "--aggregate", "trimmed:f=0"])
    assert "give trimmed:f=F, F >= 1 values cut at each end" in err
    job = ["run", "--workers", "2", "--no-netem", "--algo", "nosync", "--chaos", "corrupt:step=2,rank=1"]
    err = refused(job)
    assert "--chaos corrupt spoils what the norm check covers" in err and "not --algo nosync" in err
    err = refused([*job[:5], "ddp", *job[6:]])  # PyTorch DDP's all-reduce: only when checked
    assert "ddp's with --max-norm-ratio or an --aggregate" in err
    err = refused(["run", "--workers", "3", "--no-netem", "--algo", "ddp_powersgd", "--aggregate", "median"])
    assert "--aggregate median is not offered with ddp_powersgd" in err
    err = refused(["run", "--workers", "3", "--no-netem", "--algo", "sparseloco", "--aggregate", "median"])
    assert "sparse messages (sparseloco) leave most coordinates zero" in err
    err = refused(["run", "--workers", "3", "--no-netem", "--algo", "co2", "--aggregate", "trimmed:f=1"])
    assert "--aggregate trimmed:f=1 is not offered with co2" in err


def test_robust_averages_equal_their_closed_forms():
    rows = torch.tensor([[1.0, 10.0], [2.0, 20.0], [3.0, -30.0], [100.0, 40.0]])
    assert robust_mean(rows, "median").tolist() == [2.5, 15.0]  # the two middle values' mean
    assert robust_mean(rows, "trimmed", 1).tolist() == [2.5, 15.0]  # 4 values, 1 cut at each end
    five = torch.tensor([[1.0], [2.0], [4.0], [8.0], [1000.0]])
    assert robust_mean(five, "trimmed", 1).tolist() == [torch.tensor(14.0 / 3).item()]  # 2, 4, 8
    assert robust_mean(five, "median").tolist() == [4.0]
    assert robust_mean(five, "trimmed", 9).tolist() == [4.0]  # never more than leaves one
    assert robust_mean(rows[:2], "median").tolist() == [1.5, 15.0]
    assert parse_aggregate("trimmed:f=2") == ("trimmed", 2) and parse_aggregate("median") == ("median", 0)


@pytest.mark.parametrize("kind", ROBUST)
def test_robust_averages_on_a_gloo_group_resist_what_the_norm_check_cannot_see(kind):
    """One of 3 workers' contribution is spoiled by the chaos hook: a flipped sign (its norm is
    an honest one) or 1e6 x. The coordinate-wise median or trimmed mean of 3 is the middle value,
    which one bad worker cannot move outside the honest ones' range; a NaN one is left out."""
    ranks = RUNS.get(kind)
    honest = [r["honest"] for r in ranks]
    how = kind.split("/")[2]
    sent = [honest[0], honest[1], -honest[2] if how == "signflip" else honest[2] * 1e6]
    if how == "nan":
        expected = (honest[0] + honest[1]) / 2  # left out by the check; the median of two
        assert all(r["rejected"] == {2: 1} for r in ranks)
    else:
        expected = torch.stack(sent).median(dim=0).values  # of 3: the middle one, exactly
    low, high = torch.minimum(honest[0], honest[1]), torch.maximum(honest[0], honest[1])
    for r in ranks:
        assert torch.equal(r["mean"], expected) and torch.equal(r["mean"], ranks[0]["mean"])
        assert ((r["mean"] >= low) & (r["mean"] <= high)).all()  # inside the honest pair's range
        # an all-gather of the vectors: 2 copies of 96 bytes out, not an all-reduce's 2 x 2/3
        assert r["sent"].sent_bytes == 2 * 4 * 24  # (the norms go in a control call, not counted)


def test_when_every_contribution_is_bad_each_worker_keeps_its_own():
    for r in RUNS.get("all"):
        assert torch.equal(r["mean"], r["mine"]) and r["rejected"] == {0: 1, 1: 1, 2: 1}


def test_aggregate_clip_scales_each_contribution_down_to_the_median_norm():
    ranks = RUNS.get("clip")
    mine = [r["mine"] for r in ranks]
    norms = [float(m.norm()) for m in mine]
    clipped = [m * (norms[1] / n) if n > norms[1] else m for m, n in zip(mine, norms, strict=True)]
    expected = (clipped[0] + clipped[1] + clipped[2]) / 3
    for r in ranks:
        torch.testing.assert_close(r["mean"], expected, atol=1e-6, rtol=1e-6)
        assert torch.equal(r["mean"], ranks[0]["mean"]) and r["rejected"] == {}
    assert float(clipped[2].norm()) == pytest.approx(2.0, rel=1e-5)  # 3 was clipped to the median


@pytest.mark.usefixtures("no_leftovers")
def test_a_host_rejected_again_and_again_is_dropped_and_the_others_go_on(tmp_path):
    """Worker 2 sends NaN at every average (--chaos corrupt:every=1): after 2 rejections in a
    row the two others ask, signed with the run token, to drop it; the coordinator publishes an
    epoch without it, and they finish the run together. (60 steps: the coordinator looks every
    0.2 s, and a shorter run of tiny steps could end before the drop lands.)"""
    import json

    from geotrain.launch.coordinator import read_jsonl

    run = tmp_path / "run"
    cmd = ["run", "--workers", "3", "--no-netem", "--model", "tiny"]
    cmd += ["--algo", "localsgd", "--H", "1", "--steps", "60", "--batch-size", "4", "--no-progress"]
    # The norm check is on by default among 3 workers (--max-norm-ratio auto: 10 for localsgd)
    cmd += ["--max-rejections", "2", "--chaos", "corrupt:every=1,rank=2,kind=nan"]
    proc = geotrain([*cmd, "--run-dir", str(run)], timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "host 2's contributions were rejected 2 steps in a row" in proc.stderr
    epochs = read_jsonl(run / "control" / "epochs.jsonl")
    assert [(e["members"], e["why"]) for e in epochs][:1] == [([0, 1], "rejected")]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["final_val_loss"] < 10
    assert summary["rejected_updates"]["2"] >= 2 and summary["max_norm_ratio"] == 10


HOSTILE_OWNERS = {
    # worker 2 flips the sign of its shard of every mean: within every norm's bound, so only the
    # second owners see it; the first dispute cannot say which owner is wrong, the second owners
    # move on, the next dispute is with the other worker, and worker 2, in both, is counted
    "signflip": (
        "kind=signflip,part=shard",
        ["host 2 disagreed with hosts 0 and 1 over copies of the same shards"],
    ),
    # worker 2 sends its copies under a false owners' stamp at every step: the first time it
    # reads as an honest worker out of step (a joiner's would), then it is counted
    "stamp": (
        "part=stamp",
        [
            "host 2 sent its copies of shards under another owners' state than most workers",
            "2 shard(s) left out this once",  # the shards it owns and holds second
        ],
    ),
}


@pytest.mark.usefixtures("no_leftovers")
@pytest.mark.parametrize(
    "how",
    # (`-m long`: false stamps end the same way, 12 s; their blame is
    # test_a_worker_that_keeps_sending_false_stamps_is_blamed_from_the_second's, on gloo)
    [h if h != "stamp" else pytest.param(h, marks=pytest.mark.long) for h in sorted(HOSTILE_OWNERS)],
)
def test_a_hostile_owner_is_found_and_dropped(tmp_path, how):
    """``--compress int4:owners=2``, worker 2 hostile as an owner at every step
    (``--chaos corrupt:every=1,...``, ``HOSTILE_OWNERS``): it is counted as rejected, 2 steps of
    that in a row (``--max-rejections 2``) and the others drop it and finish the run together;
    honest pairs never dispute."""
    import json

    from geotrain.launch.coordinator import read_jsonl

    chaos, said = HOSTILE_OWNERS[how]
    run = tmp_path / "run"
    cmd = ["run", "--workers", "3", "--no-netem", "--model", "tiny", "--algo", "localsgd", "--H", "1"]
    cmd += ["--steps", "40", "--batch-size", "4", "--no-progress", "--compress", "int4:owners=2"]
    cmd += ["--max-rejections", "2", "--chaos", f"corrupt:every=1,rank=2,{chaos}"]
    proc = geotrain([*cmd, "--run-dir", str(run)], timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for line in [*said, "host 2's contributions were rejected 2 steps in a row"]:
        assert line in proc.stderr
    epochs = read_jsonl(run / "control" / "epochs.jsonl")
    assert [(e["members"], e["why"]) for e in epochs][:1] == [([0, 1], "rejected")]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["rejected_updates"]["2"] >= 2
    disputed = set(summary["disputed_shards"] or {})
    assert disputed == ({"2,0", "2,1"} if how == "signflip" else set())  # honest pairs never dispute


def test_a_gathered_message_is_judged_by_what_it_decodes_to_and_a_forged_one_is_not_finite():
    """Chunked top-k's messages judged where they arrive: an adopter's empty stand-in (all zero
    bytes) is kept and weighs nothing; one whose indices repeat within a chunk (k copies of a
    value at one coordinate pass a norm check and still move that coordinate k times as far) is
    counted as not finite, and so is a non-finite scale."""
    from geotrain.compress.chunked import ChunkTopK, pack_bits

    codec = ChunkTopK(chunk=256, k=16, bits=4)
    v = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    real, sent = codec.encode(v)
    c = codec.chunks(1000)
    forged = real.clone()
    index_bytes = pack_bits(torch.zeros(c * 16, dtype=torch.int64), 8)  # every index 0
    forged[-index_bytes.numel() :] = index_bytes
    nan = real.clone()
    nan[:4] = torch.tensor([float("nan")]).view(torch.uint8)
    judged = codec.norms(torch.stack([real, torch.zeros_like(real), forged, nan]), 1000)
    norms, finite = [n for n, _ in judged], [ok for _, ok in judged]
    assert finite == [True, True, False, False]
    assert norms[0] == pytest.approx(float(sent.norm()), rel=1e-5) and norms[1] == 0.0  # 6 digits


def test_the_check_is_on_by_default_where_it_costs_a_round_trip_per_sync_or_nothing_at_all():
    import geotrain
    from geotrain.comm.guard import AUTO, default_norm_ratio
    from geotrain.sync import ConfigError
    from geotrain.train import TrainConfig

    for algo in ("localsgd", "diloco", "co2", "streaming", "sparseloco", "demo"):
        assert default_norm_ratio(algo) == 10.0 and TrainConfig(algo=algo).norm_ratio() == 10.0
    for algo in ("ddp", "nosync", "ddp_powersgd"):
        assert default_norm_ratio(algo) == 0.0  # the reference's all-reduce, a round trip, or nothing
    assert (
        default_norm_ratio("diloco", "int4") == 10.0 and default_norm_ratio("diloco", "chunktopk:k=8") == 10.0
    )
    assert default_norm_ratio("diloco", pace="time") == 0.0
    # Every step, off: a ratio rejects honest gradients there (given, inf checks finiteness only)
    for algo, options in (("ssgd", {}), ("dreamddp", {}), ("localsgd", {"warm_start": 20})):
        assert default_norm_ratio(algo, **options) == 0.0
    assert TrainConfig(algo="ssgd", max_norm_ratio=float("inf")).norm_ratio() == float("inf")
    # Under auto the communicator keeps it on only in groups of 3 or more (decided at each rebind)
    assert Communicator(max_norm_ratio=10, auto_min_workers=3).max_norm_ratio == 0.0  # a world of one
    assert Communicator(max_norm_ratio=10, auto_min_workers=1).max_norm_ratio == 10.0
    assert TrainConfig(algo="diloco", profile_out="p.json").norm_ratio() == 0.0  # the link, unchecked
    assert TrainConfig(algo="diloco", max_norm_ratio=0).norm_ratio() == 0.0  # told: off
    assert TrainConfig(algo="ssgd", max_norm_ratio=5).norm_ratio() == 5.0
    assert TrainConfig().max_norm_ratio == AUTO
    with pytest.raises(ConfigError, match="max_norm_ratio takes a number >= 1, 0 for off, or 'auto'"):
        geotrain.wrap(
            torch.nn.Linear(2, 2),
            torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1),
            max_norm_ratio="on",
        )


def test_a_messages_norm_is_its_float64_norm_to_6_digits_and_anything_not_finite_is_said():
    """``message_norm`` sums in float64 without a float64 copy: the same figure as the copy's
    norm, rounded alike on every host; inf or NaN anywhere is "not finite", a float64 overflow
    of finite values is a finite message of infinite norm (left out by any ratio)."""
    import math

    import torch

    from geotrain.comm.guard import message_norm

    g = torch.Generator().manual_seed(0)
    for values in (
        torch.randn(100_003, generator=g),
        torch.randn(4096, generator=g).to(torch.bfloat16),
        torch.randint(-5, 5, (999,), generator=g),
        torch.zeros(0),
    ):
        expected = float(f"{float(values.double().norm()):.6g}")
        assert message_norm(values) == (expected, True)
    for bad in (float("nan"), float("inf"), -float("inf")):
        values = torch.randn(1000, generator=g)
        values[517] = bad
        assert message_norm(values) == (0.0, False)
    norm, finite = message_norm(torch.full((4,), 1e200, dtype=torch.float64))
    assert math.isinf(norm) and finite
    assert message_norm(torch.ones(3), valid=False) == (0.0, False)


def _shards_close(got: torch.Tensor, expected: torch.Tensor, bound: float) -> None:
    error = float((got - expected).norm() / expected.norm())
    assert error < bound, error


def _one_mean(ranks: list[dict], step: int) -> torch.Tensor:
    """The mean of message ``step``, which every worker must hold bitwise alike."""
    first = ranks[0]["means"][step]
    for r in ranks:
        assert torch.equal(r["means"][step], first)
    return first


@pytest.mark.parametrize("how", ["signflip", "scale=3", "nan"])
def test_a_second_owner_per_shard_catches_a_shard_spoiled_within_the_norms_bound(how):
    """``int4:owners=2``: worker j's shard of the mean is computed by worker j+1 too, and every
    worker compares the two copies' bytes. Worker 2 flips the sign of its shard, or scales it
    3x: within what the first phase's norms allow, so one owner lets it through (the next test),
    but here every worker finds the copies differ, leaves that shard out alike, and counts the
    pair (hosts 2 and 0), not a rejection (a NaN shard too, which the bound alone would count
    against its owner: the pair cannot say which owner is wrong). The other shards are the
    honest mean; the next two messages, honest, are averaged whole again, with every shard's
    second owner moved on by one (worker j+2), both owners' error feedback restarted."""
    ranks = RUNS.get(f"owners/int4:owners=2/{how}/10.0")
    honest_run = RUNS.get("owners/int4/-/10.0")  # one owner, nobody spoiling: the same messages
    shard = ranks[0]["shard"]
    for step in range(3):
        first = _one_mean(ranks, step)
        expected = torch.stack([r["honest"][step] for r in ranks]).mean(dim=0)
        if step == 0:
            # the honest owners' shards: bitwise the honest run's
            assert torch.equal(first[: 2 * shard], honest_run[0]["means"][step][: 2 * shard])
            assert not first[2 * shard :].any()  # worker 2's shard: left out everywhere
        else:  # averaged again: int4's error with error feedback, as the honest run's (0.25)
            _shards_close(first, expected, 0.3)
    for r in ranks:
        assert r["disputed"] == {(2, 0): 1} and r["rejected"] == {}
        assert r["offsets"] == [1, 2, 2]  # moved once, by the one disputed message
        assert r["sent"] == r["wire"]  # twice one owner's bytes (wire_bytes says so)


def test_a_worker_that_keeps_spoiling_its_shard_is_found_and_counted_as_rejected():
    """Worker 2 flips its shard in three messages running (3 workers). The first dispute is
    with its second owner, worker 0, and cannot say which is wrong; the second owners then move
    on (worker j+2 computes shard j), so the second dispute is with worker 1: worker 2 has
    disputed with both others, each of whom with it alone, and is counted as rejected, at that
    message and at the next (``--max-rejections`` drops it from there). The fourth message,
    honest, is averaged whole, and every worker holds the same means throughout."""
    ranks = RUNS.get("owners/int4:owners=2/signflip/10.0/3")
    shard = ranks[0]["shard"]
    for step in range(4):
        first = _one_mean(ranks, step)
        expected = torch.stack([r["honest"][step] for r in ranks]).mean(dim=0)
        if step < 3:
            assert not first[2 * shard :].any()
            _shards_close(first[: 2 * shard], expected[: 2 * shard], 0.3)
        else:
            _shards_close(first, expected, 0.3)
    for r in ranks:
        assert r["offsets"] == [1, 2, 1, 2]
        assert r["disputed"] == {(2, 0): 2, (2, 1): 1} and r["rejected"] == {2: 2}


def test_a_sender_that_sends_two_owners_different_rows_gets_nobody_blamed():
    """Worker 2, as a sender, gives shard 0's owner (worker 0) another row of it than its second
    owner (worker 1), three messages running. The two copies differ every time, but each carries
    the digest of what it was computed from, those differ, and nobody is blamed: the shard is
    left out, its two owners restart its error feedback, and the second owners stay where they
    are (they move only for a spoiled copy, whose digests agree). Without the digests worker 0
    would have been in every dispute, as a spoiling owner is, and been blamed."""
    ranks = RUNS.get("owners/int4:owners=2/equivocate/10.0/3")
    shard = ranks[0]["shard"]
    for step in range(4):
        first = _one_mean(ranks, step)
        assert (not first[:shard].any()) == (step < 3)  # shard 0 left out while it lasts
    for r in ranks:
        assert r["disputed"] == {(0, 1): 3} and r["rejected"] == {}
        assert r["offsets"] == [1, 1, 1, 1]


def test_owners_states_that_differ_are_restarted_and_nobody_is_blamed():
    """A spoiled copy moves the second owners (offset 2), then worker 0 loses its codec state
    (a host rebuilt, a joiner): it sends under offset 1 where the others send under 2. The stamps
    on the copies differ: the two others' stamp decides, the shards worker 0 owns or holds second
    are left out (and shard 2, whose second copy got worker 0's misrolled row), alike
    everywhere, nobody is blamed or counted as disputing, and every worker starts the owners'
    state again, so the next message is checked and averaged whole."""
    ranks = RUNS.get("owners/int4:owners=2/forget/10.0/1")
    shard = ranks[0]["shard"]
    for step in range(3):
        _one_mean(ranks, step)
    assert not ranks[0]["means"][1][: 2 * shard].any()
    expected = torch.stack([r["honest"][2] for r in ranks]).mean(dim=0)
    _shards_close(ranks[0]["means"][2], expected, 0.3)
    assert [r["offsets"] for r in ranks] == [[1, 1, 1], [1, 2, 1], [1, 2, 1]]
    for r in ranks:
        assert r["disputed"] == {(2, 0): 1} and r["rejected"] == {}


def test_a_worker_that_keeps_sending_false_stamps_is_blamed_from_the_second():
    """Worker 2 sends every message under a false owners' stamp (offset 2, where the others'
    state says 1). Each message is out of step: the two others' stamp decides, and the shards
    worker 2 owns or holds second are left out alike everywhere, as is shard 0, whose second
    owner got worker 2's row misrolled (so, of 3, every shard); every worker starts the owners'
    state again. An honest worker differs at most once in a membership epoch (a joiner, a rebuilt
    host, a failed message: each comes with a new epoch), so from the second message on worker 2
    is counted as rejected, and ``--max-rejections`` drops it; the others never are."""
    ranks = RUNS.get("owners/int4:owners=2/stamp/10.0/3")
    for step in range(4):
        assert not _one_mean(ranks, step).any()
    for r in ranks:
        assert r["rejected"] == {2: 3} and r["disputed"] == {}
    assert [r["offsets"] for r in ranks] == [[1] * 4, [1] * 4, [2] * 4]


def test_the_record_of_false_stamps_is_not_saved_with_a_snapshot():
    """Who sent a stray stamp is remembered by the communicator, for its current group only: not
    in the codec's saved state (a resumed run starts its membership afresh, and a restored record
    could count an honest joiner on the workers that saved it only), and begun again at a
    regroup. A worker's second stray in the same stream is counted, a first one in another not."""
    from geotrain.comm.communicator import Communicator
    from geotrain.compress.codec import make_codec

    comm, codec = Communicator(), make_codec("int4:owners=2")
    codec.state("g")["residual"] = torch.ones(3)
    comm.count_strays("g", [2])
    comm.count_strays("h", [2])
    assert comm.rejected_by_rank == {}
    comm.count_strays("g", [2])
    assert comm.rejected_by_rank == {2: 1}
    (key, saved), *_ = codec.state_dict()["streams"]
    assert key == "g" and set(saved) == {"residual"}
    comm.rebind(None)
    comm.count_strays("g", [2])
    assert comm.rejected_by_rank == {2: 1}


def test_copies_are_judged_from_the_gathered_bytes_alone():
    """``owners.judge_copies`` on made-up copies: in step, nothing left out before the bytes are
    compared; out of step, the majority's stamp decides the offset and the shards of the worker
    that differs are left out; with no majority every shard is; a false stamp (offset 0, which
    would roll a shard onto its own owner) rolls by 1."""
    from geotrain.compress.owners import DIGEST_BYTES, judge_copies, stamp_bytes

    def halves(stamps, world):
        rows = torch.arange(world * 4, dtype=torch.uint8).reshape(world, 4)
        digests = torch.zeros(DIGEST_BYTES, dtype=torch.uint8)
        tails = torch.stack([torch.cat([digests, stamp_bytes(o, c, "cpu")]) for o, c in stamps])
        first = torch.cat([rows, tails], dim=1)
        return first, torch.cat([rows.roll(stamps[0][0], dims=0), tails], dim=1)  # honest copies

    first, second = halves([(2, 5)] * 4, 4)
    copies = judge_copies(first, second)
    assert (
        copies.in_step
        and copies.offset == 2
        and copies.disputed == []
        and copies.first.shape == (4, 4)  # the rows, the tails cut off
        and torch.equal(copies.first, copies.second)
    )
    first, second = halves([(2, 5), (2, 5), (2, 5), (1, 0)], 4)
    copies = judge_copies(first, second)
    assert not copies.in_step and copies.offset == 2 and copies.disputed == [1, 3]  # 3 owns, 1 is held by 3
    assert judge_copies(*halves([(2, 5), (1, 0)], 2)).disputed == [0, 1]  # no majority: all
    copies = judge_copies(*halves([(0, 5)] * 3, 3))
    assert copies.offset == 1 and copies.in_step


def test_the_shards_bound_is_the_owners_lower_median():
    """Each owner sends the bound its verdict sets; every worker checks the shards against the
    lower median of them, so workers whose verdicts differ (a sender that sent them different
    norms) still check alike, one hostile owner among 3 cannot loosen it, and NaN is 0."""
    from geotrain.comm.guard import agreed_shard_bound, shard_bound_bytes

    def rows(*bounds):
        return torch.stack([shard_bound_bytes(b, "cpu") for b in bounds])

    assert agreed_shard_bound(rows(2.0, 2.0, 2.0)) == 2.0
    assert agreed_shard_bound(rows(2.0, 1e30, 2.0)) == 2.0 and agreed_shard_bound(rows(2.0, 3.0, 1e30)) == 3.0
    assert agreed_shard_bound(rows(2.0, 5.0)) == 2.0  # of two, the lower
    assert agreed_shard_bound(rows(float("nan"), 2.0, 2.0)) == 2.0
    assert agreed_shard_bound(rows(float("inf"), float("inf"))) == float("inf")


def test_a_run_of_disputes_blames_the_one_worker_in_all_of_them():
    from geotrain.compress.owners import blame_disputes, digest

    partners = torch.zeros(4, 4, dtype=torch.bool)
    assert blame_disputes(partners, [(2, 3)]) == []  # one pair: either could be wrong
    assert blame_disputes(partners, [(2, 0)]) == [2]  # then with another: worker 2
    assert blame_disputes(partners, [(2, 1)]) == [2]  # and as long as it goes on
    # A worker spoiling both the shard it owns and the one it holds second: two pairs at once
    assert blame_disputes(torch.zeros(5, 5, dtype=torch.bool), [(1, 2), (2, 3)]) == [2]
    # Colluders on either side of an honest worker 2 would have it blamed with them: half the
    # group is in question, and nobody is blamed
    assert blame_disputes(torch.zeros(4, 4, dtype=torch.bool), [(0, 1), (1, 2), (2, 3), (3, 0)]) == []
    two = torch.zeros(2, 2, dtype=torch.bool)
    for _ in range(3):  # two workers: always the same pair
        assert blame_disputes(two, [(0, 1)]) == []
    # Two spoilers side by side (0 and 1 of 7, second owners at +1 then +2): worker 1 is found
    # at once (0 and 2 each disputed with it alone); then worker 2 has disputed with both
    # spoilers, and is not blamed for it
    seven = torch.zeros(7, 7, dtype=torch.bool)
    assert blame_disputes(seven, [(0, 1), (1, 2)]) == [1]
    assert blame_disputes(seven, [(0, 2), (1, 3)]) == []
    # Blamed only where it is in this message's disputes
    one = torch.zeros(4, 4, dtype=torch.bool)
    blame_disputes(one, [(2, 3)])
    assert blame_disputes(one, [(2, 0)]) == [2] and blame_disputes(one, [(0, 1)]) == []
    # A copy's digest covers its rows and the verdict it was averaged under
    rows = torch.arange(64, dtype=torch.uint8).reshape(4, 16)
    assert torch.equal(digest(rows, [True] * 4), digest(rows.clone(), [True] * 4))
    assert not torch.equal(digest(rows, [True] * 4), digest(rows, [True, True, False, True]))


def test_a_tensor_digest_is_blake3_over_its_bytes_in_row_major_order():
    """What workers compare: BLAKE3 over a tensor's bytes, then the extra bytes; a strided view
    digests as its contiguous copy; a large tensor (hashed on several threads) as one pass would."""
    import blake3

    from geotrain.comm.digest import THREADED_FROM, bytes_digest

    x = torch.randn(3, 5)
    assert bytes_digest(x, 16, b"kept") == blake3.blake3(x.numpy().tobytes() + b"kept").digest(16)
    assert bytes_digest(x.t()) == bytes_digest(x.t().contiguous()) != bytes_digest(x)
    big = torch.randint(0, 255, (3 * THREADED_FROM + 7,), dtype=torch.uint8)
    assert bytes_digest(big) == blake3.blake3(big.numpy().tobytes()).digest(32)
    assert bytes_digest(big) != bytes_digest(big[:-1])


def test_one_owner_per_shard_lets_a_flipped_shard_through():
    """Without a second owner, the same flipped shard is averaged in: the gap ``owners=2``
    closes (what makes the test above able to fail)."""
    ranks = RUNS.get("owners/int4/signflip/10.0")
    shard = ranks[0]["shard"]
    first = ranks[0]["means"][0]
    expected = torch.stack([r["honest"][0] for r in ranks]).mean(dim=0)
    _shards_close(-first[2 * shard :], expected[2 * shard :], 0.2)
    assert ranks[0]["rejected"] == {} and ranks[0]["disputed"] == {}


@pytest.mark.parametrize(
    ("two", "one"), [("int4:owners=2/-/10.0", "int4/-/10.0"), ("sign:owners=2/-/0.0", "sign/-/0.0")]
)
def test_a_second_owner_changes_no_bit_of_an_honest_mean_and_sends_twice_the_bytes(two, one):
    """Honest workers: the means with two owners per shard are bitwise those with one, checked
    or not, nothing disputed, and the bytes sent are twice one owner's, with the 16-byte digest of
    what each copy was computed from and its owners' stamp (``wire_bytes``)."""
    from geotrain.compress.owners import TAIL_BYTES

    paired, single = RUNS.get(f"owners/{two}"), RUNS.get(f"owners/{one}")
    for p, s in zip(paired, single, strict=True):
        for a, b in zip(p["means"], s["means"], strict=True):
            assert torch.equal(a, b)
        # each of the 3 messages' 2 copies goes to 2 others with its rows' digest
        assert p["disputed"] == {} and p["sent"] == p["wire"] == 2 * s["sent"] + 3 * 2 * 2 * TAIL_BYTES


def test_a_second_owner_needs_no_norm_check():
    """``int8:owners=2`` with the check off: worker 2's 3x-scaled shard is still left out
    everywhere (the comparison is of bytes, not norms)."""
    ranks = RUNS.get("owners/int8:owners=2/scale=3/0.0")
    shard = ranks[0]["shard"]
    first = ranks[0]["means"][0]
    assert not first[2 * shard :].any() and first[: 2 * shard].any()
    for r in ranks:
        assert torch.equal(r["means"][0], first) and r["disputed"] == {(2, 0): 1}


def test_owners_is_validated_and_left_out_of_the_spec_at_its_default():
    from geotrain.compress.codec import ConfigError, make_codec

    with pytest.raises(ConfigError, match="owners .* must be 1 or 2"):
        make_codec("int4:owners=3")
    assert make_codec("int4").spec() == "int4:warmup=0,block=256"  # as snapshots and plans saved it
    assert make_codec("int4:owners=2").spec() == "int4:warmup=0,block=256,owners=2"


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _periodic_case(rank: int, world_size: int, spec: str, how: str) -> dict:
    """One sync of a periodic method (H=1) with worker 2's contribution spoiled as ``--chaos
    corrupt`` spoils it: every worker's parameters before and after it. DreamDDP averages each
    layer during backward, so its sync is a real step, spoiled at its second (the first starts
    every replica from the same model), and its layers' averages are read before the update."""
    algo, _, codec = spec.partition("+")
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", 256, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    comm = Communicator(max_norm_ratio=10.0)
    options = {"H": 1, "compress": codec or ("none" if algo == "diloco" else "")}
    if algo == "diloco":
        options |= {"outer_lr": 1.0, "outer_momentum": 0.0}
    if algo == "dreamddp":
        options |= {"replan_threshold": 0.0, "lag": 0}
    sync = build_sync(algo, model, opt, comm, options)
    gen = torch.Generator().manual_seed(rank)
    if algo == "dreamddp":
        names = [layer.name for layer in layer_groups(model)]
        sync.set_plan({"schedule": {"H": 1, "layers": names, "assignment": [0] * len(names),
                                    "iterations": [names]}})  # fmt: skip
        offsets, at = {}, 0
        for p in model.parameters():
            offsets[id(p)], at = (at, at + p.numel()), at + p.numel()
        layers = [[offsets[id(p)] for p in layer.params] for layer in layer_groups(model)]
        after = None
        for step in range(2):
            x = torch.randint(0, 256, (2, 16), generator=gen)
            start = after if step else None  # the last average: the same on every worker
            before = _flat(model)
            if rank == 2 and step == 1:
                comm.corrupt_next = how
            sync.model(x, x)[1].backward()
            sync.before_step()  # lag 0: every layer's average is in before the update
            after = _flat(model)
            opt.step()
            opt.zero_grad()
            sync.after_step()
        sync.close()
        rejected = dict(comm.rejected_by_rank)
        return {"start": start, "honest": before, "after": after, "rejected": rejected, "layers": layers}
    start = _flat(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.01)
    honest = _flat(model)
    if rank == 2:
        comm.corrupt_next = how
    sync.after_step()
    return {"start": start, "honest": honest, "after": _flat(model), "rejected": dict(comm.rejected_by_rank)}


PERIODIC = [
    *(("localsgd", how) for how in ("nan", "inf", "scale=1e6")),
    ("diloco", "inf"),
    ("localsgd+int4", "nan"),
    ("diloco+int4", "scale=1e6"),
    ("diloco+int8", "inf"),
    ("dreamddp", "nan"),
    ("dreamddp", "scale=1e6"),
    ("dreamddp+int4", "nan"),
]
PERIODIC_RUNS = Cases(_periodic_case, 3, PERIODIC)


@pytest.mark.parametrize("spec, how", PERIODIC)
def test_a_periodic_sync_with_a_spoiled_worker_is_the_honest_workers_average(spec, how):
    """Issue 16's test for the periodic methods, with and without a codec: worker 2 of 3 sends a
    NaN, inf or 1e6-scaled contribution; every replica stays finite and equal and is counted
    rejected once per message, and the average is the honest pair's: bitwise where nothing is
    quantised (local SGD's mean of the parameters, DiLoCo's plain outer step from the anchor,
    each DreamDDP layer whose all-reduce was spoiled), within the codec's rounding otherwise."""
    ranks = PERIODIC_RUNS.get(spec, how)
    h0, h1, h2 = (r["honest"] for r in ranks)
    for r in ranks:
        assert torch.isfinite(r["after"]).all()
        assert torch.equal(r["after"], ranks[0]["after"])
        assert set(r["rejected"]) == {2} and r["rejected"][2] >= 1
    after, start = ranks[0]["after"], ranks[0]["start"]
    if spec in ("localsgd", "diloco"):  # one message, one rejection
        assert ranks[0]["rejected"] == {2: 1}
    if spec == "localsgd":
        assert torch.equal(after, (h0 + h1) / 2)  # bitwise: the left-out worker adds a zero
    elif spec == "diloco":  # anchor - mean(anchor - x_k) over the honest pair, as its SGD takes it
        assert torch.equal(after, start - ((start - h0) + (start - h1)) / 2)
    elif spec.startswith("dreamddp"):  # layer by layer: the spoiled one the pair's, the rest the trio's
        pair = ((h0 - start) + (h1 - start)) / 2
        trio = ((h0 - start) + (h1 - start) + (h2 - start)) / 3
        spoiled = []
        for spans in ranks[0]["layers"]:
            idx = torch.cat([torch.arange(a, b) for a, b in spans])
            change = after[idx] - start[idx]
            to_pair = float((change - pair[idx]).norm() / pair[idx].norm())
            to_trio = float((change - trio[idx]).norm() / trio[idx].norm())
            spoiled.append(to_pair < to_trio)
            if spec == "dreamddp" and to_pair < to_trio:  # bitwise: the left-out worker adds a zero
                assert torch.equal(after[idx], ((h0 + h1) / 2)[idx])
            elif spec == "dreamddp":
                torch.testing.assert_close(after[idx], ((h0 + h1 + h2) / 3)[idx], rtol=1e-5, atol=1e-7)
            else:  # within int4's rounding of the mean it should be
                assert min(to_pair, to_trio) < 0.3 < max(to_pair, to_trio), (to_pair, to_trio)
        assert sum(spoiled) == 1  # the first layer sent in backward: worker 2's spoiled message
        if spec == "dreamddp":
            assert ranks[0]["rejected"] == {2: 1}
    else:  # the change since the anchor, averaged through the codec over the honest pair
        pair = ((h0 - start) + (h1 - start)) / 2
        error = float((after - start - pair).norm() / pair.norm())
        assert error < (0.02 if "int8" in spec else 0.3), error
