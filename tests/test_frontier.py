"""SparseLoCo and DeMo, and the chunked top-k message they share.

Pure logic first (the codec, bit packing, the error-feedback invariant, the DCT against scipy,
config errors), then real gloo groups of 3 checked against the closed forms of SparseLoCo's outer
step and DeMo's step, then the CLI's refusals.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

import geotrain.plan.profile as profile_module
import geotrain.sync.sparseloco as sparseloco_module
from geotrain.comm.buckets import flatten
from geotrain.comm.communicator import Communicator
from geotrain.compress.chunked import ChunkTopK, index_bits, pack_bits, unpack_bits
from geotrain.models.gpt import GPT, gpt_config
from geotrain.plan.gather import choose_sparseloco_period
from geotrain.sync import ConfigError, build_sync, sync_config
from geotrain.sync.demo import BlockDCT, dct_matrix
from geotrain.sync.sparseloco import next_landing
from helpers import Cases, geotrain, refused, run_workers


# -- pure logic ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 7, 8, 12, 16])
@pytest.mark.parametrize("count", [1, 5, 8, 13, 64, 1001])
def test_pack_and_unpack_round_trip_every_width(bits, count):
    gen = torch.Generator().manual_seed(bits * 1000 + count)
    codes = torch.randint(0, 2**bits, (count,), generator=gen)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == -(-count * bits // 8)
    assert torch.equal(unpack_bits(packed, bits, count), codes)


@pytest.mark.parametrize("bits", [1, 2, 4, 8, 12])
@pytest.mark.parametrize("count", [1, 2, 3, 7, 64, 1001])
def test_packing_whole_codes_lays_out_the_bytes_bit_planes_do(bits, count):
    """The fast paths (widths dividing 8, and 12) write the stream the bit planes write: a
    message in flight in a snapshot, or from a worker of another version, decodes the same."""
    from geotrain.compress.chunked import _pack_bit_planes

    gen = torch.Generator().manual_seed(7 * bits + count)
    codes = torch.randint(0, 2**bits, (count,), generator=gen)
    codes[0] = 2**bits - 1  # every bit of a code set, where a cast could drop the high ones
    assert torch.equal(pack_bits(codes, bits), _pack_bit_planes(codes, bits))


def test_an_index_in_a_chunk_of_4096_takes_12_bits():
    assert [index_bits(c) for c in (2, 64, 4096, 4097)] == [1, 6, 12, 13]


@pytest.mark.parametrize("chunk,k,bits", [(64, 8, 2), (64, 64, 4), (4096, 128, 2), (100, 7, 8)])
def test_encode_sends_the_top_k_of_each_chunk_within_half_a_level(chunk, k, bits):
    codec = ChunkTopK(chunk=chunk, k=k, bits=bits)
    n = 3 * chunk + chunk // 2  # a last chunk that is padded
    v = torch.randn(n, generator=torch.Generator().manual_seed(chunk + k))
    payload, sent = codec.encode(v)
    assert payload.dtype == torch.uint8 and payload.numel() == codec.payload_bytes(n)
    assert torch.equal(codec.decode(payload, n), sent)  # the receivers decode what was kept out
    # sparse: the same payload, and the same values at the indices it names, with a work vector
    # for the magnitudes or without one
    for work in (None, torch.full((codec.chunks(n) * chunk,), 7.0)):
        same, idx, values = codec.encode_sparse(v, work=work)
        assert torch.equal(same, payload) and idx.shape == values.shape == (codec.chunks(n), k)
        assert torch.equal(torch.zeros(codec.chunks(n), chunk).scatter_(1, idx, values).reshape(-1)[:n], sent)
    padded = torch.zeros(codec.chunks(n) * chunk)
    padded[:n] = v
    for c, row in enumerate(padded.reshape(-1, chunk)):
        picked = set(row.abs().topk(k).indices.tolist())
        got = sent[c * chunk : (c + 1) * chunk]
        nonzero = set(torch.nonzero(got).flatten().tolist())
        assert nonzero <= picked and len(nonzero) == min(k, (c * chunk < n) * min(chunk, n - c * chunk))
        scale = row[list(picked)].abs().max()
        level = scale / (2**bits - 1)  # levels are 2*scale/(2^bits - 1) apart
        err = (got[list(nonzero)] - row[list(nonzero)]).abs()
        assert err.max() <= level * (1 + 1e-5)


def test_the_default_message_is_72_times_smaller_than_fp32():
    codec = ChunkTopK(chunk=4096, k=128, bits=2)
    n = 4096 * 10
    assert codec.payload_bytes(n) == 10 * 4 + 10 * 128 * 2 // 8 + 10 * 128 * 12 // 8
    assert 4 * n / codec.payload_bytes(n) > 71


def _tiny_sync(options: dict, comm: Communicator | None = None, seed: int = 0, algo: str = "sparseloco"):
    torch.manual_seed(seed)
    model = GPT(gpt_config("tiny", 256, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, build_sync(algo, model, opt, comm or Communicator(), options)


def test_error_feedback_buffer_before_is_sent_plus_buffer_after():
    _, _, sync = _tiny_sync({"H": 1, "chunk": 256, "k": 8, "overlap": False, "beta": 0.9})
    gen = torch.Generator().manual_seed(3)
    real = sync.layout.mask  # chunks per tensor: the padding is zero in every vector
    sync._error = torch.randn(sync.n, generator=gen) * real
    for _ in range(3):
        delta = torch.randn(sync.n, generator=gen) * real
        before = sync._error * 0.9 + delta
        payload, _, after = sync._message(delta)
        sent = sync.chunker.decode(payload, sync.n)
        untouched = sent == 0
        assert torch.equal(after[untouched], before[untouched])  # what was not sent stays, exactly
        # taken out at the entries sent alone, as the dense subtraction would (padding kept)
        assert torch.equal(after[real], (before - sent)[real])
        torch.testing.assert_close(sent + after, before, atol=1e-6, rtol=0)
        assert (sent != 0).sum() == sync.chunker.chunks(sync.n) * 8
        assert not after[~real].any()
        sync._error = after


def test_padding_picked_by_a_chunk_with_fewer_than_k_entries_never_reaches_the_model():
    """A LayerNorm's 64 gains in a chunk of 256 with k=128: top-k picks padding too, and a picked
    zero codes to +-scale/3. None of it may stay in the error buffer, the start point (overlap)
    or the anchor; left there it grew by alpha every outer step until the model blew up."""
    model, opt, sync = _tiny_sync({"H": 1, "chunk": 256, "k": 128, "alpha": 2.0})
    pad = ~sync.layout.mask
    for step in range(8):
        x, y = _batch(0, step)
        sync.model(x, y)[1].backward()
        sync.before_step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync.after_step()
        for v in (sync._anchor, sync._error, sync._start):
            assert not v[pad].any()
    sync.finalize()
    sync.close()
    assert all(p.detach().abs().max() < 10 for p in model.parameters())


def test_chunks_are_cut_per_tensor_and_no_chunk_spans_two():
    """Each parameter is padded to whole chunks, so a chunk's k entries come from one tensor;
    the model's parameters go in and come out unchanged."""
    model, _, sync = _tiny_sync({"H": 1, "chunk": 256, "k": 8})
    sizes = [p.numel() for p in model.parameters()]
    assert sync.n == sum(-(-n // 256) * 256 for n in sizes) > sum(sizes)
    flat = sync._local()
    offset = 0
    for p, n in zip(model.parameters(), sizes, strict=True):
        assert offset % 256 == 0 and torch.equal(flat[offset : offset + n], p.detach().reshape(-1))
        assert not flat[offset + n : offset + -(-n // 256) * 256].any()
        offset += -(-n // 256) * 256
    before = [p.detach().clone() for p in model.parameters()]
    sync._set_params(flat)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    # The slice copies agree with the mask: in and out of the layout, and into a used work vector
    layout, real = sync.layout, torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    back = [torch.empty_like(p) for p in model.parameters()]
    layout.copy_into(flat, back)
    assert torch.equal(flat[layout.mask], real)
    assert torch.equal(torch.cat([b.reshape(-1) for b in back]), real)
    assert torch.equal(layout.padded_from_real(real), flat)
    assert torch.equal(layout.flatten(list(model.parameters()), out=torch.full((sync.n,), 7.0)), flat)
    ones = torch.ones(sync.n)
    layout.zero_padding(ones)
    assert torch.equal(ones, layout.mask.float())


def test_a_mean_summed_into_a_used_work_vector_is_the_same_mean():
    codec = ChunkTopK(chunk=256, k=16, bits=2)
    gen = torch.Generator().manual_seed(5)
    n = 256 * 6
    payloads = torch.stack([codec.encode(torch.randn(n, generator=gen))[0] for _ in range(3)])
    for per_sender in (False, True):
        fresh = codec.mean_of(payloads, n, per_sender=per_sender)
        reused = codec.mean_of(payloads, n, per_sender=per_sender, out=torch.full((n,), 7.0))
        assert torch.equal(fresh, reused)


@pytest.mark.parametrize(
    "options,needle",
    [
        ({"k": 5000}, "--k (values sent per chunk) must be an integer in [1, --chunk=4096]"),
        ({"bits": 3}, "--bits (per value sent) must be one of 2, 4, 8"),
        ({"beta": 1.0}, "--beta (error-feedback decay) must be in [0, 1)"),
        ({"H": 0}, "H (inner steps between outer steps) must be an integer >= 1"),
        ({"alpha": -1}, "--alpha (outer learning rate) must be > 0"),
        ({"H": "auto", "tau": 41}, "must be an integer in [1, H=auto (at most 40)]"),
    ],
)
def test_bad_options_say_what_to_change(options, needle):
    with pytest.raises(ConfigError, match=r".*") as err:
        sync_config("sparseloco", options)
    assert needle in str(err.value)


def test_a_chunk_larger_than_the_model_is_refused():
    with pytest.raises(ConfigError, match="larger than the whole model"):
        _tiny_sync({"chunk": 2**24, "k": 4})


def test_the_dct_is_scipys_orthonormal_dct_ii_per_block():
    scipy_fft = pytest.importorskip("scipy.fft")
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(5))
    want = scipy_fft.dct(x.double().numpy(), norm="ortho", axis=-1)
    torch.testing.assert_close(x @ dct_matrix(64).T, torch.from_numpy(want).float(), atol=1e-5, rtol=1e-5)
    t = BlockDCT((128, 192), 64)
    w = torch.randn(128, 192, generator=torch.Generator().manual_seed(6))
    coeffs = t.encode(w).reshape(2, 3, 64, 64)  # block (row 1, column 2) of 2 x 3
    block = scipy_fft.dctn(w[64:, 128:].double().numpy(), norm="ortho")
    torch.testing.assert_close(coeffs[1, 2], torch.from_numpy(block).float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(t.decode(t.encode(w)), w, atol=1e-5, rtol=1e-5)
    v = BlockDCT((384,), 64)  # 1-d: blocks of 64 along the length
    assert (v.b1, v.b2) == (1, 64)
    torch.testing.assert_close(v.decode(v.encode(w[0, : 384 - 192].repeat(2))), w[0, :192].repeat(2))


def test_a_demo_message_is_under_1_percent_of_the_model():
    torch.manual_seed(0)
    model = GPT(gpt_config("mini", 256))
    opt = torch.optim.AdamW(model.parameters())
    sync = build_sync("demo", model, opt, Communicator(), {})
    n = sum(p.numel() for p in model.parameters())
    assert sync.message_bytes() < 0.01 * 4 * n


# -- real gloo groups ---------------------------------------------------------------------------
def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    xy = torch.randint(0, 256, (2, 17), generator=g)
    return xy[:, :-1], xy[:, 1:]


def _outer_steps(rank, world_size, overlap: bool, steps: int = 6):
    """Train ``steps`` steps (H=2); at each outer step record what the closed form needs."""
    comm = Communicator()
    options = {"H": 2, "chunk": 256, "k": 16, "bits": 2, "beta": 0.9, "alpha": 1.5, "overlap": overlap}
    model, opt, sync = _tiny_sync(options, comm, seed=0)
    records = []
    for step in range(steps):
        x, y = _batch(rank, step)
        sync.model(x, y)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        before = {"anchor": sync._anchor.clone(), "local": sync._local(), "error": sync._error.clone()}
        if sync.after_step():
            records.append({**before, "params": sync._local(), "anchor_after": sync._anchor.clone()})
    sync.finalize()
    sync.close()
    return {"records": records, "final": flatten(list(model.parameters())).detach(), "sent": comm.stats}


def _demo_steps(rank, world_size, overlap: bool, steps: int = 3):
    """DeMo steps with plain SGD (lr 0.01, weight decay 0.1); what the closed form needs."""
    comm = Communicator()
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", 256, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, weight_decay=0.1)
    options = {"chunk": 16, "k": 8, "bits": 8, "beta": 0.9, "overlap": overlap}
    sync = build_sync("demo", model, opt, comm, options)
    records = []
    for step in range(steps):
        x, y = _batch(rank, step)
        sync.model(x, y)[1].backward()
        before = {
            "params": [p.detach().clone() for p in model.parameters()],
            "grads": [p.grad.clone() for p in model.parameters()],
            "momentum": [m.clone() for m in sync._momentum],
        }
        sync.before_step()
        opt.step()  # skips every parameter: DeMo took the step
        opt.zero_grad(set_to_none=True)
        sync.after_step()
        after = {"params": [p.detach().clone() for p in model.parameters()], "momentum": sync._momentum}
        records.append({"before": before, "after": after})
    sync.finalize()  # with overlap: the last step's update lands
    final = [p.detach().clone() for p in model.parameters()]
    return {
        "records": records,
        "final": final,
        "sent": comm.stats.sent_bytes,
        "message": sync.message_bytes(),
    }


def _different_seeds(rank, world_size):
    """Workers whose models differ get rank 0's; equal ones compare 8 bytes and move nothing.
    PyTorch DDP too: its constructor's own broadcast of every parameter is turned off."""
    import torch.distributed as dist

    coalesced = []  # DDP's constructor broadcasts through this when it syncs the module itself
    original = dist._broadcast_coalesced
    dist._broadcast_coalesced = lambda *a, **k: coalesced.append(1) or original(*a, **k)
    out = {}
    for algo in ("sparseloco", "ddp"):
        for name, seed in (("equal", 0), ("differ", rank)):
            model, _, sync = _tiny_sync({"H": 2} if algo == "sparseloco" else {}, Communicator(), seed, algo)
            params = flatten(list(model.parameters())).detach()
            out[f"{algo}/{name}"] = (sync.startup_broadcast_bytes, params, len(coalesced))
            sync.close()
    return out


RUNS = Cases(_outer_steps, 3, [(False,), (True,)])
DEMO = Cases(_demo_steps, 3, [(False,), (True,)])


@pytest.mark.parametrize("overlap", [False, True])
def test_a_demo_step_is_signed_sgd_on_the_decoded_mean_and_replicas_stay_equal(overlap):
    """Without overlap step t's update is the sign of the mean of step t's messages; with it, of
    step t-1's (its gather ran under step t's compute), and ``finalize`` lands the last one."""
    ranks = DEMO.get(overlap)
    torch.manual_seed(0)
    shapes = [tuple(p.shape) for p in GPT(gpt_config("tiny", 256, 16)).parameters()]
    transforms = [BlockDCT(s, 16) for s in shapes]
    codecs = [ChunkTopK(chunk=t.block, k=min(8, t.block), bits=8) for t in transforms]

    def landed(before: torch.Tensor, sents: list[torch.Tensor], t: BlockDCT) -> torch.Tensor:
        return before * (1 - 0.01 * 0.1) - 0.01 * t.decode(torch.stack(sents).mean(dim=0)).sign()

    previous = None  # each parameter's messages of the step before
    for step in range(3):
        recs = [r["records"][step] for r in ranks]
        messages = []
        for i, (t, c) in enumerate(zip(transforms, codecs, strict=True)):
            n = recs[0]["before"]["params"][i].numel()
            sents = []
            for rec in recs:
                m = rec["before"]["momentum"][i] * 0.9 + rec["before"]["grads"][i]
                sent = c.decode(c.encode(t.encode(m))[0], n)
                sents.append(sent)
                # The momentum keeps what was not sent, in the DCT's basis.
                torch.testing.assert_close(
                    rec["after"]["momentum"][i], m - t.decode(sent), atol=1e-6, rtol=1e-5
                )
            messages.append(sents)
            p0 = recs[0]["before"]["params"][i]
            if not overlap:
                want = landed(p0, sents, t)
            else:  # step 0 lands nothing; step t lands step t-1's messages
                want = p0 if previous is None else landed(p0, previous[i], t)
            for rec in recs:
                assert torch.equal(rec["after"]["params"][i], recs[0]["after"]["params"][i])  # bitwise
                torch.testing.assert_close(rec["after"]["params"][i], want, atol=1e-6, rtol=1e-6)
        previous = messages
    for i, t in enumerate(transforms):
        last = ranks[0]["records"][-1]["after"]["params"][i]
        want = landed(last, previous[i], t) if overlap else last
        for r in ranks:
            torch.testing.assert_close(r["final"][i], want, atol=1e-6, rtol=1e-6)
            assert torch.equal(r["final"][i], ranks[0]["final"][i])
    # One all-gather of the packed message per step: (N-1) copies of it leave each worker.
    assert ranks[0]["sent"] == 3 * 2 * ranks[0]["message"]


# overlapped: after each step a message of the worker's own is in flight (sparseloco at H=1)
IN_FLIGHT_OPTIONS = {
    "sparseloco": {"H": 1, "chunk": 256, "k": 16, "overlap": True},
    "demo": {"chunk": 16, "k": 8, "overlap": True},
}


def _one_step_in_flight(algo: str, step: int):
    """A world of one after one step of ``algo`` (on batch ``step``), its message in flight."""
    model, opt, sync = _tiny_sync(IN_FLIGHT_OPTIONS[algo], Communicator(), seed=0, algo=algo)
    x, y = _batch(0, step)
    sync.model(x, y)[1].backward()
    sync.before_step()  # DeMo's momentum takes the gradient here
    opt.step()
    sync.after_step()  # sparseloco: the outer step at H=1 launches its gather
    return model, opt, sync


@pytest.mark.parametrize("algo", ["sparseloco", "demo"])
def test_a_worker_that_adopts_anothers_state_takes_part_in_its_gather_in_flight_with_nothing(algo):
    """A joiner (or a survivor behind) loads a member's state while that member's message is in
    flight (overlap). The members gather their messages again on the new group: the adopter must
    take part with a message of the same size that decodes to zero, or one period's gather would
    pair with another's; and it starts with no residual of its own."""
    options = IN_FLIGHT_OPTIONS[algo]
    member, _, member_sync = _one_step_in_flight(algo, step=0)
    assert member_sync.in_flight.flying
    state = member_sync.state_dict()
    joiner, _, joiner_sync = _tiny_sync(options, Communicator(), seed=1, algo=algo)
    joiner.load_state_dict(member.state_dict())
    joiner_sync.load_state_dict(state)
    joiner_sync.adopted_state()
    member_sync.rebind()  # the regroup: the member's message is to be gathered again
    mine, theirs = joiner_sync.in_flight.saved(), member_sync.in_flight.saved()
    assert theirs is not None and mine is not None and mine.shape == theirs.shape
    assert not mine.any() and theirs.any()
    codec = joiner_sync.chunker if algo == "sparseloco" else None
    if codec is not None:
        assert not codec.decode(mine, joiner_sync.n).any() and not joiner_sync._error.any()
    else:
        assert all(not m.any() for m in joiner_sync._momentum)
    member_sync.close()


@pytest.mark.parametrize("algo, key", [("sparseloco", "error"), ("demo", "momentum")])
def test_a_workers_own_buffer_is_in_its_snapshots_and_never_in_a_hand_over(algo, key):
    """SparseLoCo's error feedback and DeMo's momentum are each worker's own: an adopter zeroes
    what it loads (``adopted_state``), so the state handed over leaves them out (a third of
    SparseLoCo's), while a snapshot holds them and a resume restores them exactly. A snapshot
    made when they sat with the shared state loads too."""
    from geotrain.ft.state import capture, restore

    options = IN_FLIGHT_OPTIONS[algo]
    model, opt, sync = _one_step_in_flight(algo, step=1)
    mine = [t.clone() for t in ([sync._error] if algo == "sparseloco" else sync._momentum)]
    assert any(t.any() for t in mine)
    state = capture(
        step=1, model=model, optimizer=opt, sync=sync, generators={}, progress={}, replicated=set(), copy=True
    )  # fmt: skip
    assert key not in state["parts"]["sync"] and key in state["parts"]["own"]
    for old_style in (False, True):
        if old_style:  # where snapshots held it before: with the shared state
            state["parts"]["sync"][key] = state["parts"]["own"].pop(key)
        other_model, other_opt, other = _tiny_sync(options, Communicator(), seed=1, algo=algo)
        restore(state, model=other_model, optimizer=other_opt, sync=other, generators={})
        got = [other._error] if algo == "sparseloco" else other._momentum
        assert all(torch.equal(a, b) for a, b in zip(got, mine, strict=True))
        other.close()
    sync.close()


def test_an_outer_step_is_the_closed_form_and_leaves_identical_replicas():
    ranks = RUNS.get(False)
    codec = ChunkTopK(chunk=256, k=16, bits=2)
    for i in range(3):
        recs = [r["records"][i] for r in ranks]
        sents = []
        for rec in recs:
            e = rec["error"] * 0.9 + (rec["anchor"] - rec["local"])
            sents.append(codec.decode(codec.encode(e)[0], e.numel()))
        # Without overlap each entry is the mean over the workers that sent it (mean_over auto):
        # a picked entry decodes to +-scale or +-scale/3, never 0 here, so nonzero marks a sender.
        stacked = torch.stack(sents)
        per_sender = stacked.sum(dim=0) / (stacked != 0).sum(dim=0).clamp(min=1)
        expected = recs[0]["anchor"] - 1.5 * per_sender
        for rec in recs:
            torch.testing.assert_close(rec["params"], expected, atol=1e-6, rtol=1e-6)
            assert torch.equal(rec["params"], recs[0]["params"])  # bitwise, on every replica
    for r in ranks:
        assert torch.equal(r["final"], ranks[0]["final"])


def test_overlap_lands_each_mean_one_period_late_eagerly_and_ends_with_one_model():
    ranks = RUNS.get(True)
    codec = ChunkTopK(chunk=256, k=16, bits=2)
    records = [r["records"] for r in ranks]

    def message(rec: list[dict], j: int) -> torch.Tensor:  # q_j of one replica, decoded
        start = rec[j - 1]["params"] if j else rec[0]["anchor"]  # where the period started
        e = rec[j]["error"] * 0.9 + (start - rec[j]["local"])
        return codec.decode(codec.encode(e)[0], e.numel())

    anchor = records[0][0]["anchor"]
    for i in range(3):
        if i:  # sync i lands the mean of sync i-1's messages, gathered during the period
            anchor = anchor - 1.5 * torch.stack([message(rec, i - 1) for rec in records]).mean(dim=0)
        for rec in records:
            torch.testing.assert_close(rec[i]["anchor_after"], anchor, atol=1e-6, rtol=1e-6)
            assert torch.equal(rec[i]["anchor_after"], records[0][i]["anchor_after"])  # bitwise
            # ... and goes on from the anchor minus its own message (eager).
            torch.testing.assert_close(rec[i]["params"], anchor - 1.5 * message(rec, i), atol=1e-6, rtol=1e-6)
    finals = [r["final"] for r in ranks]
    assert all(torch.equal(f, finals[0]) for f in finals)


def test_only_differing_replicas_are_broadcast_at_start_up():
    from helpers import run_workers

    out = run_workers(_different_seeds, 2, timeout=120)
    for algo in ("sparseloco", "ddp"):
        assert [o[f"{algo}/equal"][0] for o in out] == [0, 0]
        assert all(o[f"{algo}/differ"][0] > 0 for o in out)
        assert torch.equal(out[0][f"{algo}/differ"][1], out[1][f"{algo}/differ"][1])
    assert [o["ddp/differ"][2] for o in out] == [0, 0]  # DDP's own broadcast never ran


# -- the CLI ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "algo,flags,needle",
    [
        ("sparseloco", ["--k", "5000"], "--chunk=4096"),
        ("sparseloco", ["--bits", "3"], "--bits"),
        ("sparseloco", ["--H", "20", "--tau", "21"], "--tau (steps after an outer step"),
        ("sparseloco", ["--tau", "3", "--no-overlap"], "drop one of them"),
        ("sparseloco", ["--H", "auto", "--tau", "41"], "H=auto (at most 40)"),
        # with --lora only the adapters are chunked (1,024 values on tiny), counted on the meta device
        ("sparseloco", ["--model", "tiny", "--lora", "r=2,alpha=4,targets=c_attn"], "(1024 trained values)"),
        ("demo", ["--beta", "1"], "--beta (momentum decay)"),
        ("demo", ["--compress", "int8"], "demo does not take --compress"),
    ],
)
def test_the_cli_refuses_bad_options_in_one_line_before_starting(tmp_path, algo, flags, needle):
    run_dir = tmp_path / "run"
    cmd = ["run", "--workers", "2", "--no-netem", "--algo", algo, *flags, "--run-dir", str(run_dir)]
    assert needle in refused(cmd)
    assert not run_dir.exists()


@pytest.mark.timeout(300)
def test_the_cli_runs_h_auto_at_the_period_it_measured_and_says_so(tmp_path):
    run_dir = tmp_path / "run"
    proc = geotrain(
        ["run", "--workers", "2", "--no-netem", "--model", "tiny", "--steps", "12", "--algo", "sparseloco",
         "--H", "auto", "--run-dir", str(run_dir), "--no-progress"]
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    (chosen,) = [row["H"] for row in summary["period_choice"] if row["H"] == int(summary["periods"][2:])]
    assert f"geotrain: sparseloco --H auto: H={chosen}" in proc.stderr
    assert summary["algo_config"].startswith(f"H=auto (measured: {chosen}) ")
    assert summary["syncs"] == 12 // chosen


# -- the planner's terms ------------------------------------------------------------------------
def test_the_gather_stops_beating_an_int4_all_reduce_past_2m_over_p_workers():
    from geotrain.plan.gather import allreduce_bytes, crossover_workers, gather_bytes, gather_warning

    for payload, message in [(606_480, 5_616_000), (100, 1_000), (1, 10**6)]:
        n = crossover_workers(payload, message)
        assert gather_bytes(payload, n) > allreduce_bytes(message, n)
        assert gather_bytes(payload, n - 1) <= allreduce_bytes(message, n - 1) or n == 2
        assert n - 1 <= 2 * message / payload <= n
    assert gather_warning(606_480, 10_893_312, 4) == ""
    assert "below 19 workers" in gather_warning(606_480, 10_893_312, 19)


def test_an_emulated_rate_stands_for_a_faster_link_on_an_h100():
    from geotrain.plan.gather import Accelerator, speed_factor, stands_for_bps

    # 6 * 0.5M tokens / (989 TFLOP/s * 0.4) = 7.58 ns per parameter per step on an H100.
    h100 = Accelerator()
    assert abs(h100.seconds_per_param_step() - 7.583e-9) < 1e-11
    factor = speed_factor(2.0, 10_000_000, h100)  # a 10M model stepping in 2 s here
    assert abs(factor - 2e-7 / 7.583e-9) < 0.01
    assert abs(stands_for_bps(350e3, 2.0, 10_000_000) - 350e3 * factor) < 1.0
    with pytest.raises(ValueError, match="--accel-mfu"):
        Accelerator(mfu=1.5)


def test_demo_takes_a_one_value_tensor():
    """A one-output layer's bias is one value: one DCT block of one coefficient, which a chunk
    of 2 holds (a chunk of 1 was refused, so DeMo could not train such a model at all)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = build_sync("demo", model, opt, Communicator(), {"chunk": 4, "k": 2})
    before = model.bias.detach().clone()
    (model(torch.ones(3, 4)) - 5).pow(2).mean().backward()
    sync.before_step()
    opt.step()
    sync.after_step()
    assert model.bias.item() > before.item()  # the sign of its gradient moved it toward 5
    # A 1-d tensor of 67 values (prime, above --chunk 4) is 67 blocks of one coefficient: all sent.
    wide = torch.nn.Linear(4, 67)
    wide_sync = build_sync(
        "demo", wide, torch.optim.SGD(wide.parameters(), lr=0.1), Communicator(), {"chunk": 4, "k": 8}
    )
    (bias_codec,) = [c for c, p in zip(wide_sync._codecs, wide_sync._params, strict=True) if p.dim() == 1]
    assert (bias_codec.chunk, bias_codec.k) == (2, 2)


def test_the_mean_over_senders_divides_each_entry_by_the_workers_that_sent_it():
    """Two workers, chunks of 8, k=2: worker 0 sends entries 1 and 3, worker 1 entries 3 and 6.
    Over every worker (``workers``) an entry one of them sent is halved; over its senders (the
    SparseLoCo reference's scatter_reduce mean) it moves by the value sent. A clipped worker's
    weight stays on its values and it still counts as one sender."""
    codec = ChunkTopK(chunk=8, k=2, bits=8)
    a = torch.tensor([0.0, 4.0, 0.0, 2.0, 0.0, 0.0, 0.0, 0.0])
    b = torch.tensor([0.0, 0.0, 0.0, 6.0, 0.0, 0.0, -8.0, 0.0])
    (pa, da), (pb, db) = codec.encode(a), codec.encode(b)
    gathered = torch.stack([pa, pb])
    torch.testing.assert_close(codec.mean_of(gathered, 8), (da + db) / 2)
    want = da + db
    want[3] = (da[3] + db[3]) / 2  # the one entry both sent
    torch.testing.assert_close(codec.mean_of(gathered, 8, per_sender=True), want)
    clipped = codec.mean_of(gathered, 8, weights=[1.0, 0.5], per_sender=True)
    torch.testing.assert_close(clipped[6], 0.5 * db[6])  # one sender, scaled, not divided
    torch.testing.assert_close(clipped[3], (da[3] + 0.5 * db[3]) / 2)
    dropped = codec.mean_of(gathered, 8, weights=[0.0, 1.0], per_sender=True)
    torch.testing.assert_close(dropped, db)  # a worker left out counts nowhere
    # --mean-over auto: the reference's mean without overlap, every worker's with it
    config = sync_config("sparseloco", {})
    assert config.per_sender(False) and not config.per_sender(True)
    assert sync_config("sparseloco", {"mean_over": "senders"}).per_sender(True)
    assert not sync_config("sparseloco", {"mean_over": "workers"}).per_sender(False)
    # and the outer learning rate measured best with each (unless given)
    assert config.outer_lr(False) == 1.0 and config.outer_lr(True) == 2.0
    assert sync_config("sparseloco", {"alpha": 1.5}).outer_lr(True) == 1.5


class _ClockedGather(Communicator):
    """A world of one on a clock of the test's, whose gathers complete ``gather_s`` after their
    launch on that clock: polled before, they have not; waited for, the clock moves to then."""

    def __init__(self, gather_s: float) -> None:
        super().__init__()
        self.now, self.gather_s = 0.0, gather_s
        self.sizes: list[int] = []  # each gather's message, in bytes

    def clock(self) -> float:
        return self.now

    def all_gather(self, tensor, async_op=False):
        self.sizes.append(tensor.numel())
        handle = super().all_gather(tensor, async_op=True)
        due, landed = self.now + self.gather_s, handle.wait

        def wait():
            self.now = max(self.now, due)
            return landed()

        handle.is_completed = lambda: self.now >= due
        handle.wait = wait
        return handle if async_op else handle.wait()


def _clocked(config: dict, comm: _ClockedGather):
    """A world of one whose steps and gathers run on the test's clock (``comm``'s)."""
    _, opt, sync = _tiny_sync(config, comm)
    sync.clock = comm.clock
    sync._restart_timing()
    return opt, sync


@pytest.mark.parametrize(
    "gather_s, overlap, landing",
    [(0.04, False, 10), (0.4, False, 10), (0.6, True, 1), (4.0, True, 6), (30.0, True, 10)],
)
def test_overlap_auto_overlaps_from_the_second_outer_step_where_the_first_gather_says_it_pays(
    gather_s, overlap, landing
):
    """H=10 steps of 1 s each (one of them 20 s: a validation, which the median ignores): the
    first outer step runs synchronously, then the verdict holds for the run and its snapshots
    (overlapped where 1 + what outlasts the period, times 1 + min(0.4 L / 10, 0.24), is below 1 +
    the gather's share: 4% is a tie with landing 1, so synchronous; 6% overlaps), with the step
    its gathers land at (1.5 times the gather's steps: 0.9 -> 1, 6 -> 6, 45 -> H)
    and the mean and alpha that go with it (over senders, alpha 1, landing in the period's first
    half; over workers, alpha 2, after it)."""
    comm = _ClockedGather(gather_s)
    model, opt, sync = _tiny_sync({"H": 10, "chunk": 256, "k": 8}, comm)
    sync.clock = comm.clock
    assert sync.overlap is None and sync.alpha == 1.0 and not sync.measures_noise
    undecided = {"alpha": 1.0, "overlap": "auto (undecided)", "mean_over": "senders"}
    assert sync.resolved_options() == undecided  # the summary's, over the config's alpha=0.0
    # A worker that timed no step (one that adopted another's state for this sync) has no say,
    # and where none has, no verdict is taken: the next outer step is timed instead.
    verdict = sync._verdict(5.0)
    assert verdict[2] == -1.0
    sync._decide(*verdict)
    assert sync.overlap is None and sync.decision == ""
    sync._restart_timing()  # on the test's clock
    for step in range(1, 21):
        comm.now += 20.0 if step == 4 else 1.0
        x, y = _batch(0, step)
        sync.model(x, y)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        synced = sync.after_step()
        if step == 10:  # the first: synchronous, every replica on the anchor
            assert synced and torch.equal(sync._local(), sync._anchor) and not sync.in_flight.flying
            assert sync.overlap is overlap and f"--overlap auto: {'on' if overlap else 'off'}" in sync.info()
            assert f"{100 * gather_s / 10:.1f}%" in sync.decision
    assert sync.in_flight.flying is overlap  # the second outer step, at 20, overlapped or not
    assert sync.landing == landing
    late = overlap and 2 * landing >= 10
    assert sync.alpha == (2.0 if late else 1.0)
    options = {
        "alpha": 2.0 if late else 1.0,
        "overlap": f"auto ({'on' if overlap else 'off'})",
        "mean_over": "workers" if late else "senders",
    }
    if overlap:
        options["tau"] = landing
        assert f"landing {landing} of 10 steps later" in sync.decision
    assert sync.resolved_options() == options
    state = sync.state_dict()
    assert state["overlap"] is overlap and state["landing"] == landing
    _, _, again = _tiny_sync({"H": 10, "chunk": 256, "k": 8})
    again.load_state_dict(state)
    assert again.overlap is overlap and again.landing == landing
    del state["overlap"], state["landing"]  # saved before --overlap auto: on, a period late
    again.load_state_dict(state)
    assert again.overlap is True and again.landing == 10 and again.alpha == 2.0
    sync.close()
    again.close()


@pytest.mark.parametrize(
    "gather_s, chosen",
    [
        (0.0, 5),  # nothing to wait for: the shortest period learns most per token
        (0.2, 5),  # 4% of a period of 5 one-second steps: synchronous (landing 1 late costs 8%)
        (3.0, 5),  # overlapped, hidden under 5 steps and landing a period late: 1.1 x 1.24
        (12.0, 20),  # H=10 waits 2 s a period (1.2 x 1.2 x 1.24); H=20 hidden: 1.4 x 1.24
        # H=20 waits 30 s a period: 2.5 x 1.4 x 1.24; H=40 10 s: 1.25 x 1.8 x 1.24. At H=5 and 10
        # overlap hides a period of 5 or 10 s and costs 24% more steps: synchronous there
        (50.0, 40),
    ],
)
def test_h_auto_takes_the_period_with_the_shortest_predicted_time_to_a_loss(gather_s, chosen):
    """Closed form, one-second steps, 0.02 more steps to a loss per step of period: time to a
    loss is (1 + 0.02 H) x the predicted step (the gather every H steps) and, overlapped, x (1 +
    min(0.4 L / H, 0.24)) for a mean landing L = ceil(1.5 x the gather's steps) of the H steps
    late; each period overlaps where that product is below the synchronous one."""
    H, table = choose_sparseloco_period(1.0, gather_s, penalty=0.02)
    assert chosen == H
    for row in table:
        h = row["H"]
        landing = min(h, max(1, math.ceil(1.5 * gather_s)))
        late = 1 + min(0.4 * landing / h, 0.24)
        hidden = (1.0 + max(0.0, gather_s - h) / h) * late
        overlap = hidden < 1.0 + gather_s / h
        exposed = max(0.0, gather_s - h) if overlap else gather_s
        assert row["overlap"] is overlap and row["landing"] == (landing if overlap else h)
        assert row["predicted_step_s"] == pytest.approx(1.0 + exposed / h)
        steps = (1 + 0.02 * h) * (late if overlap else 1.0)
        assert row["time_to_loss_factor"] == pytest.approx(steps * (1.0 + exposed / h))
    assert [row["H"] for row in table] == [5, 10, 20, 40]
    assert [row["overlap"] for row in table] == {
        0.0: [False] * 4,
        0.2: [False] * 4,
        3.0: [True] * 4,
        12.0: [True] * 4,
        50.0: [False, False, True, True],
    }[gather_s]
    assert choose_sparseloco_period(1.0, 0.0, penalty=0.0)[0] == 5  # a tie goes to the shorter period
    with pytest.raises(ValueError, match="a step's compute > 0"):
        choose_sparseloco_period(0.0, 1.0)


@pytest.mark.parametrize(
    "share, H, overlap, landing",
    [
        (0.053, 5, False, 1),  # tiny at H=5: 1.08 overlapped (landing 1 of 5) > 1.053
        (0.053, 20, True, 2),  # the same share at H=20: 1.04 (landing 2 of 20) < 1.053
        (0.09, 5, True, 1),  # 1.08 < 1.09
        (0.6, 5, True, 5),  # a period late (5 of 5): 1.24 < 1.6
        (2.0, 10, True, 10),  # outlasts the period: 2 x 1.24 = 2.48 < 3
        (0.0, 10, False, 1),
    ],
)
def test_overlap_pays_where_the_step_it_saves_outweighs_the_steps_its_late_landing_costs(
    share, H, overlap, landing
):
    """``weigh_overlap`` in closed form: synchronous 1 + share; overlapped (1 + what
    outlasts the period) x (1 + min(0.4 L / H, 0.24)), L = ceil(1.5 share H) in [1, H]."""
    from geotrain.plan.gather import landing_penalty, weigh_overlap

    verdict = weigh_overlap(share, H)
    penalty = min(0.4 * landing / H, 0.24)
    assert (verdict.overlap, verdict.landing) == (overlap, landing)
    assert verdict.penalty == pytest.approx(penalty) == landing_penalty(landing, H)
    assert verdict.sync == pytest.approx(1 + share)
    assert verdict.overlapped == pytest.approx((1 + max(0.0, share - 1)) * (1 + penalty))
    # Given, overlap is as told: --tau's landing (at most H), else a period late
    assert weigh_overlap(share, H, overlap=True, tau=2).landing == 2
    assert weigh_overlap(share, H, overlap=True, tau=H + 3).landing == H
    assert weigh_overlap(share, H, overlap=True).landing == H
    assert weigh_overlap(share, H, overlap=False).overlap is False
    assert weigh_overlap(share, H, tau=3).landing == 3  # auto, landing at --tau


def test_overlap_verdict_edges():
    """A tie stays synchronous; a gather of over 1 / 0.24 periods too (overlap hides one period of
    it and costs 24% more steps); a landing set by --tau before the gather is there waits for the
    rest, which shows in the verdict and in the predicted step."""
    from geotrain.plan.gather import sparseloco_step, weigh_overlap

    tie = weigh_overlap(0.04, 10)  # landing 1 of 10: 1.04 both ways
    assert tie.landing == 1 and tie.overlapped == pytest.approx(tie.sync) and tie.overlap is False
    assert weigh_overlap(4.0, 10).overlap is True  # (1 + 3) x 1.24 = 4.96 < 5
    assert weigh_overlap(4.5, 10).overlap is False  # (1 + 3.5) x 1.24 = 5.58 > 5.5
    # --tau 2 of H=10 with a gather of 20 one-second steps: 18 s show at the landing
    early = weigh_overlap(2.0, 10, tau=2)
    assert early.overlapped == pytest.approx((1 + 2.0 - 0.2) * 1.08) and early.overlap is False
    step, verdict = sparseloco_step(1.0, 20.0, 10, overlap=True, tau=2)
    assert verdict.overlap and step == pytest.approx(1.0 + 18.0 / 10)
    assert sparseloco_step(1.0, 20.0, 10, overlap=True)[0] == pytest.approx(1.0 + 10.0 / 10)
    # --H auto's table with --tau: the same verdict, landing at tau, its wait priced
    H, table = choose_sparseloco_period(1.0, 3.0, tau=2)
    for row in table:
        verdict = weigh_overlap(3.0 / row["H"], row["H"], tau=2)
        assert row["overlap"] is verdict.overlap
        if verdict.overlap:
            assert row["landing"] == 2
            assert row["predicted_step_s"] == pytest.approx(1.0 + 1.0 / row["H"])
    assert sparseloco_step(0.0, 1.0, 10, overlap=False)[0] == pytest.approx(0.1)  # no compute: no share


def _h_auto(rank, world_size, gathers: list[float] | None):
    """--H auto on a real group: each worker's gather as ``gathers`` says (None: the real one,
    timed on this loopback group); the period taken, its first syncs, and a worker restored
    from the state saved after them (through bytes, as a snapshot or a hand-over carries it)."""
    import io

    if gathers is not None:  # and a step of 1 s with no wait (the real ones: the None case)
        sparseloco_module.SparseLoCo._time_gather = lambda self: gathers[self.comm.rank]
        profile_module.profile_compute = lambda *a, **k: {"step_s": 1.0, "barrier_wait_s": 0.0}
    # The verdict as taken at start-up, through the steps: the synchronous gathers' waits (a few
    # ms, against steps of a few ms here) would take it again (tested on a clock of its own)
    sparseloco_module.SparseLoCo._watch = lambda self, *args: None
    comm = Communicator()
    model, opt, sync = _tiny_sync({"H": "auto", "chunk": 256, "k": 8}, comm)
    before = (sync.config.H, sync.resolved_options()["H"])
    sent, control = comm.stats.sent_bytes, comm.control_calls

    def loss():
        x, y = _batch(rank + 10, 0)
        return sync.model(x, y)[1]

    sync.prepare(loss)
    after = {"H": sync.config.H, "landing": sync.landing, "period": sync.sync_period()}
    after |= {"option": sync.resolved_options()["H"], "choice": sync.period_choice, "overlap": sync.overlap}
    after |= {"grads": [p.grad for p in model.parameters() if p.grad is not None]}
    after |= {"sent": comm.stats.sent_bytes - sent, "control": comm.control_calls - control}
    synced = []
    for step in range(1, 11):
        x, y = _batch(rank, step)
        sync.model(x, y)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        synced += [step] if sync.after_step() else []
        if step == sync.config.H:  # the first outer step: on the anchor, unless it overlapped
            after["first_on_anchor"] = torch.equal(sync._local(), sync._anchor)
            after["flying"] = sync.in_flight.flying
    saved = io.BytesIO()
    torch.save(sync.state_dict(), saved)
    _, _, again = _tiny_sync({"H": "auto", "chunk": 256, "k": 8}, Communicator())
    again.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=False))
    profile_module.profile_compute = None  # a restored choice measures nothing again
    again.prepare(loss)
    restored = {"H": again.config.H, "choice": again.period_choice, "period": again.sync_period()}
    restored |= {"overlap": again.overlap, "landing": again.landing}
    restored |= {"synced_now": again.synced_now()}  # saved at step 10, a boundary of 5 (not of 40)
    sync.close()
    again.close()
    return {"before": before, "after": after, "synced": synced, "restored": restored}


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "gathers, chosen, overlap",
    [
        ([0.0, 0.0], 5, False),
        ([0.2, 0.0], 5, False),
        ([3.0, 0.0], 5, True),
        ([0.0, 50.0], 40, True),
        (None, None, False),
    ],
)
def test_h_auto_measures_at_start_up_the_slowest_decides_and_a_restore_keeps_the_period(
    gathers, chosen, overlap
):
    """Two workers: ``prepare`` times steps and a gather (given, with 1 s steps: a gather of 0
    s, of 0.2 s (4% of a period of 5: synchronous), of 3 s (overlapped) or of 50 s on one worker
    only (overlapped at H=40, a period late), which the slowest-decides agreement makes every
    worker's; or the real ones, whose bytes stay out of the run's), and both run at the period
    chosen from them: their syncs at its multiples, the summary's option saying so, no gradient
    left behind. ``--overlap auto`` is
    decided from the same figures before step 1, so a slow link's first outer step overlaps too
    (its replicas off the anchor, its gather in flight), landing 1.5 times the gather's steps on
    (4.5 -> 5, a period late). A state saved after it carries the period and the verdict, and a
    worker restored from it (a resume, a joiner) measures nothing and stands where the saver
    stood (at a boundary, or not)."""
    out = run_workers(_h_auto, 2, gathers, timeout=210)
    if gathers is None:  # the real figures: the verdict is the chosen row's, landing within the period
        chosen = out[0]["after"]["H"]
        (row,) = [row for row in out[0]["after"]["choice"] if row["H"] == chosen]
        overlap, landing = row["overlap"], out[0]["after"]["landing"]
        assert 1 <= landing <= chosen
    else:
        landing = chosen
    for r in out:
        assert r["before"] == (20, "auto (not measured: 20)")
        a = r["after"]
        assert (a["H"], a["landing"], a["period"], a["overlap"]) == (chosen, landing, chosen, overlap)
        if chosen <= 10:
            assert a["first_on_anchor"] is not overlap and a["flying"] is overlap
        assert a["option"] == f"auto (measured: {chosen})" and not a["grads"]
        if gathers is None:  # the profile's barriers, the probe's two gathers and its barrier
            assert a["sent"] == 0 and a["control"] >= 7
        assert [row["H"] for row in a["choice"]] == [5, 10, 20, 40]
        assert r["synced"] == [s for s in range(1, 11) if s % chosen == 0]
        boundary = 10 % chosen == 0
        assert r["restored"] == {
            "H": chosen,
            "choice": a["choice"],
            "period": chosen,
            "synced_now": boundary,
            "overlap": overlap,
            "landing": landing,
        }
    assert out[0]["after"]["choice"] == out[1]["after"]["choice"]  # one table: the slowest's figures


def test_h_auto_alone_measures_nothing_and_a_joiner_takes_the_members_period(monkeypatch):
    """A world of one (a joiner before it is admitted; a one-worker run gathers nothing): no
    probe, the shortest period, the summary saying so; then the members' state handed over
    sets theirs."""
    monkeypatch.setattr(profile_module, "profile_compute", lambda *a, **k: pytest.fail("measured"))
    _, _, sync = _tiny_sync({"H": "auto", "chunk": 256, "k": 8})
    sync.prepare(lambda: pytest.fail("a step taken"))
    assert sync.config.H == 5 and sync.period_choice == [] and sync.sync_period() == 5
    assert sync.resolved_options()["H"] == "auto (alone: 5)"
    _, _, members = _tiny_sync({"H": 40, "chunk": 256, "k": 8})
    state = members.state_dict() | {"period": {"H": 40, "choice": [{"H": 40}]}}
    sync.load_state_dict(state)
    assert sync.config.H == 40 and sync.sync_period() == 40 and sync.landing == 40
    assert sync.resolved_options()["H"] == "auto (measured: 40)"
    sync.close()
    members.close()
    _, _, landing = _tiny_sync({"H": "auto", "tau": 7, "chunk": 256, "k": 8})  # --tau lands within
    assert landing.config.H == 20 and landing.landing == 7
    landing.prepare(lambda: pytest.fail("a step taken"))
    assert landing.config.H == 10 and landing.landing == 7
    landing.close()


@pytest.mark.parametrize(
    "landing, arrivals, moved",
    [
        (4, [], 4),  # no figures (the first overlapped message carries none)
        (4, [0.0, 0.0], 4),  # adopters' empty messages: no say
        (4, [3.0, 4.0], 4),  # there by the landing: stays
        (4, [4.05], 4),  # a wait under a tenth of a step is let go
        (4, [2.0, 6.4, 0.0], 7),  # the slowest was there 2.4 steps late: later at once
        (4, [30.0], 10),  # never past H
        (4, [1e30], 10),
        (4, [float("inf"), float("nan"), 3.0], 4),  # figures that cannot be right have no say
        (4, [3.0], 4),  # one step to spare is kept
        (7, [1.0, 2.0], 3),  # sooner: to a step after the slowest
        (2, [1.0], 2),
        (1, [1.0], 1),
    ],
)
def test_the_landing_follows_the_slowest_arrival_later_at_once_sooner_with_a_step_to_spare(
    landing, arrivals, moved
):
    assert next_landing(landing, arrivals, 10) == moved


def test_under_auto_the_landing_follows_when_the_gathers_arrive():
    """H=10 steps of 1 s. The first gather (2.5 s, timed alone) sets the landing at 4 (1.5
    times its steps). Each worker notes when each later gather was there and sends it in 4
    bytes after its next message, and every worker moves the landing from the figures the
    gathers carry: the link slows (gathers of 6.4 s) and the landing moves to 7, two landings
    on; it speeds up (0.5 s) and the landing comes back to 2. A snapshot with a message in
    flight holds the figure and restarts from the same start point. A landing moves only at an
    outer step: inside a period every worker, wherever it is, sees the landing it lands at (the
    regroup's collective points)."""
    comm = _ClockedGather(2.5)
    opt, sync = _clocked({"H": 10, "chunk": 256, "k": 8}, comm)
    payload = sync.chunker.payload_bytes(sync.n)
    landings, arrivals = {}, {}
    for step in range(1, 81):
        comm.now += 1.0
        comm.gather_s = 6.4 if step < 50 and step >= 30 else 0.5 if step >= 50 else 2.5
        _local_step(sync, opt, step)
        sync.after_step()
        if step % 10 == 0 and step > 10:  # an overlapped message: the figure after it
            assert sync.in_flight.saved().numel() == payload + 4
            assert sync.in_flight.saved()[payload:].view(torch.float32).item() == pytest.approx(sync._arrival)
        landings[step], arrivals[step] = sync.landing, sync._arrival
        if step == 45:  # a snapshot with a message in flight: the figure and the start point
            _, _, again = _tiny_sync({"H": 10, "chunk": 256, "k": 8})
            again.load_state_dict(sync.state_dict())
            assert again.landing == 4 and again._next_landing == 7 and again._arrival == sync._arrival
            assert torch.equal(again._start, sync._start)
            assert sync.collective_period() == again.collective_period() == 10  # (landed tells the sides)
            again.close()
    assert sync.overlap and sync.follows_link
    assert landings[20] == 4  # auto's: 1.5 x 2.5 steps
    assert arrivals[24] == 3.0  # seen complete at the end of step 23 of the gather launched at 20
    assert landings[34] == 4 and arrivals[34] == pytest.approx(6.4)  # waited 2.4 steps at 34
    assert landings[44] == landings[49] == 4 and sync.config.per_sender(True, 7) is False
    assert landings[50] == 7  # asked for by 40's figure at the landing at 44, taken at 50
    assert arrivals[57] == 1.0 and landings[57] == 7  # there after a step, figure sent at 60
    assert landings[67] == 7 and landings[70] == 2 and landings[80] == 2
    assert "moved 2 times, now 2 of 10 steps" in sync.info()  # the summary's codec line
    sync.close()


class _DriftingGather(_ClockedGather):
    """Overlapped (async) gathers are there ``drift_s`` after their launch, where synchronous
    ones take ``gather_s``: the workers drift apart between outer steps, not the link."""

    def __init__(self, gather_s: float, drift_s: float) -> None:
        super().__init__(gather_s)
        self.drift_s = drift_s

    def all_gather(self, tensor, async_op=False):
        if not async_op:
            return super().all_gather(tensor)
        plain, self.gather_s = self.gather_s, self.drift_s
        try:
            return super().all_gather(tensor, async_op=True)
        finally:
            self.gather_s = plain


@pytest.mark.parametrize("link_slowed", [False, True])
def test_under_auto_a_landing_moved_past_what_overlap_pays_for_decides_again_on_a_timed_gather(link_slowed):
    """H=10 steps of 1 s. The first gather (0.6 s, 6% of the period) turns overlap on, landing
    1 step late (1.04 against 1.06). Later gathers are there 2.5 s after their launch: the
    figure sent at 30 asks for a landing at 3, where overlap costs 12% more steps (1.12 against
    1.06 at the share measured), so at that landing (step 31) the next outer step is set to be
    synchronous, timed after a barrier, and to decide again, landing no sooner than 3.
    - The workers drifted (a synchronous gather still takes 0.6 s): synchronous from 40 on, every
      replica on the anchor at each outer step, nothing in flight, the mean over senders at
      alpha 1.
    - The link slowed (a synchronous gather takes 2.5 s too, 25%): overlapped again, landing at
      4 (1.5 x 2.5 steps), 1.16 against 1.25.
    A snapshot between the two holds what is to come."""
    comm = _ClockedGather(0.6) if link_slowed else _DriftingGather(0.6, 2.5)
    opt, sync = _clocked({"H": 10, "chunk": 256, "k": 8}, comm)
    for step in range(1, 61):
        comm.now += 1.0
        if link_slowed:
            comm.gather_s = 0.6 if step <= 10 else 2.5
        _local_step(sync, opt, step)
        synced = sync.after_step()
        assert synced == (step % 10 == 0)
        if step == 20:
            assert sync.overlap and sync.landing == 1 and sync.in_flight.flying
        if step == 30:
            assert sync.overlap and not sync._again
        if step == 31:  # the figure carried by 30's message (there 2.5 steps after launch): 3
            assert sync._again[1] == 3 and sync.overlap and sync._share == pytest.approx(0.06)
        if step == 35:  # a snapshot before the outer step holds it
            _, _, again = _tiny_sync({"H": 10, "chunk": 256, "k": 8})
            again.load_state_dict(sync.state_dict())
            assert (
                again.overlap
                and again._again == sync._again
                and again._again[1] == 3
                and again._share == pytest.approx(0.06)
            )
            again.close()
        if step == 40:  # decided again on the synchronous gather it timed
            assert not sync._again and sync.verdicts_again == 1
            took = "2.500" if link_slowed else "0.600"
            again_at = (
                f"again at step 40, the gathers there 3 of 10 steps after launch; a gather took {took} s"
            )
            assert again_at in sync.last_verdict
            assert sync.decision.startswith("--overlap auto: on (the first outer step's gather took 0.600 s")
            assert "again at step" not in sync.decision  # the first verdict, kept as it was
            assert sync._share == pytest.approx(0.25 if link_slowed else 0.06)
            assert sync.overlap is link_slowed and not sync.in_flight.flying  # synchronous, timed
        if step == 50:
            assert sync.in_flight.flying is link_slowed
        if step >= 40 and synced and not link_slowed:  # every replica on the anchor
            assert sync.overlap is False and not sync.in_flight.flying
            assert torch.equal(sync._local(), sync._anchor)
    if link_slowed:
        assert sync.overlap and sync.landing == 4 and sync.alpha == 1.0
        assert "overlapped 1.160 (landing 4 of 10 steps late: 16% more steps)" in sync.info()
    else:
        taken = "taken again 1 time (the landing moved, the synchronous waits rose, or the period moved), "
        taken += "the last: "
        assert f"{taken}--overlap auto: off (again" in sync.info()
        assert "synchronous 1.060, overlapped 1.120 (landing 3 of 10 steps late" in sync.info()
        options = {"alpha": 1.0, "overlap": "auto (off)", "mean_over": "senders"}
        assert sync.resolved_options() == options and sync.in_flight.saved() is None
        assert sync.state_dict()["overlap"] is False
    sync.close()


@pytest.mark.parametrize("first_s, checked, landing", [(2.5, False, 7), (2.3, True, 10)])
def test_a_landing_moved_within_what_overlap_pays_for_keeps_overlap_on_without_a_check(
    first_s, checked, landing
):
    """The first gather 2.5 s (25%: landing 4) and later ones 6.4 s: the landing moves to 7 of
    10, where overlap costs 24% more steps, still under the 25% a synchronous gather waits
    (1.24 against 1.25): overlap stays on, no check. From 2.3 s (23%) the same move asks for the
    check (1.24 against 1.23); the synchronous step times 6.4 s (64%) and overlaps again, landing
    a period late (1.24 against 1.64)."""
    comm = _ClockedGather(first_s)
    opt, sync = _clocked({"H": 10, "chunk": 256, "k": 8}, comm)
    for step in range(1, 71):
        comm.now += 1.0
        comm.gather_s = first_s if step <= 20 else 6.4
        _local_step(sync, opt, step)
        sync.after_step()
    assert sync.overlap and sync.landing == landing and not sync._again
    assert sync.verdicts_again == int(checked)
    assert ("taken again" in sync.info()) is checked
    sync.close()


def test_a_check_with_the_gather_in_flight_lands_it_first_and_one_without_timings_waits():
    """Landing a period late (the first gather 30 s of a 10 s period) with the check asked for
    at the outer step at 30 (set by hand: the figures ask for it only inside a period): the gather
    in flight lands first, the replica moving with the anchor, then the step is synchronous and
    timed (0.5 s: off), every replica on the anchor. Where no worker timed a step, the check
    waits for the next outer step, its floor kept."""
    comm = _ClockedGather(30.0)
    opt, sync = _clocked({"H": 10, "chunk": 256, "k": 8}, comm)
    for step in range(1, 31):
        comm.now += 1.0
        comm.gather_s = 30.0 if step < 30 else 0.5
        _local_step(sync, opt, step)
        if step == 29:
            assert sync.overlap and sync.landing == 10 and sync.in_flight.flying
            sync._again = ("the gathers there 10 of 10 steps after launch", 10)
        sync.after_step()
    assert sync.overlap is False and not sync.in_flight.flying and sync.verdicts_again == 1
    assert torch.equal(sync._local(), sync._anchor) and torch.equal(sync._start, sync._anchor)
    assert "a gather took 0.500 s" in sync.last_verdict
    sync._again, sync.overlap = ("asked", 4), None
    sync._decide(0.1, 0.0, -1.0)  # no worker timed a step: undecided, the floor kept
    assert sync.overlap is None and sync._again == ("asked", 4)
    sync.close()


def _synchronous_then(later_s: float, steps: int = 70):
    """H=10 steps of 1 s; gathers of 0.3 s to step 25 (3%: synchronous at the first outer step,
    1.04 overlapped against 1.03), ``later_s`` after."""
    comm = _ClockedGather(0.3)
    opt, sync = _clocked({"H": 10, "chunk": 256, "k": 8}, comm)
    for step in range(1, steps + 1):
        comm.now += 1.0
        comm.gather_s = 0.3 if step <= 25 else later_s
        _local_step(sync, opt, step)
        sync.after_step()
        if step == 45:  # a snapshot holds this worker's wait, sent with its next message, and the watch
            state = sync.state_dict()
            _, _, again = _tiny_sync({"H": 10, "chunk": 256, "k": 8})
            again.load_state_dict(state)
            assert again._waited == sync._waited == pytest.approx(later_s / 10)
            assert again._watch_level == sync._watch_level == pytest.approx(0.03)
            assert (again._rises, again._again) == (sync._rises, sync._again) == (int(later_s > 1), None)
            del state["overlap_watch"], state["overlap_again"]  # saved before the watch: none begun
            again.load_state_dict(state)
            assert (again._watch_level, again._rises, again._again) == (None, 0, None)
            again.close()
    return comm, sync


def test_under_auto_synchronous_gathers_carry_their_waits_and_a_slower_link_turns_overlap_on():
    """Off at the first outer step (10); from the second each message carries its sender's
    wait in the last gather (4 bytes). The figures at 30 (3%) set the level. Gathers of 3 s from
    step 26: the figures at 40 and 50 (30%, 10 times the level, twice in a row; overlapped 1.2
    against 1.3) ask for a timed outer step, and at 60 the gather timed after a barrier turns
    overlap on (landing 5); the outer step at 70 overlaps. Gathers of 0.5 s (5%): under twice its
    level: synchronous throughout, no timed step."""
    comm, sync = _synchronous_then(3.0)
    payload = sync.chunker.payload_bytes(sync.n)
    # the decisions' timed gathers (10, 60) carry no wait; the overlapped one (70) its arrival
    assert comm.sizes == [payload] + [payload + 4] * 4 + [payload, payload + 4]
    assert sync.overlap and sync.landing == 5 and sync.in_flight.flying and sync.verdicts_again == 1
    why = "the synchronous gathers' shortest wait up from 3.0% to 30.0%; a gather took 3.000 s"
    assert f"again at step 60, {why}" in sync.last_verdict
    assert "synchronous 1.300, overlapped 1.200" in sync.info()
    sync.close()
    comm, sync = _synchronous_then(0.5)
    assert sync.overlap is False and sync.verdicts_again == 0 and not sync.in_flight.flying
    assert comm.sizes == [payload] + [payload + 4] * 6
    sync.close()


@pytest.mark.parametrize(
    "figures, weights, check",
    [
        ([0.3, 0.03, 0.2], None, False),  # the last to arrive waited 3%: no rise
        ([0.3, 0.25], None, True),  # 25%: overlapped would land 4 (1.16 against 1.25)
        ([0.3, 0.0], None, False),  # a worker with no figure: none read
        ([0.3, 0.01], [1.0, 0.0], True),  # a message the check left out has no say
        ([0.3, float("nan")], None, False),
        ([0.3, 0.039], None, False),  # under twice the level (2%)
        ([0.3, 0.05], None, False),  # risen, but overlap is sooner by 0.01 of a step, under 0.4 / H
    ],
)
def test_a_timed_step_is_asked_for_where_the_shortest_wait_rose_and_overlap_would_pay(
    figures, weights, check
):
    _, sync = _synchronous_then(0.3, steps=10)
    assert sync.overlap is False and sync.watches_link and sync._watch_level is None
    sync._watch(0.1, [0.02], None)  # the first shortest wait after the verdict: the level
    assert sync._watch_level == 0.02 and not sync._again
    sync._watch(0.1, figures, weights)  # risen once: not yet
    assert not sync._again and sync._rises == int(check)
    sync._watch(0.1, figures, weights)  # and again: a timed step where both times it paid
    assert (
        (sync._again is not None) is check and sync.overlap is False and sync._waited == pytest.approx(0.01)
    )
    sync.close()


def test_the_watch_wants_its_rises_in_a_row_and_its_level_is_the_least_wait_since_the_verdict():
    _, sync = _synchronous_then(0.3, steps=10)
    sync._watch(0.1, [0.02], None)  # the level
    for figures, rises in (([0.3], 1), ([0.03], 0), ([0.3], 1), ([0.3, 0.0], 0), ([0.3], 1)):
        sync._watch(0.1, figures, None)
        assert sync._rises == rises and not sync._again
    sync._watch(0.1, [0.01], None)  # lower: the level follows it down
    assert sync._watch_level == 0.01 and sync._rises == 0
    sync._watch(0.1, [0.25], None)
    sync._watch(0.1, [0.25], None)
    assert sync._again and sync._again[1] == 0 and "up from 1.0% to 25.0%" in sync._again[0]
    sync.close()


@pytest.mark.parametrize("share, on", [(0.045, False), (0.3, True)])
def test_a_timed_step_the_waits_asked_for_turns_overlap_on_only_by_the_margin(share, on):
    """At 4.5% overlap is sooner by 0.005 of a step (1.04 against 1.045): a near tie, which the
    first verdict takes and the watch's does not; at 30% by 0.1."""
    _, sync = _synchronous_then(0.3, steps=10)
    sync._again = ("risen", 0)
    sync._decide(share * 10, 10.0, share)
    assert sync.overlap is on and not sync._again and sync.verdicts_again == 1
    assert sync.last_verdict.startswith(f"--overlap auto: {'on' if on else 'off'} (again at step 10, risen")
    sync.close()


def _weighed_again(rank, world_size):
    """--overlap auto on a real group of 3, H=4, its timings fixed (every verdict sees a share
    of 15%: on at the first outer step, landing 1) and the figures made to ask for a landing at
    3 (1.3 against 1.15): the check at the landing at 9, the outer step at 12 synchronous and
    timed (off), 16 synchronous. What each outer step leaves, and the end."""
    sparseloco_module.SparseLoCo._verdict = lambda self, gather_s: (gather_s, 4.0, 0.15)
    sparseloco_module.next_landing = lambda landing, arrivals, H: 3 if arrivals else landing
    comm = Communicator()
    model, opt, sync = _tiny_sync({"H": 4, "chunk": 256, "k": 8}, comm)
    seen = {}
    for step in range(1, 17):
        _local_step(sync, opt, step + 10 * rank)
        sync.after_step()
        seen[step] = (sync.overlap, (sync._again or ("", 0))[1], sync._anchor.clone(), sync._local())
    sync.finalize()
    sync.close()
    return {"seen": seen, "again": sync.verdicts_again, "final": sync._local()}


WEIGHED = Cases(_weighed_again, 3, [()])


def test_on_a_real_group_every_worker_takes_the_check_and_the_synchronous_step_together():
    ranks = WEIGHED.get()
    for r in ranks:
        assert [r["seen"][s][0] for s in (4, 8, 9, 12, 16)] == [True, True, True, False, False]
        assert r["seen"][9][1] == 3 and r["seen"][12][1] == 0 and r["again"] == 1
        for step in (12, 16):  # synchronous: every replica on the anchor
            assert torch.equal(r["seen"][step][3], r["seen"][step][2])
    for step in (4, 8, 9, 12, 16):  # the anchors bitwise equal on every worker
        assert all(torch.equal(r["seen"][step][2], ranks[0]["seen"][step][2]) for r in ranks)
    assert not torch.equal(ranks[0]["seen"][12][2], ranks[0]["seen"][9][2])  # the step moved it
    assert all(torch.equal(r["final"], ranks[0]["final"]) for r in ranks)


def _h_auto_at(H: int, comm):
    """A world of one on the test's clock, --H auto at H (as if its start-up probe chose it)."""
    opt, sync = _clocked({"H": "auto", "chunk": 256, "k": 8}, comm)
    sync._set_period(H)
    sync.period_choice = []
    return opt, sync


@pytest.mark.parametrize("at_start", [False, True])
def test_under_h_auto_a_verdict_taken_again_moves_to_the_period_that_hides_a_slower_link(at_start):
    """H=10 steps of 1 s: the first gather 2 s (20%: overlapped, landing 3; 1.12 against 1.20),
    then the link slows to 15 s a gather. The figures ask for a landing at 10 (1.24 against
    1.20): a check, and the timed outer step measures 150% of the period. At H=10 that waits 5 s
    a period (time to a loss 1.5 x 1.126 x 1.24 = 2.09 x nosync's step); at H=20 it hides
    (1.252 x 1.24 = 1.55): the period moves to 20, overlapped, a period late.
    - Decided at the first outer step (10): the check is asked at 33 and times 40, a multiple
      of 20: the period moves there.
    - Decided at start-up (10 overlapped): the check is asked at 23 and times 30; the period
      moves at 40, the first multiple of 20, its verdict taken there from 30's figures (a
      snapshot between holds them).
    Either way the outer steps fall at 10, 20, 30, 40, 60 and 80, and the snapshots at the new
    period's boundaries."""
    comm = _ClockedGather(2.0)
    opt, sync = _h_auto_at(10, comm)
    if at_start:
        sync._decide(2.0, 10.0, 0.2, at_start=True)
        comm.gather_s = 15.0
    assert sync.overlap is (True if at_start else None)
    synced = []
    for step in range(1, 81):
        comm.now += 1.0
        if step > 10:
            comm.gather_s = 15.0
        _local_step(sync, opt, step)
        synced += [step] if sync.after_step() else []
        if step == (30 if at_start else 40):  # the timed step: H=20 pays
            assert sync.verdicts_again == 1
            assert "time to a loss x nosync's step 2.094 at H=10, 1.552 at H=20" in sync.last_verdict
        if at_start and step == 35:  # pending: at 40, the verdict for it from 30's figures
            assert sync.config.H == 10 and sync._period_next[:1] == [20] and sync.overlap
            assert "the period to go from H=10 to H=20 at step 40, its multiple" in sync.last_verdict
            _, _, again = _tiny_sync({"H": "auto", "chunk": 256, "k": 8})
            again.load_state_dict(sync.state_dict())
            assert again._period_next == sync._period_next and again.config.H == 10
            again.close()
            _, _, fixed = _tiny_sync({"H": "auto", "chunk": 256, "k": 8, "overlap": False})
            fixed.load_state_dict(sync.state_dict())  # resumed with --no-overlap: auto's move is not
            assert fixed._period_next is None and fixed._again is None and fixed.config.H == 10
            fixed.close()
        if step == 40:
            assert sync.config.H == 20 and sync._period_next is None and sync.period_moves == [[40, 20]]
            assert sync.overlap and sync.landing == 20 and not sync._again
    assert synced == [10, 20, 30, 40, 60, 80]
    assert sync.sync_period() == 20 and sync.default_snapshot_every() == 60
    # the gathers there 15 s after launch: the landing follows them sooner, to 16 of 20, once a
    # message (60's) has carried the figure of one launched at the new period (40's)
    assert sync.overlap and sync.landing == (16 if at_start else 20) and sync.verdicts_again == 1 + at_start
    assert "the period moved with the link: H=20 from step 40" in sync.info()
    assert sync.resolved_options()["H"] == "auto (alone, then moved with the link: 20)"
    _, _, again = _tiny_sync({"H": "auto", "chunk": 256, "k": 8})
    again.load_state_dict(sync.state_dict())
    assert again.config.H == 20 and again.period_moves == [[40, 20]] and again._period_next is None
    again.close()
    sync.close()


def test_under_h_auto_a_fixed_period_or_a_near_tie_keeps_the_period():
    """The same timed gather of 150% with --H 10 given: overlapped at H=10, landing a period late,
    the period as given. And under --H auto a gather whose best period is under 5% sooner
    (a step's gather at H=5: 1.233 at H=5, 1.216 at H=10) leaves it; one of 7.5 steps does not
    (1.977 against 1.396)."""
    comm = _ClockedGather(1.0)
    _, _, fixed = _tiny_sync({"H": 10, "chunk": 256, "k": 8}, comm)
    fixed._again = ("asked", 0)
    fixed._decide(15.0, 10.0, 1.5)
    assert fixed.config.H == 10 and fixed.overlap and fixed.landing == 10 and not fixed.period_moves
    fixed.close()
    _, sync = _h_auto_at(5, comm)
    assert sync._better_period(0.2) is None and sync._better_period(1.5)[0] == 10
    sync._again = ("asked", 0)
    sync._period_next = [10, 1.0, 10.0, 0.1, 0, 0]  # chosen before: weighed again here, and withdrawn
    sync._decide(1.0, 5.0, 0.2)
    assert sync.config.H == 5 and not sync.period_moves and sync._period_next is None
    assert "again at step 0, asked" in sync.decision and "the period from" not in sync.decision
    sync.close()


def test_under_h_auto_a_synchronous_run_watched_asks_for_a_longer_period_where_it_alone_pays():
    """H=5 steps of 1 s, gathers of 0.3 s (6%: synchronous), then 20 s from step 26 (400% of
    the period). Overlap at H=5 would hide one period of four and cost 24% more steps: 4.96
    against 5.0, under the watch's margin (0.08), so with a fixed H the run stays synchronous,
    each outer step waiting 20 s. Under --H auto H=20 hides it (1.552 against 5.272 at H=5): the
    watch asks (the figures at 35 and 40), the outer step at 45 is timed and chooses H=20, which
    starts at 60, its first multiple, overlapped."""
    for auto in (False, True):
        comm = _ClockedGather(0.3)
        if auto:
            opt, sync = _h_auto_at(5, comm)
        else:
            opt, sync = _clocked({"H": 5, "chunk": 256, "k": 8}, comm)
        for step in range(1, 81):
            comm.now += 1.0
            comm.gather_s = 0.3 if step <= 25 else 20.0
            _local_step(sync, opt, step)
            sync.after_step()
            if auto and step == 45:
                timed = sync.last_verdict
        if not auto:
            assert sync.overlap is False and sync.config.H == 5 and sync.verdicts_again == 0
        else:
            assert "again at step 45, the synchronous gathers' shortest wait up from 6.0% to 400.0%" in timed
            assert (
                "the period to go from H=5 to H=20 at step 60" in timed
                and "5.272 at H=5, 1.552 at H=20" in timed
            )
            assert sync.config.H == 20 and sync.period_moves == [[60, 20]] and sync.overlap
            assert "again at step 60, the period from H=5 to H=20 as weighed at step 45" in sync.last_verdict
        sync.close()


def test_a_longer_period_chosen_for_a_later_step_lands_the_gather_in_flight_first_and_survives_a_retry():
    """H=10 steps of 1 s: the first gather 2 s (overlapped, landing 3), gathers of 30 s from the
    one launched at 30. The check is asked at 43 and the outer step at 50 times 30 s (300%):
    H=40 (1.865 against 4.189 at H=10; 2.33 at H=20), from 80; meanwhile overlapped at H=10, a
    period late. At 80 the gather launched at 70 is in flight; its wait fails once (a lost
    member), and the retry (``rebind``, ``retry_sync``) lands it and moves the period, landing a
    period late (45 steps of gather). The arrival figures past the period (carried to 80) ask
    nothing more: a longer period is chosen already."""
    comm = _ClockedGather(2.0)
    opt, sync = _h_auto_at(10, comm)
    for step in range(1, 121):
        comm.now += 1.0
        comm.gather_s = 2.0 if step < 30 else 30.0
        _local_step(sync, opt, step)
        if step == 80:
            assert sync._period_next[0] == 40 and sync.in_flight.flying and sync.landing == 10
            handle, fails = sync.in_flight._handle, [1]

            def wait(real=handle.wait, fails=fails):
                if fails:
                    fails.pop()
                    raise RuntimeError("a member was lost")
                return real()

            handle.wait = wait
            with pytest.raises(RuntimeError):
                sync.after_step()
            assert sync._period_next[0] == 40 and sync.config.H == 10  # pending still
            sync.rebind()
            sync.retry_sync()
        else:
            sync.after_step()
        if step == 50:
            assert "the period to go from H=10 to H=40 at step 80" in sync.last_verdict
            assert "4.189 at H=10, 1.865 at H=40" in sync.last_verdict
    assert sync.config.H == 40 and sync.period_moves == [[80, 40]] and sync._period_next is None
    assert sync.overlap and sync.landing == 40 and not sync._again and sync.verdicts_again == 2
    assert "again at step 80, the period from H=10 to H=40 as weighed at step 50" in sync.last_verdict
    sync.close()


def test_landing_a_period_late_the_arrivals_past_the_period_ask_for_a_longer_one():
    """H=10, overlapped a period late from the start (gathers of 12 s, 120% of the period): the
    landing is at H and cannot move later, so the landing's check never asks. The figure the
    gather launched at 10 carries to the landing at 30 (there 12 steps after launch) does: H=20
    is 7% sooner (1.552 against 1.675), the outer step at 40 is timed and moves the period."""
    comm = _ClockedGather(12.0)
    opt, sync = _h_auto_at(10, comm)
    sync._decide(12.0, 10.0, 1.2, at_start=True)
    assert sync.overlap and sync.landing == 10
    for step in range(1, 61):
        comm.now += 1.0
        _local_step(sync, opt, step)
        sync.after_step()
        if step == 30:
            assert (
                sync._again and "the gathers there 12.0 steps after launch, past the period" in sync._again[0]
            )
    assert sync.config.H == 20 and sync.period_moves == [[40, 20]] and sync.overlap
    assert "again at step 40, the gathers there 12.0 steps after launch" in sync.last_verdict
    sync.close()


def test_a_period_moved_is_priced_on_the_start_up_probes_steps_where_it_measured_them():
    """Steps of 0.5 s in the run (4 workers on 2 cores step faster while one waits on the link)
    where the start-up probe timed 1 s: a gather of 15 s at H=10 is 300% of the run's period and
    150% of the probe's. Priced on the run's steps it would take H=40 (30 steps of gather); on
    the probe's it takes H=20, and the verdict there is taken on the same steps (75%: landing
    a period late, 1.24 against 1.75). Without a probe (a fixed H, or geotrain.wrap without
    profile=) the run's steps price it, as before. Where the run's steps are the slower (1.5 s:
    something else takes the CPU), they price it: 100%, and H=10 stays (1.396 against 1.552)."""
    for probe, step_s, H, share in ((1.0, 0.5, 20, 0.75), (0.0, 0.5, 40, 0.75), (1.0, 1.5, 10, 1.0)):
        comm = _ClockedGather(15.0)
        opt, sync = _h_auto_at(10, comm)
        sync.probe_step_s = probe
        for _ in range(10):
            comm.now += step_s
            sync._stepped_at.append(comm.now)
        sync._again = ("asked", 0)
        sync._decide(*sync._verdict(15.0))
        assert sync.config.H == H and sync._share == pytest.approx(share)
        assert sync.period_moves == ([[0, H]] if H != 10 else [])
        probed = bool(probe) and step_s < probe
        assert ("on the start-up probe's steps: a share of 150.0%" in sync.decision) is probed
        assert ("s of the period's compute (the start-up probe's steps)" in sync.decision) is probed
        assert sync.overlap and sync._nominal_share is None
        state = sync.state_dict()
        assert state["period"]["step_s"] == probe
        sync.close()


def test_arrival_figures_past_the_period_ask_again_only_once_risen_over_the_figure_that_asked():
    """Landing a period late at H=10 (a gather of 120%): figures 24 steps after launch ask for a
    timed step (H=20 would pay). Where it kept the period (the run's steps, which the figures
    count, ran faster than the probe's, which the timed step prices), figures under twice 24 do
    not ask again; 48 does. A move of the period lets them ask afresh; snapshots keep the figure."""
    comm = _ClockedGather(12.0)
    _, sync = _h_auto_at(10, comm)
    sync._decide(12.0, 10.0, 1.2, at_start=True)
    assert sync.overlap and sync.landing == 10
    sync._weigh_longer(24.0)
    assert sync._again and sync._again[1] == 10 and sync._longer_asked == 24.0
    sync._again = None  # the timed step kept the period
    sync._weigh_longer(30.0)
    assert sync._again is None
    _, _, again = _tiny_sync({"H": "auto", "chunk": 256, "k": 8})
    again.load_state_dict(sync.state_dict())
    assert again._longer_asked == 24.0
    again.close()
    sync._weigh_longer(48.0)
    assert sync._again is not None and sync._longer_asked == 48.0
    sync._again = None
    sync._switch_period(20)
    assert sync._longer_asked == 0.0 and sync.period_moves == [[0, 20]]
    sync.close()


def test_a_state_saved_before_the_checks_is_timed_at_its_next_outer_step_and_checked_from_there():
    """A state saved before stop 69 holds a verdict (overlapped, landing 4) and no share: its
    next outer step (30) lands the gather in flight, is timed and decides again (a gather of
    0.6 s, 6%: off, as overlap would win by 0.02 of a step, under the margin of a verdict taken
    again), and the share it measured is what the checks weigh from there."""
    comm = _ClockedGather(2.5)
    opt, sync = _clocked({"H": 10, "chunk": 256, "k": 8}, comm)
    for step in range(1, 21):
        comm.now += 1.0
        _local_step(sync, opt, step)
        sync.after_step()
    assert sync.overlap and sync.landing == 4 and sync.in_flight.flying
    state = sync.state_dict()
    for key in (
        "overlap_share",
        "overlap_again",
        "overlap_verdicts_again",
        "overlap_waited",
        "overlap_watch",
    ):
        del state[key]
    sync.close()
    comm = _ClockedGather(0.6)
    _, opt, again = _tiny_sync({"H": 10, "chunk": 256, "k": 8}, comm)
    again.load_state_dict(state)
    assert again._share is None and again._again and "without the share" in again._again[0]
    again.clock = comm.clock
    again._restart_timing()
    for step in range(21, 31):
        comm.now += 1.0
        _local_step(again, opt, step)
        again.after_step()
    assert again.verdicts_again == 1 and again._share == pytest.approx(0.06) and not again._again
    assert again.overlap is False and not again.in_flight.flying and again.watches_link
    assert "again at step 30, resumed from a state saved without the share" in again.last_verdict
    again.close()


def _period_moved(rank, world_size):
    """--H auto at 5 on a real group of 3, its timings fixed and different on each worker (a
    share of 2% to step 10, then of 240%: twelve steps' gather, on rank 1; 0.6 of those on the
    others), and a check asked by hand after step 7: the outer step at 10 is timed and chooses
    H=20 (the largest share: rank 1's), which starts at 20; the outer step at 15 overlaps (at
    H=5, landing a period late), so a gather is in flight at 20, and lands there first. What
    each step leaves, and the end."""

    def verdict(self, gather_s):
        share = (0.02 if self.step_count < 10 else 2.4) * (1.0 if self.comm.rank == 1 else 0.6)
        return gather_s, 5.0, self.comm.max_scalars([share])[0]

    sparseloco_module.SparseLoCo._verdict = verdict
    sparseloco_module.SparseLoCo._watch = lambda self, *args: None  # the real waits: none read
    comm = Communicator()
    model, opt, sync = _tiny_sync({"H": "auto", "chunk": 256, "k": 8}, comm)
    sync._set_period(5)
    sync.period_choice = []
    seen, synced = {}, []
    for step in range(1, 41):
        _local_step(sync, opt, step + 10 * rank)
        flying = sync.in_flight.flying
        synced += [step] if sync.after_step() else []
        if step == 7:
            sync._again = ("asked", 0)
        seen[step] = (sync.config.H, sync.overlap, flying, sync._anchor.clone())
    sync.finalize()
    sync.close()
    return {"seen": seen, "synced": synced, "moves": sync.period_moves, "final": sync._local()}


MOVED = Cases(_period_moved, 3, [()])


def test_on_a_real_group_every_worker_moves_to_the_longer_period_at_the_same_step():
    ranks = MOVED.get()
    for r in ranks:
        assert r["synced"] == [5, 10, 15, 20, 40] and r["moves"] == [[20, 20]]
        # (H, overlap, in flight before the step)
        assert [r["seen"][s][:3] for s in (5, 10, 15, 20, 21, 40)] == [
            (5, False, False),  # the first outer step decided: off
            (5, True, False),  # timed: on at H=5, and H=20 chosen for step 20
            (5, True, False),
            (20, True, True),  # the gather launched at 15 landed first
            (20, True, True),  # launched at 20, landing 18 steps later (1.5 x 12)
            (20, True, False),
        ]
    for step in (5, 10, 15, 20, 38, 40):  # the anchors bitwise equal on every worker
        assert all(torch.equal(r["seen"][step][3], ranks[0]["seen"][step][3]) for r in ranks)
    assert all(torch.equal(r["final"], ranks[0]["final"]) for r in ranks)


def test_an_adopters_empty_message_is_left_out_of_the_gathered_mean():
    """A worker that adopted another's state sends an all-zero payload in the gather in flight
    (its loaded message was the other's): the mean is over the workers that sent one, not
    halved by the stand-in."""
    codec = ChunkTopK(chunk=64, k=8, bits=2)
    v = torch.randn(200, generator=torch.Generator().manual_seed(7))
    payload, sent = codec.encode(v)
    gathered = torch.stack([payload, torch.zeros_like(payload)])
    assert torch.equal(codec.mean_of(gathered, 200), sent)
    both = torch.stack([payload, payload])
    assert torch.equal(codec.mean_of(both, 200), sent)


class _WithAPeer(Communicator):
    """A world of one whose gathers hold a second worker's message too (``peer``, encoded from a
    fixed vector), so that a mean differs from this worker's own message."""

    def __init__(self) -> None:
        super().__init__()
        self.peer: torch.Tensor | None = None

    def all_gather(self, tensor, async_op=False):
        handle = super().all_gather(tensor, async_op=True)
        handle._tensor = torch.stack([tensor, self.peer])  # what Handle.wait returns
        return handle if async_op else handle.wait()


def _tau_sync_with_a_peer():
    """H=4, tau=1 in a world of one whose gathers hold a second worker's message too."""
    comm = _WithAPeer()
    model, opt, sync = _tiny_sync({"H": 4, "chunk": 256, "k": 8, "overlap": True, "tau": 1}, comm)
    comm.peer = sync.chunker.encode(torch.randn(sync.n, generator=torch.Generator().manual_seed(5)) * 1e-2)[0]
    return model, opt, sync


def _local_step(sync, opt, step: int) -> None:
    x, y = _batch(0, step)
    sync.model(x, y)[1].backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_with_tau_the_outer_steps_mean_lands_tau_steps_into_the_next_period():
    """H=4, tau=1: the outer step at 4 launches its gather and starts the period from the anchor
    moved by this worker's own message; after step 5 the mean lands: the anchor moves by it,
    the start becomes the new anchor, and the parameters move by the same change (new anchor -
    old start), exactly; nothing is in flight until the outer step at 8."""
    _, opt, sync = _tau_sync_with_a_peer()
    assert sync.landing == 1 and sync.alpha == 1.0 and sync._per_sender()  # lands in the first half
    for step in range(1, 9):
        _local_step(sync, opt, step)
        if step == 5:
            anchor, start, stepped = sync._anchor.clone(), sync._start.clone(), sync._local()
            gathered = sync.in_flight._handle._tensor
        synced = sync.after_step()
        assert synced == (step % 4 == 0)
        assert sync.in_flight.flying == (step in (4, 8)), step
        if step == 5:
            assert not torch.equal(start, anchor)  # the period started off the anchor: own message
            mean = sync.chunker.mean_of(gathered, sync.n, per_sender=True)
            assert torch.equal(sync._anchor, torch.sub(anchor, mean.mul_(1.0)).mul_(sync.layout.mask.float()))
            assert torch.equal(sync._start, sync._anchor)
            assert torch.equal(sync._local(), stepped + (sync._anchor - start))
    sync.close()


def _old_dense_mean(codec, payloads, n, weights=None, per_sender=False):
    """The dense mean ``ChunkTopK.mean_of`` computed before ``sparse_mean``: a vector of sums
    and one of counts the model's size, a pass over each. The reference the sparse mean must
    equal to the bit."""
    total = torch.zeros(codec.chunks(n), codec.chunk)
    counts = torch.zeros(codec.chunks(n), codec.chunk)
    senders = []
    for r, part in enumerate(codec.parts_of(payloads, n)):
        weight = 1.0 if weights is None else weights[r]
        if weight == 0 or part is None:
            continue
        scales, codes, idx = part
        senders.append(idx)
        values = codec._values(scales, codes)
        total.scatter_add_(1, idx, values if weight == 1 else values * weight)
        counts.scatter_add_(1, idx, torch.ones(idx.shape))
    if per_sender:
        if senders:
            touched = torch.cat(senders, dim=1)
            total.scatter_(1, touched, total.gather(1, touched) / counts.gather(1, touched))
        return total.reshape(-1)[:n]
    return total.reshape(-1)[:n].div_(max(1, len(senders)))


@pytest.mark.parametrize("per_sender", [False, True])
def test_the_sparse_mean_equals_the_old_dense_mean_to_the_bit(per_sender):
    """Four payloads over a vector that does not fill its last chunk (padding), one of them an
    adopter's empty stand-in, weighed [1, 0.5, 0, 1] (a clip and a reject): ``mean_of`` (built
    on ``dense_mean``), ``dense_mean`` into a dirty work tensor and the sparse mean spread out
    equal the dense computation bitwise, and a kept count tally is left all zero by each."""
    codec = ChunkTopK(chunk=64, k=16, bits=4)
    gen = torch.Generator().manual_seed(11)
    n = 64 * 5 + 17
    payloads = [codec.encode(torch.randn(n, generator=gen))[0] for _ in range(3)]
    payloads.insert(2, torch.zeros_like(payloads[0]))
    gathered = torch.stack(payloads)
    for weights in (None, [1.0, 0.5, 0.0, 1.0]):
        want = _old_dense_mean(codec, gathered, n, weights, per_sender)
        assert torch.equal(codec.mean_of(gathered, n, weights, per_sender=per_sender), want)
        tally = torch.zeros(codec.chunks(n), 64, dtype=torch.uint8)
        dense = codec.dense_mean(
            gathered, n, weights, per_sender, out=torch.full((codec.chunks(n), 64), 7.0), counts=tally
        )
        assert torch.equal(dense.reshape(-1)[:n], want) and not tally.any()
        assert not dense.reshape(-1)[n:].any()  # the padding of the last chunk: zero
        work = torch.full((codec.chunks(n), 64), 7.0)
        touched, mean = codec.sparse_mean(gathered, n, weights, per_sender, work=work, counts=tally)
        spread = torch.zeros(codec.chunks(n), 64).scatter_(1, touched, mean).reshape(-1)[:n]
        assert torch.equal(spread, want) and not tally.any()


def _dense_land_early(sync) -> None:
    """The landing as it was before it worked at the gathered entries alone: the dense mean
    (``_old_dense_mean``) off the anchor, then three passes over the model. The reference the
    sparse landing must equal."""
    gathered = sync._message_part(sync.in_flight.land())[0]
    codec, n, comm = sync.chunker, sync.n, sync.comm
    weights = comm.weigh_gathered(codec.norms(gathered, n)) if comm.checking else None
    mean = _old_dense_mean(codec, gathered, n, weights, per_sender=sync._per_sender())
    sync._anchor.sub_(mean.mul_(sync.alpha) if sync.alpha != 1.0 else mean)
    sync.layout.zero_padding(sync._anchor)
    change = sync._anchor - sync._start
    sync._start.copy_(sync._anchor)
    with torch.no_grad():
        sync.layout.add_into(change, [p.data for p in sync.parameters()])


@pytest.mark.parametrize("in_passes", [False, True])
@pytest.mark.parametrize("tau,spoil", [(1, ""), (3, ""), (3, "nan"), (1, "scale=0")])
def test_a_landing_at_the_gathered_entries_alone_equals_the_dense_one_to_the_bit(
    tau, spoil, in_passes, monkeypatch
):
    """H=4 with a peer whose messages differ from this worker's, landing in the first half
    (mean over senders) or the second (over workers), and a resume while a gather is in flight
    (the start rebuilt from the saved message): the anchor, the start and the parameters after
    12 steps equal, bitwise, those of the dense landing; after each landing start == anchor.
    Landed at the entries named (``in_passes`` False) or in passes over the whole vector, as
    ``_in_passes`` chooses by how many entries the messages name.
    ``spoil``: the first outer step's message is spoiled on the way (``--chaos corrupt``; NaNs
    the norm check leaves out, zeros it keeps): what was sent holds other entries than those
    the start was moved at (this worker's clean message), and the resume rebuilds the start
    from the clean one."""

    import geotrain.sync.sparseloco as sparseloco_module

    monkeypatch.setattr(sparseloco_module, "DENSE_ABOVE", 0.0 if in_passes else 1.0)
    chosen = []  # what each landing of the run under test chose

    def watch(sync):
        choose = sync._in_passes
        monkeypatch.setattr(sync, "_in_passes", lambda parts: chosen.append(choose(parts)) or chosen[-1])

    def run(dense: bool):
        comm = _WithAPeer()
        comm.max_norm_ratio = 10.0 if spoil else 0.0
        options = {"H": 4, "chunk": 256, "k": 8, "overlap": True, "tau": tau}
        model, opt, sync = _tiny_sync(options, comm)
        gen = torch.Generator().manual_seed(5)
        comm.peer = sync.chunker.encode(torch.randn(sync.n, generator=gen) * 1e-2)[0]
        if dense:
            monkeypatch.setattr(sync, "_land_early", lambda s=sync: _dense_land_early(s))
        else:
            watch(sync)
        for step in range(1, 13):
            if step == 6:  # resume: the message in flight is saved and sent again
                state = {"model": model.state_dict(), "opt": opt.state_dict(), "sync": sync.state_dict()}
                sync.close()
                model, opt, sync = _tiny_sync(options, comm)
                model.load_state_dict(state["model"])
                opt.load_state_dict(state["opt"])
                sync.load_state_dict(state["sync"])
                if dense:
                    monkeypatch.setattr(sync, "_land_early", lambda s=sync: _dense_land_early(s))
                else:
                    watch(sync)
            _local_step(sync, opt, step)
            comm.corrupt_next = spoil if step == 4 else ""
            sync.after_step()
            if step % 4 == tau:
                assert torch.equal(sync._start, sync._anchor), step
        out = (sync._anchor.clone(), sync._start.clone(), sync._local())
        assert all(t.isfinite().all() for t in out)
        sync.close()
        return out, comm.rejected_by_rank

    (sparse, rejected), (dense, _) = run(False), run(True)
    assert len(chosen) >= 2 and set(chosen) == {in_passes}  # every landing took the branch under test
    assert rejected == ({0: 1} if spoil == "nan" else {})  # NaNs left out; zeros averaged in
    for a, b in zip(sparse, dense, strict=True):
        assert torch.equal(a, b)


def test_a_sparse_add_into_the_tensors_adds_each_named_entry_once_and_skips_the_padding():
    from geotrain.compress.chunked import TensorChunks

    layout = TensorChunks([5, 8], chunk=4)  # rows: tensor 0 in rows 0-1 (3 padding), tensor 1 in 2-3
    tensors = [torch.zeros(5), torch.zeros(2, 4)]
    idx = torch.tensor([[0, 0], [0, 3], [1, 1], [2, 3]])  # row 1's 3 is padding; named twice: once
    values = torch.tensor([[1.0, 1.0], [2.0, 9.0], [3.0, 3.0], [4.0, 5.0]])
    layout.add_into_at(idx, values, tensors)
    assert torch.equal(tensors[0], torch.tensor([1.0, 0, 0, 0, 2.0]))
    assert torch.equal(tensors[1], torch.tensor([[0, 3.0, 0, 0], [0, 0, 4.0, 5.0]]))
    layout.add_into_at(torch.zeros(4, 0, dtype=torch.int64), torch.zeros(4, 0), tensors)  # nothing named
    assert tensors[0].sum() == 3.0


def test_a_landing_that_fails_with_the_group_lands_on_the_new_one_and_regroups_see_it():
    """tau=1 of H=4: the wait at step 5 fails (a member lost); after the regroup (``rebind``)
    ``retry_sync`` sends the message again and lands it then, as the step would have. And the
    landing is a collective point for the regroup's agreement: a survivor past it and one
    before it may not go on each from its own step, which the regroup tells by ``landed`` (the
    collective period stays H, so a joiner may be admitted deferred)."""
    _, opt, sync = _tau_sync_with_a_peer()
    assert sync.collective_period() == 4 and sync.defers_admission()
    for step in range(1, 6):
        _local_step(sync, opt, step)
        if step == 5:

            def lost():
                raise RuntimeError("a member was lost")

            sync.in_flight._handle.wait = lost
            with pytest.raises(RuntimeError, match="lost"):
                sync.after_step()
        else:
            sync.after_step()
    assert sync.in_flight.flying and not torch.equal(sync._start, sync._anchor)
    sync.rebind()
    sync.retry_sync()
    assert not sync.in_flight.flying and torch.equal(sync._start, sync._anchor)
    _, _, late = _tiny_sync({"H": 4, "chunk": 256, "k": 8, "overlap": True})
    _, _, off = _tiny_sync({"H": 4, "chunk": 256, "k": 8, "overlap": False, "tau": 0})
    assert late.collective_period() == off.collective_period() == 4  # landing at the outer step
    for s in (sync, late, off):
        s.close()


@pytest.mark.parametrize("decay", [1.0, 0.5])
def test_the_chunked_codec_keeps_what_it_did_not_send_exactly_across_streams_of_any_size(decay):
    """The codec's reduce (made in scratch vectors it shares across streams) against the dense
    formulas it replaced, bitwise: the message is v = x + decay * residual, the residual after
    it v - decode(payload), and the mean the dense mean of the gathered payloads; for two streams
    of different sizes, neither a multiple of the chunk, the larger second (the scratch grows)."""
    codec = ChunkTopK(chunk=64, k=4, bits=2, decay=decay)

    class Replicas(Communicator):
        world_size = 3
        screening = False

        def all_gather(self, tensor, async_op=False, control_bytes=0):
            gathered = torch.stack([tensor] * 3)
            return SimpleNamespace(wait=lambda: gathered) if async_op else gathered

    comm = Replicas()
    gen = torch.Generator().manual_seed(3)
    shapes = {"small": [(5, 7), (3,)], "large": [(40, 9), (17,), (2, 2)]}
    residual = {key: None for key in shapes}
    for _ in range(3):
        for key, sizes in shapes.items():
            tensors = [torch.randn(size, generator=gen) for size in sizes]
            v = flatten(tensors)
            if residual[key] is not None:
                v = v + residual[key] * decay if decay != 1 else v + residual[key]
            payload, sent = codec.encode(v)
            codec.reduce(comm, key, tensors).wait()
            residual[key] = v - sent
            assert torch.equal(codec.state(key)["residual"], residual[key])
            assert torch.equal(flatten(tensors), codec.mean_of(torch.stack([payload] * 3), v.numel()))
    # A codec loaded from this one's state keeps copies (as torch's optimizers do): the next
    # message, which updates the residual in place, leaves the other codec's as it was.
    saved = codec.state_dict()
    before = saved["streams"][0][1]["residual"].clone()
    twin = ChunkTopK(chunk=64, k=4, bits=2, decay=decay)
    twin.load_state_dict(saved)
    codec.reduce(comm, "small", [torch.randn(size, generator=gen) for size in shapes["small"]]).wait()
    assert torch.equal(twin.state("small")["residual"], before)
    assert not torch.equal(codec.state("small")["residual"], before)


@pytest.mark.parametrize("senders", [False, True])
def test_the_chunked_codec_averages_over_every_worker_or_over_the_senders_as_its_spec_says(senders):
    """``chunktopk:senders=true`` (for DreamDDP and the other algorithms that take a codec): each
    entry of the mean over the workers whose message holds it, as SparseLoCo's reference
    averages; by default over every worker. The option stays out of the default's spec."""
    from geotrain.compress.codec import make_codec

    codec = make_codec(f"chunktopk:chunk=8,k=2,bits=8{',senders=true' if senders else ''}")
    assert codec.senders is senders and ("senders" in codec.spec()) is senders
    other = torch.tensor([0.0, 0.0, 5.0, 0.0, 0.0, 0.0, 0.0, -3.0] * 2)
    theirs = codec.encode(other)[0]

    class TwoWorkers(Communicator):
        def all_gather(self, tensor, async_op=False, control_bytes=0):
            gathered = torch.stack([tensor, theirs])
            return SimpleNamespace(wait=lambda: gathered) if async_op else gathered

    mine = torch.tensor([4.0, 0.0, 5.0, 0.0, 0.0, 0.0, 0.0, 0.0] * 2)
    tensors = [mine.clone()]
    codec.reduce(TwoWorkers(), "layer", tensors).wait()
    # index 0: mine alone; 2: both (5 and 5); 7: theirs alone
    expected = (
        [4.0, 0.0, 5.0, 0.0, 0.0, 0.0, 0.0, -3.0] if senders else [2.0, 0.0, 5.0, 0.0, 0.0, 0.0, 0.0, -1.5]
    )
    torch.testing.assert_close(tensors[0], torch.tensor(expected * 2), atol=0.05, rtol=0)


@pytest.mark.parametrize(
    "length,k", [(4096, 64), (1024, 8), (2048, 256), (1026, 8), (1000, 8), (512, 64), (4096, 600)]
)
def test_the_top_k_in_two_rounds_picks_a_top_k_of_each_row(length, k):
    """``top_k_indices`` against ``torch.topk``: distinct indices whose values are the row's k
    largest (as a multiset), on continuous values and on values with many ties (small
    integers, where a top k is not unique), for rows cut in two rounds and rows too short or
    uneven for it (then ``torch.topk`` itself); a NaN is picked first, as ``torch.topk`` picks it."""
    from geotrain.compress.chunked import top_k_indices

    gen = torch.Generator().manual_seed(length + k)
    for values in (
        torch.randn(37, length, generator=gen).abs(),
        torch.randint(0, 5, (37, length), generator=gen).float(),
    ):
        idx = top_k_indices(values, k)
        assert idx.shape == (37, k)
        assert (idx.sort(dim=1).values.diff(dim=1) > 0).all()  # distinct in each row
        picked = values.gather(1, idx).sort(dim=1).values
        assert torch.equal(picked, values.topk(k, dim=1).values.sort(dim=1).values)
    with_nan = torch.randn(3, length, generator=gen).abs()
    with_nan[1, length // 3] = float("nan")
    assert (length // 3) in top_k_indices(with_nan, k)[1].tolist()


@pytest.mark.parametrize("bits", [1, 2, 4, 8, 10, 12, 16])
@pytest.mark.parametrize("count", [1, 7, 64, 255])
def test_unpacking_rows_at_once_equals_unpacking_each_row(bits, count):
    """``unpack_rows`` (every gathered message in one call) against ``unpack_bits`` of each row,
    for widths with whole codes a byte, 12-bit pairs and the general cut, counts that end a
    byte or a group part way."""
    from geotrain.compress.chunked import pack_bits, packed_bytes, unpack_bits, unpack_rows

    gen = torch.Generator().manual_seed(bits * 1000 + count)
    codes = torch.randint(0, 2**bits, (5, count), generator=gen)
    packed = torch.stack([pack_bits(row, bits) for row in codes])
    assert packed.shape == (5, packed_bytes(count, bits))
    rows = unpack_rows(packed, bits, count)
    assert torch.equal(rows, codes)
    assert all(torch.equal(unpack_bits(packed[r], bits, count), codes[r]) for r in range(5))
