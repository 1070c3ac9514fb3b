"""The planner on sites: a flat ring against two levels, and the period of each level.

On a topology of S sites (``netem/topology.py``: k_s hosts each, a LAN of rate L inside, one
uplink of rate W_s per site), an all-reduce of M bytes costs, with the profile's per-hop latency
a and link efficiency e (``plan/network.py``):

- **flat** (a ring through every host): each site boundary the ring crosses carries
  2 (N-1)/N M through one uplink:       T = 2 (N-1) a + 2 (N-1)/N M / (e W_min);
- **two levels** (``comm/hierarchy.py``): a LAN all-reduce inside each site, the stripes across
  (2 (S-1)/S M through each uplink in all, spread over its members), a LAN all-reduce again:
  T = (4 (k-1) + 2 (S-1)) a + 4 (k-1)/k M / (e L) + 2 (S-1)/S M / (e W_min),  k the largest site;
- **one site's average** (``--site-H``):  T = 2 (k-1) a + 2 (k-1)/k M / (e L).

A periodic method with ``--site-H h`` averages inside the sites every h steps and across them
every H (two levels), so its mean step is

    compute + T_two_level(M) / H + T_site(M) (1/h - 1/lcm(h, H))

(a step that is a multiple of both syncs across sites only). The drift a replica accumulates
before it meets the others is what costs loss, so the planner picks the *smallest* periods that
keep the step within ``speed`` (0.95) of ``nosync``'s: first H, then h, from the candidates; a
step time is a prediction, the loss it costs is left to the run (``geotrain bench``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from geotrain.netem.topology import Topology
from geotrain.plan.cost import ComputeModel, LinkModel, whole_model_allreduce_s
from geotrain.plan.network import NetworkModel

PERIODS = (1, 2, 4, 5, 8, 10, 16, 20, 25, 32, 40, 50, 64, 80, 100, 128, 200, 250, 500)


@dataclass(frozen=True)
class SiteLinks:
    """The all-reduce lines on a topology: a flat ring, the two levels, one site's LAN."""

    flat: LinkModel
    two_level: LinkModel
    site: LinkModel


def site_links(net: NetworkModel, topology: Topology) -> SiteLinks:
    """Each line a ring of ``net``'s: the flat one through the slowest uplink, a site's on its
    LAN, and the stripes' across sites (one carrier per site, the slowest uplink) between two
    of the site's."""
    wan = [min(topology.wan_bps)]
    flat = net.link_model(topology.workers, wan, "ring")
    site = net.link_model(max(topology.sites), [topology.lan_bps], "ring")  # a site of one: 0
    across = net.link_model(len(topology.sites), wan, "ring")
    two_level = LinkModel(
        2 * site.alpha_s + across.alpha_s, 2 * site.beta_s_per_byte + across.beta_s_per_byte
    )
    return SiteLinks(flat, two_level, site)


def two_level_gather_link(net: NetworkModel, topology: Topology) -> LinkModel | None:
    """A gather of every worker's message in two levels (``comm.hierarchy.two_level_gather``: a
    coordinate-wise statistic's, ``--aggregate median|trimmed``) as a line in an all-reduce's
    units (``alpha + beta * M``, M the bytes of one worker's message). Each of a site's k members
    carries its own message to the S - 1 other sites, the k of them through the site's uplink at
    once: k (S - 1) M; then each shares the S messages it holds with its k - 1 site-mates on the
    LAN: (k - 1) S M. A flat ring gather puts N - 1 = k S - 1 messages through an uplink it
    crosses, so on 2 sites of 2 the two levels carry two thirds of it. None where a run gathers
    flat: sites of unequal size (``SiteGroups.even``), one site, or sites of one host (which
    form no site groups: ``comm.hierarchy.site_groups``)."""
    if len(topology.sites) < 2 or len(set(topology.sites)) != 1 or topology.sites[0] == 1:
        return None
    k, s = topology.sites[0], len(topology.sites)
    wan = net.efficiency * min(topology.wan_bps) / 8
    lan = net.efficiency * topology.lan_bps / 8
    return LinkModel((s - 1 + k - 1) * net.hop_latency_s, k * (s - 1) / wan + (k - 1) * s / lan)


def predict_two_level(compute: ComputeModel, links: SiteLinks, H: int, site_H: int = 0) -> float:
    """A periodic method (localsgd, diloco) over two levels: across sites every H steps, inside
    them every ``site_H`` (0: never)."""
    step = compute.compute_s + whole_model_allreduce_s(compute, links.two_level) / H
    if site_H:
        per_step = 1 / site_H - 1 / math.lcm(site_H, H)
        step += whole_model_allreduce_s(compute, links.site) * per_step
    return step


def choose_periods(
    compute: ComputeModel, links: SiteLinks, speed: float = 0.95, candidates: tuple[int, ...] = PERIODS
) -> dict[str, Any]:
    """The smallest H across sites, then the smallest ``site_H`` below it, whose predicted step
    is within ``speed`` of ``nosync``'s; with each candidate's prediction. ``site_H`` 0 (no
    average inside sites) where no candidate fits beside the chosen H."""
    if not 0 < speed <= 1:
        raise ValueError(f"--speed is a fraction of nosync's step rate in (0, 1], got {speed}")
    budget = compute.compute_s / speed
    flat = [
        {"H": h, "step_s": compute.compute_s + whole_model_allreduce_s(compute, links.flat) / h}
        for h in candidates
    ]
    across = [{"H": h, "step_s": predict_two_level(compute, links, h)} for h in candidates]
    H = next((row["H"] for row in across if row["step_s"] <= budget), None)
    within = []
    site_H = 0
    if H is not None and links.site.beta_s_per_byte > 0:
        within = [
            {"site_H": h, "step_s": predict_two_level(compute, links, H, h)} for h in candidates if h < H
        ]
        site_H = next((row["site_H"] for row in within if row["step_s"] <= budget), 0)
    flat_H = next((row["H"] for row in flat if row["step_s"] <= budget), None)
    return {
        "speed": speed,
        "H": H,
        "site_H": site_H,
        "flat_H": flat_H,
        "predicted_step_s": predict_two_level(compute, links, H, site_H) if H else None,
        "flat": flat,
        "two_level": across,
        "site": within,
    }


def format_sites(sites: dict[str, Any], compute_s: float) -> str:
    """The plan's lines on sites: the all-reduce lines, and the periods chosen."""
    lines = [
        f"sites {sites['topology']}: all-reduce of the model (M = {sites['model_bytes'] / 1e6:.1f} MB) "
        f"flat {sites['allreduce_s']['flat']:.2f} s, two levels {sites['allreduce_s']['two_level']:.2f} s, "
        f"inside a site {sites['allreduce_s']['site']:.2f} s"
    ]
    choice = sites["choice"]
    speed = f"{choice['speed']:.2f}"
    if choice["H"] is None:
        lines.append(f"no period up to {PERIODS[-1]} keeps the step within {speed} of nosync on two levels")
        return "\n".join(lines)
    step = choice["predicted_step_s"]
    inside = f"--site-H {choice['site_H']}" if choice["site_H"] else "no average inside sites"
    flat = f"H {choice['flat_H']}" if choice["flat_H"] else f"no H up to {PERIODS[-1]}"
    lines.append(
        f"within {speed} of nosync: --hierarchy sites --H {choice['H']} with {inside} "
        f"(predicted {step:.3f} s, {compute_s / step:.2f} of nosync); a flat ring needs {flat} "
        "(fp32 averages: diloco with --compress none, its int4 default runs flat)"
    )
    return "\n".join(lines)
