"""``--pace time``: a period lasts the fastest worker's H steps; stragglers skip the rest of it,
and the average weighs each worker by the steps it computed.

Pure logic with a fake communicator (quotas, weights), then a gloo group of 3 whose step times
come from a test clock, checked against the token-weighted closed form; then the CLI with a
real straggler (``--slow``).
"""

from __future__ import annotations

import json

import pytest
import torch

from geotrain.comm.communicator import Communicator
from geotrain.models.gpt import GPT, gpt_config
from geotrain.sync import ConfigError, build_sync, sync_config
from geotrain.sync.pace import TimePace
from helpers import Cases, geotrain, refused


class FakeComm:
    """Rank ``rank`` of a group whose other members report ``times`` in the all-gather."""

    def __init__(self, rank: int, times: list[float]) -> None:
        self.rank, self.times, self.gathers = rank, times, 0

    @property
    def world_size(self) -> int:
        return len(self.times)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        self.gathers += 1
        rows = [torch.tensor([t], dtype=tensor.dtype) for t in self.times]
        rows[self.rank] = tensor
        return torch.stack(rows)


def _paced(rank: int, times: list[float], mine: float, H: int = 10) -> TimePace:
    pace = TimePace(H, FakeComm(rank, times))
    now = [0.0]
    pace.clock = lambda: now[0]
    for i in range(H):
        if pace.computes(i):
            now[0] += mine
            pace.stepped()
    return pace


def test_each_worker_computes_the_steps_that_fit_in_the_fastest_workers_period():
    pace = _paced(1, [1.0, 0, 2.0, 4.0], mine=1.5)
    assert pace.quotas == [10] * 4  # nothing measured yet: the first period is unpaced
    following = pace.exchange()
    assert following == [10, 7, 5, 2]  # round(10 * 1.0 / t): 6.67, 5, 2.5 (to even)
    pace.quotas = following
    assert [pace.computes(i) for i in range(10)] == [True] * 7 + [False] * 3
    assert [pace.workers_computing(i) for i in range(10)] == [4, 4, 3, 3, 3, 2, 2, 1, 1, 1]
    # N c_r / sum c, c_r = min(k_r, steps): the token-weighted mean of the contributions
    assert pace.weight(10) == pytest.approx(4 * 7 / 24)
    assert pace.weight(2) == 1.0  # two steps in (a run's last, partial period): all computed 2
    assert pace.weight(6) == pytest.approx(4 * 6 / (6 + 6 + 5 + 2))


def test_a_straggler_computes_at_least_one_step_and_a_worker_that_timed_nothing_unpaces():
    assert _paced(0, [0, 1000.0], mine=1.0).exchange() == [10, 1]
    pace = TimePace(10, FakeComm(0, [1.0, 2.0]))
    assert pace.exchange() == [10, 10]  # this worker timed no step (after a change of members)
    pace.quotas = [10, 5]
    pace.comm.times = [1.0, 2.0, 3.0]  # a new group of 3: its first period runs unpaced
    assert pace.quotas != [10] * 3 and pace.computes(9) and pace.quotas == [10] * 3
    assert pace.weight(10) == 1.0


def test_equal_workers_keep_every_step_and_a_weight_of_exactly_one():
    pace = _paced(2, [1.0, 1.0, 0, 1.0], mine=1.0)
    pace.quotas = pace.exchange()
    assert pace.quotas == [10] * 4 and pace.weight(10) == 1.0  # bitwise the unpaced average
    # Within 10% of the fastest, a worker keeps every step; beyond, it drops what does not fit.
    assert _paced(1, [1.0, 0, 1.2], mine=1.08).exchange() == [10, 10, 8]


def test_only_the_steps_every_worker_computes_are_timed_and_over_the_last_periods():
    """On shared cores a worker steps faster once the others have stopped for the period: its
    last steps, timed, made it read as the fastest and cut its equal peers. Only the steps every
    worker computes count; and t_r is the median over the last WINDOW periods' steps, so that
    one period's few steps do not move the quotas."""
    from geotrain.sync import pace as pace_module

    window = getattr(pace_module, "WINDOW", 4)
    pace = TimePace(10, FakeComm(0, [0, 1.0, 1.0]))
    now = [0.0]
    pace.clock = lambda: now[0]

    def period(step_s) -> list[int]:
        for i in range(10):
            if pace.computes(i):
                now[0] += step_s(i)
                pace.stepped()
        pace.quotas = pace.exchange()
        return pace.quotas

    assert period(lambda i: 1.0) == [10, 10, 10]
    pace.quotas = [10, 10, 4]  # a straggler computes 4 steps: the rest run alone, twice as fast
    # timed over all ten, this worker's median would be 0.5 s (and its peers cut to 5 steps)
    assert period(lambda i: 1.0 if i < 4 else 0.5) == [10, 10, 10]
    for _ in range(window - 1):  # three fast periods in four: the window's median moves
        period(lambda i: 0.8)
    assert pace.quotas == [10, 8, 8]  # 0.8 against the others' 1.0: theirs no longer fit
    assert period(lambda i: 5.0) == [10, 8, 8]  # one slow period in the window: no move


