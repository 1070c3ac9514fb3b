"""Layers as a schedule sees them: the modules that own parameters directly, in backward order.

A layer-wise schedule (DreamDDP) averages whole layers. A "layer" here is a module with
parameters of its own (a Linear, a LayerNorm, an Embedding); its parameters are all-reduced as one
message. Backward produces gradients roughly in reverse registration order; the profiler measures
the real order from the gradient hooks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn


@dataclass
class Layer:
    name: str
    params: list[nn.Parameter]

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)


def layer_groups(model: nn.Module) -> list[Layer]:
    """Parameter-owning modules in reverse registration order (the usual backward order). A
    parameter shared by two modules (a head tied to the embedding) belongs to the first only, so
    no schedule averages it twice; frozen parameters (a LoRA base) belong to none."""
    layers = []
    seen: set[int] = set()
    for name, module in model.named_modules():
        params = [p for p in module.parameters(recurse=False) if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in params)
        if params:
            layers.append(Layer(name or "<root>", params))
    return list(reversed(layers))


def order_layers(layers: list[Layer], names: list[str]) -> list[Layer]:
    """``layers`` in the order of ``names`` (a profile's backward order); every name must exist."""
    by_name = {layer.name: layer for layer in layers}
    missing = [n for n in names if n not in by_name]
    if missing or len(names) != len(layers):
        raise ValueError(
            f"the profile's layers do not match the model's ({len(names)} vs {len(layers)}; "
            f"unknown: {missing[:3]}); profile this model again"
        )
    return [by_name[n] for n in names]
