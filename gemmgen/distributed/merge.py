"""The merge rule of partial attention results: two (O, LSE) pairs over disjoint key sets combine
into the pair over their union, in the accumulator's precision."""
from __future__ import annotations

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision partial results are merged and gradients summed in: float32, float64 for
    float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def merge_partial(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """In place: (out, lse) <- the attention of the same queries over both key sets.

    out [..., N, d] and lse [..., N] (float32 or float64, views allowed) hold the result so far,
    out_b and lse_b (any float dtype) the new part's. With w = sigmoid(lse_b - lse), the new part's
    share of the softmax mass:

        out <- out - w * (out - out_b)
        lse <- lse - logsigmoid(lse - lse_b)         (= log(exp(lse) + exp(lse_b)))

    A row with lse = -inf has seen no key yet (out = 0 there): it takes the new part unchanged;
    a row whose new part saw no key (lse_b = -inf) keeps its value; both -inf stays O = 0,
    LSE = -inf. No NaN arises from -inf rows.
    """
    lse_b = lse_b.to(lse.dtype)
    # lse_b - lse is NaN where both are -inf; the new part carries no mass there.
    weight = torch.where(lse_b == NEG_INF, 0.0, torch.sigmoid(lse_b - lse))
    out.lerp_(out_b.to(out.dtype), weight.unsqueeze(-1))
    # The log-sigmoid form is -inf - (-inf) where only lse is -inf: the union is the new part then.
    lse.copy_(torch.where(lse == NEG_INF, lse_b, lse - F.logsigmoid(lse - lse_b)))
