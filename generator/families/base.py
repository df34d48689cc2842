"""The family contract: the one dtype table, the instance base classes, and what a family module declares.

A family is one module (generator/families/<name>.py) that declares at module level every member of
`Family`, and for its kind those of `AttentionFamily` or `GemmFamily`. gemmgen.generator.space
registers it only after `check_family` has found them all, so code that reads a family reads its
members directly. Its instance type is a frozen dataclass of enums, ints and bools deriving from
`Instance` (`AttentionInstance`, `GemmInstance` by kind), which derives the symbol, the params, the
content hash and the way back from a manifest's params (`from_params`) from the fields.

Besides the contract, the rules every family states the same way: an instance's threads from its
warps (`Warps`), the shared memory of a Q tile and staged K/V tiles (`QKVStages`), both masks from
a launch parameter (`BothMasks`), the head-dim bound and tiles of CUTLASS example 41's kernels
(`BoundedHeadDim`), an axis value outside its axis (`axis_reason`), shared memory beyond the arch's
(`smem_reason`), and an attention problem's features a family lacks (`feature_reason`).
"""
from __future__ import annotations

import abc
import dataclasses
import enum
import functools
import hashlib
import inspect
import typing
from typing import Any, ClassVar, Mapping, NamedTuple, Protocol, TypeVar

from gemmgen.arch import Arch


# dataclasses.field metadata key of an instance field added to a family after its first builds
# (Instance.params leaves it out while it holds its default).
ADDED = "added"


class DType(enum.Enum):
    """An element type, by the name the manifest and the instance names use."""

    FP16 = "fp16"
    BF16 = "bf16"
    FP32 = "fp32"
    FP8 = "fp8"  # float8 e4m3 (torch.float8_e4m3fn)

    @property
    def cpp(self) -> str:
        """The C++ type the templates instantiate."""
        return DTYPE_TABLE[self].cpp

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPE_TABLE[self].itemsize


class DTypeInfo(NamedTuple):
    cpp: str
    itemsize: int


# The one table from DType to C++ (cutlass_library's DataTypeTag and DataTypeSize in one).
DTYPE_TABLE: dict[DType, DTypeInfo] = {
    DType.FP16: DTypeInfo("cutlass::half_t", 2),
    DType.BF16: DTypeInfo("cutlass::bfloat16_t", 2),
    DType.FP32: DTypeInfo("float", 4),
    DType.FP8: DTypeInfo("cutlass::float_e4m3_t", 1),
}


class Mask(enum.Enum):
    NONE = "none"
    CAUSAL = "causal"  # the alignment (top-left / bottom-right) is a launch parameter
    # A sliding window: key j visible to query i iff i + offset - left <= j <= i + offset + right
    # (left or right -1: unbounded on that side); the offset and both bounds are launch parameters.
    LOCAL = "local"


@dataclasses.dataclass(frozen=True)
class CostInputs:
    """What gemmgen.select.heuristic's cost model reads of an attention instance."""

    block_m: int  # query rows per CTA
    block_n: int  # key columns per step of the key loop
    stages: int  # K/V tiles in flight: the model divides the exposed first loads by it
    threads: int  # per CTA
    smem_bytes: int  # per CTA
    regs_per_thread: int = 255  # what ptxas gives the kernel (the residency limit by registers)
    # Key columns of work a row tile's epilogue costs beyond its mainloop (0: overlapped with it).
    epilogue_cols: float = 0.0

    def __post_init__(self) -> None:
        if min(self.block_m, self.block_n, self.stages, self.threads, self.regs_per_thread) < 1 or self.smem_bytes < 0:
            raise ValueError(f"cost inputs must be positive: {self}")


InstanceT = TypeVar("InstanceT", bound="Instance")


