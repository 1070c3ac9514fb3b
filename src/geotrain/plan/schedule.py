"""DreamDDP's layer-to-iteration schedule, found by a pruned search (arXiv 2502.11058, Sec. 4).

Over a period of ``H`` iterations every layer is averaged exactly once; layer l's all-reduce is
launched in its iteration when backward finishes it (at T_l) and competes for one link with the
other layers of that iteration. The search assigns layers in backward order, so each iteration's
link queue can be advanced exactly as the iteration will run it, and minimises the total
communication left exposed after backward (T_L). It keeps the paper's three properties:

1. **hide if it fits**: if a layer's all-reduce fits in some iteration before backward ends, it
   goes to such an iteration (branching only among those);
2. **delay if it cannot hide**: otherwise it goes where it adds the least exposure;
3. **at least one layer per iteration**: when as many layers remain as iterations are empty,
   the remaining layers go to the empty iterations.

The search is depth-first (its first leaf is the greedy schedule), branches on at most
``branch`` distinct iterations per layer, merges iterations in the same state (they are
interchangeable), memoises visited states, prunes with a lower bound (each remaining layer
exposes at least what it would alone), and stops at a node or time budget. Then the fill-in:
each iteration also averages every other layer whose all-reduce still fits in its bubbles without
adding exposure, which only ever adds averaging.

Beyond the paper, ``lag`` 1 (``DreamDDPConfig.lag``): an iteration's averages land when each
layer's next forward begins, not at the end of backward, so a layer's deadline moves from T_L to
T_L + O + F_l (``cost.deadlines``: the optimizer step and the forward of the layers before it).
An iteration's exposure is then its most overdue landing. The period's last iteration keeps
T_L, so that a period ends with nothing in flight. With a codec of two phases, the first phases
keep T_L at lag 1 too (the update waits for them, to launch the second phases, which then run
under the update and the forward); the search places the first phases, and the prediction adds
what the second phases leave exposed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from geotrain.comm.guard import GATHERED, SPARSE_CODECS
from geotrain.plan.cost import (
    ComputeModel,
    LinkModel,
    deadlines,
    exposed_for_layers,
    iteration_overhead,
    lands_late,
    predict_schedule,
)

# The periods `geotrain plan --choose` and dreamddp's `--H auto` weigh (at most one per layer).
CANDIDATE_H = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 50, 64, 80, 100)


@dataclass
class Schedule:
    """``assignment[l]``: the iteration that averages layer l; ``iterations[h]``: all layers iteration h
    averages, fill-ins included (ascending, i.e. backward order)."""

    H: int
    assignment: list[int]
    iterations: list[list[int]]
    exposed_s: list[float] = field(default_factory=list)
    search_nodes: int = 0
    search_s: float = 0.0
    complete: bool = True  # False when the budget stopped the search before it proved optimality
    lag: int = 0  # 1: all iterations but the last land their averages at the layers' next forward

    def validate(self, n_layers: int) -> None:
        if len(self.assignment) != n_layers or len(self.iterations) != self.H:
            raise ValueError("schedule does not match the layer count or H")
        for layer, h in enumerate(self.assignment):
            if not 0 <= h < self.H or layer not in self.iterations[h]:
                raise ValueError(f"layer {layer} is not averaged in its assigned iteration {h}")
        for h, layers in enumerate(self.iterations):
            if not layers:
                raise ValueError(f"iteration {h} averages no layer")
            if len(set(layers)) != len(layers) or any(not 0 <= x < n_layers for x in layers):
                raise ValueError(f"iteration {h} lists an unknown or repeated layer")

    def fill_in_count(self) -> int:
        return sum(len(it) for it in self.iterations) - len(self.assignment)


def search_schedule(
    compute: ComputeModel,
    link: LinkModel,
    H: int,
    *,
    fill_in: bool = True,
    lag: int = 0,
    headroom: float = 0.0,
    branch: int = 2,
    node_budget: int = 50_000,
    time_budget_s: float = 0.5,
) -> Schedule:
    """``lag`` 1: every iteration but the period's last lands its averages at the layers' next
    forward (``cost.deadlines``), so a layer may still be on the link after backward ends."""
    L = compute.n_layers
    if not 1 <= H <= L:
        raise ValueError(f"H must be 1 to the number of layers ({L}) so each iteration averages one; got {H}")
    started = time.perf_counter()
    if not 0 <= headroom <= 10:
        raise ValueError(f"headroom (the link's margin in the plan) must be in [0, 10], got {headroom}")
    nominal = link
    # placed as if the link were 1 + headroom times slower: slack against noise and model error
    link = link.scaled(1 + headroom)
    finish = compute.finish_times()
    comm_late = [link.time(n) for n in compute.nbytes]
    # Landing at once, a codec's second phase goes out under backward after the next layer's
    # first (``cost.codec_exposed``): placed here as if both went out when the layer is ready.
    tails = compute.tail_bytes or (0,) * L
    comm_now = [c + link.time(t) for c, t in zip(comm_late, tails, strict=True)]
    comm = [comm_late if lands_late(lag, h, H) else comm_now for h in range(H)]
    now_due = deadlines(compute, late=False)
    # A codec's first phases are waited for before the update even where its averages land late
    # (only the second phases run on under the update and the forward: ``exposed_for_layers``).
    late_due = list(now_due) if compute.tail_bytes else deadlines(compute, late=True)
    due = [late_due if lands_late(lag, h, H) else now_due for h in range(H)]
    # Each remaining layer exposes at least what it would alone in an idle iteration.
    loosest = late_due if lands_late(lag, 0, H) else now_due
    alone = [max(0.0, finish[i] + comm_late[i] - loosest[i]) for i in range(L)]
    suffix = [0.0] * (L + 1)
    for i in range(L - 1, -1, -1):
        suffix[i] = suffix[i + 1] + alone[i]

    best_cost = float("inf")
    best: list[int] = []
    assignment = [0] * L
    queue = [0.0] * H
    count = [0] * H
    # the most overdue landing in each iteration so far (its exposure where positive; where
    # negative, the slack it leaves)
    overdue = [-math.inf] * H
    seen: dict[tuple, float] = {}
    nodes = 0
    stopped = False

    def dfs(layer: int, cost: float) -> None:
        nonlocal best_cost, best, nodes, stopped
        nodes += 1
        if nodes >= node_budget or (nodes % 512 == 0 and time.perf_counter() - started > time_budget_s):
            stopped = True
        if cost + suffix[layer] >= best_cost - 1e-12:
            return
        if layer == L:
            best_cost, best = cost, assignment.copy()
            return
        states = zip(queue, (c > 0 for c in count), overdue, (d is late_due for d in due), strict=True)
        key = (layer, tuple(sorted(states)))
        if seen.get(key, float("inf")) <= cost + 1e-12:
            return
        seen[key] = cost
        empty = sum(1 for c in count if c == 0)
        remaining = L - layer
        options: dict[tuple, tuple[float, float, float, int]] = {}  # state -> (added, end, overdue, h)
        for h in range(H):
            if remaining == empty and count[h]:
                continue  # property 3: the rest must fill the empty iterations
            state = (queue[h], count[h] > 0, overdue[h], due[h] is late_due)
            if state in options:
                continue  # interchangeable with an iteration already considered
            new_end = max(queue[h], finish[layer]) + comm[h][layer]
            new_overdue = max(overdue[h], new_end - due[h][layer])
            added = max(0.0, new_overdue) - max(0.0, overdue[h])
            options[state] = (added, new_end, new_overdue, h)
        hidden = [o for o in options.values() if o[0] <= 1e-12]
        if hidden:  # property 1: hide it; best fit first (the fullest queue it fits in)
            ranked = sorted(hidden, key=lambda o: -o[1])
        else:  # property 2: delay it where it costs least
            ranked = sorted(options.values(), key=lambda o: (o[0], o[1]))
        for added, new_end, new_overdue, h in ranked[:branch]:
            old = queue[h], overdue[h]
            queue[h], overdue[h], assignment[layer] = new_end, new_overdue, h
            count[h] += 1
            dfs(layer + 1, cost + added)
            count[h] -= 1
            queue[h], overdue[h] = old
            if stopped and best:
                return

    dfs(0, 0.0)
    late = [lands_late(lag, h, H) for h in range(H)]
    if compute.tail_bytes:
        # The search places a codec's two phases as one message; the run waits in backward for
        # each first phase before the next layer's goes out (``cost.codec_exposed``), which
        # favours iterations that alternate large and small layers. Refined under that exact
        # cost, from the search's assignment and from round-robin, the better kept.
        seeds = [best, [i % H for i in range(L)]]
        best = min((_refine(compute, link, seed, late) for seed in seeds), key=lambda r: r[1])[0]
    iterations = _members(best, H)
    if fill_in:
        iterations = [_fill(compute, link, it, late[h]) for h, it in enumerate(iterations)]
    return Schedule(
        H=H,
        assignment=best,
        iterations=iterations,
        exposed_s=[exposed_for_layers(compute, nominal, it, late[h]) for h, it in enumerate(iterations)],
        search_nodes=nodes,
        search_s=time.perf_counter() - started,
        complete=not stopped,
        lag=lag,
    )


def _members(assignment: Sequence[int], H: int) -> list[list[int]]:
    return [[i for i, a in enumerate(assignment) if a == h] for h in range(H)]


def _refine(
    compute: ComputeModel, link: LinkModel, assignment: Sequence[int], late: list[bool], rounds: int = 6
) -> tuple[list[int], float]:
    """Move one layer at a time to the iteration where the period's overhead falls most, while
    any move lowers it (every iteration keeps at least one layer). The assignment and its
    period's overhead."""
    H = len(late)
    best = list(assignment)
    members = _members(best, H)
    cost = [iteration_overhead(compute, link, it, late[h]) for h, it in enumerate(members)]
    for _ in range(rounds):
        moved = False
        for i in range(len(best)):
            src = best[i]
            if len(members[src]) == 1:
                continue
            without = [j for j in members[src] if j != i]
            left = iteration_overhead(compute, link, without, late[src])
            gain, to, joined = 1e-9, -1, 0.0
            for h in range(H):
                if h == src:
                    continue
                c = iteration_overhead(compute, link, sorted([*members[h], i]), late[h])
                if cost[src] + cost[h] - left - c > gain:
                    gain, to, joined = cost[src] + cost[h] - left - c, h, c
            if to >= 0:
                members[src], members[to] = without, sorted([*members[to], i])
                cost[src], cost[to], best[i] = left, joined, to
                moved = True
        if not moved:
            break
    return best, sum(cost)


