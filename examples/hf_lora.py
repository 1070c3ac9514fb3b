"""A Hugging Face causal LM, fine-tuned with LoRA adapters, spread over workers with geotrain.wrap.

    pip install -e '.[hf]'
    torchrun --nproc-per-node 2 examples/hf_lora.py --algo diloco --H 5 [--no-lora]

The model is GPT-2's architecture built from a small config (nothing is downloaded). With LoRA
(peft) the base weights are frozen and only the adapters train, so the algorithm averages only
them: each sync sends the adapters' bytes, not the model's. Every rank prints what it trained
and sent, and a digest of the parameters, equal on all at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import torch
import torch.distributed as dist

import geotrain
import geotrain.api
from geotrain.launch.dist import device_and_backend, uses_nccl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algo", default="diloco")
    parser.add_argument("--H", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lora", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--compress", default="", help="a codec (none: fp32; default: the algorithm's)")
    parser.add_argument(
        "--backend", default="auto", help="auto (NCCL where each worker has a GPU of its own), nccl or gloo"
    )
    parser.add_argument("--autocast", action="store_true", help="forward passes in bf16 (torch.autocast)")
    args = parser.parse_args()
    try:
        from peft import LoraConfig, get_peft_model
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as e:
        raise SystemExit(f"this example needs transformers and peft: pip install -e '.[hf]' ({e})") from None

    # This worker's GPU (else the CPU); NCCL for CUDA tensors paired with gloo for the few CPU
    # numbers geotrain exchanges, or gloo alone; torchrun sets the rendezvous.
    device, backend = device_and_backend(args.backend)
    dist.init_process_group(backend, device_id=device if uses_nccl(backend) else None)
    rank = dist.get_rank()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    if args.lora:
        model = get_peft_model(
            model, LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], lora_dropout=0.0)
        )
    model.to(device).train()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    accepted = geotrain.api.accepted_options(args.algo)
    options = {"H": args.H} if "H" in accepted else {}
    if args.compress and "compress" in accepted:
        options["compress"] = args.compress
    sync = geotrain.wrap(model, optimizer, algo=args.algo, **options)

    data = torch.Generator().manual_seed(1 + rank)  # this worker's shard of (random) token streams
    for _ in range(args.steps):
        tokens = torch.randint(0, 256, (4, 32), generator=data).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.autocast):
            loss = sync.model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        sync.step()
        sync.zero_grad()
    sync.finish()

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    digest = hashlib.sha256(flat.cpu().numpy().tobytes()).hexdigest()[:16]
    sent = sync.stats["sent_bytes"]
    # One write per line: both ranks share torchrun's stdout, and print's separate write of the
    # newline (unbuffered under PYTHONUNBUFFERED) lets the other rank's line land mid-line.
    sys.stdout.write(
        f"rank {rank}: trainable {trainable} sent {sent} loss {loss.item():.4f} digest {digest}\n"
    )
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
