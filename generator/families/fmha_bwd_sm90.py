"""CUTLASS's Hopper FMHA backward (example 88 of the CUTLASS source tree) as a gemmgen family.

The backward kernel is CUTLASS's (TMA loads, wgmma, a producer warp group and two math warp
groups, dQ added up in fp32 with TMA reductions), included from the installed nvidia-cutlass
package, with either its own math warp groups' loop or ours (split_dq.h: dQ's GEMM split between
the two groups, `_sq`); templates/include/gemmgen/fmha_bwd_sm90/launch.h maps gemmgen's backward
C ABI (GemmgenAttnBwdParams) onto it, with our own steps around it: D = rowsum(O * dO) and the LSE copy
before, the fp32 dQ into dQ's dtype and strides after, and our mask (keys past seqlen_k, the partial
last query tile; in the split-dQ mainloop band.h's band, given at launch: causal in both alignments
and sliding windows; in example 88's causal top-left). Built for sm_90a only: wgmma and setmaxnreg
have no other target.

Built by default for sm90: on an H100 and an H200 its default instances pass the backward GPU
suite (odd and unequal lengths, both causal cases it accepts) and run the FlashAttention sweep's
backward at 155-584 TFLOP/s, 0.93-1.13x cuDNN at N >= 1024 but one H100 row at 0.74 (NOTES 67;
example 88's own loop 131-273, NOTES 53; 0.91-1.15x with the band mask, NOTES 75-76); fa2_bwd_sm80
and mea_bwd_sm80 serve what it refuses. Causal instances start their CTAs in tile_order.h's order.
Packed sequences (variable lengths) run on the split-dQ instances as one batch entry over the packed
tensors, each key masked to its own sequence's query rows (band.h's Packed; NOTES 86). Additive
masks (attn_mask, no dBias) run on the `_bias` instances (split_dq.h's kBias; a shared mask's tiles
sorted first as the forward sorts them, each key tile's query range cut to the tiles it sees; NOTES
99). Dropout runs on the `_dropout` instances (split_dq.h's kDropout: the forward's Philox mask drawn
again, templates/include/gemmgen/fmha_bwd_sm90/dropout.h; fixed lengths; NOTES 115).

One instance = one (dtype, head_dim, mask, tile): block_m queries per step of a CTA's loop, block_n
keys per CTA (example 88's TileShape (block_m, block_n, head_dim)). `problem_reason` states what a
built instance cannot run, so the registry picks another family for those calls.
"""
from __future__ import annotations

import dataclasses
import itertools

from gemmgen.arch import Arch
from gemmgen.generator.families.base import (ADDED, AttentionInstance, CostInputs, DType, Mask, axis_reason,
                                             dropout_reason, feature_reason, smem_reason)

FAMILY = "fmha_bwd_sm90"
KIND = "attention_bwd"
BUILT_BY_DEFAULT = True
TEMPLATE = "fmha_bwd_sm90.cu.jinja"
# fmha_sm90/cutlass_launch.h: the shared launch; philox: the dropout mask
HEADER_DIRS = ("fmha_bwd_sm90", "fmha_sm90", "philox")
ARCHS = (Arch.SM90,)
# Features its kernel reads that a build from before did not: instances say so in their params, and
# the registry keeps the feature from an entry without the mark (registry.MARKS).
MARKED = ("varlen", "deterministic_varlen")

# Axes.
DTYPES = (DType.FP16, DType.BF16)
# 256 does not fit: its Q/dO stages and fp32 dQ tile alone take 256 KB at block_m 64.
HEAD_DIMS = (32, 64, 128)
# Causal runs both alignments and local every window in the split-dQ mainloop (its band.h mask is a
# launch parameter); example 88's (head dim 32) runs no mask and causal top-left only.
MASKS = (Mask.NONE, Mask.CAUSAL, Mask.LOCAL)
BAND_KIND = {Mask.NONE: "kNone", Mask.CAUSAL: "kCausal", Mask.LOCAL: "kLocal"}  # band.h's BandKind
TILES = ((64, 128), (128, 128))  # (block_m, block_n): the tiles example 88 runs its backward with
# Which mainloop: example 88's (dQ on the second math warp group), or split_dq.h's (dQ split
# between both groups; head dims 64 and 128): suffix `_sq`.
SPLIT_DQ = (False, True)
SOFTCAPS = (False, True)  # the forward's logit softcap (split-dQ mainloop only; suffix `_sc`)
SOFTCAP_DEFAULT_HEAD_DIMS = (128,)  # Gemma 2's largest model and Grok-1 (d256 has no tile here)
# The forward's additive mask (attn_mask; split-dQ mainloop, no softcap or window, fixed lengths;
# suffix `_bias`): built by default beside the default tiles of these head dims and masks, the
# forward's `_bias` defaults that this family's tiles serve.
BIASES = (False, True)
BIAS_DEFAULT_HEAD_DIMS = (64, 128)
# The forward's dropout (split-dQ mainloop, no softcap, bias or window, fixed lengths; suffix
# `_dropout`): built by default beside the default tiles of these head dims without a mask and
# causal, the forward's `_dropout` instances (fmha_sm90.DROPOUT_HEAD_DIMS).
DROPOUTS = (False, True)
DROPOUT_DEFAULT_HEAD_DIMS = (64, 128)
THREADS = 384  # a producer warp group and two math warp groups of block_n / 2 keys each
MAX_SMEM = Arch.SM90.max_smem_bytes
INT32_MAX = 2**31 - 1
MAX_GRID_YZ = 65535  # a CUDA grid's y and z limit (launch.h's kMaxGridYZ)