def _fill(compute: ComputeModel, link: LinkModel, layers: list[int], late: bool = False) -> list[int]:
    """Add every layer whose all-reduce fits in this iteration's bubbles without adding time."""
    chosen = set(layers)
    base = iteration_overhead(compute, link, chosen, late)
    for i in range(compute.n_layers):
        if i in chosen:
            continue
        chosen.add(i)
        if iteration_overhead(compute, link, chosen, late) > base + 1e-12:
            chosen.discard(i)
    return sorted(chosen)


def schedule_to_json(schedule: Schedule, names: list[str]) -> dict:
    return {
        "H": schedule.H,
        "layers": names,
        "assignment": schedule.assignment,
        "iterations": [[names[i] for i in it] for it in schedule.iterations],
        "exposed_s": schedule.exposed_s,
        "lag": schedule.lag,
        "search": {
            "nodes": schedule.search_nodes,
            "seconds": schedule.search_s,
            "complete": schedule.complete,
        },
    }


def schedule_from_json(data: dict) -> tuple[Schedule, list[str]]:
    names = list(data["layers"])
    index = {n: i for i, n in enumerate(names)}
    iterations = [sorted(index[n] for n in it) for it in data["iterations"]]
    schedule = Schedule(
        H=int(data["H"]),
        assignment=list(data["assignment"]),
        iterations=iterations,
        exposed_s=list(data.get("exposed_s", [])),
        lag=int(data.get("lag", 0)),
    )
    schedule.validate(len(names))
    return schedule, names


