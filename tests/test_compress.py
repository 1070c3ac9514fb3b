"""Codecs: local properties (error feedback, exactness, packing), compressed means on real gloo
groups against closed forms, byte counts against each codec's estimate, and bad specs."""

from __future__ import annotations

import pytest
import torch

from geotrain.comm.communicator import Communicator
from geotrain.compress.codec import ConfigError, codec_names, make_codec
from geotrain.compress.quantize import Sign
from geotrain.sync import build_sync
from helpers import Cases, run_workers

LOCAL_LOSSY = [
    *("fp16", "bf16", "int8", "int4", "sign", "topk:ratio=0.05", "chunktopk:chunk=64,k=8"),
    *("powersgd:rank=2", "acpsgd:rank=2"),
]
ALL_SPECS = LOCAL_LOSSY + ["adatopk:ratio=0.05"]


def _residual_sum(codec, key, shapes) -> list[torch.Tensor]:
    """The error-feedback residual of ``key`` per tensor (zeros where the tensor went exactly)."""
    state = codec.state(key)
    if "residual" in state:  # flat codecs: one residual for the concatenation
        flat = state["residual"]
        out, offset = [], 0
        for s in shapes:
            n = torch.Size(s).numel()
            out.append(flat[offset : offset + n].reshape(s))
            offset += n
        return out
    return [state[f"e{i}"].reshape(s) if f"e{i}" in state else torch.zeros(s) for i, s in enumerate(shapes)]


@pytest.mark.parametrize("spec", LOCAL_LOSSY)
def test_error_feedback_keeps_the_sum(spec):
    codec = make_codec(spec)
    comm = Communicator()  # a world of one: what is sent is what arrives
    shapes = [(24, 40), (40,)]
    gen = torch.Generator().manual_seed(1)
    sent = [torch.zeros(s) for s in shapes]
    went_in = [torch.zeros(s) for s in shapes]
    for _ in range(40):
        xs = [torch.randn(s, generator=gen) for s in shapes]
        for acc, x in zip(went_in, xs, strict=True):
            acc += x
        out = [x.clone() for x in xs]
        codec.reduce(comm, "k", out).wait()
        for acc, o in zip(sent, out, strict=True):
            acc += o
        # Something really was lost on the way at least once, or the test would prove nothing.
    residual = _residual_sum(codec, "k", shapes)
    assert any(r.abs().max() > 1e-6 for r in residual) or spec in ("fp16", "bf16")
    for s, r, w in zip(sent, residual, went_in, strict=True):
        torch.testing.assert_close(s + r, w, atol=2e-4, rtol=1e-5)


@pytest.mark.parametrize("spec", LOCAL_LOSSY)
def test_a_worker_left_out_of_a_redone_average_keeps_its_error_feedback(spec):
    """In an average redone after a regroup, a worker holding a copy of the leader's state is
    left out (``Communicator.leaving_out``): what its codec would keep of the copy, the leader
    sends, so its error feedback stays as it was before the call."""
    codec = make_codec(spec)
    comm = Communicator()
    shapes = [(24, 40), (40,)]
    gen = torch.Generator().manual_seed(2)
    codec.reduce(comm, "k", [torch.randn(s, generator=gen) for s in shapes]).wait()
    before = [r.clone() for r in _residual_sum(codec, "k", shapes)]
    comm.left_out = frozenset({0})  # as leaving_out sets it for a copy on a larger group
    codec.reduce(comm, "k", [torch.randn(s, generator=gen) for s in shapes]).wait()
    comm.left_out = frozenset()
    for b, a in zip(before, _residual_sum(codec, "k", shapes), strict=True):
        assert torch.equal(b, a)


def test_restored_error_feedback_takes_the_layout_of_a_new_group():
    from geotrain.compress.codec import _restore_feedback

    state = {
        "residual": torch.zeros(12),
        "server_residual": torch.ones(4),
        "e0": torch.ones(2, 2),
        "q0": torch.ones(3),
    }
    _restore_feedback(state, {"residual": torch.arange(9.0)})  # saved under a group of another size
    assert torch.equal(state["residual"], torch.cat([torch.arange(9.0), torch.zeros(3)]))
    assert "e0" not in state  # none before the call: none after
    assert torch.equal(state["server_residual"], torch.ones(4)) and torch.equal(state["q0"], torch.ones(3))


def _rank_r(n, m, r, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, r, generator=g) @ torch.randn(r, m, generator=g)