@dataclasses.dataclass(frozen=True)
class FmhaBwdSm90Instance(AttentionInstance):
    """One head dim and mask, a CTA of `block_n` keys looping over the queries `block_m` at a time."""

    family = FAMILY

    dtype: DType
    head_dim: int
    mask: Mask
    block_m: int
    block_n: int
    split_dq: bool = False
    # The forward's logit softcap (a launch parameter): such an instance runs softcap calls only.
    softcap: bool = dataclasses.field(default=False, metadata={ADDED: True})
    # The forward's additive mask (a launch parameter, the bias tensor; no dbias): such an instance
    # runs calls with one only, the others none.
    bias: bool = dataclasses.field(default=False, metadata={ADDED: True})
    # The forward's dropout (a launch parameter, 0 < p < 1; the mask drawn again): such an instance
    # runs dropout calls only, the others none.
    dropout: bool = dataclasses.field(default=False, metadata={ADDED: True})

    @property
    def name(self) -> str:
        return (f"{self.name_stem}_m{self.block_m}n{self.block_n}" + ("_sq" if self.split_dq else "")
                + ("_sc" if self.softcap else "") + ("_bias" if self.bias else "")
                + ("_dropout" if self.dropout else ""))

    @property
    def stages(self) -> int:
        """Q/dO tiles in flight: the mainloop double-buffers them (its StageCount of 2 pairs)."""
        return 2

    @property
    def threads(self) -> int:
        return THREADS

    @property
    def smem_bytes(self) -> int:
        """Shared memory of CUTLASS's SharedStorage (the compiled instances report the same figure; a
        test checks one): K or V, four stages of block_n / 2 rows; dS, block_m x block_n; Q or dO,
        four stages of block_m rows; the fp32 dQ tile, two stages; LSE or D, four stages of block_m
        floats; 512 bytes of pipeline barriers. The split-dQ mainloop keeps a second dS buffer."""
        e = self.dtype.itemsize
        bm, bn, d = self.block_m, self.block_n, self.head_dim
        ds_buffers = 2 if self.split_dq else 1
        return 2 * bn * d * e + ds_buffers * bm * bn * e + 4 * bm * d * e + 2 * bm * d * 4 + 4 * bm * 4 + 512

    @property
    def cost_inputs(self) -> CostInputs:
        """The cost model's view of a CTA: rows are keys here (block_n per CTA), columns queries
        (block_m per step of its loop), the transpose of a forward tile."""
        return CostInputs(self.block_n, self.block_m, self.stages, self.threads, self.smem_bytes)

    def params(self) -> dict:
        """The fields, and on split-dQ instances the marks of packed sequences and of deterministic
        ones (MARKED), which their mainloop runs (band.h's Packed; not with a bias)."""
        packs = self.split_dq and not self.bias and not self.dropout
        return {**super().params(), **({mark: True for mark in MARKED} if packs else {})}

    def template_values(self) -> dict:
        return {**super().template_values(), "band_kind": BAND_KIND[self.mask], "split_dq": self.split_dq,
                "softcap": self.softcap, "bias": self.bias, "dropout": self.dropout}


INSTANCE = FmhaBwdSm90Instance


def invalid_reason(inst: FmhaBwdSm90Instance, arch: Arch = Arch.SM90) -> str | None:
    """The one validity rule of this family: None when valid, else why not."""
    if reason := axis_reason("head_dim", inst.head_dim, HEAD_DIMS):
        return reason
    if (inst.block_m, inst.block_n) not in TILES:
        return f"tile {inst.block_m}x{inst.block_n} not in {TILES}"
    if inst.split_dq and inst.head_dim not in (64, 128):
        return "the split-dQ mainloop runs head dims 64 and 128 (split_dq.h says why)"
    if inst.mask is Mask.LOCAL and not inst.split_dq:
        return "the local mask runs on the split-dQ mainloop only (example 88's has no window)"
    if inst.softcap and not inst.split_dq:
        return "a softcap runs on the split-dQ mainloop only"
    if inst.bias and (not inst.split_dq or inst.softcap or inst.mask is Mask.LOCAL):
        return "a bias runs on the split-dQ mainloop, without a softcap or a window"
    if inst.dropout and (not inst.split_dq or inst.softcap or inst.bias or inst.mask is Mask.LOCAL):
        return "dropout runs on the split-dQ mainloop, without a softcap, bias or window"
    return smem_reason(inst, arch)


