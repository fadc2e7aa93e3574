"""Linear layers on CPU with their weights packed in 32-column panels, multiplied by the native panel matmul.

At decoding's row counts torch's float32 linear ran at a fraction of this project's CPU hosts (the embedded target's
29 linears: 1.7-2.3 ms for one row and 2.4-3.9 ms for five, against 0.26 ms and 0.39 ms in ``panel_matmul.c``), so
most of a decode step's forward was matmul and a verify of five tokens cost 1.5 plain forwards. Packed, the weights
stream once per step in the order they are used, and a short verify costs little more than a decode.

The packing replaces the model's ``nn.Linear`` modules (:func:`pack_linears`); the panels are the weights, so memory
stays what it was (a tied ``lm_head`` gets its own panels beside the embedding). The product is batch-invariant: a
row's result is bit for bit the same in any batch and with any thread count (panel_matmul.c), so a verify's logits
for a draft node equal plain decoding's exactly. Only for CPU float32 models with the native kernel available
(``ORDINAL_NATIVE`` not 0); everything else keeps torch's linear.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.native import PanelLinearKernel, panel_linear_kernel

PANEL = 32  # columns per weight panel (panel_matmul.c's PANEL)


def panels(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A linear's weight [out, in] as the kernel reads it: [ceil(out / 32), in, 32] of ``dtype`` (float32 or
    bfloat16), contiguous, zero-padded."""
    out, width = weight.shape[0], -(-weight.shape[0] // PANEL) * PANEL
    padded = torch.zeros(width, weight.shape[1], dtype=dtype)  # [out', in]
    padded[:out] = weight
    return padded.view(width // PANEL, PANEL, -1).transpose(1, 2).contiguous()  # [out' / 32, in, 32]


def padded_bias(bias: torch.Tensor) -> torch.Tensor:
    """A bias [out] zero-padded to whole panels."""
    out = torch.zeros(-(-bias.shape[0] // PANEL) * PANEL, dtype=bias.dtype)  # [out']
    out[: bias.shape[0]] = bias
    return out


class PanelLinear(nn.Module):
    """``nn.Linear``'s product with the weight held as float32 panels (the same values, another layout)."""

    def __init__(self, linear: nn.Linear, kernel: PanelLinearKernel) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.panels: torch.Tensor
        self.bias: torch.Tensor | None
        self.register_buffer("panels", panels(linear.weight.detach(), torch.float32), persistent=False)
        # Padded to whole panels like the weight.
        bias = None if linear.bias is None else padded_bias(linear.bias.detach().float())
        self.register_buffer("bias", bias, persistent=False)
        self._product = kernel.bind(self.panels, self.out_features, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return self._product(x)  # [N, out]
        return self._product(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module, kernel: PanelLinearKernel) -> int:
    """Replace every ``nn.Linear`` of ``model`` (CPU float32) by a :class:`PanelLinear`; returns how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PanelLinear(child, kernel))
                count += 1
    return count


def pack_for_cpu(model: nn.Module, dtype: torch.dtype, device: torch.device) -> bool:
    """Pack ``model``'s linears where the native matmul computes them as torch would (a CPU float32 model, the kernel
    available); False, leaving the model as it is, everywhere else."""
    if device.type != "cpu" or dtype != torch.float32:
        return False
    kernel = panel_linear_kernel()
    if kernel is None:
        return False
    pack_linears(model, kernel)
    return True