def test_powersgd_reconstructs_a_rank_r_matrix_exactly():
    codec = make_codec("powersgd:rank=3")
    m = _rank_r(64, 48, 3)
    out = m.clone()
    codec.reduce(Communicator(), "k", [out]).wait()
    torch.testing.assert_close(out, m, atol=1e-4, rtol=1e-4)


def test_acpsgd_reconstructs_a_rank_r_matrix_exactly_from_the_second_step():
    codec = make_codec("acpsgd:rank=3,error_feedback=false")
    m = _rank_r(64, 48, 3)
    errors = []
    for _ in range(6):
        out = m.clone()
        codec.reduce(Communicator(), "k", [out]).wait()
        errors.append((out - m).abs().max().item() / m.abs().max().item())
    assert errors[0] > 1e-2  # one factor of a random start is not the matrix
    # Step 2: P spans M's columns, so P P^T M = M; step 3 on: Q spans its rows, M Q Q^T = M.
    assert max(errors[1:]) < 1e-4, errors


def test_sign_packs_32_values_in_4_bytes_and_decodes_sign_times_mean_magnitude():
    codec = Sign()
    x = torch.randn(1, 4096, generator=torch.Generator().manual_seed(0))
    data = codec.encode(x, 1024)
    assert data.dtype == torch.uint8
    assert data.shape == (1, 4096 // 8 + 4 * 4)  # packed bits, then one fp32 scale per block
    back = codec.decode(data, 4096, 1024).reshape(4, 1024)
    blocks = x.reshape(4, 1024)
    expected = torch.where(blocks >= 0, 1.0, -1.0) * blocks.abs().mean(dim=1, keepdim=True)
    torch.testing.assert_close(back, expected)


@pytest.mark.parametrize("spec,levels", [("int8", 127), ("int4", 7)])
def test_block_quantisers_round_to_the_nearest_level(spec, levels):
    codec = make_codec(spec)
    x = torch.randn(2048, generator=torch.Generator().manual_seed(0))
    back = codec.roundtrip(x)
    scale = x.reshape(-1, 256).abs().amax(dim=1, keepdim=True) / levels
    assert ((back - x).reshape(-1, 256).abs() <= scale / 2 + 1e-6).all()
    assert codec.row_bytes(2048, 256) == 2048 * codec.bits // 8 + 4 * 8


@pytest.mark.parametrize("spec", ["int8", "int4", "sign"])
def test_block_quantisers_know_what_their_receiver_decodes_bitwise(spec):
    """The error feedback takes the decoded values from the quantiser's own integers, not from
    unpacking its bytes: they must be the receiver's, bit for bit (zeros' signs included), or
    the replicas' residuals would drift from what was sent."""
    codec = make_codec(spec)
    g = torch.Generator().manual_seed(1)
    block, chunk = codec.layout(3 * 4096 + 5, 3)
    x = torch.randn(3 * chunk, generator=g) * 10.0 ** torch.randint(-6, 3, (3 * chunk,), generator=g)
    x[:block] = 0.0  # a block of zeros: scale 0
    x[block : 2 * block] = -0.0
    x[-3] = -0.0
    x[2 * block + 5] = float("inf")  # a spoiled message (the norm check's to leave out): its
    x[3 * block + 7] = float("nan")  # blocks decode as they encode all the same
    rows = x.reshape(3, chunk)
    data, values = codec.encode_with_values(rows, block)
    assert torch.equal(data, codec.encode(rows, block))
    decoded = codec.decode(data, chunk, block)
    assert torch.equal(values.view(torch.int32), decoded.view(torch.int32))
    assert decoded[0, 2 * block + 5].isnan() or spec == "sign"  # inf / inf: no level, not -inf


def test_warmup_sends_the_first_messages_of_each_stream_uncompressed():
    codec = make_codec("sign:warmup=2")
    x = torch.randn(300, generator=torch.Generator().manual_seed(0))
    outs = []
    for key in ("a", "a", "a", "b"):
        out = [x.clone()]
        codec.reduce(Communicator(), key, out).wait()
        outs.append(out[0])
    assert torch.equal(outs[0], x) and torch.equal(outs[1], x) and torch.equal(outs[3], x)
    assert not torch.equal(outs[2], x)  # the third message of stream "a" is signs
    assert outs[2].unique().numel() <= 2


def _shared(codec) -> dict:
    """The codec's entries every worker holds equal, by stream (copies)."""
    from geotrain.compress.codec import shared_entries

    state = shared_entries(codec.state_dict())
    return {} if state is None else {k: {n: t.clone() for n, t in v.items()} for k, v in state["streams"]}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].keys() == b[k].keys() and all(torch.equal(a[k][n], b[k][n]) for n in a[k]) for k in a
    )