@pytest.mark.parametrize("algo", ["localsgd", "diloco"])
def test_pace_is_validated_and_refused_by_algorithms_without_periods(algo):
    with pytest.raises(ConfigError, match="--pace must be one of steps, time, got 'wall'"):
        sync_config(algo, {"pace": "wall"})
    with pytest.raises(
        ConfigError, match="dreamddp does not take --pace; algorithms that do: localsgd, diloco"
    ):
        sync_config("dreamddp", {"pace": "time"})
    assert "--pace must be one of steps, time" in refused(
        ["run", "--workers", "2", "--no-netem", "--algo", algo, "--pace", "fast"]
    )


# -- a gloo group of 3, step times from a test clock ---------------------------------------------
H, STEPS = 4, 8
STEP_S = {0: 1.0, 1: 2.0, 2: 1.0}  # rank 1 takes twice as long: 2 of the second period's 4 steps


def _paced_run(rank: int, world_size: int, algo: str, sited: bool = False) -> dict:
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", 256, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    options = {"H": H, "pace": "time"} | (
        {"outer_lr": 1.0, "outer_momentum": 0.0, "compress": "none"} if algo == "diloco" else {}
    )
    comm = Communicator()
    if sited:  # ranks 0 and 1 share a site and average every 2 steps; rank 1 is 4x slower
        options["site_H"], comm = 2, Communicator(site_of_host=[0, 0, 1])
    sync = build_sync(algo, model, opt, comm, options)
    step_s = {**STEP_S, 1: 4.0} if sited else STEP_S
    mid = mid_after = None
    now = [0.0]
    sync.pacer.clock = lambda: now[0]
    computed, computing, before = [], [], None
    for step in range(STEPS):
        computing.append(sync.workers_computing())
        computed.append(sync.computes_step())
        if computed[-1]:
            g = torch.Generator().manual_seed(1000 * rank + step)
            x = torch.randint(0, 256, (2, 16), generator=g)
            sync.model(x, torch.roll(x, -1, dims=1))[1].backward()
            sync.before_step()
            opt.step()
            opt.zero_grad(set_to_none=True)
            now[0] += step_s[rank]
        if step == STEPS - 1:
            before = [p.detach().clone() for p in model.parameters()]
        if step == 5:
            mid = [p.detach().clone() for p in model.parameters()]  # before the site average at 6
        sync.after_step()
        if step == 5:
            mid_after = [p.detach().clone() for p in model.parameters()]
    sync.close()
    return {
        "mid": mid,
        "mid_after": mid_after,
        "computed": computed,
        "computing": computing,
        "before": before,
        "after": [p.detach().clone() for p in model.parameters()],
        "quotas": list(sync.pacer.quotas),
    }


PACED = Cases(_paced_run, 3, [("localsgd",), ("diloco",), ("localsgd", True)])


@pytest.mark.parametrize("algo", ["localsgd", "diloco"])
def test_a_time_paced_sync_is_the_token_weighted_mean_of_the_replicas(algo):
    """Period 1: every worker computes its 4 steps, then the quotas follow the step times:
    [4, 2, 4]. Period 2: rank 1 computes 2 steps and skips 2, and the sync at step 8 is
    (4 x_0 + 2 x_1 + 4 x_2) / 10 (DiLoCo at outer lr 1, no momentum: the same mean)."""
    ranks = PACED.get(algo)
    assert ranks[1]["computed"] == [True] * 6 + [False] * 2
    assert ranks[0]["computed"] == ranks[2]["computed"] == [True] * 8
    assert ranks[0]["computing"] == [3] * 6 + [2] * 2  # the tokens each step trains, everywhere
    k = torch.tensor([4.0, 2.0, 4.0])
    for i, after in enumerate(ranks[0]["after"]):
        want = sum(k[r] * ranks[r]["before"][i] for r in range(3)) / k.sum()
        torch.testing.assert_close(after, want, atol=1e-6, rtol=1e-5)
        assert all(torch.equal(r["after"][i], after) for r in ranks)  # one model again
    assert all(r["quotas"] == [4, 2, 4] for r in ranks)


def test_with_site_averages_each_site_counts_for_its_tokens_and_each_worker_for_its_last_steps():
    """Sites {0, 1} and {2}, --site-H 2, H=4; rank 1 4x slower, so the second period's quotas
    are [4, 1, 4]. The site average at step 6 weighs ranks 0 and 1 by the steps each computed
    since the period began (2 and 1): (2 x_0 + x_1) / 3. At the sync at step 8 rank 1 has
    computed nothing since, so its site counts through rank 0 with the site's 5 steps, and rank
    2's site with its 4: (5 x_0 + 4 x_2) / 9."""
    ranks = PACED.get("localsgd", True)
    assert all(r["quotas"] == [4, 1, 4] for r in ranks)
    assert ranks[1]["computed"] == [True] * 5 + [False] * 3
    for i in range(len(ranks[0]["after"])):
        site = (2 * ranks[0]["mid"][i] + ranks[1]["mid"][i]) / 3
        torch.testing.assert_close(ranks[0]["mid_after"][i], site, atol=1e-6, rtol=1e-5)
        assert torch.equal(ranks[1]["mid_after"][i], ranks[0]["mid_after"][i])
        assert torch.equal(ranks[2]["mid_after"][i], ranks[2]["mid"][i])  # a site of one
        want = (5 * ranks[0]["before"][i] + 4 * ranks[2]["before"][i]) / 9
        torch.testing.assert_close(ranks[0]["after"][i], want, atol=1e-6, rtol=1e-5)
        assert all(torch.equal(r["after"][i], ranks[0]["after"][i]) for r in ranks)


