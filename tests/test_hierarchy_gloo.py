"""Two-level all-reduce on real gloo groups: the sum of every rank, exactly, on every rank alike."""

from __future__ import annotations

import pytest
import torch

from geotrain.comm.communicator import Communicator
from helpers import run_workers


def _two_level(rank, world_size, site_of_host):
    comm = Communicator(site_of_host=site_of_host)
    assert comm.two_level is not None
    # Integers in float32: the sum is exact whatever the order, so the result is checkable.
    x = torch.arange(11, dtype=torch.float32) * (rank + 1)
    y = torch.full((3, 5), float(rank))
    hx = comm.all_reduce(x, async_op=True)  # two in flight at once, waited in reverse
    hy = comm.all_reduce(y, op="sum", async_op=True)
    y = hy.wait()
    x = hx.wait()
    scalars = comm.mean_scalars([float(rank)])  # the default group still works beside the two levels
    return {
        "x": x,
        "y": y,
        "scalars": scalars,
        "stats": comm.stats.as_dict(),
        "stripes": comm.two_level.stripes,
        "carried": [j for j, _ in comm.two_level.carried],
    }


def _a_member_lost_while_the_groups_form(rank, world_size):
    import time

    from geotrain.comm.hierarchy import site_groups

    if rank == 2:
        return {"lost": True}  # it never makes the groups, as a host killed in the regroup
    t0 = time.monotonic()
    try:
        site_groups([0, 0, 1], rank, timeout_s=3600.0, formation_s=2.0)
    except RuntimeError as e:
        return {"failed_after_s": time.monotonic() - t0, "error": str(e)[:200]}
    return {"failed_after_s": None}


def test_a_member_lost_while_the_site_groups_form_fails_the_others_within_the_formation_timeout():
    """The groups are made under a short timeout and given the collective timeout after: a
    member lost in those seconds fails the others in about 2 s here (the default: a minute),
    not the hour their collectives may take at a slow link, and they regroup."""
    out = run_workers(_a_member_lost_while_the_groups_form, 3, timeout=60)
    for r in out[:2]:
        assert r["failed_after_s"] is not None and r["failed_after_s"] < 20, r


class _Published:
    """A membership whose coordinator publishes an epoch that lost a member 1 s from now."""

    def __init__(self) -> None:
        import time

        self.epoch, self.members, self._at = 0, None, time.monotonic() + 1.0

    @property
    def published_leave(self) -> int:
        import time

        return 1 if time.monotonic() > self._at else 0


def _an_agreement_with_a_lost_member(rank: int, store: str, out: str) -> None:
    import os
    import time

    import torch.distributed as dist

    from geotrain.ft.membership import MembershipChanged

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    comm = Communicator(membership=_Published())
    result = {"gave_up_after_s": None}
    if rank == 0:  # rank 1 never joins the all-gather, as a host frozen in the regroup
        t0 = time.monotonic()
        try:
            comm.all_gather_object((rank, "status"))
        except MembershipChanged:
            result["gave_up_after_s"] = time.monotonic() - t0
    else:
        time.sleep(8)  # alive, its connections open: only the published epoch can end rank 0's wait
    torch.save(result, out)
    os._exit(0)  # the group is abandoned, as a regroup retires it: no teardown


def _an_agreement(rank, world_size):
    return Communicator().all_gather_object({"rank": rank, "pad": "x" * (100 * rank)})