@pytest.mark.parametrize("spec", ["acpsgd:rank=2", "powersgd:rank=2", "int8:warmup=3"])
def test_a_failed_step_rolls_the_shared_entries_back_to_the_last_settled_one(spec):
    """Two survivors of one failure, cut short at different points of one step: one launched both
    of its messages and landed the first (a count, a turn advanced; a factor replaced), the
    other launched the first alone. Rolled back, both hold what the last complete step left,
    bitwise, and redo the step alike; a settled step is never undone."""
    x = [torch.randn(24, 40, generator=torch.Generator().manual_seed(s)) for s in range(2)]
    ahead, behind = make_codec(spec), make_codec(spec)
    for codec in (ahead, behind):  # two complete steps, settled
        for _ in range(2):
            for key in ("a", "b"):
                codec.reduce(Communicator(), key, [t.clone() for t in x]).wait()
            codec.settle()
    settled = _shared(ahead)
    assert settled and _same(settled, _shared(behind))
    first = ahead.reduce(Communicator(), "a", [t.clone() for t in x])
    ahead.reduce(Communicator(), "b", [t.clone() for t in x])  # launched, never landed
    first.wait()
    behind.reduce(Communicator(), "a", [t.clone() for t in x])
    assert not _same(_shared(ahead), settled)  # (the step changed them: the test can fail)
    for codec in (ahead, behind):
        codec.roll_back()
    assert _same(_shared(ahead), settled) and _same(_shared(behind), settled)
    # redone alike: the same turn or count after (the factors are means over a group: here, in
    # a world of one, each worker's own)
    for codec in (ahead, behind):
        codec.reduce(Communicator(), "a", [t.clone() for t in x]).wait()
        codec.settle()
    counts = [
        {k: v for k, v in _shared(c)["a"].items() if k in ("step", "messages")} for c in (ahead, behind)
    ]
    assert _same({"a": counts[0]}, {"a": counts[1]}) and (counts[0] or spec.startswith("powersgd"))
    after = _shared(ahead)
    ahead.roll_back()  # settled: nothing to undo
    assert _same(_shared(ahead), after)


def test_a_mean_landed_a_step_after_its_launch_is_rolled_back_with_the_step_it_lands_in():
    """DreamDDP's late messages: launched in one step (settled with its count), landed in the
    next; a failure of that next step puts back the factor the landing replaced."""
    codec = make_codec("acpsgd:rank=2")
    x = [torch.randn(24, 40, generator=torch.Generator().manual_seed(0))]
    codec.reduce(Communicator(), "a", [x[0].clone()]).wait()
    codec.settle()
    late = codec.reduce(Communicator(), "a", [x[0].clone()])
    codec.settle()  # the step it was launched in is complete
    launched = _shared(codec)
    late.wait()  # lands in the next step, which then fails
    assert not _same(_shared(codec), launched)
    codec.roll_back()
    assert _same(_shared(codec), launched)


def test_adatopk_gives_the_slowest_link_the_smallest_ratio_and_keeps_the_mean():
    codec = make_codec("adatopk:ratio=0.1")
    ratios = codec.ratios_for([100.0, 100.0, 100.0, 20.0])
    assert ratios[3] == min(ratios) and ratios[3] < 0.1 < ratios[0]
    assert sum(ratios) / 4 == pytest.approx(0.1)
    assert ratios[0] / ratios[3] == pytest.approx(5.0)


@pytest.mark.parametrize(
    "spec,needle",
    [
        ("zip", "accepted: fp16, bf16, int8, int4, sign, topk, adatopk, chunktopk, powersgd, acpsgd"),
        ("powersgd:rank=0", "rank must be an integer >= 1"),
        ("acpsgd:rank=0", "rank must be an integer >= 1"),
        ("topk:ratio=2.0", "ratio (fraction of values sent) must be in (0, 1]"),
        ("topk:ratio=abc", "is not a valid float"),
        ("int8:bogus=1", "unknown parameter 'bogus'; accepted: warmup, block"),
        ("sign:warmup=-1", "warmup (uncompressed messages first) must be an integer >= 0"),
        ("int8:block=12", "multiple of 8"),
        ("topk:0.1", "must look like key=value"),
    ],
)
def test_bad_codec_specs_say_what_is_accepted(spec, needle):
    with pytest.raises(ConfigError) as err:
        make_codec(spec)
    assert needle in str(err.value)