def problem_reason(inst: FmhaBwdSm90Instance, problem) -> str | None:
    """What a built instance cannot run (the registry's reason), None when it can: no dbias; a bias
    (the forward's additive mask) on `_bias` instances only, which run nothing else, at fixed
    lengths; dropout likewise on `_dropout` instances, with Nq * Nk below 2^31; packed sequences on
    the split-dQ instances, deterministic ones too."""
    if reason := feature_reason(FAMILY, problem, ("kv_cache",)):
        return reason
    if reason := dropout_reason(inst, problem):
        return reason
    if bool(problem.bias) != inst.bias:
        return ("built for an additive mask; the problem has none" if inst.bias else
                f"{inst.name} has no additive mask (only instances built for one, `_bias`, run it)")
    if inst.bias and problem.varlen:
        return f"{inst.name} runs a bias at fixed lengths only"
    if problem.varlen and not inst.split_dq:
        return f"{FAMILY} runs variable lengths on its split-dQ instances (`_sq`)"
    if getattr(problem, "bias_grad", False):
        return f"{FAMILY} has no dbias"
    if getattr(problem, "deterministic", False) and not inst.split_dq:
        return f"{inst.name} adds dQ up with atomic TMA reductions across key tiles: not deterministic"
    if problem.negative_scale:
        return f"{FAMILY} runs scales >= 0 (its masked scores are -inf times the scale)"
    if problem.gqa != 1:
        return f"{FAMILY} runs heads_kv == heads (the caller expands K and V)"
    if problem.align < 16:
        return f"{FAMILY} needs 16-byte aligned data and strides (TMA), the problem's are {problem.align}-byte aligned"
    if (problem.causal and not inst.split_dq and problem.causal_alignment != "top_left"
            and problem.seqlen_q != problem.seqlen_k):
        # Example 88's mask is key j visible to query i iff j <= i; the alignments agree when Nq == Nk.
        return f"{inst.name} runs causal top-left only (bottom-right differs when Nq != Nk)"
    if problem.max_offset > INT32_MAX:
        return f"{FAMILY} indexes with int32; this call reaches element {problem.max_offset}"
    if problem.batch_heads * problem.seqlen_q * problem.head_dim > INT32_MAX:
        return f"{FAMILY} indexes dQ's fp32 accumulator with int32; B*H*Nq*d passes it"
    if problem.causal and -(-problem.seqlen_k // inst.block_n) > MAX_GRID_YZ:
        # tile_order.h: the causal grid's y dimension counts key tiles.
        return f"{FAMILY} causal takes at most {MAX_GRID_YZ} key tiles of {inst.block_n} keys"
    return None


SPACE: tuple[FmhaBwdSm90Instance, ...] = tuple(
    inst
    for inst in itertools.starmap(
        FmhaBwdSm90Instance,
        ((dt, d, mask, bm, bn, sq, sc, bias, drop)
         for dt, d, mask, (bm, bn), sq, sc, bias, drop in itertools.product(DTYPES, HEAD_DIMS, MASKS, TILES, SPLIT_DQ,
                                                                             SOFTCAPS, BIASES, DROPOUTS)))
    if invalid_reason(inst) is None
)

# Default tile per head dim. With example 88's loop 64x128 was 1.17-1.20x faster than 128x128 at
# d64 (H200, bf16, NOTES 53); with the split-dQ loop 128x128 is 1.05-1.20x faster there (H100, NOTES
# 65: twice the queries per barrier, wgmma N = 128 for S and dP). d128 fits 64x128 only; at d32
# 128x128 was 3% faster on the one shape timed, too little to add a per-shape default.
DEFAULT_TILE = {32: (64, 128), 64: (128, 128), 128: (64, 128)}

# The split-dQ mainloop where it runs (d64, d128): 1.4-1.8x example 88's (NOTES 65); d32 keeps
# example 88's.
DEFAULT: tuple[FmhaBwdSm90Instance, ...] = tuple(
    inst for inst in SPACE
    if (inst.block_m, inst.block_n) == DEFAULT_TILE[inst.head_dim] and inst.split_dq == (inst.head_dim in (64, 128))
    and (not inst.softcap or inst.head_dim in SOFTCAP_DEFAULT_HEAD_DIMS)
    and (not inst.bias or (inst.head_dim in BIAS_DEFAULT_HEAD_DIMS and inst.mask in (Mask.NONE, Mask.CAUSAL)))
    and (not inst.dropout or (inst.head_dim in DROPOUT_DEFAULT_HEAD_DIMS and inst.mask in (Mask.NONE, Mask.CAUSAL)))
)

# Throughput per unit of the cost model's tile work against fa2_sm80's forward: the forward Hopper
# family's figure. The only other backward family on sm90 is mea_bwd_sm80 (0.2); on the sweep this
# one measured 1.35-8x its speed (NOTES 53), so the ratio of the two orders them as measured.
RELATIVE_SPEED = 1.8