class Instance(abc.ABC):
    """A family's instance: the base of its frozen dataclass, whose fields are the family's axes.

    The subclass gives the class attribute `family` (its module's FAMILY), `name` (readable, stable
    and unique: the source file, the library, the symbol, the manifest entry and every message),
    `threads` and `smem_bytes` (properties or fields), and extends `template_values` with what its
    template needs beyond the params. It overrides `params` (and then `from_params`) only where its
    params are not exactly its fields."""

    family: ClassVar[str]
    dtype: DType
    threads: int
    smem_bytes: int

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """Readable, stable, unique; starts with the family's name."""

    @property
    def symbol(self) -> str:
        """The exported entry point of the instance's library."""
        return f"gemmgen_{self.name}"

    def params(self) -> dict[str, Any]:
        """Plain values for the manifest and the template: every field in order, enums by value. A
        field added after its family's instances were first built (metadata ADDED) is left out while
        it holds its default, so that those instances keep their params, content hash and tuning
        records (from_params gives it back its default)."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)
                if not (f.metadata.get(ADDED) and getattr(self, f.name) == f.default)}

    @classmethod
    def from_params(cls: type[InstanceT], params: Mapping[str, Any]) -> InstanceT:
        """The instance whose params() are `params` (a manifest entry's): each field from the param
        of its name, enums by value; a field with a default may be absent, other params are derived
        and ignored. Raises ValueError when `params` describe no instance of this class."""
        types = _field_types(cls)
        values = {}
        for f in dataclasses.fields(cls):
            if f.name in params:
                values[f.name] = _typed(types[f.name], params[f.name], f.name)
            elif f.default is dataclasses.MISSING:
                raise ValueError(f"{cls.family} params lack {f.name!r}")
        return cls(**values)

    def template_values(self) -> dict[str, Any]:
        """Plain values for the template: the params, name, symbol and `element` (the C++ dtype)."""
        return {**self.params(), "name": self.name, "symbol": self.symbol, "element": self.dtype.cpp}

    def content_hash(self) -> str:
        """Hash of the family and the params (template, headers and toolchain join it in the build key)."""
        return hashlib.sha256((self.family + repr(sorted(self.params().items()))).encode()).hexdigest()[:16]


class Warps:
    """Mixed into an instance whose CTA is `warps` whole warps (a field or a property): its
    `threads` follow from them."""

    warps: int

    @property
    def threads(self) -> int:
        """Threads per CTA: 32 per warp."""
        return 32 * self.warps


class QKVStages:
    """Mixed into an attention instance whose shared memory holds a Q tile of `block_m` rows and,
    per stage, a K and a V tile of `block_n` rows, all `head_dim` wide (fa2_sm80's kernel and
    decode_sm80's, which reuse the space for their epilogues): its `smem_bytes` follow from them."""

    block_m: int
    block_n: int
    stages: int
    head_dim: int
    dtype: DType

    @property
    def smem_bytes(self) -> int:
        """The Q tile and the K and V tiles of every stage."""
        return (self.block_m + 2 * self.stages * self.block_n) * self.head_dim * self.dtype.itemsize


class BothMasks:
    """Mixed into an attention instance that serves no mask and causal because the causal offset
    is a launch parameter: it fixes no mask (its family's problem_reason checks the problem's; the
    registry keeps sliding windows, Mask.LOCAL, from it)."""

    @property
    def mask(self) -> None:
        """None: the causal offset is a launch parameter."""
        return None


class BoundedHeadDim(BothMasks):
    """Mixed into an attention instance built on one of CUTLASS example 41's kernels: it serves
    every head dim up to its `max_head_dim` and both masks, so it fixes neither (its family's
    problem_reason checks them), its CTA holds one 32x32 warp tile per warp of its `block_m` x
    `block_n` block, and it loads each block's K and V before using them (one stage)."""

    max_head_dim: int
    block_m: int
    block_n: int

    @property
    def head_dim(self) -> None:
        """None: every multiple of 8 up to max_head_dim."""
        return None

    @property
    def warps(self) -> int:
        return self.block_m * self.block_n // (32 * 32)

    @property
    def stages(self) -> int:
        """1: the cost model counts a CTA's first K/V loads as fully exposed."""
        return 1

    @property
    def tile_stem(self) -> str:
        """The start of the name: name_stem, the bound (k<max_head_dim>) and the tile
        (q<block_m>k<block_n>)."""
        return f"{getattr(self, 'name_stem')}_k{self.max_head_dim}_q{self.block_m}k{self.block_n}"

    def tile_reason(self, max_head_dims: tuple[int, ...], block_ms: tuple[int, ...],
                    block_ns: tuple[int, ...]) -> str | None:
        """The first checks of such a family's invalid_reason: the bound one of `max_head_dims` and
        the tile one of `block_ms` x `block_ns` (None when they pass)."""
        if reason := axis_reason("max_head_dim", self.max_head_dim, max_head_dims):
            return reason
        if self.block_m not in block_ms or self.block_n not in block_ns:
            return f"tile {self.block_m}x{self.block_n} not in {block_ms} x {block_ns}"
        return None

    def measured_smem_reason(self, arch: Arch, what: str) -> str | None:
        """The last check of such a family's invalid_reason: its shared memory comes from a table
        of the sizes nvcc laid out (0 where the table lacks `what`: never built), and it must fit
        `arch`'s (None when it does)."""
        if getattr(self, "smem_bytes") == 0:
            return f"{what}: shared memory size unknown"
        return smem_reason(self, arch)

    def bound_reason(self, problem: Any, multiple: int) -> str | None:
        """The first checks of such a family's problem_reason: no key-value cache, and a head dim
        within the bound and a multiple of `multiple` (None when they pass)."""
        if reason := feature_reason(getattr(self, "family"), problem, ("kv_cache",)):
            return reason
        if problem.head_dim > self.max_head_dim:
            return f"head_dim {problem.head_dim} above this instance's bound {self.max_head_dim}"
        if problem.head_dim % multiple:
            return f"head_dim {problem.head_dim} is not a multiple of {multiple}"
        return None


class AttentionInstance(Instance):
    """An attention family's instance. Besides Instance's members it has `head_dim` (int) and
    `mask` (Mask), fields or properties that are None where one instance serves several (its
    family's problem_reason then checks the problem's), and the cost model's inputs, `cost_inputs`:
    by default its tile (`block_m` query rows by `block_n` keys), the K/V tiles it keeps in flight
    (`stages`), its threads and its shared memory; an instance without those overrides it."""

    head_dim: int | None
    mask: Mask | None
    block_m: int
    block_n: int
    stages: int

    @property
    def name_stem(self) -> str:
        """The start of the name: family and dtype, then the head dim (d<head_dim>) and the mask
        where the instance fixes them."""
        parts = [self.family, self.dtype.value]
        if self.head_dim is not None:
            parts.append(f"d{self.head_dim}")
        if self.mask is not None:
            parts.append(self.mask.value)
        return "_".join(parts)

    @property
    def causal(self) -> bool:
        """Whether the instance is built for the causal mask (False where `mask` is None)."""
        return self.mask is Mask.CAUSAL

    @property
    def cost_inputs(self) -> CostInputs:
        """What the heuristic's cost model reads."""
        return CostInputs(self.block_m, self.block_n, self.stages, self.threads, self.smem_bytes)


class Strategy(enum.Enum):
    """How a batched GEMM finds a batch's matrices: one pointer and strides per operand, or an array
    of pointers per operand."""

    STRIDED = "strided"
    PTR_ARRAY = "ptr"


# The one table from Strategy to its C++ spellings: the run function, the ABI's args struct, its tag.
STRATEGY_CPP = {Strategy.STRIDED: ("strided", "GemmgenBatchedGemmStridedArgs", "GEMMGEN_GEMM_STRIDED"),
                Strategy.PTR_ARRAY: ("ptrs", "GemmgenBatchedGemmPtrArgs", "GEMMGEN_GEMM_PTR_ARRAY")}


@dataclasses.dataclass(frozen=True)
class GemmInstance(Instance):
    """A GEMM family's instance: a batched C = alpha * A * op(B) on tiles of tile_m x tile_n x
    tile_k. Its first fields are what gemmgen.select.gemm_select matches and estimates: the input
    dtype, `out_fp32` (C in fp32, else in the input dtype; in the params the output dtype
    `out_dtype`), `b_transposed` (B stored [N, K], else [K, N]), the strategy and the tile; the
    family's dataclass adds its own axes after them. Besides Instance's members it has `align` (the
    elements A's and B's pointers, strides and extents must be multiples of) and `params` starting
    with `gemm_params()`."""

    dtype: DType
    out_fp32: bool
    b_transposed: bool
    strategy: Strategy
    tile_m: int
    tile_n: int
    tile_k: int

    @property
    def out_dtype(self) -> DType:
        return DType.FP32 if self.out_fp32 else self.dtype

    @property
    def stream_k(self) -> bool:
        """Whether the K loops of the last wave are split over idle SMs (the cost model's input)."""
        return False

    @property
    def align_c(self) -> int:
        """C's alignment in output elements: 16-byte vectors where the inputs have vectors."""
        return 1 if self.align == 1 else 16 // self.out_dtype.itemsize

    @property
    def name_stem(self) -> str:
        """The start of the name: family, strategy, input and output dtypes, layout (nn: B is
        [K, N]; nt: B is [N, K]) and tile."""
        out = "f32" if self.out_fp32 else self.dtype.value
        layout = "nt" if self.b_transposed else "nn"
        return (f"{self.family}_{self.strategy.value}_{self.dtype.value}_{out}_{layout}"
                f"_m{self.tile_m}n{self.tile_n}k{self.tile_k}")

    @property
    def stage_bytes(self) -> int:
        """Shared memory of one mainloop stage: an A and a B tile, tile_k deep."""
        return (self.tile_m + self.tile_n) * self.tile_k * self.dtype.itemsize

    def gemm_params(self) -> dict[str, Any]:
        """The params of the fields above, in order, out_fp32 as `out_dtype`."""
        return {"dtype": self.dtype.value, "out_dtype": self.out_dtype.value, "b_transposed": self.b_transposed,
                "strategy": self.strategy.value, "tile_m": self.tile_m, "tile_n": self.tile_n,
                "tile_k": self.tile_k}

    def template_values(self) -> dict[str, Any]:
        """Instance's, C's C++ type `element_out`, and the strategy's C++ spellings (STRATEGY_CPP):
        `run`, `args_type` and `strategy_cpp`."""
        run, args, strategy = STRATEGY_CPP[self.strategy]
        return {**super().template_values(), "element_out": self.out_dtype.cpp, "run": run, "args_type": args,
                "strategy_cpp": strategy}

    @classmethod
    def from_params(cls: type[InstanceT], params: Mapping[str, Any]) -> InstanceT:
        if "out_dtype" not in params:
            raise ValueError(f"{cls.family} params lack 'out_dtype'")
        return super().from_params({**params, "out_fp32": params["out_dtype"] == DType.FP32.value})


class Family(Protocol):
    """What every family module declares at module level (check_family checks it)."""

    FAMILY: str  # prefix of every instance name, e.g. "fa2_sm80"
    KIND: str  # "attention", "attention_bwd", "gemm" or "softmax": which kind of selection serves it
    BUILT_BY_DEFAULT: bool  # whether `gemmgen generate` without --family builds it
    TEMPLATE: str  # its Jinja file under templates/ (an absolute path for a family kept elsewhere)
    HEADER_DIRS: tuple[str, ...]  # folders under templates/include/gemmgen/ its build key covers
    ARCHS: tuple[Arch, ...]  # the build targets it compiles for
    INSTANCE: type[Instance]  # its instance dataclass
    SPACE: tuple[Instance, ...]  # every valid instance: axes crossed, filtered by invalid_reason
    DEFAULT: tuple[Instance, ...]  # the subset `gemmgen generate` builds without --all

    def invalid_reason(self, inst: Any, arch: Arch) -> str | None:
        """The one validity rule: None, or why this instance is never built for `arch`."""


class GemmFamily(Family, Protocol):
    """A GEMM family: gemmgen.select.gemm_select checks dtypes, layout, strategy and alignment."""

    def problem_reason(self, inst: Any, problem: Any) -> str | None:
        """What a built instance cannot run beyond those checks (None when it can)."""


class AttentionFamily(Family, Protocol):
    """An attention family: the registry checks dtype, and head_dim and mask where the instance
    fixes them; problem_reason covers the rest."""

    HEAD_DIMS: tuple[int, ...]  # every head dim some instance serves: what fused_attention accepts
    RELATIVE_SPEED: float  # throughput per unit of the cost model's tile work against fa2_sm80's

    def problem_reason(self, inst: Any, problem: Any) -> str | None:
        """What a built instance cannot run (None when it can): the registry's reject reason."""


def axis_reason(label: str, value: Any, axis: tuple[Any, ...]) -> str | None:
    """None when `value` is one of `axis`, else "<label> <value> not in <axis>" (enums by value)."""
    if value in axis:
        return None
    if isinstance(value, enum.Enum):
        return f"{label} {value.value} not in {[v.value for v in axis]}"
    return f"{label} {value} not in {axis}"


def smem_reason(inst: Instance, arch: Arch) -> str | None:
    """None when `inst`'s shared memory fits `arch`'s per-block maximum, else how far it is over."""
    if inst.smem_bytes > arch.max_smem_bytes:
        return f"shared memory {inst.smem_bytes} B exceeds {arch.value}'s {arch.max_smem_bytes} B"
    return None


def feature_reason(family: str, problem: Any,
                   features: tuple[str, ...] = ("dropout", "bias", "varlen", "kv_cache")) -> str | None:
    """None when `problem` asks for none of `features` (attention problem flags), else "<family>
    has no <feature>" for the first it asks for."""
    for feature in features:
        if getattr(problem, feature, False):
            return f"{family} has no {feature.replace('_', ' ')}"
    return None


# The dropout mask's position of weight (i, j) within a head is 32-bit (templates/include/gemmgen/
# philox/philox.h: i * Nk + j, as CUTLASS's memory-efficient kernel computes it): Nq * Nk stays below
# 2^31 wherever an instance draws it.
DROPOUT_MAX_SCORES = 2**31 - 1


def dropout_reason(inst: Any, problem: Any) -> str | None:
    """The dropout rule of families whose instances are built for dropout or not (`inst.dropout`,
    suffix `_dropout`): such an instance runs dropout calls only, at fixed lengths, with Nq * Nk
    below 2^31; the others run none. None when `inst` runs `problem`'s dropout (or its lack)."""
    if bool(problem.dropout) != inst.dropout:
        return ("built for dropout; the problem has none" if inst.dropout else
                f"{inst.name} has no dropout (only instances built for it, `_dropout`, run it)")
    if inst.dropout and problem.varlen:
        return f"{inst.name} runs dropout at fixed lengths only"
    if inst.dropout and problem.seqlen_q * problem.seqlen_k > DROPOUT_MAX_SCORES:
        return (f"{inst.family} dropout positions are 32-bit within a head: seqlen_q * seqlen_k "
                f"({problem.seqlen_q} x {problem.seqlen_k}) must stay below 2^31")
    return None


# Per kind: the members its module declares and the base of its instance type.
KINDS: dict[str, tuple[type, type[Instance]]] = {
    "attention": (AttentionFamily, AttentionInstance),
    # Backward families: the attention contract, their instances served by the backward's kind.
    "attention_bwd": (AttentionFamily, AttentionInstance),
    "gemm": (GemmFamily, GemmInstance),
    "softmax": (Family, Instance),
}


def contract(protocol: type) -> dict[str, Any]:
    """A family protocol's members: name -> the type its value must have (`callable` for functions)."""
    members: dict[str, Any] = {}
    for klass in reversed(protocol.__mro__):
        if klass is Protocol or not getattr(klass, "_is_protocol", False):
            continue
        members.update({n: callable for n, v in vars(klass).items() if inspect.isfunction(v) and n[0] != "_"})
    members.update({n: typing.get_origin(t) or t for n, t in typing.get_type_hints(protocol).items()})
    return members


def check_family(family: Any) -> None:
    """Raise TypeError naming every member `family` lacks or declares wrongly for its KIND, and
    every instance of SPACE or DEFAULT that is not its INSTANCE type."""
    kind = getattr(family, "KIND", None)
    protocol, base = KINDS.get(kind, (Family, Instance))
    problems = [] if kind in KINDS else [f"KIND {kind!r} is not one of {', '.join(KINDS)}"]
    for name, expected in contract(protocol).items():
        if not hasattr(family, name):
            problems.append(f"lacks {name}")
            continue
        value = getattr(family, name)
        if not (callable(value) if expected is callable else isinstance(value, expected)):
            problems.append(f"{name} is a {type(value).__name__}, not a {expected.__name__}")
    inst_type = getattr(family, "INSTANCE", None)
    if isinstance(inst_type, type):
        if not (issubclass(inst_type, base) and dataclasses.is_dataclass(inst_type)
                and inst_type.__dataclass_params__.frozen):
            problems.append(f"INSTANCE {inst_type.__name__} is not a frozen dataclass deriving from {base.__name__}")
        elif getattr(inst_type, "family", None) != getattr(family, "FAMILY", None):
            problems.append(f"INSTANCE.family is not FAMILY {getattr(family, 'FAMILY', None)!r}")
        else:
            try:
                _field_types(inst_type)  # what from_params converts params to
            except NameError as exc:
                problems.append(f"INSTANCE's field types do not resolve in its module ({exc})")
        for pool in ("SPACE", "DEFAULT"):
            if any(not isinstance(inst, inst_type) for inst in getattr(family, pool, ())):
                problems.append(f"{pool} holds something other than {inst_type.__name__} instances")
    if kind in ("attention", "attention_bwd") and any(not isinstance(d, int) or d < 1 for d in getattr(family, "HEAD_DIMS", ())):
        problems.append("HEAD_DIMS are not positive ints")
    if problems:
        raise TypeError(f"family module {getattr(family, '__name__', family)!r} breaks the family contract "
                        f"(gemmgen.generator.families.base): {'; '.join(problems)}")


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _typed(kind: Any, value: Any, name: str) -> Any:
    """`value` (a param) as a field of type `kind`; ValueError when it is not one."""
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        try:
            return kind(value)
        except ValueError:
            raise ValueError(f"{name} {value!r} is not one of {[m.value for m in kind]}") from None
    if isinstance(value, bool) if kind is bool else kind is int and type(value) is int:
        return value
    raise ValueError(f"{name} {value!r} is not a {getattr(kind, '__name__', kind)}")