def test_algorithms_validate_compress_at_config_time():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="does not take --compress"):
        build_sync("nosync", model, opt, Communicator(), {"compress": "int8"})
    with pytest.raises(ConfigError, match="unknown codec"):
        build_sync("ssgd", model, opt, Communicator(), {"compress": "int9"})


# -- real gloo groups ------------------------------------------------------------------------------
SHAPES = [(48, 40), (40,), (7, 3)]  # a matrix worth compressing, a vector, a small matrix


def _inputs(rank: int, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _compressed_mean_worker(rank, world_size, spec, steps):
    codec = make_codec(spec)
    if spec.startswith("adatopk"):
        codec.link_speeds = [1.0 + r for r in range(world_size)]  # uneven links, no probe
    comm = Communicator()
    results, sent, estimates = [], [], []
    for step in range(steps):
        xs = _inputs(rank, step)
        before = comm.stats.sent_bytes
        if spec.startswith("acpsgd"):
            estimates.append(codec.wire_bytes(SHAPES, world_size, step=step))
        elif spec.startswith("adatopk"):
            estimates.append(codec.wire_bytes(SHAPES, world_size, codec.ratios_for(codec.link_speeds), rank))
        else:
            estimates.append(codec.wire_bytes(SHAPES, world_size))
        codec.reduce(comm, "k", xs).wait()
        sent.append(comm.stats.sent_bytes - before)
        results.append(xs)
    return {"results": results, "sent": sent, "estimates": estimates}


MEAN_SPECS = ["fp16", "bf16", "topk:ratio=0.1", "adatopk:ratio=0.1", "chunktopk:chunk=64,k=8"]
TWO_PHASE_SPECS = ["int8", "int4", "sign"]
SPECS_AT = {  # world size: every spec the tests below run there
    2: MEAN_SPECS + TWO_PHASE_SPECS,
    3: list(dict.fromkeys(TWO_PHASE_SPECS + ALL_SPECS)),
    4: MEAN_SPECS,
}


MEAN_RUNS = {
    n: Cases(_compressed_mean_worker, n, [(spec, 2) for spec in specs]) for n, specs in SPECS_AT.items()
}


def _decoded_input(spec: str, x: list[torch.Tensor], world_size: int) -> list[torch.Tensor]:
    """What the codec makes of one worker's first message, computed locally."""
    codec = make_codec(spec)
    out = [t.clone() for t in x]
    codec.reduce(Communicator(), "k", out).wait()
    return out


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("spec", MEAN_SPECS)
def test_compressed_mean_equals_mean_of_decompressed_inputs(world_size, spec):
    out = MEAN_RUNS[world_size].get(spec, 2)
    if spec.startswith("adatopk"):  # every worker keeps its own share of the values
        ratios = make_codec(spec).ratios_for([1.0 + r for r in range(world_size)])
        decoded = [
            _decoded_input(f"topk:ratio={ratios[r]}", _inputs(r, 0), world_size) for r in range(world_size)
        ]
    else:
        decoded = [_decoded_input(spec, _inputs(r, 0), world_size) for r in range(world_size)]
    expected = [torch.stack([d[i] for d in decoded]).mean(dim=0) for i in range(len(SHAPES))]
    tol = 2e-2 if spec in ("fp16", "bf16") else 1e-6  # the halves are summed in half precision
    for rank in range(world_size):
        for got, want in zip(out[rank]["results"][0], expected, strict=True):
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("spec", TWO_PHASE_SPECS)
def test_two_phase_quantised_mean_is_the_owner_requantised_mean_of_decoded_inputs(world_size, spec):
    out = MEAN_RUNS[world_size].get(spec, 2)
    codec = make_codec(spec)
    flats = [torch.cat([t.reshape(-1) for t in _inputs(r, 0)]) for r in range(world_size)]
    n = flats[0].numel()
    block, chunk = codec.layout(n, world_size)
    rows = []
    for f in flats:
        v = torch.zeros(world_size * chunk)
        v[:n] = f
        rows.append(codec.decode(codec.encode(v.reshape(world_size, chunk), block), chunk, block))
    mean = torch.stack(rows).mean(dim=0)  # (world, chunk): chunk j averaged by worker j
    expected = codec.decode(codec.encode(mean, block), chunk, block).reshape(-1)[:n]
    true_mean = torch.stack(flats).mean(dim=0)
    for rank in range(world_size):
        got = torch.cat([t.reshape(-1) for t in out[rank]["results"][0]])
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    if spec != "sign":  # and within half a level per quantisation (two) of the true mean
        levels = 127 if spec == "int8" else 7
        bound = torch.stack(flats).abs().max() / levels
        assert (got - true_mean).abs().max() <= bound + 1e-6


@pytest.mark.parametrize("spec", ["powersgd:rank=2", "acpsgd:rank=2"])
def test_low_rank_mean_is_exact_for_a_shared_low_rank_space(spec):
    """Workers whose matrices share column and row spaces (rank 2): the mean is reconstructed."""

    def inputs(rank):
        m = _rank_r(48, 40, 2, seed=7)
        return [m * (1 + rank), torch.full((40,), float(rank)), torch.ones(7, 3) * rank]

    out = run_workers(_lowrank_worker, 3, spec, timeout=90)
    expected = [torch.stack([inputs(r)[i] for r in range(3)]).mean(dim=0) for i in range(3)]
    for rank in range(3):
        for got, want in zip(out[rank], expected, strict=True):
            torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)


