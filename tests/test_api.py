"""geotrain.wrap: any training loop, its options checked, its state and counters exposed.

Pure logic on a world of one first, then a real gloo group of 2 against the closed form of local
SGD, then the example script under torchrun.
"""

from __future__ import annotations

import importlib.util
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import geotrain
from geotrain.sync import ConfigError
from helpers import run_workers

ROOT = Path(__file__).resolve().parents[1]


def _model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _train(sync, rank: int, steps: range) -> list[bool]:
    synced = []
    for step in steps:
        gen = torch.Generator().manual_seed(100 * rank + step)
        x = torch.randn(8, 4, generator=gen)
        loss = (sync.model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        loss.backward()
        synced.append(sync.step())
        sync.zero_grad()
    return synced


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"algo": "adamw"}, "unknown algorithm 'adamw'; accepted: ssgd, ddp"),
        ({"algo": "diloco", "tau": 2}, "diloco does not take tau; it takes: H, outer_lr, outer_momentum"),
        ({"algo": "diloco", "H": 0}, "H (inner steps between outer steps) must be an integer >= 1"),
        ({"algo": "diloco", "compress": "int3"}, "int3"),
        ({"algo": "dreamddp", "H": 0}, "H (the schedule's period in iterations) must be an integer >= 1"),
        ({"algo": "ssgd", "H": 4}, "ssgd does not take H"),
    ],
)
def test_bad_options_are_refused_with_what_to_change(kwargs, needle):
    model, opt = _model_and_optimizer()
    with pytest.raises(ConfigError) as e:
        geotrain.wrap(model, opt, **kwargs)
    assert needle in str(e.value)


def test_wrap_refuses_what_is_not_a_model_or_an_optimizer():
    model, opt = _model_and_optimizer()
    with pytest.raises(ConfigError, match="takes a torch.nn.Module as the model, got dict"):
        geotrain.wrap({}, opt)
    with pytest.raises(ConfigError, match="takes a torch.optim.Optimizer, got list"):
        geotrain.wrap(model, [])


def test_a_wrapped_loop_resumes_from_its_state_exactly():
    """diloco H 3, 7 steps in one go equals 4 steps, a state_dict through torch.save, and 3 more
    in a fresh model, optimizer and wrap; step() says which steps synchronised."""
    model, opt = _model_and_optimizer()
    whole = geotrain.wrap(model, opt, algo="diloco", H=3)
    assert _train(whole, 0, range(7)) == [False, False, True, False, False, True, False]
    whole.finish()

    model2, opt2 = _model_and_optimizer()
    first = geotrain.wrap(model2, opt2, algo="diloco", H=3)
    _train(first, 0, range(4))
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    model3, opt3 = _model_and_optimizer(seed=5)  # different: everything comes from the state
    second = geotrain.wrap(model3, opt3, algo="diloco", H=3)
    buffer.seek(0)
    second.load_state_dict(torch.load(buffer, weights_only=False))
    _train(second, 0, range(4, 7))
    second.finish()
    for a, b in zip(model.parameters(), model3.parameters(), strict=True):
        assert torch.equal(a, b)
    assert whole.stats["sent_bytes"] == 0 and whole.stats["calls"] == 0  # a world of one
    with pytest.raises(RuntimeError, match="step\\(\\) after finish\\(\\)"):
        whole.step()
    with pytest.raises(ValueError, match="lacks optimizer, sync"):
        second.load_state_dict({"model": {}})


