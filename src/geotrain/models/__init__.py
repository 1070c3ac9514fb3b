"""The models a run trains: geotrain's GPT by size (``tiny``, ``mini``, ``small``) or a Hugging Face
causal LM (``hf:DIR`` or ``hf:TYPE``), either one resized by ``--model-config`` and optionally
adapted with LoRA (``--lora``). Every model built here answers ``model(x, y) -> (logits, loss)``
and has ``block_size`` and ``num_parameters()``; nothing in it knows about distribution.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from geotrain.models.gpt import GPT, MODEL_SIZES, GPTConfig, gpt_config
from geotrain.models.hf import HF_PREFIX, NEEDS_EXTRA, LoraSpec, ModelError, is_hf, parse_assignments


@dataclass(frozen=True)
class ModelSpec:
    """What ``--model``, ``--model-config``, ``--lora`` and ``--lora-fa`` ask for."""

    model: str = "mini"
    model_config: str = ""  # NAME=VALUE,... over the size's or the model type's config
    lora: str = ""  # r=8,alpha=16,targets=q_proj,v_proj ("": no adapters)
    lora_fa: bool = False

    def check(self) -> None:
        """Refuse a bad spec without building anything (cheap: no transformers import)."""
        if is_hf(self.model):
            if importlib.util.find_spec("transformers") is None:
                raise ModelError(f"--model {self.model} needs transformers: {NEEDS_EXTRA}")
        elif self.model not in MODEL_SIZES:
            raise ModelError(
                f"unknown model {self.model!r}; accepted: {', '.join(MODEL_SIZES)}, or hf:DIR / hf:TYPE "
                "(a Hugging Face causal LM)"
            )
        overrides = parse_assignments(self.model_config, "--model-config")
        if not is_hf(self.model):
            known = {f.name for f in dataclasses.fields(GPTConfig)} - {"vocab_size", "block_size"}
            unknown = sorted(set(overrides) - known)
            if unknown:
                raise ModelError(
                    f"--model-config {', '.join(unknown)}: {self.model} takes {', '.join(sorted(known))} "
                    "(the context is --block-size)"
                )
            self.gpt_config(256, None)
        if self.lora_fa and not self.lora:
            raise ModelError("--lora-fa freezes LoRA's A matrices: give --lora too")
        if self.lora:
            LoraSpec.parse(self.lora, self.lora_fa)
            if importlib.util.find_spec("peft") is None:
                raise ModelError(f"--lora needs peft: {NEEDS_EXTRA}")

    @property
    def overrides(self) -> dict[str, Any]:
        return parse_assignments(self.model_config, "--model-config")

    def gpt_config(self, vocab_size: int, block_size: int | None) -> GPTConfig:
        try:
            return dataclasses.replace(gpt_config(self.model, vocab_size, block_size), **self.overrides)
        except (TypeError, ValueError) as e:
            raise ModelError(f"--model-config {self.model_config}: {e}") from None


def build_model(
    spec: ModelSpec, vocab_size: int, block_size: int | None = None, tokens: int | None = None
) -> nn.Module:
    """The model ``spec`` names, for data of ``vocab_size`` tokens (``tokens``: its largest id + 1,
    if below), with context ``block_size`` (None: the model's own). Built from the current torch
    seed, so every worker builds the same."""
    spec.check()
    if is_hf(spec.model):
        from geotrain.models.hf import build_hf

        model: nn.Module = build_hf(spec.model, spec.overrides, vocab_size, block_size, tokens)
    else:
        model = GPT(spec.gpt_config(vocab_size, block_size))
    if spec.lora:
        from geotrain.models.hf import apply_lora

        apply_lora(model, LoraSpec.parse(spec.lora, spec.lora_fa))
    return model


def model_context(spec: ModelSpec, vocab_size: int, block_size: int | None, tokens: int | None = None) -> int:
    """The context a run of ``spec`` trains with, without building the model; an hf: model's
    config is read (and refused here, in the launcher, if it cannot be used), and LoRA's targets
    are looked for in the model built on the meta device (no memory, no weights read)."""
    if spec.lora:
        check_lora(spec, vocab_size, tokens)
    if is_hf(spec.model):
        from geotrain.models.hf import context_of, hf_config

        context = context_of(hf_config(spec.model, spec.overrides, vocab_size, block_size or None, tokens))
        if block_size and block_size > context:
            raise ModelError(f"--block-size {block_size} exceeds --model {spec.model}'s context of {context}")
        return block_size or context
    return block_size or spec.gpt_config(vocab_size, None).block_size


def _meta_model(spec: ModelSpec, vocab_size: int, tokens: int | None = None) -> nn.Module:
    """The model's shape on the meta device: from its config only (no weights read, no memory)."""
    if is_hf(spec.model):
        from geotrain.models.hf import CausalLM, _transformers, hf_config

        config = hf_config(spec.model, spec.overrides, vocab_size, None, tokens)
        with torch.device("meta"):
            return CausalLM(_transformers().AutoModelForCausalLM.from_config(config), 1)
    with torch.device("meta"):
        return GPT(spec.gpt_config(vocab_size, None))


def check_lora(spec: ModelSpec, vocab_size: int = 256, tokens: int | None = None) -> None:
    """Refuse LoRA targets the model does not have, before any worker starts."""
    from geotrain.models.hf import apply_lora

    with torch.device("meta"):
        apply_lora(_meta_model(spec, vocab_size, tokens), LoraSpec.parse(spec.lora, spec.lora_fa))


def parameter_count(spec: ModelSpec, vocab_size: int = 256) -> int:
    """Parameters of the model (all of them, trainable or not): a GPT's from its config, a
    Hugging Face model's counted on the meta device."""
    if not is_hf(spec.model):
        return spec.gpt_config(vocab_size, None).num_parameters()
    return sum(p.numel() for p in _meta_model(spec, vocab_size).parameters())


def trainable_count(
    spec: ModelSpec, vocab_size: int = 256, tokens: int | None = None, block_size: int | None = None
) -> int:
    """Trainable parameters (with ``--lora``, the adapters' alone), counted on the meta device;
    a GPT's at context ``block_size`` (its position embedding; None: the model's own)."""
    if is_hf(spec.model) or not block_size:
        model = _meta_model(spec, vocab_size, tokens)
    else:
        with torch.device("meta"):
            model = GPT(spec.gpt_config(vocab_size, block_size))
    if spec.lora:
        from geotrain.models.hf import apply_lora

        with torch.device("meta"):
            apply_lora(model, LoraSpec.parse(spec.lora, spec.lora_fa))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def describe(model: nn.Module, spec: ModelSpec) -> dict[str, Any]:
    """What ``geotrain export`` needs to build the model again without the run's flags or files."""
    out: dict[str, Any] = {"spec": dataclasses.asdict(spec), "block_size": model.block_size}
    if is_hf(spec.model):
        out["hf_config"] = model.hf.config.to_dict()
        for name in ("dtype", "torch_dtype"):  # what it holds: fp32 (a directory's may say bf16)
            if name in out["hf_config"]:
                out["hf_config"][name] = "float32"
    else:
        out["gpt_config"] = dataclasses.asdict(model.cfg)
    return out


__all__ = [
    "HF_PREFIX",
    "MODEL_SIZES",
    "ModelError",
    "ModelSpec",
    "build_model",
    "describe",
    "model_context",
    "parameter_count",
]