def _lowrank_worker(rank, world_size, spec):
    codec = make_codec(spec + ",error_feedback=false")
    comm = Communicator()
    m = _rank_r(48, 40, 2, seed=7)
    for _ in range(3):  # acpsgd (no error feedback) is exact from its second step
        xs = [m * (1 + rank), torch.full((40,), float(rank)), torch.ones(7, 3) * rank]
        codec.reduce(comm, "k", xs).wait()
    return xs


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_bytes_on_the_wire_match_the_codec_estimate(spec):
    world_size = 3
    out = MEAN_RUNS[world_size].get(spec, 2)
    raw = 2 * (world_size - 1) * 4 * sum(torch.Size(s).numel() for s in SHAPES) // world_size
    for rank in range(world_size):
        for sent, estimate in zip(out[rank]["sent"], out[rank]["estimates"], strict=True):
            assert abs(sent - estimate) <= 0.05 * estimate, (rank, sent, estimate)
            if not spec.startswith(("fp16", "bf16")):
                assert sent < raw / 2
        # Every worker got the same mean: replicas that apply it stay identical.
        torch.testing.assert_close(out[rank]["results"], out[0]["results"], atol=0, rtol=0)


def test_every_codec_is_covered():
    assert sorted(codec_names()) == sorted(s.split(":")[0] for s in ALL_SPECS)


# -- every algorithm with a codec, on 2 gloo workers ---------------------------------------------------
def _train_with_codec(rank, world_size, algo, codec, steps=4):
    from test_dreamddp_gloo import _batch, _model, _plan

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    comm = Communicator()
    options = {"H": 2, "replan_threshold": 0.0, "compress": codec}
    sync = build_sync(algo, model, opt, comm, options)
    if algo == "dreamddp":
        sync.set_plan(_plan(model, 2))
    synced_params = []
    start = comm.stats.sent_bytes  # after rank 0's broadcast of the initial parameters
    for step in range(steps):
        x, y = _batch(rank, step)
        sync.model(x, y)[1].backward()
        sync.before_step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sync.after_step():
            if algo == "dreamddp":  # the last averages, layer by layer
                synced_params.append([t.clone() for ts in sync._ref.values() for t in ts])
            else:
                synced_params.append([p.detach().clone() for p in model.parameters()])
    sync.close()
    return {"synced": synced_params, "sent": comm.stats.sent_bytes - start, "state": sync.state_dict()}


CODEC_CASES = [
    ("ssgd", "int8"),
    ("ssgd", "acpsgd:rank=2"),
    ("ssgd", "topk:ratio=0.05"),
    ("ddp", "powersgd:rank=2"),
    ("localsgd", "int4"),
    ("diloco", "sign"),
    ("diloco", "chunktopk:chunk=256,k=16"),
    ("dreamddp", "int8"),
]


PLAIN = [(algo, "") for algo in dict.fromkeys(a for a, _ in CODEC_CASES)]
CODEC_RUNS = Cases(_train_with_codec, 2, [*CODEC_CASES, *PLAIN, ("ssgd", "fp16")])


@pytest.mark.parametrize("algo,codec", CODEC_CASES)
def test_algorithms_with_a_codec_keep_replicas_identical_and_send_less(algo, codec):
    a, b = CODEC_RUNS.get(algo, codec)
    plain = CODEC_RUNS.get(algo, "")[0]
    assert len(a["synced"]) >= 2
    for pa, pb in zip(a["synced"], b["synced"], strict=True):
        for x, y in zip(pa, pb, strict=True):
            assert torch.equal(x, y)
    assert 0 < a["sent"] < plain["sent"] / 2, (a["sent"], plain["sent"])
    assert "codec" in a["state"] and a["state"]["codec"]["streams"]  # residuals are checkpointed