def _local_sgd_pair(rank: int, world_size: int) -> dict:
    model, opt = _model_and_optimizer()
    sync = geotrain.wrap(model, opt, algo="localsgd", H=2)
    records = []
    for step in range(4):
        gen = torch.Generator().manual_seed(100 * rank + step)
        x = torch.randn(8, 4, generator=gen)
        (sync.model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean().backward()
        # This worker's own SGD step, before any average: p - 0.1 grad.
        local = [p.detach().add(p.grad, alpha=-0.1) for p in model.parameters()]
        synced = sync.step()
        sync.zero_grad()
        records.append(
            {"local": local, "after": [p.detach().clone() for p in model.parameters()], "synced": synced}
        )
    sync.finish()
    return {"records": records, "stats": sync.stats}


def test_on_a_real_group_local_sgd_averages_every_h_steps_and_counts_its_bytes():
    """Two workers, localsgd H 2: after steps 2 and 4 the parameters are the mean of the two
    workers' own steps, bitwise equal on both; between them each keeps its own; each average
    sends the model's fp32 bytes once (a ring of 2), counted in sync.stats."""
    ranks = run_workers(_local_sgd_pair, 2)
    n_bytes = 4 * sum(p.numel() for p in _model_and_optimizer()[0].parameters())
    for step in range(4):
        recs = [r["records"][step] for r in ranks]
        assert all(rec["synced"] == (step % 2 == 1) for rec in recs)
        for i in range(len(recs[0]["after"])):
            if step % 2:
                mean = (recs[0]["local"][i] + recs[1]["local"][i]) / 2
                torch.testing.assert_close(recs[0]["after"][i], mean, atol=1e-7, rtol=1e-6)
                assert torch.equal(recs[0]["after"][i], recs[1]["after"][i])
            else:
                assert all(torch.equal(rec["after"][i], rec["local"][i]) for rec in recs)
    assert ranks[0]["stats"]["sent_bytes"] == 2 * n_bytes  # two averages, one model each
    assert ranks[0]["stats"]["calls"] == 2


def _dreamddp_planning_from_its_first_steps(rank: int, world_size: int, compress: str = "") -> dict:
    model, opt = _model_and_optimizer()
    sync = geotrain.wrap(model, opt, algo="dreamddp", H=2, compress=compress)  # no plan, no loss function
    synced, equal_after = [], []
    for step in range(8):
        gen = torch.Generator().manual_seed(100 * rank + step)
        x = torch.randn(8, 4, generator=gen)
        (sync.model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean().backward()
        synced.append(sync.step())
        sync.zero_grad()
        equal_after.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    schedule = sync.algorithm.schedule
    sync.finish()
    return {
        "synced": synced,
        "after": equal_after,
        "H": schedule.H,
        "observed": sync.algorithm.profile["observed_steps"],
        "timed_codecs": sorted(sync.algorithm.profile.get("codecs", {})),
        "codec_choice": sync.algorithm.codec_choice,
        "codec": sync.algorithm.codec.spec() if sync.algorithm.codec else "",
        "final": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
    }


@pytest.mark.parametrize("compress", ["", "auto"])
def test_dreamddp_without_a_plan_times_its_first_steps_and_plans_from_them(compress):
    """wrap(algo="dreamddp") with neither plan= nor profile=: the first 4 steps are timed as the
    loop runs them, each averaging every layer (the replicas stay equal), then the schedule is
    planned from the 3 after the warm-up and the loop goes on with it; finish() leaves one model.
    With compress="auto" the candidate codecs are timed then too, and the codec chosen."""
    ranks = run_workers(_dreamddp_planning_from_its_first_steps, 2, compress)
    assert ranks[0]["codec_choice"] == ranks[1]["codec_choice"] and ranks[0]["codec"] == ranks[1]["codec"]
    for r in ranks:
        assert r["synced"][:4] == [True] * 4 and r["H"] == 2 and r["observed"] == 3
        if compress:
            assert r["timed_codecs"] == [
                "chunktopk:warmup=0,chunk=4096,k=64,bits=2,decay=1.0",
                "int4:warmup=0,block=256",
                "int8:warmup=0,block=256",
            ]
            assert {row["codec"] for row in r["codec_choice"]} == {"", *r["timed_codecs"]}
        else:
            assert r["timed_codecs"] == [] and r["codec_choice"] is None
    for step in range(4):
        assert torch.equal(ranks[0]["after"][step], ranks[1]["after"][step])
    assert torch.equal(ranks[0]["final"], ranks[1]["final"])


@pytest.mark.parametrize(
    "algo, extra",
    [
        ("diloco", ["--pace", "time", "--slow", "1"]),  # rank 1 skips steps; rank 0 none
        # (dreamddp planning from its first steps in a wrapped loop: test_dreamddp_without_a_plan...)
    ],
)
def test_the_example_loop_runs_under_torchrun_and_ends_with_one_model(algo, extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(ROOT / "examples" / "plain_loop.py"), "--algo", algo, "--H", "5", "--steps", "20", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pattern = r"rank (\d): loss ([0-9.]+) sent (\d+) bytes digest ([0-9a-f]{16}) skipped (\d+)"
    lines = {r: rest for r, *rest in re.findall(pattern, proc.stdout)}
    assert sorted(lines) == ["0", "1"]
    assert len({digest for _, _, digest, _ in lines.values()}) == 1  # the same parameters on both
    assert all(int(sent) > 0 for _, sent, _, _ in lines.values())
    skipped = {r: int(rest[-1]) for r, rest in lines.items()}
    assert skipped["0"] == 0 and (skipped["1"] > 0) == bool(extra), skipped


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("peft") is None,
    reason="needs the hf extra: pip install -e '.[hf]' (transformers, peft)",
)
def test_a_hugging_face_lm_with_lora_syncs_only_its_adapters():
    """GPT-2's architecture from a config, LoRA on c_attn (r 8): diloco H 5 averages only the
    trainable adapters, so 4 syncs send 4 x their fp32 bytes (a ring of 2; ``--compress none``:
    diloco's default is int4), and both ranks end with the same parameters, frozen base included."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(ROOT / "examples" / "hf_lora.py"), "--algo", "diloco", "--H", "5", "--steps", "20"]
    cmd += ["--compress", "none"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = re.findall(
        r"rank (\d): trainable (\d+) sent (\d+) loss [0-9.]+ digest ([0-9a-f]{16})", proc.stdout
    )
    assert sorted(r for r, *_ in lines) == ["0", "1"]
    (trainable,) = {int(t) for _, t, _, _ in lines}
    assert trainable == 2 * (8 * 64 + 8 * 192)  # A (r x in) and B (out x r) on each layer's c_attn
    assert {int(s) for _, _, s, _ in lines} == {4 * 4 * trainable}
    assert len({d for *_, d in lines}) == 1