def test_the_regroups_agreement_gives_up_when_an_epoch_that_lost_a_member_is_published():
    """The regroup's all-gather of objects waits like a collective: given up once an epoch that
    lost members is published (here 1 s in; the collective timeout would be minutes), so a
    member frozen during a regroup does not hold the others (one killed fails them at once). It
    still gathers every worker's object, of any size, in rank order."""
    import os
    import tempfile

    from helpers import CONTEXT as ctx  # forked from a server that imported torch once

    with tempfile.TemporaryDirectory(prefix="geotrain-test-") as tmp:
        outs = [os.path.join(tmp, f"rank{r}.pt") for r in range(2)]
        procs = [
            ctx.Process(target=_an_agreement_with_a_lost_member, args=(r, os.path.join(tmp, "s"), outs[r]))
            for r in range(2)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
        gave_up = torch.load(outs[0])["gave_up_after_s"]
    assert gave_up is not None and gave_up < 6, gave_up
    got = run_workers(_an_agreement, 3, timeout=60)
    assert all(g == [{"rank": r, "pad": "x" * (100 * r)} for r in range(3)] for g in got)


def _site_means_leaving_out(rank, world_size):
    comm = Communicator(site_of_host=[0, 0, 1, 1])
    out = {}
    for name, ranks in (("one", {1}), ("a whole site", {0, 1}), ("none", set()), ("across", {0, 2})):
        x = torch.full((5,), float(rank + 1))
        with comm.leaving_out(ranks):
            comm.site_mean(x)
        out[name] = x
    return out


def test_a_site_average_redone_after_a_regroup_leaves_the_copies_out():
    """Sites {0, 1} and {2, 3}, each rank contributing rank + 1. Leaving out rank 1 (a copy of
    the leader's state): site 0's mean is rank 0's alone, site 1's untouched. A whole site of
    copies averages them (they are the same state), and so does leaving out no one."""
    out = run_workers(_site_means_leaving_out, 4, timeout=120)
    want = {
        "one": [1.0, 1.0, 3.5, 3.5],
        "a whole site": [1.5, 1.5, 3.5, 3.5],
        "none": [1.5, 1.5, 3.5, 3.5],
        "across": [2.0, 2.0, 4.0, 4.0],
    }
    for name, values in want.items():
        for rank, v in enumerate(values):
            assert torch.equal(out[rank][name], torch.full((5,), v)), (name, rank)


SITES = [[0, 0, 1, 1], [0, 0, 0, 1], [0, 1, 0, 1], [2, 2, 0, 1]]


@pytest.mark.parametrize("sites", SITES, ids=["2+2", "3+1", "interleaved", "2+1+1"])
def test_a_two_level_all_reduce_is_the_exact_mean_on_every_rank(sites):
    out = run_workers(_two_level, 4, sites, timeout=120)
    for r in out:
        assert torch.equal(r["x"], torch.arange(11, dtype=torch.float32) * 10 / 4)
        assert torch.equal(r["y"], torch.full((3, 5), 6.0))  # 0 + 1 + 2 + 3
        assert r["scalars"] == [1.5]
    # every stripe carried once per site
    sizes = {s: sites.count(s) for s in set(sites)}
    assert out[0]["stripes"] == max(sizes.values())
    for s in set(sites):
        carried = sorted(j for r, o in enumerate(out) if sites[r] == s for j in o["carried"])
        assert carried == list(range(out[0]["stripes"]))


def test_two_sites_of_two_send_less_across_than_a_ring():
    """11 floats (44 bytes) among 2 sites of 2: each rank sends 44 twice on its LAN (two
    all-reduces of 2) and its stripe across (a 2-rank all-reduce sends the stripe once): 6 floats
    for member 0, 5 for member 1, so a site's uplink carries 44, where a ring of 4 sends
    2 x 3/4 x 44 = 66 bytes through each crossing."""
    out = run_workers(_two_level, 4, [0, 0, 1, 1], timeout=120)
    # x: 11 floats, stripes of 6 and 5; y: 15 floats, stripes of 8 and 7. The scalars are control
    # traffic, not counted.
    for rank, (x_stripe, y_stripe) in enumerate([(6, 8), (5, 7), (6, 8), (5, 7)]):
        stats = out[rank]["stats"]
        assert stats["wan_sent_bytes"] == 4 * (x_stripe + y_stripe)
        assert stats["sent_bytes"] == 2 * 44 + 2 * 60 + 4 * (x_stripe + y_stripe)
        assert stats["calls"] == 2 and stats["payload_bytes"] == 44 + 60


def test_after_a_failed_two_level_job_every_later_one_fails_unrun():
    """A member whose stripe failed must not start the next job's LAN sum while its site-mate
    still waits in this one's: the chain fails the rest with the first error, and is closed."""
    from geotrain.comm.hierarchy import Chain

    chain, ran = Chain(), []

    def boom():
        raise RuntimeError("peer lost")

    first = chain.submit(boom)
    second = chain.submit(lambda: ran.append(1))
    with pytest.raises(RuntimeError, match="peer lost"):
        first.wait()
    with pytest.raises(RuntimeError, match="peer lost"):
        second.wait()
    assert ran == [] and first.is_completed() and second.is_completed()
    chain.close(wait_s=5)
    with pytest.raises(RuntimeError, match="chain is closed"):
        chain.submit(lambda: None)
    ok = Chain()
    assert ok.submit(lambda: ran.append(2)).wait() and ran == [2]
    ok.close(wait_s=5)


def _site_averaged(rank, world_size, algo):
    """4 ranks in sites 3+1, H=4, --site-H 2: the parameters before and after each sync."""
    from geotrain.sync import build_sync

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # diloco in fp32: a codec's all-to-all runs flat, the two levels are the fp32 all-reduce's
    diloco = {"outer_lr": 1.0, "outer_momentum": 0.0, "compress": "none"}
    options = {"H": 4, "site_H": 2} | (diloco if algo == "diloco" else {})
    comm = Communicator(site_of_host=[0, 0, 0, 1])
    sync = build_sync(algo, model, opt, comm, options)
    before, after = [], []
    for step in range(4):
        g = torch.Generator().manual_seed(100 * rank + step)
        x = torch.randn(8, 6, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        before.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
        sync.after_step()
        after.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
    stats = comm.stats.as_dict()
    comm.close()
    return {"before": before, "after": after, "stats": stats}


@pytest.mark.parametrize("algo", ["localsgd", "diloco"])
def test_site_h_averages_inside_each_site_between_the_syncs_across_sites(algo):
    """Step 2 (a multiple of --site-H 2): the three hosts of site 0 take their mean over their LAN,
    the lone host of site 1 keeps its own; step 4 (H): every host takes the mean of all four.
    Steps 1 and 3 move nothing. Bytes: one site all-reduce of the 21 parameters (84 bytes; 2 x 2/3
    of them on a site of 3), then the two-level average across sites."""
    out = run_workers(_site_averaged, 4, algo, timeout=120)
    site = torch.stack([out[r]["before"][1] for r in range(3)]).mean(dim=0)
    for r in range(3):
        torch.testing.assert_close(out[r]["after"][1], site, atol=1e-6, rtol=1e-6)
        assert torch.equal(out[r]["after"][1], out[0]["after"][1])  # bitwise, inside the site
    assert torch.equal(out[3]["after"][1], out[3]["before"][1])  # a site of one: nothing to average
    for r in range(4):
        assert torch.equal(out[r]["after"][0], out[r]["before"][0])
        assert torch.equal(out[r]["after"][2], out[r]["before"][2])
    everyone = torch.stack([out[r]["before"][3] for r in range(4)]).mean(dim=0)
    for r in range(4):
        torch.testing.assert_close(out[r]["after"][3], everyone, atol=1e-6, rtol=1e-6)
    assert out[0]["stats"]["calls"] == 1 + 1 and out[3]["stats"]["calls"] == 1  # site + across
    assert out[0]["stats"]["payload_bytes"] == 2 * 84 and out[3]["stats"]["payload_bytes"] == 84


def _two_level_gather(rank, world_size, site_of_host):
    import geotrain.comm.communicator as communicator

    communicator.TWO_LEVEL_GATHER_BYTES = 6  # these messages: two levels; a smaller one flat
    comm = Communicator(site_of_host=site_of_host)
    message = torch.arange(6, dtype=torch.uint8) + 10 * rank  # a rank's own bytes, told apart
    gathered = comm.all_gather(message, async_op=True).wait()
    again = comm.all_gather(message.float())  # blocking, another dtype, after the first
    before = comm.stats.as_dict()
    small = comm.all_gather(message[:5])
    return {
        "gathered": gathered,
        "again": again,
        "small": small,
        "stats": before,
        "small_wan": comm.stats.wan_sent_bytes - before["wan_sent_bytes"],
        "even": comm.two_level.even,
    }


@pytest.mark.parametrize(
    "sites", [[0, 0, 1, 1], [0, 1, 0, 1], [1, 1, 0, 0], [0, 0, 0, 1], [2, 0, 1, 2, 0, 1]], ids=str
)
def test_a_two_level_all_gather_gives_every_rank_every_message_in_rank_order(sites):
    """Sites of equal size gather in two levels (each message carried across by its own host,
    then shared over the LAN), wherever the sites' ranks lie (three sites of two, interleaved,
    too); unequal sites gather flat. Either
    way every rank holds every rank's message, in rank order; the WAN bytes counted are the
    two levels': (S-1) messages out of each member, against a ring's N-1. A gather under
    ``TWO_LEVEL_GATHER_BYTES`` (latency-bound, a control figure) goes flat."""
    n = len(sites)
    out = run_workers(_two_level_gather, n, sites, timeout=120)
    want = torch.stack([torch.arange(6, dtype=torch.uint8) + 10 * r for r in range(n)])
    even = len({sites.count(s) for s in set(sites)}) == 1
    S, k = len(set(sites)), n // len(set(sites))
    for r in out:
        assert torch.equal(r["gathered"], want) and torch.equal(r["again"], want.float())
        assert torch.equal(r["small"], want[:, :5]) and r["small_wan"] == 0  # below the floor: flat
        assert r["even"] == even
        stats = r["stats"]
        if even:  # its message to S-1 other sites, then the S it carried to its k-1 site-mates
            assert stats["wan_sent_bytes"] == (S - 1) * (6 + 24)
            assert stats["sent_bytes"] == (S - 1) * (6 + 24) + (k - 1) * S * (6 + 24)
        else:
            assert stats["wan_sent_bytes"] == 0 and stats["sent_bytes"] == (n - 1) * (6 + 24)