def test_ssgd_fp16_stays_close_to_uncompressed_ssgd():
    fp16 = CODEC_RUNS.get("ssgd", "fp16")[0]["synced"][-1]
    plain = CODEC_RUNS.get("ssgd", "")[0]["synced"][-1]
    for x, y in zip(fp16, plain, strict=True):
        torch.testing.assert_close(x, y, atol=1e-3, rtol=1e-3)


# -- PyTorch DDP with a codec: its buckets sent under backward ----------------------------------------
DDP_BUCKET_MB = 0.02  # GPT tiny in 8 buckets (DDP caps its first at this too)


def _ddp_with_codec(rank, world_size, spec, hook):
    """4 steps of ``ddp --compress spec``: through geotrain's hook (``hook`` "geotrain"), or
    through a hook of the test's that waits for each bucket's mean before it returns, the
    behaviour before means went out under backward (the reference: when a mean is launched and
    waited for changes no bit of it). Geotrain's records, at its last bucket, which of the
    means before it had their second collective launched."""
    from torch.nn.parallel import DistributedDataParallel

    from geotrain.sync.ddp import NO_INIT_SYNC
    from test_dreamddp_gloo import _batch, _model

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    comm = Communicator()
    advanced: list[list[bool]] = []
    if hook == "geotrain":
        sync = build_sync("ddp", model, opt, comm, {"compress": spec, "bucket_mb": DDP_BUCKET_MB})
        land = sync._land_codec_means

        def recording() -> None:
            advanced.append([mean.advanced for mean, _, _ in sync._in_flight])
            land()

        sync._land_codec_means = recording
        wrapped = sync.model
    else:
        codec = make_codec(spec)
        wrapped = DistributedDataParallel(
            model, process_group=comm.group, bucket_cap_mb=DDP_BUCKET_MB, find_unused_parameters=True,
            **NO_INIT_SYNC,
        )  # fmt: skip

        def blocking(_state, bucket):
            grads = bucket.gradients()
            key = ("ddp", bucket.index(), tuple(tuple(g.shape) for g in grads))
            codec.reduce(comm, key, grads).wait()
            future = torch.futures.Future()
            future.set_result(bucket.buffer())
            return future

        wrapped.register_comm_hook(None, blocking)
    for step in range(4):
        x, y = _batch(rank, step)
        wrapped(x, y)[1].backward()
        if hook == "geotrain":
            assert not sync._in_flight  # all landed by the last bucket's hook
            sync.before_step()
        opt.step()
        opt.zero_grad(set_to_none=True)
    buckets = len(sync.model.reducer._get_zeros_like_grad_buckets()) if hook == "geotrain" else 0
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "advanced": advanced,
        "buckets": buckets,
    }


DDP_CODECS = ["int8", "topk:ratio=0.05"]
DDP_RUNS = Cases(_ddp_with_codec, 2, [(s, hook) for s in DDP_CODECS for hook in ("geotrain", "blocking")])


@pytest.mark.parametrize("spec", DDP_CODECS)
def test_ddp_with_a_codec_sends_under_backward_and_averages_as_if_it_waited_for_each_bucket(spec):
    from geotrain.plan.cost import ADVANCE_DEPTH

    ours, reference = DDP_RUNS.get(spec, "geotrain"), DDP_RUNS.get(spec, "blocking")
    for rank in range(2):
        for x, y in zip(ours[rank]["params"], reference[rank]["params"], strict=True):
            assert torch.equal(x, y)
        for x, y in zip(ours[rank]["params"], ours[0]["params"], strict=True):
            assert torch.equal(x, y)  # one model on every worker
        # At the last bucket's hook, every mean but the last ADVANCE_DEPTH has gone on to its
        # second collective (int8's all-gather) under backward; a one-phase codec has none.
        steps = ours[rank]["advanced"]
        assert len(steps) == 4
        for flags in steps:
            assert len(flags) == ours[rank]["buckets"] >= ADVANCE_DEPTH + 2, (
                "a mean per bucket, enough to advance"
            )
            if spec == "int8":
                assert flags == [True] * (len(flags) - ADVANCE_DEPTH) + [False] * ADVANCE_DEPTH
            else:
                assert all(flags)
