"""gemmgen as an attention implementation of Hugging Face transformers.

    import gemmgen.integrations.transformers as gt
    gt.register()                                        # once per process
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="gemmgen")

register() adds "gemmgen" to transformers' AttentionInterface (the attention function below) and
AttentionMaskInterface (the masks of its SDPA path: None where a causal flag serves, else a bool
[B, 1, Nq, Nk] mask, True taking part). Every attention layer of a model that dispatches through
those interfaces (Llama, Qwen, Mistral, GPT-2 and most decoder models) then calls
gemmgen.fused_attention: causal and padding masks, sliding windows, GQA without repeating K and V,
the layer's scaling, dropout in training, T5-style position biases (as an additive mask), autograd,
and generation with the model's KV cache (a decode step is a dense call of one query row, which the
registry gives the decode family).

A sliding-window layer's mask that is exactly the causal window of its size, aligned bottom-right
(no padding: the mask is compared with that pattern on the GPU when it is made), runs as
fused_attention(window=...), skipping the key tiles outside the window, in training too where a
backward runs the window (fa2_bwd_sm80 on every GPU, fmha_bwd_sm90's local instances on Hopper);
any other mask, and a window nothing here runs (with dropout, or where no backward for it is built),
runs with the mask as before.

A logit softcap (Gemma 2's) runs on the instances built for one (its backward at head dims 128
and 256). A call gemmgen cannot run (a dtype, head dim or mask no family serves, CPU tensors, a
softcap it has no backward for) runs on transformers' own SDPA path instead (a softcap on the model's
eager attention, which SDPA's path refuses), with one warning per distinct reason on the logger
"gemmgen.transformers"; fallback_reasons() lists them. Needs transformers >= 4.56 (the optional
extra: pip install 'gemmgen[transformers]').
"""
from __future__ import annotations

import logging
import sys
from typing import Any

import torch

from gemmgen.errors import DeviceError, InputError, NoInstanceError
from gemmgen.ops.attention import fused_attention

NAME = "gemmgen"
logger = logging.getLogger("gemmgen.transformers")
_reasons: dict[str, int] = {}


def register(name: str = NAME) -> None:
    """Make attn_implementation=`name` run on gemmgen (see the module doc). Raises ImportError naming
    the extra to install when transformers is missing or too old."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as exc:
        raise ImportError("gemmgen.integrations.transformers needs transformers >= 4.56 (AttentionInterface and "
                          "AttentionMaskInterface): pip install 'gemmgen[transformers]'") from exc
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, lambda *args, **kwargs: _mark_window(sdpa_mask(*args, **kwargs), kwargs))


def fallback_reasons() -> dict[str, int]:
    """Each distinct reason a call ran on transformers' SDPA path instead, with its count."""
    return dict(_reasons)


def _fallback(reason: str, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The call on transformers' SDPA path, or, with a logit softcap (which that path refuses), on the
    layer's own model's eager attention function."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    forward, path = sdpa_attention_forward, "SDPA"
    if kwargs.get("softcap") is not None:
        forward = getattr(sys.modules.get(type(args[0]).__module__), "eager_attention_forward", None)
        if forward is None:
            raise InputError(f"gemmgen does not run this call ({reason}), and its model defines no eager attention "
                             "function to run its logit softcap")
        path = "eager"
    if reason not in _reasons:
        logger.warning("gemmgen does not run %s; transformers' %s path does (logged once per reason)", reason, path)
    _reasons[reason] = _reasons.get(reason, 0) + 1
    return forward(*args, **kwargs)


def _mark_window(mask: torch.Tensor | None, kwargs: dict) -> torch.Tensor | None:
    """`mask` as made by transformers' sdpa_mask, marked (attribute _gemmgen_window) with the window
    (size - 1, 0) when it equals the causal sliding window of kwargs' local_size for every batch entry,
    the diagonal bottom-right (the last query row sees the last key); attention_forward then runs the
    window. A mask being traced is left unmarked (its values cannot be compared)."""
    size = kwargs.get("local_size")
    if (mask is None or size is None or mask.dtype != torch.bool or mask.dim() != 4 or torch.compiler.is_compiling()
            or mask.device.type != "cuda" or torch.cuda.is_current_stream_capturing()):
        return mask
    nq, nk = mask.shape[-2:]
    rows = torch.arange(nq, device=mask.device)[:, None] + (nk - nq)
    cols = torch.arange(nk, device=mask.device)[None, :]
    if torch.equal(mask, ((cols <= rows) & (cols > rows - size)).expand_as(mask)):
        mask._gemmgen_window = (size - 1, 0)
    return mask


def _with_position_bias(bias: torch.Tensor, mask: torch.Tensor | None, causal: bool, q: torch.Tensor,
                        k: torch.Tensor) -> torch.Tensor:
    """An additive float mask of `bias` (T5-style relative positions) with `mask` or the causal pattern
    folded in: -inf where a query must not see a key."""
    if mask is None and causal:
        nq, nk = q.shape[2], k.shape[2]
        mask = torch.arange(nq, device=q.device)[:, None] >= torch.arange(nk, device=q.device)[None, :]
    if mask is None:
        return bias
    if mask.dtype == torch.bool:
        return bias.masked_fill(~mask, float("-inf"))
    return bias + mask


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, position_bias: torch.Tensor | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [B, H, Nq, d], key and value [B, Hkv, Nk, d],
    attention_mask from the mask interface (None, bool or additive float, broadcasting to
    [B, H, Nq, Nk]); returns (output [B, Nq, H, d], no attention weights). Causal (the layer's
    is_causal, or the argument) applies where no mask is given and Nq > 1, top-left as transformers'
    SDPA path means it."""
    args = (module, query, key, value, attention_mask)
    rest = dict(dropout=dropout, scaling=scaling, is_causal=is_causal, position_bias=position_bias, **kwargs)
    softcap = float(kwargs.get("softcap") or 0.0)
    q_len = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(q_len > 1 and attention_mask is None and causal)
    mask = attention_mask
    if position_bias is not None:
        mask, causal = _with_position_bias(position_bias, mask, causal, query, key), False
    if mask is not None and mask.dtype not in (torch.bool, query.dtype):
        mask = mask.to(query.dtype)
    window = getattr(mask, "_gemmgen_window", None)
    if window is not None:
        try:  # the marked mask is exactly this window
            out = fused_attention(query, key, value, causal=True, causal_alignment="bottom_right", scale=scaling,
                                  dropout_p=float(dropout), window=window, softcap=softcap)
            return out.transpose(1, 2).contiguous(), None
        except NoInstanceError:
            pass  # nothing runs the window here (with dropout, or no backward for it built): the mask does
    try:
        out = fused_attention(query, key, value, causal=causal, scale=scaling, dropout_p=float(dropout),
                              attn_mask=mask, softcap=softcap)
    except (NoInstanceError, InputError, DeviceError) as exc:
        return _fallback(str(exc).splitlines()[0], *args, **rest)
    return out.transpose(1, 2).contiguous(), None
