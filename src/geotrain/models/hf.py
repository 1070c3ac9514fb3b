"""Hugging Face causal LMs as geotrain models, and LoRA adapters on any model.

``--model hf:DIR`` loads a causal LM saved with ``save_pretrained`` (weights and config) through
``transformers.AutoModelForCausalLM``; ``--model hf:TYPE`` (``hf:gpt2``, ``hf:llama``, any
``model_type`` transformers knows) builds one from its default config, sized with
``--model-config n_layer=2,n_embd=64,...``: no download, so runs here and in the tests need no
hub. Either way the model is wrapped in :class:`CausalLM`, which speaks the interface the training
loop uses for geotrain's own GPT (``model(x, y) -> (logits, loss)``, ``block_size``), so the sync
algorithms see a plain ``nn.Module`` and the model code is never touched.

``--lora r=8,alpha=16,targets=q_proj,v_proj`` injects peft's LoRA layers into the model (LoRA,
Hu et al. 2021): the base weights are frozen and only the adapters train, so only they are
averaged and only they cross the network. ``--lora-fa`` also freezes the A matrices (LoRA-FA,
Zhang et al. 2023), halving what travels again.

``transformers`` and ``peft`` are the optional ``hf`` extra (``pip install 'geotrain[hf]'``); they
are imported only when asked for.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from geotrain.compress.codec import ConfigError

HF_PREFIX = "hf:"
NEEDS_EXTRA = "pip install 'geotrain[hf]' (or pip install -e '.[hf]' in a checkout)"


class ModelError(ConfigError):
    """A model option that cannot be used, with what to change."""


def is_hf(spec: str) -> bool:
    return spec.startswith(HF_PREFIX)


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ModelError(f"--model hf:... needs transformers: {NEEDS_EXTRA}") from None
    transformers.logging.set_verbosity_error()  # its warnings about unused defaults are noise here
    return transformers


def parse_assignments(text: str, flag: str) -> dict[str, Any]:
    """``a=1,b=0.5,c=x,d=true`` -> {"a": 1, "b": 0.5, "c": "x", "d": True}."""
    out: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise ModelError(f"{flag} {text!r}: expected NAME=VALUE[,NAME=VALUE...], got {item!r}")
        out[key.strip()] = _value(value.strip())
    return out


def _value(text: str) -> Any:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


class CausalLM(nn.Module):
    """A transformers causal LM behind geotrain's model interface: ``forward(idx, targets)``
    returns ``(logits, loss)`` with the loss over every position (the targets are already the
    inputs shifted by one, as the batch sampler makes them)."""

    def __init__(self, hf_model: nn.Module, block_size: int) -> None:
        super().__init__()
        self.hf = hf_model
        self.block_size = block_size

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        if idx.shape[1] > self.block_size:
            raise ValueError(f"sequence length {idx.shape[1]} exceeds the context {self.block_size}")
        logits = self.hf(input_ids=idx, use_cache=False).logits
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def _check_overrides(config_class, overrides: dict[str, Any], spec: str) -> None:
    import inspect

    known = set(config_class().to_dict()) | set(getattr(config_class, "attribute_map", {}))
    known |= set(inspect.signature(config_class.__init__).parameters) - {"self", "kwargs"}
    known |= {"attn_implementation", "rope_theta", "rope_scaling", "sliding_window"}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ModelError(
            f"--model-config {', '.join(unknown)}: not a field of {spec}'s config "
            f"({config_class.__name__}; e.g. {', '.join(sorted(known)[:8])}, ...)"
        )


def hf_config(
    spec: str, overrides: dict[str, Any], vocab_size: int, block_size: int | None, tokens: int | None = None
):
    """The transformers config ``spec`` names (a directory's, or a model type's default), with
    ``overrides`` and the data's vocabulary and context applied. ``tokens``: the data's largest
    token id + 1 (its vocabulary before rounding), which the model's vocabulary must cover."""
    transformers = _transformers()
    name = spec[len(HF_PREFIX) :]
    if not name:
        raise ModelError("--model hf: needs a directory (save_pretrained) or a model type, e.g. hf:gpt2")
    if Path(name).is_dir():
        try:
            config = transformers.AutoConfig.from_pretrained(name)
        except (OSError, ValueError) as e:
            raise ModelError(f"--model {spec}: not a Hugging Face model directory ({e})") from None
        _check_overrides(type(config), overrides, spec)
        for key, value in overrides.items():
            setattr(config, key, value)
    else:
        if "/" in name or name.startswith("."):
            raise ModelError(
                f"--model {spec}: no such directory; nothing loads from the hub here, so give a local "
                "directory (save_pretrained) or a model type (hf:gpt2, hf:llama) with --model-config"
            )
        try:
            config_class = transformers.AutoConfig.for_model(name).__class__
        except ValueError:
            raise ModelError(
                f"--model {spec}: {name!r} is neither a directory nor a model type transformers knows "
                "(e.g. gpt2, llama, qwen2, mistral)"
            ) from None
        _check_overrides(config_class, overrides, spec)
        try:
            config = transformers.AutoConfig.for_model(name, **overrides)
        except Exception as e:  # transformers 5 checks values with errors of its own
            raise ModelError(f"--model-config {_show(overrides)}: {str(e).splitlines()[0]}") from None
        if "vocab_size" not in overrides:
            config.vocab_size = vocab_size
        if block_size is not None and "max_position_embeddings" not in overrides:
            config.max_position_embeddings = block_size
        for special in ("bos_token_id", "eos_token_id", "pad_token_id"):  # defaults beyond a small vocabulary
            value = getattr(config, special, None)
            if special not in overrides and isinstance(value, int) and value >= config.vocab_size:
                setattr(config, special, None)
    needed = tokens or vocab_size
    if config.vocab_size < needed:
        raise ModelError(
            f"--model {spec} has a vocabulary of {config.vocab_size}, the data's tokens go up to "
            f"{needed - 1}: give data tokenized with the model's own tokenizer (a .bin, --data)"
        )
    return config


