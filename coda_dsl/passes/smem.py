"""Shared memory of a plan's kernel, modelled in Python so that a kernel that cannot fit is refused (or
made to fit) before nvcc, not by a static assertion deep in CUTLASS.

The kernel template sizes the mainloop with StageCountAutoCarveout<sizeof(CollectiveEpilogue::
SharedStorage)>: what the epilogue takes is carved out of the 227 KiB of an sm90 block, and the rest
holds as many A/B stages as fit. CUTLASS needs at least 2 of them. The model follows CUTLASS 3.x/4.x
(epilogue/collective/builders/sm90_builder.inl, sm90_epilogue_tma_warpspecialized.hpp, the visitor
nodes' SharedStorage, gemm/collective/builders/sm90_gmma_builder.inl) and rounds every buffer up to
the largest swizzle alignment, so it over-estimates: it may refuse a plan CUTLASS would just fit, never
the reverse.
"""
from __future__ import annotations

import dataclasses
import math

from ..errors import SharedMemoryError
from ..ir.ops import DTYPES
from .plan import AuxLoad, AuxStore, Config, PairStore, Plan, Reduce, RowBroadcast, WideLoad, WideStore

CAPACITY = 232448  # bytes of shared memory an sm90 block may use (cutlass detail::sm90_smem_capacity_bytes)
MIN_STAGES = 2  # "Specialization requires Stages set to value 2 or more."
PREFERRED_STAGES = 3  # fewer leave the mainloop's loads exposed: a narrower epilogue tile is cheaper
_ALIGN = 1024  # the largest alignment CUTLASS gives a shared-memory buffer (128-byte swizzle)
_SLACK = 16  # an empty fusion SharedStorage: one byte, padded