def test_site_weights_are_the_closed_forms():
    pace = TimePace(10, FakeComm(1, [1.0, 2.0, 1.0, 1.0]))
    pace.quotas = [10, 3, 10, 6]
    sites = [0, 0, 1, 1]
    # A site average 4 steps into the period, the last at 0: steps since, by rank 4, 3, 4, 4.
    assert pace.site_weight(0, 4, sites) == pytest.approx(2 * 3 / 7)
    assert pace.site_weight(4, 6, sites) == pytest.approx(0.0)  # rank 1 computed none of 5, 6
    pace.comm.rank = 2
    assert pace.site_weight(4, 6, sites) == 1.0 and pace.site_weight(4, 8, sites) == pytest.approx(2 * 4 / 6)
    # The sync at 10, the last site average at 8: site 1 computed 16 of 29 steps, rank 2 all of
    # its site's 2 since (rank 3 stopped at 6).
    assert pace.weight(10, 8, sites) == pytest.approx(4 * 16 * 1.0 / 29)
    pace.comm.rank = 1  # site 0: 13 steps, rank 1 none of the last 2
    assert pace.weight(10, 8, sites) == 0.0
    pace.quotas = [10] * 4
    assert pace.weight(10, 8, sites) == 1.0 and pace.site_weight(4, 8, sites) == 1.0


# -- the CLI ---------------------------------------------------------------------------------------
def test_a_time_paced_run_lets_the_straggler_skip_steps_and_counts_only_computed_tokens(tmp_path):
    """--slow 1:4 on 2 workers, localsgd H=5: after the first period host 1 computes about a
    quarter of each period's steps and host 0 all of them; tokens count computed steps only."""
    run = tmp_path / "run"
    cmd = ["run", "--workers", "2", "--no-netem", "--model", "tiny", "--batch-size", "4"]
    cmd += ["--steps", "15", "--H", "5", "--algo", "localsgd", "--pace", "time", "--slow", "1:4"]
    cmd += ["--no-progress", "--threads", "1", "--eval-every", "0", "--run-dir", str(run)]
    proc = geotrain(cmd, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    skipped = summary["skipped_steps"]
    assert skipped["0"] == 0 and 4 <= skipped["1"] <= 8, skipped  # 2 periods, k_1 in 1..3 of 5
    per_step = 4 * 64  # tokens of one worker's step (batch 4 x tiny's block of 64)
    assert summary["tokens"] == per_step * (2 * 15 - skipped["1"])
    assert "paced by time" in summary["codec_info"]
    records = [json.loads(x) for x in (run / "metrics" / "rank1.jsonl").read_text().splitlines()]
    assert sum(r.get("computed") is False for r in records if "step" in r) == skipped["1"]


def test_site_h_and_pace_refuse_what_they_cannot_honour(monkeypatch, capsys):
    """--site-H needs sites (a library wrap without them is refused, not silently idle); --pace
    time is not combined with the norm check; a site average is a collective
    between syncs, so a regroup agrees on it (collective_period) and retries it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="--site-H averages inside sites, and this run has none"):
        build_sync("diloco", model, opt, Communicator(), {"site_H": 2})
    sited = Communicator(site_of_host=[0])
    with pytest.raises(ConfigError, match="--pace time weighs each worker's contribution"):
        build_sync("localsgd", model, opt, Communicator(max_norm_ratio=10), {"pace": "time"})
    sync = build_sync("diloco", model, opt, sited, {"H": 10, "site_H": 4})
    assert "averages nothing here" not in capsys.readouterr().err  # a world of one (a joiner's) is quiet
    assert (sync.sync_period(), sync.collective_period()) == (10, 2)
    averaged = []
    monkeypatch.setattr(sync, "average_in_site", lambda weight=1.0: averaged.append(sync.step_count))
    for _ in range(10):
        sync.after_step()
        sync.retry_sync()  # a regroup at this step: the site average is redone, the rest not
    assert averaged == [4, 4, 8, 8]  # at 10 the sync across sites, not the site's
    unsited = build_sync("diloco", model, opt, Communicator(), {"H": 10})
    assert unsited.collective_period() == unsited.sync_period() == 10
    assert "--pace time weighs each worker" in refused(
        [
            "run",
            "--workers",
            "2",
            "--no-netem",
            "--algo",
            "diloco",
            "--pace",
            "time",
            "--max-norm-ratio",
            "5",
        ]
    )