def _show(overrides: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in overrides.items())


def set_dtype(config, dtype: torch.dtype) -> None:
    """The dtype a config says its weights are in (``dtype`` in transformers 5, ``torch_dtype``
    before): set to what the model really holds, so a rebuild from it matches."""
    for name in ("dtype", "torch_dtype"):
        if hasattr(config, name):
            with contextlib.suppress(AttributeError, TypeError):
                setattr(config, name, dtype)


def context_of(config) -> int:
    return int(getattr(config, "max_position_embeddings", 0) or getattr(config, "n_positions", 0) or 1024)


def build_hf(
    spec: str, overrides: dict[str, Any], vocab_size: int, block_size: int | None, tokens: int | None = None
) -> CausalLM:
    transformers = _transformers()
    config = hf_config(spec, overrides, vocab_size, block_size, tokens)
    name = spec[len(HF_PREFIX) :]
    try:
        if Path(name).is_dir():
            hf_model = transformers.AutoModelForCausalLM.from_pretrained(name, config=config)
        else:
            hf_model = transformers.AutoModelForCausalLM.from_config(config)
    except ValueError as e:  # a type that is not a causal LM (t5, bert...)
        raise ModelError(
            f"--model {spec}: not a causal LM transformers can build ({str(e).splitlines()[0]})"
        ) from None
    hf_model.train()  # from_pretrained returns it in eval mode (dropout off)
    set_dtype(hf_model.config, torch.float32)  # trained (and exported) in fp32
    context = context_of(config)
    if block_size is not None and block_size > context:
        raise ModelError(f"--block-size {block_size} exceeds --model {spec}'s context of {context} positions")
    return CausalLM(hf_model.float(), block_size or context)


@dataclass(frozen=True)
class LoraSpec:
    """``--lora r=8,alpha=16,targets=q_proj,v_proj[,dropout=0]`` and ``--lora-fa``."""

    r: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ()
    dropout: float = 0.0
    fa: bool = False

    @staticmethod
    def parse(text: str, fa: bool = False) -> LoraSpec:
        fields: dict[str, Any] = {}
        targets: list[str] = []
        for item in filter(None, (s.strip() for s in text.split(","))):
            key, eq, value = item.partition("=")
            if not eq:  # a bare name continues targets=q_proj,v_proj
                if not targets:
                    raise ModelError(f"--lora {text!r}: expected NAME=VALUE, got {item!r}")
                targets.append(item)
            elif key == "targets":
                targets = [value] if value else []
            elif key in ("r", "alpha", "dropout"):
                fields[key] = _value(value)
            else:
                raise ModelError(f"--lora {text!r}: unknown {key!r}; accepted: r, alpha, targets, dropout")
        spec = LoraSpec(targets=tuple(targets), fa=fa, **fields)
        if not isinstance(spec.r, int) or isinstance(spec.r, bool) or spec.r < 1:
            raise ModelError(f"--lora r must be an integer >= 1, got {spec.r}")
        if not isinstance(spec.alpha, (int, float)) or spec.alpha <= 0:
            raise ModelError(f"--lora alpha must be > 0, got {spec.alpha}")
        if not isinstance(spec.dropout, (int, float)) or not 0 <= spec.dropout < 1:
            raise ModelError(f"--lora dropout must be in [0, 1), got {spec.dropout}")
        return spec


def default_targets(model: nn.Module) -> list[str]:
    """Attention projections, by the names the common architectures give them."""
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    for choice in (["q_proj", "v_proj"], ["c_attn"], ["query", "value"], ["qkv_proj"], ["Wqkv"]):
        if set(choice) <= names:
            return choice
    raise ModelError("--lora: give targets=NAME[,NAME] (the names of the Linear layers to adapt)")


def apply_lora(model: nn.Module, spec: LoraSpec) -> nn.Module:
    """Inject LoRA adapters in place (peft); freeze everything else (and, with ``fa``, the A
    matrices). The model keeps its class and interface."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        raise ModelError(f"--lora needs peft: {NEEDS_EXTRA}") from None
    targets = list(spec.targets) or default_targets(model)
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in targets if t not in present]
    if missing:
        raise ModelError(f"--lora targets {', '.join(missing)}: the model has no layer of that name")
    # GPT-2's projections are transformers' Conv1D, whose weight is stored (in, out)
    conv1d = any(
        type(m).__name__ == "Conv1D" for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in targets
    )
    config = LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=targets,
        fan_in_fan_out=conv1d,
    )
    inject_adapter_in_model(config, model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_B" in name or ("lora_A" in name and not spec.fa))
    return model


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every LoRA adapter into its base layer and put the base layer back in its place."""
    from peft.tuners.lora import LoraLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, module.get_base_layer())
    for p in model.parameters():
        p.requires_grad_(True)
    return model