def _round(x: int, to: int = _ALIGN) -> int:
    return -(-x // to) * to


def _bytes(dtype: str) -> int:
    return DTYPES[dtype].itemsize


def epilogue_tile(config: Config) -> tuple[int, int]:
    """The epilogue subtile: the config's, else CUTLASS's EpilogueTileAuto (sm90_compute_tile_shape_or_override;
    the 64-wide choice it makes for 8-bit D never applies: outputs are 16 or 32 bits)."""
    if config.epilogue_tile:
        return config.epilogue_tile
    tm, tn, _ = config.tile
    return min(128 if config.schedule == "cooperative" else 64, tm), math.gcd(min(32, tn), tn)


@dataclasses.dataclass(frozen=True)
class Usage:
    """What a plan's kernel puts in shared memory at one config (upper bounds, in bytes)."""

    config: Config
    epilogue: int  # sizeof(CollectiveEpilogue::SharedStorage), the carve-out
    parts: tuple[tuple[str, int], ...]  # (what, bytes) of the epilogue's buffers, largest first
    stage_bytes: int  # one A/B mainloop stage

    @property
    def stages(self) -> int:
        """Mainloop stages CUTLASS fits beside the epilogue (compute_stage_count_or_override)."""
        return (CAPACITY // 128 * 128 - _round(self.epilogue, 128)) // self.stage_bytes

    @property
    def fits(self) -> bool:
        return self.stages >= MIN_STAGES


def usage(plan: Plan, config: Config | None = None) -> Usage:
    """Shared memory of `plan` at `config` (default: the plan's own)."""
    cfg = config or plan.signature.config
    tm, tn, tk = cfg.tile
    em, en = epilogue_tile(cfg)
    tiles = (tm // em) * (tn // en)
    # EpilogueDescriptor (sm90_get_tma_dispatch_policy): the stages of C, which AuxLoad nodes share, and of D.
    # C = D (accumulation) reuses C's buffer for D, with StagesC >= StagesD + 1.
    stages_d = min(tiles, 2)
    stages_c = max(min(tiles, 4), stages_d + 1) if plan.reads_d else min(tiles, 4)
    sub = em * en
    d_bytes = _bytes(plan.d_dtype) if plan.d_dtype else 4  # no D: CUTLASS sizes the buffer from ElementAux = float
    if plan.reads_d:
        parts = [(f"D ({plan.d_dtype}, read and written in place)", _round(stages_c * sub * d_bytes))]
    else:
        parts = [(f"D ({plan.d_dtype})" if plan.d_dtype else "the D staging buffer (fp32, no D stored)",
                  _round(stages_d * sub * d_bytes))]
    pipeline = 16 * stages_c  # the C load pipeline's full and empty barriers
    names = dict(enumerate(plan.inputs))
    for n in plan.nodes:
        if isinstance(n, AuxLoad):
            what, elements = f"operand '{names[n.input_index]}' (cd.Tensor, {n.dtype})", stages_c * sub
        elif isinstance(n, WideLoad):  # double width: two values per column
            what, elements = f"operand '{names[n.input_index]}' (cd.Tensor, {n.dtype}, 2N wide)", stages_c * sub * 2
        elif isinstance(n, AuxStore):
            what, elements = f"output '{plan.outputs[n.output_index][0]}' ({n.dtype})", stages_d * sub
        elif isinstance(n, PairStore):  # half-width: one value per column pair
            what, elements = f"output '{plan.outputs[n.output_index][0]}' ({n.dtype}, N/2 wide)", stages_d * sub // 2
        elif isinstance(n, WideStore):
            what, elements = f"output '{plan.outputs[n.output_index][0]}' ({n.dtype}, 2N wide)", stages_d * sub * 2
        elif isinstance(n, RowBroadcast):  # one CTA tile's row of the vector
            what, elements = f"operand '{names[n.input_index]}' (cd.VecN, {n.dtype})", tn
        else:
            continue  # no shared memory of its own
        parts.append((what, _round(elements * _bytes(n.dtype))))
    # SharedStorage {TensorStorage {collective; fusion tuple} tensors; PipelineStorage pipeline;}, each struct
    # padded to its alignment (at most _ALIGN); each buffer was rounded up to _ALIGN above, which covers the
    # padding before the next. cute::tuple stores no empty member, but a fusion tuple of nothing but empty
    # members still takes a byte.
    tensors = _round(sum(b for _, b in parts) + (_SLACK if len(parts) == 1 else 0))
    total = _round(tensors + pipeline)
    ab = _bytes(plan.signature.ab_dtype)
    stage = _round(ab * (tm * tk + tn * tk), 128) + 16  # A and B tiles, and the stage's two barriers
    return Usage(cfg, total, tuple(sorted(parts, key=lambda p: -p[1])), stage)


def _shrinkable(plan: Plan) -> bool:
    """CUTLASS's deterministic row/column reductions use the D buffer as scratch and need a large enough
    epilogue tile: never shrink one (atomic reductions go from registers to global memory)."""
    return not any(type(n) is Reduce and n.deterministic for n in plan.nodes)


# Configs suggested when nothing fits: smaller CTA tiles leave more room to the epilogue.
_SMALLER = [Config((128, 128, 64), (1, 1), "cooperative"), Config((128, 128, 64), (1, 1), "cooperative", (128, 16)),
            Config((128, 64, 64), (1, 1), "cooperative", (128, 16)), Config((64, 64, 64), (1, 1), "pingpong", (64, 16))]


def fit(plan: Plan) -> Plan:
    """`plan` if its kernel leaves PREFERRED_STAGES mainloop stages. If not, and its epilogue tile is
    CUTLASS's choice, the plan with the widest narrower epilogue tile that does (each epilogue step then
    stages fewer columns); else the widest that fits at all (MIN_STAGES). Else SharedMemoryError, naming
    what costs the most and a config that fits."""
    first = usage(plan)
    if first.stages >= PREFERRED_STAGES:
        return plan
    cfg = plan.signature.config
    configs = [cfg]
    if cfg.epilogue_tile is None and _shrinkable(plan):
        em, en = epilogue_tile(cfg)
        configs += [dataclasses.replace(cfg, epilogue_tile=(em, w)) for w in range(en - 16, 15, -16) if cfg.tile[1] % w == 0]
    for want in (PREFERRED_STAGES, MIN_STAGES):
        c = next((c for c in configs if usage(plan, c).stages >= want), None)
        if c is not None:
            return plan if c is cfg else dataclasses.replace(plan, signature=dataclasses.replace(plan.signature, config=c))
    costly = ", ".join(f"{what} {b / 1024:.0f} KiB" for what, b in first.parts[:3])
    ok = next((c for c in _SMALLER if usage(plan, c).fits and (c.epilogue_tile is None or _shrinkable(plan))), None)
    fp32 = any("fp32" in what and "staging" not in what for what, _ in first.parts[:3])  # among the costliest
    raise SharedMemoryError(
        f"epilogue '{plan.name}' does not fit in shared memory at config {cfg.text}: its epilogue needs about "
        f"{first.epilogue / 1024:.0f} KiB (most: {costly}), leaving room for {max(first.stages, 0)} mainloop "
        f"stage(s) of {first.stage_bytes / 1024:.0f} KiB where CUTLASS needs {MIN_STAGES} (227 KiB in all)\n"
        "  fix: " + ("pass the largest operands and outputs in bf16/fp16 instead of fp32, or " if fp32 else "")
        + "use fewer full-size operands and outputs per kernel" + (f", or config='{ok.text}'" if ok else ""))
