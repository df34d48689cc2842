"""The guard against silently missing gradients: an operation without a backward pass (batched
GEMMs, fused_attention with out=, fused_attention_with_kvcache) raises at the forward when its
inputs require grad (with grad mode on) instead of returning an output that autograd cannot
differentiate."""
from __future__ import annotations

import torch

from gemmgen.errors import InputError


def check_no_grad(op: str, hint: str = "for training use torch.nn.functional.scaled_dot_product_attention",
                  **tensors: object) -> None:
    """Raise InputError naming `op` and every tensor argument that requires grad, when grad mode is on.

    Outside grad mode (torch.no_grad, torch.inference_mode) and for tensors that do not require grad
    this is a no-op; non-tensors are ignored (the argument checks that follow report them).
    """
    if not torch.is_grad_enabled():
        return
    names = [name for name, t in tensors.items() if isinstance(t, torch.Tensor) and t.requires_grad]
    if names:
        verb = "requires" if len(names) == 1 else "require"
        raise InputError(
            f"{op} has no backward pass: {', '.join(names)} {verb} grad, and the gradients would be "
            f"missing. Supported: inference, under torch.no_grad() or torch.inference_mode(), or with "
            f"detached inputs (x.detach()); for training, {hint}")