@dataclass(frozen=True)
class ChooseConfig:
    """How a period H is chosen: by its predicted time to a loss, the step time times the steps
    it needs, taken as ``1 + penalty * (H - 1)`` times synchronous SGD's, among the H whose steps
    stay within ``budget`` times those.

    The default penalty is measured (docs/reaching-ddp-loss.md): tokens to DDP's loss on
    ``mini`` with W1's batch, DreamDDP at H=10 1.17x at 2,000 steps (0.019 per unit of H beyond
    1), local SGD 1.28x at H=10 (0.031) and 1.02x at H=2 (0.020) and DiLoCo 1.19x at H=10
    (0.021) at 400 steps."""

    budget: float = 1.25
    penalty: float = 0.02
    max_H: int = 100

    def __post_init__(self) -> None:
        if not self.budget >= 1:
            raise ValueError(f"--budget is a factor of synchronous SGD's steps, >= 1; got {self.budget}")
        if not self.penalty >= 0:
            raise ValueError(f"--penalty must be >= 0, got {self.penalty}")
        if self.max_H < 1:
            raise ValueError(f"--max-H must be >= 1, got {self.max_H}")

    def steps_factor(self, H: int) -> float:
        return 1 + self.penalty * (H - 1)


def choose_period(
    compute: ComputeModel,
    link: LinkModel,
    choose: ChooseConfig,
    *,
    time_budget_s: float = 0.1,
    **search: Any,
) -> tuple[int, list[dict]]:
    """The H of ``CANDIDATE_H`` (up to ``choose.max_H`` and the layer count) with the shortest
    predicted time to a loss, and the table it was chosen from (one row per H weighed; ties go
    to the shorter period). Each H's schedule is searched as a run searches its own (``search``:
    ``search_schedule``'s options), but within ``time_budget_s`` each (a run's own search, for
    the H chosen, has the default 0.5 s)."""
    table = []
    for h in CANDIDATE_H:
        if h > min(choose.max_H, compute.n_layers) or choose.steps_factor(h) > choose.budget:
            continue
        schedule = search_schedule(compute, link, h, time_budget_s=time_budget_s, **search)
        step = predict_schedule(compute, link, schedule.iterations, schedule.lag)
        table.append(
            {
                "H": h,
                "predicted_step_s": step,
                "steps_factor": choose.steps_factor(h),
                "time_to_loss_factor": step * choose.steps_factor(h) / compute.compute_s,
            }
        )
    if not table:
        raise ValueError("no H satisfies the convergence budget; raise --budget or lower --penalty")
    return min(table, key=lambda row: row["time_to_loss_factor"])["H"], table


