"""A problem: what decides which instances can run a call (the functional key) and which of them
wins (the sizes, through their bucket)."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from gemmgen.select import buckets
from gemmgen.select.device import DeviceFacts

ALIGN_BYTES = 16  # data pointers and outer strides; the kernels load 16 bytes per thread per copy
# What only some families run (Problem's flags of the same names), in the order keys name them.
FEATURES = ("dropout", "bias", "varlen", "kv_cache", "softcap")


def layout_kind(q_strides: tuple[int, ...], k_strides: tuple[int, ...]) -> str:
    """ "bhnd" when Q's and K's rows lie inside their heads ([B, H, N, d] storage order), "bnhd"
    when their heads lie inside their rows ([B, N, H, d] storage), "mixed" otherwise."""
    q_rows_inner = q_strides[2] <= q_strides[1]
    k_rows_inner = k_strides[2] <= k_strides[1]
    if q_rows_inner == k_rows_inner:
        return "bhnd" if q_rows_inner else "bnhd"
    return "mixed"


@dataclasses.dataclass(frozen=True)
class Problem:
    """One attention call as the registry sees it.

    Functional key (selects the candidates): dtype, head_dim, the mask (causal, or a sliding
    `window` (left, right) around the diagonal, each side -1 for unbounded), the GPU (`device`), the
    layout kind, the GQA ratio H / Hkv and the byte alignment of the data, and what only some
    families run: the causal alignment, a negative or zero scale, dropout, an additive bias, variable
    lengths, a logit softcap, element offsets past int32. Sizes (select the winner, through `bucket`):
    batch_heads = B * H, seqlen_q, seqlen_k.
    """

    dtype: str  # "fp16" | "bf16"
    head_dim: int
    causal: bool
    device: DeviceFacts
    batch_heads: int = 1
    seqlen_q: int = 1
    seqlen_k: int = 1
    gqa: int = 1
    layout: str = "bhnd"
    align: int = ALIGN_BYTES
    causal_alignment: str = "top_left"
    negative_scale: bool = False
    zero_scale: bool = False
    dropout: bool = False
    bias: bool = False
    varlen: bool = False
    # varlen: some sequence with queries has no keys, or with a mask fewer keys than queries (True
    # when the offsets could not be read: the families that cannot run such sequences then refuse)
    short_keys: bool = False
    kv_cache: bool = False  # per-sequence key counts and/or a paged K/V (fused_attention_with_kvcache)
    paged: bool = False  # kv_cache through a block table (not a functional key: it sets the split count)
    max_offset: int = 0  # the largest element offset from a tensor's data pointer the call reaches
    window: tuple[int, int] | None = None  # a sliding window (causal False; never (-1, -1) or (-1, 0))
    softcap: bool = False  # a logit softcap (its value is a launch parameter)
    kind: ClassVar[str] = "attention"  # the selection engine's Kind for it

    @property
    def mask(self) -> str:
        """The instance-parameter spelling of the mask: "causal", "local" (a window) or "none"."""
        return "local" if self.window is not None else "causal" if self.causal else "none"

    @property
    def functional_key(self) -> str:
        """The part of the functional key a tuning database files entries under (the GPU is the
        database itself; layout and GQA ratio are in the bucket), e.g. "bf16_d128_causal_a16"."""
        features = "".join(f"_{name}" for name in FEATURES if getattr(self, name))
        return f"{self.dtype}_d{self.head_dim}_{self.mask}_a{self.align}{features}"

    @property
    def bucket_key(self) -> str:
        """The bucket's key in the tuning database."""
        return self.bucket.key

    @property
    def bucket(self) -> buckets.Bucket:
        """The size bucket of this problem."""
        return buckets.bucket_of(layout=self.layout, gqa=self.gqa, batch_heads=self.batch_heads,
                                 seqlen_q=self.seqlen_q, seqlen_k=self.seqlen_k)

    def describe(self) -> str:
        """A one-line description of the functional key, for messages."""
        if self.window is not None:
            aligned = "" if self.causal_alignment == "top_left" else f", {self.causal_alignment}"
            mask = f"sliding window {self.window}{aligned}"
        else:
            mask = "no mask" if not self.causal else "causal" if self.causal_alignment == "top_left" else \
                f"causal ({self.causal_alignment})"
        extra = "".join(f", {name.replace('_', '-')}" for name in FEATURES if getattr(self, name))
        return f"{self.dtype} head_dim={self.head_dim} {mask}{extra} on sm_{self.device.cc[0]}{self.device.cc[1]}"

    def describe_sizes(self) -> str:
        """The sizes and the rest of the key, for `gemmgen explain`."""
        return (f"B*H={self.batch_heads} Nq={self.seqlen_q} Nk={self.seqlen_k}, layout {self.layout}, "
                f"GQA ratio {self.gqa}, {self.align}-byte aligned")


@dataclasses.dataclass(frozen=True)
class BwdProblem(Problem):
    """One attention backward call (dQ, dK, dV from dO and the forward's O and LSE) as the registry
    sees it: the forward's functional key and sizes, with K and V as the kernel reads them (the
    caller expands GQA, so `gqa` is 1), plus whether dBias is wanted and whether the call must be
    deterministic. Tuning entries are filed under "bwd_"-prefixed keys."""

    bias_grad: bool = False
    deterministic: bool = False
    kind: ClassVar[str] = "attention_bwd"

    @property
    def functional_key(self) -> str:
        extra = ("_dbias" if self.bias_grad else "") + ("_det" if self.deterministic else "")
        return f"bwd_{super().functional_key}{extra}"

    def describe(self) -> str:
        extra = (", dbias" if self.bias_grad else "") + (", deterministic" if self.deterministic else "")
        return f"backward of {super().describe()}{extra}"
