"""The CUDA path: every algorithm and codec on a model whose parameters live on a GPU.

Skipped without CUDA (CI has none); run where a GPU is lent (``benchmarks/gpu_check.sh``). With
one GPU, NCCL cannot hold two ranks (it refuses two on one device), so the groups of 2 here
are gloo's, which moves CUDA tensors too: what is checked is that no computation mixes devices,
that every replica ends bitwise equal, and that each run lands where the same run on the CPU
does. A world of one runs the examples under NCCL (with gloo for CPU tensors), as
``geotrain.wrap`` users on one GPU per process start them.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (none visible)", allow_module_level=True)

import geotrain  # noqa: E402
from helpers import owners_means, run_workers  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEPS = 12

# (algorithm, its options): every algorithm, and every codec through one that sends it
CASES = [
    ("ssgd", {}),
    ("ddp", {}),
    ("localsgd", {"H": 3}),
    ("diloco", {"H": 3}),
    ("dreamddp", {"H": 3}),
    ("dreamddp", {"H": 2, "compress": "int4"}),
    ("dreamddp", {"H": 2, "compress": "powersgd:rank=2"}),
    ("streaming", {"H": 4, "fragments": 2}),  # carry (its default) and 4-bit error feedback
    ("streaming", {"H": 4, "fragments": 2, "carry": False}),  # the paper's mix
    ("co2", {"H": 3}),  # int4 gathered, with error feedback
    ("co2", {"H": 3, "bits": 32}),  # the fp32 all-reduce
    ("co2", {"H": 3, "tau": 1}),  # each mean landing a step into the next period
    ("sparseloco", {"H": 3, "chunk": 64, "k": 8}),  # overlap auto: decided from a timed gather
    ("sparseloco", {"H": 3, "chunk": 64, "k": 8, "overlap": False}),
    ("sparseloco", {"H": 3, "chunk": 64, "k": 8, "overlap": True, "tau": 1}),
    ("demo", {"chunk": 8, "k": 4}),
    ("ssgd", {"compress": "int8"}),
    ("ssgd", {"compress": "acpsgd:rank=2"}),
    ("ssgd", {"compress": "topk:ratio=0.1"}),
    ("ssgd", {"compress": "adatopk:ratio=0.1"}),
    ("ssgd", {"compress": "fp16"}),
    ("ddp", {"compress": "bf16"}),
    ("localsgd", {"H": 3, "compress": "sign"}),
    ("diloco", {"H": 3, "compress": "chunktopk:chunk=64,k=8"}),
]


def _run(rank: int, world_size: int, device: str, algo: str, options: dict, autocast: bool) -> dict:
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    torch.manual_seed(0)
    layers = [nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)]
    model = nn.Sequential(*layers).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def batch(step: int):
        gen = torch.Generator().manual_seed(1000 * rank + step)
        x = torch.randn(32, 16, generator=gen)
        return x.to(dev), x.sum(dim=1, keepdim=True).to(dev)

    profile = None
    if algo == "dreamddp":

        def profile() -> torch.Tensor:  # noqa: E306
            x, y = batch(10_000)
            return nn.functional.mse_loss(model(x), y)

    sync = geotrain.wrap(model, opt, algo=algo, profile=profile, **options)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            loss = nn.functional.mse_loss(sync.model(x).float(), y)
        loss.backward()
        sync.step()
        sync.zero_grad()
        losses.append(loss.item())
    sync.finish()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {
        "params": flat.cpu(),
        "devices": sorted({str(p.device) for p in model.parameters()}),
        "losses": losses,
        "sent": sync.stats["sent_bytes"],
    }


def _decides_from_timings(algo: str, options: dict) -> bool:
    """DreamDDP plans its layers, AdaTopK its ratios and SparseLoCo's ``overlap="auto"`` whether
    to overlap (and then sends its arrival figure) from timings, which differ by device and load."""
    auto_overlap = algo == "sparseloco" and options.get("overlap", "auto") == "auto"
    return algo == "dreamddp" or "adatopk" in options.get("compress", "") or auto_overlap


def _case_id(algo: str, options: dict) -> str:
    overlap = options.get("overlap")
    suffix = "" if overlap is None else "-overlap" if overlap else "-no-overlap"
    suffix += "".join(f"-{key}={options[key]}" for key in ("carry", "bits", "tau") if key in options)
    return f"{algo}-{options.get('compress', 'fp32')}{suffix}"


@pytest.mark.parametrize("algo, options", CASES, ids=[_case_id(a, o) for a, o in CASES])
def test_every_algorithm_and_codec_runs_on_cuda_and_lands_where_the_cpu_does(algo, options):
    gpu = run_workers(_run, 2, "cuda:0", algo, options, False, timeout=240)
    cpu = run_workers(_run, 2, "cpu", algo, options, False, timeout=240)
    assert gpu[0]["devices"] == ["cuda:0"]
    assert torch.equal(gpu[0]["params"], gpu[1]["params"]), "the replicas differ after finish()"
    assert torch.isfinite(gpu[0]["params"]).all()
    if not _decides_from_timings(algo, options):
        assert gpu[0]["sent"] == cpu[0]["sent"], "the GPU run sent other bytes than the CPU run"
    # Float sums run in another order on the GPU: close, not bitwise; a top-k or a sign can
    # flip on such a difference, and DreamDDP plans its layers from timings, which differ by
    # device: those are held to the loss only.
    codec = options.get("compress", "")
    selects = "topk" in codec or "sign" in codec or algo in ("sparseloco", "demo", "dreamddp")
    if selects:
        assert abs(gpu[0]["losses"][-1] - cpu[0]["losses"][-1]) < 0.25 * max(1.0, cpu[0]["losses"][-1])
    else:
        assert torch.allclose(gpu[0]["params"], cpu[0]["params"], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("algo, options", [("diloco", {"H": 3}), ("dreamddp", {"H": 2, "compress": "int4"})])
def test_bf16_autocast_trains_on_cuda_with_fp32_parameters(algo, options):
    ranks = run_workers(_run, 2, "cuda:0", algo, options, True, timeout=240)
    fp32 = run_workers(_run, 2, "cuda:0", algo, options, False, timeout=240)
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])
    assert ranks[0]["params"].dtype == torch.float32
    assert ranks[0]["losses"][-1] < ranks[0]["losses"][0]
    assert ranks[0]["losses"][0] != fp32[0]["losses"][0]  # the forward ran in bfloat16


def _torchrun(args: list[str], nproc: int, timeout: float = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


@pytest.mark.parametrize("algo", ["diloco", "dreamddp", "sparseloco", "ddp"])
def test_the_example_runs_under_nccl_with_one_process_per_gpu(algo):
    proc = _torchrun(["examples/plain_loop.py", "--algo", algo, "--steps", "12"], nproc=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0: loss" in proc.stdout


def test_the_lora_example_runs_on_two_ranks_sharing_a_gpu_through_gloo_with_autocast():
    proc = _torchrun(["examples/hf_lora.py", "--algo", "dreamddp", "--steps", "8", "--autocast"], nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    digests = {line.split("digest ")[1] for line in proc.stdout.splitlines() if "digest" in line}
    assert len(digests) == 1, proc.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["--algo", "dreamddp", "--autocast", "bf16"],
        ["--algo", "dreamddp", "--compress", "int4", "--H", "2"],
        ["--algo", "diloco", "--H", "4", "--compress", "powersgd:rank=2"],
        ["--algo", "streaming", "--H", "8"],
        ["--algo", "co2", "--H", "4"],
    ],
    ids=lambda a: "-".join(a[1::2]),
)
def test_the_cli_trains_two_hosts_on_one_gpu(tmp_path, args):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "geotrain", "run", "--workers", "2", "--no-netem", "--model", "tiny",
           "--steps", "16", "--no-progress", "--run-dir", str(run_dir), *args]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["backend"] == "gloo"  # two ranks on one GPU: NCCL would refuse them
    assert summary["device"] == "cuda:0"
    assert summary["final_val_loss"] < summary["first_train_loss"]


def _resumed(rank: int, world_size: int, algo: str, options: dict) -> dict:
    """12 steps in one go, and 5 steps, the state through torch.save onto the CPU (as a snapshot
    holds it), then 7 more in a fresh model, optimizer and wrap: both on cuda:0."""
    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)

    def build(seed: int):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)).to(dev)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train(sync, steps: range) -> None:
        for step in steps:
            gen = torch.Generator().manual_seed(1000 * rank + step)
            x = torch.randn(32, 16, generator=gen).to(dev)
            nn.functional.mse_loss(sync.model(x), x.sum(dim=1, keepdim=True)).backward()
            sync.step()
            sync.zero_grad()

    model, opt = build(0)
    whole = geotrain.wrap(model, opt, algo=algo, **options)
    train(whole, range(12))
    whole.finish()
    model2, opt2 = build(0)
    first = geotrain.wrap(model2, opt2, algo=algo, **options)
    train(first, range(5))
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    model3, opt3 = build(5)  # different: everything comes from the state
    second = geotrain.wrap(model3, opt3, algo=algo, **options)
    second.load_state_dict(torch.load(buffer, map_location="cpu", weights_only=False))
    train(second, range(5, 12))
    second.finish()
    flat = [torch.cat([p.detach().reshape(-1) for p in m.parameters()]).cpu() for m in (model, model3)]
    return {"whole": flat[0], "resumed": flat[1]}


RESUMED_CASES = [
    ("ssgd", {"compress": "powersgd:rank=2"}),
    ("ssgd", {"compress": "int8"}),
    ("diloco", {"H": 3, "compress": "chunktopk:chunk=64,k=8"}),
    ("co2", {"H": 3}),
    ("co2", {"H": 3, "bits": 32}),
    ("co2", {"H": 3, "tau": 2}),
    ("streaming", {"H": 4, "fragments": 2}),
    ("streaming", {"H": 4, "fragments": 2, "carry": False}),
    ("demo", {"chunk": 8, "k": 4}),
]


@pytest.mark.parametrize("algo, options", RESUMED_CASES, ids=[_case_id(a, o) for a, o in RESUMED_CASES])
def test_a_state_restored_from_the_cpu_resumes_on_cuda_where_the_run_would_have_been(algo, options):
    ranks = run_workers(_resumed, 2, algo, options, timeout=240)
    for r in ranks:
        assert torch.allclose(r["whole"], r["resumed"], rtol=1e-5, atol=1e-6)


def test_wrap_pairs_a_plain_nccl_group_with_gloo_for_its_cpu_numbers(tmp_path):
    script = tmp_path / "plain_nccl.py"
    script.write_text(
        "import torch, torch.distributed as dist, torch.nn as nn, geotrain\n"
        "dist.init_process_group('nccl', device_id=torch.device('cuda', 0))\n"
        "model = nn.Linear(4, 1).cuda()\n"
        "sync = geotrain.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), algo='diloco', H=2)\n"
        "for _ in range(4):\n"
        "    model(torch.randn(8, 4, device='cuda')).pow(2).mean().backward()\n"
        "    sync.step()\n"
        "    sync.zero_grad()\n"
        "sync.finish()\n"
        "print('backend', dist.get_backend(sync.algorithm.comm.group))\n"
        "dist.destroy_process_group()\n"
    )
    proc = _torchrun([str(script)], nproc=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "backend cpu:gloo,cuda:nccl" in proc.stdout


@pytest.mark.parametrize(
    "spec, how, spoiled",
    [
        ("int4", "-", 1),  # one owner: the shard bound agreed in band, nobody left out
        ("int4", "scale=1e6", 1),  # one owner: a shard above the agreed bound left out
        ("int4:owners=2", "-", 1),  # two owners, digests and stamps, nothing disputed
        ("int4:owners=2", "signflip", 3),  # a persistent spoiler: second owners move, it is blamed
    ],
    ids=lambda v: str(v),
)
def test_checked_quantised_means_on_cuda_decide_as_on_the_cpu(spec, how, spoiled):
    """The norm check's shard bound, the second owners' digests and stamps, and the blame they
    lead to, with the codec's rows on the GPU (3 ranks sharing it through gloo): every worker
    holds the same means, on the GPU, and every verdict (who is left out, where the second
    owners sit, the bytes sent) is the CPU's; the means are the CPU's but for a rounding edge."""
    gpu = run_workers(owners_means, 3, spec, how, 10.0, spoiled, "cuda:0", timeout=240)
    cpu = run_workers(owners_means, 3, spec, how, 10.0, spoiled, "cpu", timeout=240)
    for r in range(3):
        assert gpu[r]["devices"] == ["cuda:0"]
        for mine, first, ref in zip(gpu[r]["means"], gpu[0]["means"], cpu[r]["means"], strict=True):
            assert torch.equal(mine, first), "the workers hold different means"
            # A sum in another order can move a value across a rounding edge of the re-quantised
            # mean: one level of a few elements, never more.
            apart = (mine - ref).abs() > 1e-5
            assert apart.float().mean() < 0.005, f"{int(apart.sum())} of {mine.numel()} values differ"
        for key in ("rejected", "offsets", "sent"):
            assert gpu[r][key] == cpu[r][key], key
    if how == "scale=1e6" or how == "signflip":
        assert gpu[0]["rejected"].get(2, 0) >= 1, gpu[0]["rejected"]
    else:
        assert gpu[0]["rejected"] == {}


def test_a_gpu_tensor_digests_as_its_bytes_on_the_cpu_through_the_pinned_buffer():
    """A digest that workers compare may not depend on where the tensor lives: a GPU tensor
    larger than the pinned buffer, copied through it a chunk at a time, digests as on the CPU."""
    from geotrain.comm.digest import CHUNK_BYTES, bytes_digest

    x = torch.randn(CHUNK_BYTES // 2 + 3)  # two chunks and a part of a third, in bytes
    assert bytes_digest(x.cuda(), 16, b"-") == bytes_digest(x, 16, b"-")
    assert bytes_digest(x.cuda()[1:]) == bytes_digest(x[1:])
    halves = x[: 2 * (x.numel() // 2)].reshape(-1, 2)  # a strided column, as a codec's copies are
    assert bytes_digest(halves.cuda()[:, 1]) == bytes_digest(halves[:, 1])