# ``--compress auto``'s candidates: uncompressed, the quantisers with error feedback, whose cost
# in loss was measured within noise (int4 at H=2 on `tiny` over 2,000 steps: 0.004, 0.3%), and
# the chunked top-k (SparseLoCo's message per layer), which on W1 at H=2 reached DDP's loss at
# 2,000 steps in 0.97x its tokens, where int4 needed 0.99x (benchmarks/curves/).
AUTO_CODEC = "auto"
AUTO_CODECS = ("", "int8", "int4", "chunktopk")


def auto_codecs(aggregate: str | None = "mean") -> tuple[str, ...]:
    """``AUTO_CODECS`` a run may choose under ``--aggregate``: a coordinate-wise statistic
    (median, trimmed mean) needs every worker's value at each coordinate, which a sparse message
    does not carry, so the chunked top-k is left out there (chosen, the statistic would be lost)."""
    kind = (aggregate or "mean").partition(":")[0]
    return tuple(c for c in AUTO_CODECS if not (kind in GATHERED and c in SPARSE_CODECS))


# A codec is taken only where it is predicted this much sooner to a loss than sending fp32:
# lossless wins the near-ties, where the prediction's own error (a few percent) decides nothing.
CODEC_MARGIN = 0.02


def choose_codec(
    candidates: dict[str, tuple[ComputeModel, LinkModel, int]],
    H: int | None,
    choose: ChooseConfig,
    *,
    time_budget_s: float = 0.1,
    **search: Any,
) -> tuple[str, int, list[dict]]:
    """``--compress auto``: the codec (a key of ``candidates``, "" for none) and the period with
    the shortest predicted time to a loss, and the table they were chosen from (one row per
    codec and period weighed). ``candidates`` holds each codec's compute model with its messages
    and encoding priced, the link, and the lag a run with it lands at. ``H``: the period, or None to choose
    it too (``choose_period``, per codec). A codec's score carries ``CODEC_MARGIN``; ties go to
    the first candidate (uncompressed first). Each candidate comes with its link line (under
    the trust options; a clipped quantiser's verdict is a round trip more) and its lag."""
    if not candidates:
        raise ValueError("--compress auto needs at least one candidate codec")
    table = []
    for spec, (compute, link, lag) in candidates.items():
        if H is None:
            rows = choose_period(compute, link, choose, time_budget_s=time_budget_s, lag=lag, **search)[1]
        else:
            schedule = search_schedule(compute, link, H, time_budget_s=time_budget_s, lag=lag, **search)
            step = predict_schedule(compute, link, schedule.iterations, schedule.lag)
            factor = choose.steps_factor(H)
            rows = [
                {
                    "H": H,
                    "predicted_step_s": step,
                    "steps_factor": factor,
                    "time_to_loss_factor": step * factor / compute.compute_s,
                }
            ]
        table += [{"codec": spec, "lag": lag, **row} for row in rows]
    best = min(table, key=lambda row: row["time_to_loss_factor"] * (1 + CODEC_MARGIN if row["codec"] else 1))
    return best["codec"], best["H"], table
