"""The EVT plan: what one specialization's epilogue is, node by node, as data.

A plan is a list of Sm90 visitor nodes in topological order (children before parents); the last
one yields D. Each node kind is one class holding what its code depends on and what it adds to the
plan's canonical text (`canonical()`, which the specialization key hashes); codegen/evt.py spells
each kind in C++ (its type, Arguments initializer and host code). Runtime operands are bound by
position: `inputs[i]` of the op is the plan's i-th input operand, `outputs[j]` its j-th output.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field

from ..errors import OperandError
from ..ir.ops import to_fp32


@dataclass(frozen=True)
class Config:
    """Kernel configuration: CTA tile (M, N, K), cluster (M, N), schedule, the epilogue subtile (M, N)
    the epilogue works through (None: CUTLASS's choice, 128x32 / 64x32), and the tile scheduler:
    the order in which persistent CTAs walk the output tiles (raster "m": down the M tiles first,
    "n": along N first, "auto": along the shorter side) in swizzled groups of `swizzle` tiles, which
    keeps one wave's A and B slices in L2 (8: 2-7 % faster than 1 at N >= 14336 on the H200), and
    "streamk" to split the last wave's work along K. `swizzle` is the most a launch uses: a smaller one
    where rounding the tile grid up to whole groups would run over 2 % more (empty) tiles
    (csrc/coda_dsl/schedule.h: swizzle_for).

    Its text form, which every API taking a config also accepts (Config.parse, .text), e.g.
    "128x256x64_c2x1_cooperative" or "128x128x64_c1x2_pingpong_rm_s4_streamk": tile, cluster, schedule,
    then optional raster (_rm/_rn), swizzle (_sN), epilogue tile (_eMxN) and _streamk. The cooperative
    schedule needs tile M >= 128 (two warp groups split it)."""

    tile: tuple[int, int, int] = (128, 256, 64)
    cluster: tuple[int, int] = (2, 1)
    schedule: str = "cooperative"  # or "pingpong"
    epilogue_tile: tuple[int, int] | None = None
    raster: str = "auto"  # "m" | "n" | "auto"
    swizzle: int = 8  # 1, 2, 4 or 8
    scheduler: str = "persistent"  # or "streamk"

    def __post_init__(self):
        def ints(name: str, value, count: int) -> tuple[int, ...]:
            if not (isinstance(value, (tuple, list)) and len(value) == count
                    and all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
                raise OperandError(f"{name} must be {count} integers, not {value!r}")
            return tuple(value)
        object.__setattr__(self, "tile", ints("tile", self.tile, 3))  # a list is taken as its tuple
        object.__setattr__(self, "cluster", ints("cluster", self.cluster, 2))
        if self.epilogue_tile is not None:
            object.__setattr__(self, "epilogue_tile", ints("epilogue_tile", self.epilogue_tile, 2))
        m, n, k = self.tile
        if self.schedule not in ("cooperative", "pingpong"):
            raise OperandError(f"schedule must be 'cooperative' or 'pingpong', not {self.schedule!r}")
        if self.schedule == "cooperative" and m < 128:
            raise OperandError(f"the cooperative schedule needs tile M >= 128 (got {m}); use schedule='pingpong'")
        if n % 16 or k % 16 or m % 64 or min(self.tile) <= 0:
            raise OperandError(f"tile {self.tile}: M must be a positive multiple of 64, N and K of 16")
        if any(c not in (1, 2, 4) for c in self.cluster) or self.cluster[0] * self.cluster[1] > 4:
            # (a side of 3 splits no tile into the multicast slices CUTLASS's TMA loads need)
            raise OperandError(f"cluster {self.cluster}: 1 to 4 CTAs, each side 1, 2 or 4")
        if self.epilogue_tile is not None:
            em, en = self.epilogue_tile
            if em != (128 if self.schedule == "cooperative" else 64) or en <= 0 or en % 16 or n % en:
                raise OperandError(f"epilogue tile {self.epilogue_tile}: M must be 128 (cooperative) or 64 "
                                   f"(pingpong), N a multiple of 16 dividing the tile's {n}")
        if self.raster not in ("auto", "m", "n"):
            raise OperandError(f"raster must be 'auto', 'm' or 'n', not {self.raster!r}")
        if not isinstance(self.swizzle, numbers.Integral) or isinstance(self.swizzle, bool) or self.swizzle not in (1, 2, 4, 8):
            raise OperandError(f"swizzle must be 1, 2, 4 or 8, not {self.swizzle!r}")
        if self.scheduler not in ("persistent", "streamk"):
            raise OperandError(f"scheduler must be 'persistent' or 'streamk', not {self.scheduler!r}")

    @property
    def text(self) -> str:
        """The string form, e.g. 128x256x64_c2x1_cooperative_e128x64_rm_s4_streamk (defaults left out)."""
        parts = [f"{'x'.join(map(str, self.tile))}_c{self.cluster[0]}x{self.cluster[1]}_{self.schedule}"]
        if self.epilogue_tile:
            parts.append(f"e{self.epilogue_tile[0]}x{self.epilogue_tile[1]}")
        if self.raster != "auto":
            parts.append(f"r{self.raster}")
        if self.swizzle != 8:
            parts.append(f"s{self.swizzle}")
        if self.scheduler != "persistent":
            parts.append(self.scheduler)
        return "_".join(parts)

    @staticmethod
    def parse(text: str) -> "Config":
        """'128x256x64_c2x1_cooperative[_e128x64][_rm|_rn][_s1|_s2|_s4][_streamk]' -> Config (the inverse of .text)."""
        try:
            if not isinstance(text, str):
                raise OperandError(f"a config text is a string, not {type(text).__name__}")
            if text.count("_") < 2:
                raise OperandError("it needs at least three parts: tile, cluster and schedule, joined by _")
            tile, cluster, schedule, *rest = text.split("_")

            def ints(s: str) -> tuple[int, ...]:
                if not all(x.isdigit() for x in s.split("x")):
                    raise OperandError(f"{s!r} is not numbers joined by x")
                return tuple(int(x) for x in s.split("x"))
            if cluster[:1] != "c":
                raise OperandError(f"the cluster part is c<M>x<N>, not {cluster!r}")
            extra: dict = {}
            for part in rest:
                if part == "streamk":
                    key, value = "scheduler", part
                elif part[:1] == "e" and part[1:2].isdigit():
                    key, value = "epilogue_tile", ints(part[1:])
                elif part in ("rm", "rn"):
                    key, value = "raster", part[1]
                elif part[:1] == "s" and part[1:].isdigit():
                    key, value = "swizzle", int(part[1:])
                else:
                    raise OperandError(f"unknown part {part!r}")
                if key in extra:
                    raise OperandError(f"two {key} parts")
                extra[key] = value
            return Config(ints(tile), ints(cluster[1:]), schedule, **extra)  # type: ignore[arg-type]
        except (ValueError, TypeError, IndexError) as e:
            raise OperandError(f"bad config {text!r}: expected e.g. 128x256x64_c2x1_cooperative or "
                             f"128x256x64_c2x1_cooperative_e128x64_rm_s4 ({e})") from None


MAX_DIM = 2**31 - 1  # the kernels take M, N, K and L as 32-bit ints (kernel.cu.j2's run)


@dataclass(frozen=True)
class Signature:
    """Everything about a call that changes the generated code (never sizes, pointers or scalar values)."""

    ab_dtype: str  # bf16 | fp16
    b_layout: str  # "nk": B is [N, K] K-contiguous (nn.Linear weight); "kn": [K, N] N-contiguous
    operand_dtypes: tuple[tuple[str, str], ...]  # (operand name, dtype) of every load operand
    output_dtypes: tuple[tuple[str, str], ...]  # (output name, dtype) of every tensor output
    consts: tuple[tuple[str, float], ...] = ()
    config: Config = Config()
    deterministic: bool = False  # reductions: fixed-order combine instead of atomics
    accumulate: bool = False  # D += epilogue value (D is read through the C operand)
    a_layout: str = "mk"  # "mk": A is [M, K] K-contiguous; "km": [K, M] storage passed as X.t() (M-contiguous)


# ---------------------------------------------------------------------------------------------
# Visitor nodes
# ---------------------------------------------------------------------------------------------
@dataclass
class EvtNode:
    name: str  # C++ type alias, unique in the plan
    children: tuple[int, ...] = ()
    comment: str = ""

    def canonical(self) -> str:
        return f"{type(self).__name__}{self.children}"


@dataclass
class AccFetch(EvtNode):
    """The fp32 accumulator (Sm90AccFetch)."""


@dataclass
class SrcFetch(EvtNode):
    """The current contents of D, read through CUTLASS's C operand (in-place accumulation)."""

    def canonical(self) -> str:
        return "Src"


@dataclass
class Operand(EvtNode):
    """A leaf reading one runtime operand, `inputs[input_index]`, of element type `dtype`."""

    dtype: str = "bf16"
    input_index: int = 0


@dataclass
class AuxLoad(Operand):
    """A full [M, N] operand, TMA-loaded into shared memory by the producer warp."""

    def canonical(self) -> str:
        return f"AuxLoad{self.dtype}{self.children}"


@dataclass
class PairLoad(Operand):
    """An [M, N/2] operand (one value per column pair), read straight into registers."""

    def canonical(self) -> str:
        return f"PairLoad{self.dtype}"


@dataclass
class WideLoad(Operand):
    """A [M, 2N] operand of 16-bit values, TMA-loaded like AuxLoad as [M, N] 32-bit words: word n holds
    columns 2n and 2n + 1 (the halves Unpack takes apart)."""

    def canonical(self) -> str:
        return f"WideLoad{self.dtype}"


@dataclass
class Unpack(EvtNode):
    """Half `part` (0: columns 2n, 1: columns 2n + 1) of its WideLoad child's words, an [M, N] value in
    fp32: what cd.pairs of a double-width operand gives."""

    dtype: str = "bf16"
    part: int = 0

    def canonical(self) -> str:
        return f"Unpack{self.dtype}{self.part}{self.children}"


@dataclass
class Pack(EvtNode):
    """Its two [M, N] children rounded to `dtype` and packed into 32-bit words (child i -> columns
    2n + i): the value of an interleaved output, which a WideStore writes."""

    dtype: str = "bf16"

    def canonical(self) -> str:
        return f"Pack{self.dtype}{self.children}"


@dataclass
class RowBroadcast(Operand):
    """cd.VecN: one value per column n, broadcast down the rows. CUTLASS names broadcast nodes after
    the vector's shape: a vector over n (one value per column) is a *row* broadcast."""

    def canonical(self) -> str:
        return f"RowB{self.dtype}"


@dataclass
class ColBroadcast(Operand):
    """cd.VecM: one value per row m, broadcast along the columns (a *column* broadcast)."""

    def canonical(self) -> str:
        return f"ColB{self.dtype}"


@dataclass
class OneHot(Operand):
    """1.0 at column index[m] of each row m, else 0.0 (cd.take's derivative): `inputs[input_index]` is the
    int64 index, read once per row a thread holds."""

    def canonical(self) -> str:
        return f"OneHot{self.input_index}"  # (which index, as Take's: two may share one)


@dataclass(frozen=True)
class Ref:
    """An fp32 value inside a functor."""

    kind: str  # "input": the functor's input x<index>; "temp": the result of step <index>;
    # "const": the number `index`; "scalar": the runtime scalar at position `index` (p.s<index>)
    index: int | float
    slot: int | None = None  # inputs of pairwise functors: 0 the pair's even column, 1 its odd one


@dataclass(frozen=True)
class Step:
    """One elementwise op (an op name of ir/ops.py; attr: cast's dtype) applied to earlier values;
    its result is Ref("temp", its position in the functor's steps)."""

    op: str
    attr: object
    args: tuple[Ref, ...]


@dataclass
class Functor:
    """One fused elementwise region, as data: steps over fp32 inputs x0..xk, scalars and constants.
    codegen/cpp.py spells it in C++; tests/test_functor_semantics.py runs it with the ops' torch
    semantics."""

    name: str
    arity: int
    steps: list[Step]
    result: Ref  # the value returned
    text: str = ""  # the region in DSL terms, for a comment
    # Pairwise functors work on column pairs q of the fragment (slots 2q, 2q+1): inputs are read per
    # slot (Ref.slot); `result` goes to the even slot, `result_odd` to the odd one.
    pairwise: bool = False
    result_odd: Ref | None = None

    def canonical(self) -> str:
        """The functor in the plan's canonical text, as data (its name and comment left out). How codegen spells it
        is in every specialization key too (build/cache.py digests codegen/), so a new spelling is a new key."""
        steps = ";".join(f"{s.op}{'' if s.attr is None else f'[{s.attr}]'}({','.join(map(_ref_text, s.args))})"
                         for s in self.steps)
        odd = f",{_ref_text(self.result_odd)}" if self.pairwise and self.result_odd is not None else ""
        return f"[{steps};return {_ref_text(self.result)}{odd}]"


def _ref_text(r: Ref) -> str:
    if r.kind == "input":
        return f"x{r.index}" + ("" if r.slot is None else f".{r.slot}")
    if r.kind == "const":  # the fp32 value, -0.0 and nan included
        return f"{to_fp32(r.index)!r}f"
    return f"{'t' if r.kind == 'temp' else 's'}{r.index}"


@dataclass
class Compute(EvtNode):
    """A fused elementwise region (Sm90Compute over its functor)."""

    functor: Functor = field(default_factory=lambda: Functor("", 0, [], Ref("input", 0)))

    def canonical(self) -> str:
        return f"Compute{self.children}{self.functor.canonical()}"


@dataclass
class _Store(EvtNode):
    """An output tensor `outputs[output_index]` of element type `dtype`, a tap on its child's value."""

    dtype: str = "bf16"
    output_index: int = 0

    def canonical(self) -> str:
        return f"{type(self).__name__}{self.dtype}{self.children}"


@dataclass
class AuxStore(_Store):
    """A full-size auxiliary output, staged in shared memory and TMA-stored."""


@dataclass
class PairStore(_Store):
    """A half-width output ([M, N/2], one value per column pair), staged in shared memory and TMA-stored."""


@dataclass
class WideStore(_Store):
    """A double-width output ([M, 2N], cd.interleave(a, b) of [M, N] values): its Pack child's words,
    staged in shared memory and TMA-stored like AuxStore."""


@dataclass
class Reduce(EvtNode):
    """A statistic of its input over an output axis, in fp32.

    axis "n" (per row, [M]) is CUTLASS's ColReduction (CUTLASS names them after the shape of the result, the
    opposite of the ML reading), "m" (per column, [N]) coda::ColumnReduction (columns.h).
    Default: tiles combine with global atomics into the output (filled with the identity first).
    deterministic: every tile writes its partial (FinalReduction=false) and a small finishing kernel
    combines them in a fixed order. `finish` (from `.then`) runs in that kernel too.
    """

    kind: str = "sum"
    axis: str | None = "n"
    output_index: int = 0
    deterministic: bool = False
    finish: Functor | None = None

    def canonical(self) -> str:
        body = self.finish.canonical() if self.finish else ""
        return f"Reduce{self.kind}{self.axis}{'det' if self.deterministic else ''}{self.children}{body}"


@dataclass
class LogSumExp(Reduce):
    """cd.logsumexp over n: per row and N tile an online (reference point, sum of exp) pair, combined exactly
    by the finishing kernel. Always per-tile partials, never atomics: deterministic in either mode."""

    def canonical(self) -> str:
        return "LogSumExp" + super().canonical()


@dataclass
class Take(Reduce):
    """cd.take over n: the value at column index[m] of each row, stored by the one thread holding it
    (no atomics); `inputs[index_input]` is the int64 index. Rows whose index is outside [0, N) keep the
    0 the output is filled with before the launch."""

    index_input: int = 0

    def canonical(self) -> str:
        return f"Take{self.index_input}" + super().canonical()


# An output's shape kind (Plan.outputs) -> (its shape as text, its shape from (batch dims, M, N))
OUTPUT_SHAPES = {
    "mn": ("[M, N]", lambda lead, m, n: (*lead, m, n)),
    "mh": ("[M, N/2]", lambda lead, m, n: (*lead, m, n // 2)),  # a pairwise value
    "mw": ("[M, 2N]", lambda lead, m, n: (*lead, m, 2 * n)),  # an interleave
    "m": ("[M]", lambda lead, m, n: (*lead, m)),  # a statistic per row
    "n": ("[N]", lambda lead, m, n: (*lead, n)),  # per column
    "": ("scalar", lambda lead, m, n: tuple(lead)),  # of everything
}
KIND_OF_AXIS = {"n": "m", "m": "n", None: ""}  # a statistic over `axis` -> its output's shape kind


@dataclass
class Plan:
    """One specialization: GEMM operand types, epilogue nodes, and the runtime binding order."""

    name: str  # the epilogue's name (comments only)
    signature: Signature
    nodes: list[EvtNode]
    functors: list[Functor]
    inputs: list[str]  # operand names, in the order the op receives them
    outputs: list[tuple[str, str, str]]  # (name, dtype, shape kind: OUTPUT_SHAPES) in the order the op receives them
    d_dtype: str | None  # dtype of D; None: the epilogue stores no D
    scalars: list[str]  # scalar operand names, in the order the op receives them
    widened: list[str] = field(default_factory=list)  # N/2-wide operands the runtime widens to N

    @property
    def reads_d(self) -> bool:
        return any(isinstance(n, SrcFetch) for n in self.nodes)

    @property
    def wide(self) -> list[str]:
        """[M, 2N] operands, which the kernel reads as 32-bit words (TMA: 16-byte aligned rows)."""
        return [self.inputs[n.input_index] for n in self.nodes if isinstance(n, WideLoad)]

    @property
    def canonical(self) -> str:
        """Canonical text of everything that shapes the generated code (never user-facing names)."""
        s = self.signature
        return "|".join([s.ab_dtype, s.b_layout, *([] if s.a_layout == "mk" else ["a_km"]), s.config.text,
                         str(self.d_dtype), str(len(self.scalars)), str(self.reads_d),
                         *(n.canonical() for n in self.nodes)])
