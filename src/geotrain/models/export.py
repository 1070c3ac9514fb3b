"""``geotrain export RUN_DIR --to DIR``: a run's final model as files ``transformers`` loads alone.

The run's ``checkpoint.pt`` holds the final model (the replicas' end-of-run average) and what
built it (``describe``). Export rebuilds that model, loads the weights and writes:

- a Hugging Face model (``--model hf:...``): ``save_pretrained`` (``config.json`` and
  ``model.safetensors``);
- geotrain's GPT: the same files in GPT-2's layout (``GPT2LMHeadModel``, exact GELU, untied
  head), so ``AutoModelForCausalLM.from_pretrained(DIR)`` gives the same logits without geotrain;
- with LoRA: the adapters merged into the base (``W + B A * alpha / r``), and the adapters alone
  in ``adapters.safetensors`` for those who keep them apart.

``geotrain.json`` beside them records where the model came from (run, step, validation loss).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from geotrain.models import ModelError, ModelSpec
from geotrain.models.gpt import GPT, GPTConfig
from geotrain.models.hf import LoraSpec, apply_lora, is_hf, merge_lora, set_dtype

# Our Linear weights are (out, in); GPT-2's Conv1D stores (in, out).
_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def load_trained(run_dir: Path) -> tuple[nn.Module, ModelSpec, dict[str, Any]]:
    """The run's final model, rebuilt (adapters unmerged), its spec and the checkpoint's record."""
    path = run_dir / "checkpoint.pt"
    if not path.exists():
        raise ModelError(f"{run_dir}: no checkpoint.pt (export reads a finished run's directory)")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, corrupted, not a checkpoint
        raise ModelError(f"{path} cannot be read ({type(e).__name__}): is the run finished?") from None
    described = ckpt.get("model_spec")
    if described is None and "model_config" in ckpt:  # written before models were described
        gpt = ckpt["model_config"]
        described = {"spec": {"model": "small"}, "block_size": gpt["block_size"], "gpt_config": gpt}
    if described is None:
        raise ModelError(f"{path} does not say which model it holds: train again with this geotrain")
    spec = ModelSpec(**described["spec"])
    if is_hf(spec.model):
        from geotrain.models.hf import CausalLM, _transformers

        transformers = _transformers()
        config_dict = dict(described["hf_config"])
        config = transformers.AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
        hf_model = transformers.AutoModelForCausalLM.from_config(config).float()
        set_dtype(hf_model.config, torch.float32)  # trained in fp32: merged and written in fp32
        model: nn.Module = CausalLM(hf_model, described["block_size"])
    else:
        model = GPT(GPTConfig(**described["gpt_config"]))
    if spec.lora:
        apply_lora(model, LoraSpec.parse(spec.lora, spec.lora_fa))
    model.load_state_dict(ckpt["model"])
    model.eval()
    return model, spec, ckpt


def gpt2_layout(model: GPT) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """GPT-2's config and state dict for geotrain's GPT (which has GPT-2's shape)."""
    cfg = model.cfg
    config = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "activation_function": "gelu",  # F.gelu, exact (GPT-2's own is the tanh approximation)
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": None,  # GPT-2's 50256 is outside a byte vocabulary
        "eos_token_id": None,
        "torch_dtype": "float32",
    }
    tensors = {}
    for name, value in model.state_dict().items():
        out = name.replace("blocks.", "h.")
        if not name.startswith("lm_head."):
            out = "transformer." + out
        if name.endswith(_TRANSPOSED):
            value = value.t()
        tensors[out] = value.detach().contiguous().clone()
    return config, tensors


def export(run_dir: str | Path, to: str | Path) -> dict[str, Any]:
    """Write the run's final model to ``to``; returns what was written."""
    from safetensors.torch import save_file

    run_dir, to = Path(run_dir), Path(to)
    model, spec, ckpt = load_trained(run_dir)
    to.mkdir(parents=True, exist_ok=True)
    written = []
    if spec.lora:
        adapters = {n: t.contiguous().clone() for n, t in model.state_dict().items() if "lora_" in n}
        save_file(adapters, str(to / "adapters.safetensors"), metadata={"format": "pt", "lora": spec.lora})
        written.append("adapters.safetensors")
        merge_lora(model)
    if is_hf(spec.model):
        before = {p.name for p in to.iterdir()}
        model.hf.save_pretrained(to, safe_serialization=True)
        written += sorted({p.name for p in to.iterdir()} - before - set(written))
    else:
        config, tensors = gpt2_layout(model)
        (to / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(to / "model.safetensors"), metadata={"format": "pt"})
        written += ["config.json", "model.safetensors"]
    train = ckpt.get("train_config", {})
    record = {
        "run_dir": str(run_dir.resolve()),
        "model": spec.model,
        "model_config": spec.model_config,
        "lora": spec.lora or None,
        "lora_merged": bool(spec.lora),
        "steps": train.get("steps"),
        "algo": train.get("algo"),
        "parameters": sum(p.numel() for p in model.parameters()),
        "files": written,
    }
    summary = run_dir / "summary.json"
    if summary.exists():
        record["final_val_loss"] = json.loads(summary.read_text()).get("final_val_loss")
    (to / "geotrain.json").write_text(json.dumps(record, indent=2) + "\n")
    return record
