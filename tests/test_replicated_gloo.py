"""What each algorithm says is bitwise equal on every worker (``replicated_parts``) must be: a
snapshot keeps only a digest of those parts for a lost host, and rebuilds them from a survivor's
copy, which the digest check refuses if they differ (the host could not be rebuilt from peers)."""

from __future__ import annotations

import pytest
import torch

from helpers import run_workers

ALGOS = [
    ("ssgd", {}),
    ("ddp", {}),
    ("localsgd", {"H": 2}),
    ("diloco", {"H": 2}),
    ("diloco", {"H": 2, "warm_start": 1}),
    ("co2", {"H": 2}),  # eager by default: each worker starts a period from its own point
    ("co2", {"H": 2, "eager": False}),
    ("sparseloco", {"H": 2}),  # overlap auto: decided at the first outer step
    ("sparseloco", {"H": 2, "overlap": True}),
    ("sparseloco", {"H": 2, "overlap": False}),
    ("streaming", {"H": 4, "fragments": 2}),
    ("demo", {}),
    ("nosync", {}),
]


def _claims(rank, world_size, algos):
    """Each algorithm trained 4 steps on this worker's own batches: after every step, the
    digest of each part this worker's algorithm says is replicated."""
    from geotrain.comm.communicator import Communicator
    from geotrain.ft.state import capture, tensor_digest
    from geotrain.models.gpt import GPT, gpt_config
    from geotrain.sync import build_sync

    out = {}
    for algo, options in algos:
        torch.manual_seed(0)
        model = GPT(gpt_config("tiny", 256, 16))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sync = build_sync(algo, model, opt, Communicator(), dict(options))
        gen = torch.Generator().manual_seed(100 + rank)
        seen = []
        for step in range(1, 5):
            xy = torch.randint(0, 256, (2, 17), generator=gen)
            sync.model(xy[:, :-1], xy[:, 1:])[1].backward()
            sync.before_step()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync.after_step()
            state = capture(
                step=step, model=model, optimizer=opt, sync=sync, generators={"g": gen},
                progress={}, replicated=sync.replicated_parts(),
            )  # fmt: skip
            seen.append({p: tensor_digest(state["parts"][p]) for p in state["shared"]})
        sync.close()
        out[f"{algo} {options}"] = seen
    return out


@pytest.mark.timeout(240)
def test_every_part_an_algorithm_calls_replicated_is_equal_on_every_worker():
    results = run_workers(_claims, 2, ALGOS, timeout=220)
    wrong = []
    for case, steps in results[0].items():
        for step, claimed in enumerate(steps, start=1):
            for part, digest in claimed.items():
                others = [r[case][step - 1].get(part) for r in results[1:]]
                if any(o != digest for o in others):
                    wrong.append(f"{case} step {step}: '{part}'")
    assert not wrong, "claimed replicated, but differs between workers:\n" + "\n".join(wrong)
