"""The callable ops: cd.gemm, cd.compile and CompiledOp (the cached, ready-to-launch specialization)."""
from __future__ import annotations

import difflib
import numbers
import threading
import warnings
import weakref
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

import torch

from .. import build, pipeline
from ..dsl import RESERVED, Epilogue, identity
from ..errors import EpilogueError, OperandError, UnsupportedError
from ..ir import graph as ir
from ..ir.ops import DTYPES, REDUCTIONS
from ..passes import accumulate_into_d, specialize
from ..passes.widths import infer as infer_widths, load_widths, width_text
from ..passes.plan import MAX_DIM, OUTPUT_SHAPES, Config, Signature
from . import checks, reference, tune as tuning, warm
from .kernel import Kernel, remember
from .torch_op import register_eager, traced_gemm



@dataclass
class Call:
    """One call's operands: 2-D/3-D A and B, tensors/scalars/consts by operand name."""

    a: torch.Tensor
    b: torch.Tensor
    tensors: dict[str, torch.Tensor]
    scalars: dict[str, float]
    consts: dict[str, float]
    batch: tuple[int, ...] = ()  # batch dims of A folded into M for the kernel (A 3-D, B 2-D)

    @property
    def mnkl(self) -> tuple[int, int, int, int]:
        a, b = self.a, self.b
        return a.shape[-2], b.shape[-2], a.shape[-1], (a.shape[0] if a.dim() == 3 else 1)


def _where(ep: Epilogue) -> str:
    """The prefix of a call's messages (cd.gemm's, a CompiledOp's, cd.linear's): the epilogue called."""
    return ep.program.title


def _normalize(ep: Epilogue, a, b, operands: dict, out: dict | None = None) -> Call:
    where = _where(ep)
    _check_out_dict(ep, out)
    for name, t in (("A", a), ("B", b)):
        if not isinstance(t, torch.Tensor):
            raise checks.fail(where, f"{name} must be a torch.Tensor, got {type(t).__name__}")
        checks.dense(where, name, t)
        if t.dim() not in (2, 3):
            raise checks.fail(where, f"{name} must be 2-D or 3-D (batched), got shape {list(t.shape)}")
    if a.shape[-1] != b.shape[-1]:
        hint = ("B looks like [K, N]: pass B.t() (a view; no copy), since B is taken as [N, K] like an "
                "nn.Linear weight" if b.shape[-2] == a.shape[-1] else "A is [M, K] and B is [N, K]")
        raise checks.fail(where, f"K mismatch: A {list(a.shape)} and B {list(b.shape)}", hint)
    if b.dim() == 3 and (a.dim() != 3 or a.shape[0] != b.shape[0]):
        raise checks.fail(where, f"batched B {list(b.shape)} needs A of shape [{b.shape[0]}, M, K], got {list(a.shape)}")

    check_operands(ep, operands)
    return _unpack(_facts(ep).kinds, a, b, operands)


def check_operands(ep: Epilogue, operands: dict) -> None:
    """The operands' names against the epilogue's, and its numbers (also while torch.compile traces)."""
    where = _where(ep)
    declared = [p.name for p in ep.params]
    _check_names(where, declared, operands, "operand(s)", "operand(s)",  # (a misspelt keyword of cd.gemm lands here)
                 lambda unknown: f"the epilogue declares {declared or 'no operands'}{_lookalikes(unknown, RESERVED)}")
    for p in ep.params:
        if p.kind not in ir.LOAD_KINDS:  # tensors: checked by _check_tensors
            _check_number(where, p, operands[p.name])


def _lookalikes(unknown: list[str], keywords) -> str:
    """'; backnd= looks like the keyword backend=' for each unknown name close to one of the keywords."""
    return "".join(f"; {n}= looks like the keyword {k}=" for n in unknown
                   for k in difflib.get_close_matches(n, sorted(keywords), 1))


def _check_names(where: str, declared: list[str], given: dict, extra: str, absent: str,
                 fix: Callable[[list[str]], str]) -> None:
    """`given` holds every name `declared` and no other; else the error lists what is extra and what is absent,
    with fix(the names not declared)."""
    unknown = sorted(set(given) - set(declared))
    missing = [n for n in declared if n not in given]
    if unknown or missing:
        raise checks.fail(where, "; ".join([f"unexpected {extra} {unknown}"] * bool(unknown)
                                           + [f"missing {absent} {missing}"] * bool(missing)), fix(unknown))


def _check_number(where: str, p: ir.Param, v) -> None:
    if isinstance(v, torch.Tensor) and v.numel() == 1 and p.kind == "scalar":
        raise checks.fail(where, f"scalar '{p.name}' was given as a tensor",
                          f"pass a Python number (float({p.name})), or declare it cd.VecM/VecN (cd.linear "
                          "learns a cd.Scalar given as a 0-d tensor)")
    if isinstance(v, bool) and p.kind == "scalar":  # a flag where a runtime number goes (a cd.Const may select)
        raise checks.fail(where, f"'{p.name}' (scalar) must be a number, got {v}", f"pass {float(v)} if that was meant")
    if not isinstance(v, numbers.Real):  # int, float, numpy's scalars
        t = type(v)
        raise checks.fail(where, f"'{p.name}' ({p.kind}) must be a number, got "
                          f"{t.__name__ if t.__module__ == 'builtins' else t.__module__ + '.' + t.__name__}",
                          f"pass float({p.name})")
    try:
        float(v)
    except OverflowError:  # an int beyond double's range
        raise checks.fail(where, f"'{p.name}' ({p.kind}) has {len(str(abs(int(v))))} digits: too large for a float",
                          "pass a value within fp32's range (3.4e38)") from None


def check_consts(api: str, ep: Epilogue, consts: dict, options: tuple[str, ...] = ()) -> None:
    """The cd.Const values given to `api` (a derivation: no operands but these): each one the epilogue
    declares, a number, and nothing else (a misspelt option of api's lands here)."""
    where = f"{api}: {ep.program.title}"
    declared = [p for p in ep.params if p.kind == "const"]
    names = [p.name for p in declared]
    _check_names(where, names, consts, "keyword(s)", "cd.Const value(s)", lambda unknown: f"the epilogue's cd.Const "
                 f"parameters are {names or 'none'}" + (f"; {api}'s options are {list(options)}" if options else "")
                 + _lookalikes(unknown, options))
    for p in declared:
        _check_number(where, p, consts[p.name])


def _check_out_dict(ep: Epilogue, out) -> None:
    if out is not None and not isinstance(out, dict):
        raise checks.fail(_where(ep), f"out must be a dict of output name -> tensor, got {type(out).__name__}",
                          "pass out={'D': tensor, ...}")
    for name, same in ep.program.aliases if out else ():
        if name in out:
            raise checks.fail(_where(ep), f"out has '{name}', which is output '{same}': the same value, stored once "
                              f"and returned as the tensor of '{same}'", f"pass out={{'{same}': tensor}} for both")


def _unpack(kinds: dict[str, str], a, b, operands: dict) -> Call:
    """The operands of a checked call, sorted by kind."""
    tensors, scalars, consts = {}, {}, {}
    for name, kind in kinds.items():
        v = operands[name]
        if kind in ir.LOAD_KINDS:
            tensors[name] = v
        else:
            (scalars if kind == "scalar" else consts)[name] = float(v)
    return Call(a, b, tensors, scalars, consts)


def _layout(v) -> object:
    """What the call checks read of one argument, so equal layouts pass or fail them alike."""
    if isinstance(v, torch.Tensor):
        try:
            return v.shape, v.stride(), v.dtype, v.device, v.data_ptr() % 16, v.requires_grad
        except RuntimeError:  # no strides or no data (a sparse tensor): the checks refuse it
            return type(v), v.layout
    return type(v)


def _const_key(v) -> object:
    """A cd.Const by its value's spelling: -0.0 and 0.0 build different kernels, every NaN the same one
    (anything but a number: its type, which the checks refuse)."""
    try:
        return repr(float(v)) if isinstance(v, numbers.Real) else type(v)
    except OverflowError:  # an int beyond double's range: the checks refuse it
        return type(v)


def _consts_key(consts: dict[str, float]) -> tuple:
    return tuple(sorted((k, _const_key(v)) for k, v in consts.items()))


_MISSING = object()  # its part of a layout, `object`, is no tensor's or number's: it fails the checks


def _call_layout(kinds: dict[str, str], a, b, operands: dict, out: dict | None) -> tuple:
    """The layouts of a whole call; a cd.Const by its spelling, since it selects the kernel. A warm
    call whose layout passed the checks before skips them (only aliasing of outputs with inputs is
    checked each time)."""
    parts = [_layout(a), _layout(b), len(operands)]
    for name, kind in kinds.items():
        v = operands.get(name, _MISSING)
        parts.append(_const_key(v) if kind == "const" else _layout(v))
    if isinstance(out, dict):
        parts.extend((k, _layout(v)) for k, v in out.items())
    elif out is not None:
        parts.append(type(out))  # not a dict: the checks refuse it
    return tuple(parts)


_MEANING = {"tensor": "a cd.Tensor has the output's shape: [M, N] (or [L, M, N])",
            "vec_n": "a cd.VecN is one value per output column: shape [N] (or [L, N])",
            "vec_m": "a cd.VecM is one value per output row: shape [M] (or [L, M])"}


def _meaning(kind: str, width) -> str:
    """What shape an operand of this kind has, read at `width` times N (a cd.pairs half: 1/2)."""
    if width == 1 or kind == "vec_m":
        return _MEANING[kind]
    cols = width_text(width)
    return (f"this one meets a value {cols} columns wide (cd.pairs / cd.interleave): shape "
            + (f"[M, {cols}] (or [L, M, {cols}])" if kind == "tensor" else f"[{cols}] (or [L, {cols}])"))


def _check_tensors(ep: Epilogue, call: Call, cutlass: bool) -> dict[str, str]:
    """Shapes, devices and (for the cutlass backend) layouts; returns operand dtypes."""
    where = _where(ep)
    m, n, k, l = call.mnkl
    ab = checks.dtype_of(where, "A", call.a, fp64=not cutlass)
    if call.b.dtype != call.a.dtype:
        raise checks.fail(where, f"A is {call.a.dtype} but B is {call.b.dtype}", "use one dtype for A and B")
    if cutlass and ab not in ("bf16", "fp16"):
        raise checks.fail(where, f"A and B are {call.a.dtype}; the cutlass backend takes bf16 or fp16 inputs",
                          "cast them: A.bfloat16(), B.bfloat16()")
    if cutlass and max(m, n, k, l) > MAX_DIM:
        raise UnsupportedError(f"{where}: M, N, K, L = {m}, {n}, {k}, {l}: the kernels take each as a 32-bit int (at "
                               f"most {MAX_DIM})\n  fix: split the call along its largest dimension, or pass "
                               "backend='reference'")
    dev = call.a.device
    checks.tensor(where, "B", call.b, (l, n, k) if call.b.dim() == 3 else (n, k), dev)
    dtypes = {}
    facts = _facts(ep)
    kinds, widths = facts.kinds, facts.widths
    if problem := n_problem(ep, n):
        raise checks.fail(where, problem, f"pairwise ops need N a multiple of {facts.n_multiple} (for SwiGLU: "
                          "interleaved gate/up rows, 2F of them)")
    for name, kind, axis in facts.extrema:  # like torch.amax: no value of an empty set
        if (m == 0 and axis != "n") or (n == 0 and axis != "m"):
            raise checks.fail(where, f"output '{name}' is a cd.{kind} over axis {axis!r}, which is empty here "
                              f"(M = {m}, N = {n}): the {kind} of no values is undefined",
                              "skip the call when M or N is 0, or reduce with cd.sum (0 over an empty axis)")
    batch = l if call.a.dim() == 3 else None  # a 2-D call has no batch: [1, M, N] would give [1, M, N] outputs
    for name, t in call.tensors.items():
        wn = int(n * widths[name]) if name in widths else n  # pairwise epilogues read N/2-wide operands
        shape = {"tensor": (m, wn), "vec_n": (wn,), "vec_m": (m,)}[kinds[name]]
        checks.tensor(where, f"operand '{name}'", t, shape, dev, _meaning(kinds[name], widths.get(name, 1)), batch)
        dtypes[name] = checks.dtype_of(where, f"operand '{name}'", t, index=name in facts.indices,
                                       fp64=ab == checks.REFERENCE_FP64, operand=True)
        if not cutlass:
            continue
        if kinds[name] == "tensor" and t.dim() == 2 and call.b.dim() == 3:
            raise UnsupportedError(f"{where}: operand '{name}' is [M, N] but the GEMM is batched; the kernel "
                                   f"reads one [M, N] slice per batch\n  fix: pass "
                                   f"{name}.expand({l}, -1, -1).contiguous()")
        if name not in widths:  # N/2-wide ones are read per pair or widened: no TMA
            (checks.tma_layout if kinds[name] == "tensor" else checks.vector)(where, f"operand '{name}'", t)
        elif t.stride(-1) != 1:
            raise checks.fail(where, f"operand '{name}' must be contiguous in its last dimension",
                              f"pass {name}.contiguous()")
    if cutlass and k:  # the kernel reads either layout of each (see layouts()); K = 0: check_widths refuses it
        for name, t, rows, other in (("A", call.a, "M", "X"), ("B", call.b, "N", "W")):
            if t.stride(-1) != 1 and t.stride(-2) != 1:
                raise checks.fail(where, f"{name} must be contiguous along K ([{rows}, K]) or along {rows} "
                                  f"([K, {rows}] storage passed as {other}.t()); its strides are {list(t.stride())}",
                                  f"pass {name}.contiguous()")
            checks.tma_layout(where, name, t if t.stride(-1) == 1 else t.transpose(-1, -2))
    return dtypes


# the fix for a kernel (cd.compile, a CompiledOp) where none runs: cd.gemm has the reference backend
_KERNEL_ONLY = "compute it with cd.gemm(A, B, epilogue, ..., backend='reference') (a CompiledOp is a kernel)"


def _check_call(ep: Epilogue, call: Call, out: dict | None, cutlass: bool, accumulate: bool,
                instead: str = "pass backend='reference'") -> dict[str, str]:
    """The checks of a normalized call (cd.gemm's, cd.compile's, a CompiledOp's); returns operand dtypes."""
    if accumulate and not (out and isinstance(out.get("D"), torch.Tensor)):
        if ep.program.output("D") is None:
            raise checks.fail(_where(ep), "accumulate=True adds into D, and this epilogue has no D output",
                              "return a D (or the value to add, as {'D': value}), or call without accumulate=True")
        if out and "D" in out:
            raise checks.fail(_where(ep), f"out['D'] is {type(out['D']).__name__}: accumulate=True adds into a "
                              "tensor", "pass out={'D': tensor}")
        raise checks.fail(_where(ep), "accumulate=True adds into an existing D", "pass it as out={'D': tensor}")
    if cutlass:
        checks.require_cutlass(_where(ep), call.a.device, instead)
    return _check_tensors(ep, call, cutlass)


@dataclass(frozen=True)
class _Facts:
    """What every call of an epilogue needs to know about it, derived once (not on the call path)."""

    kinds: dict[str, str]  # operand name -> kind
    widths: dict[str, Fraction]  # load operands not N wide -> their width over N (passes/widths.py)
    n_multiple: int  # N must be a multiple of this: 2 if some value is N/2 wide (cd.pairs of the accumulator), ...
    indices: frozenset[str]  # operands read as int64 column indices (cd.take, cd.onehot)
    cross_batch: tuple[str, ...]  # outputs reduced over m or everything: they cannot fold a batch into M
    extrema: tuple[tuple[str, str, str | None], ...]  # (output, kind, axis) of max/min/amax: undefined if empty


_facts_of: "weakref.WeakKeyDictionary[Epilogue, _Facts]" = weakref.WeakKeyDictionary()


def _facts(ep: Epilogue) -> _Facts:
    facts = _facts_of.get(ep)
    if facts is None:
        nodes = list(ir.walk(ep.program))
        facts = _facts_of[ep] = _Facts(
            kinds={p.name: p.kind for p in ep.params},
            widths={k: w for k, w in load_widths(ep.program).items() if w != 1},
            n_multiple=max((w.denominator for w in infer_widths(ep.program).values()), default=1),
            indices=ir.index_operands(nodes),
            cross_batch=tuple(o.name for o in ep.program.outputs
                              if (r := ir.reduction_of(o.node)) is not None and r.attr[1] != "n"),
            extrema=tuple((o.name, *r.attr) for o in ep.program.outputs
                          if (r := ir.reduction_of(o.node)) is not None and not REDUCTIONS[r.attr[0]].empty_defined))
    return facts


def n_problem(ep: Epilogue, n: int) -> str | None:
    """Why no call of `ep` has N = n, on any backend: N must be a multiple of 2 where a value is N/2 wide
    (cd.pairs), of 4 where one is N/4 wide, ...; None: it may."""
    q = _facts(ep).n_multiple
    return None if n % q == 0 else (f"N = {n} is not a multiple of {q}, but the epilogue works on column "
                                    f"{'pairs' if q == 2 else f'groups of {q}'} (cd.pairs)")


def index_operands(ep: Epilogue) -> frozenset[str]:
    """The operands read as int64 column indices, by cd.take or cd.onehot (their dtype is INDEX_DTYPE,
    never a choice)."""
    return _facts(ep).indices


class CompiledOp:
    """One built specialization of an epilogue. Call it like cd.gemm, without the epilogue argument."""

    def __init__(self, epilogue: Epilogue, rendered: pipeline.Rendered):
        self.epilogue = epilogue
        self.program, self.plan, self.key, self.cu_text, self.op_name = (
            rendered.program, rendered.plan, rendered.key, rendered.cu_text, rendered.op_name)
        plan = self.plan
        self._op = None
        self._where = _where(epilogue)
        d = [("D", plan.d_dtype, "mn")] if plan.d_dtype else []
        # (name, torch dtype, shape kind) of D (if stored) and then of what the op receives in `outputs`
        self._outputs = [(name, DTYPES[dt], kind) for name, dt, kind in [*d, *plan.outputs]]
        sig = plan.signature  # what a call must match: the kernel reads memory as these types
        self._expects = (DTYPES[sig.ab_dtype], (sig.a_layout, sig.b_layout), sig.operand_dtypes,
                         _consts_key(dict(sig.consts)))
        self._kinds = _facts(epilogue).kinds
        self._checked: dict[tuple, bool] = {}  # call layouts that passed the checks -> an input requires grad
        self._widened = frozenset(plan.widened)
        self._wide = frozenset(plan.wide)
        self._table = None  # its call layouts for the C++ warm path (runtime/warm.py), from the first launch
        self._call_values = {name: 2 + i for i, name in enumerate(self._kinds)}  # its numbering: 0 A, 1 B

    @classmethod
    def create(cls, epilogue: Epilogue, sig: Signature) -> "CompiledOp":
        """The pipeline up to the rendered .cu (no build yet: see load())."""
        return cls(epilogue, pipeline.render(epilogue.program, sig))

    @property
    def unit(self) -> build.BuildUnit:
        return build.BuildUnit(self.key, self.cu_text, self.op_name, self.epilogue.name)

    @property
    def loaded(self) -> bool:
        return self._op is not None

    @property
    def built(self) -> bool:
        """Whether its kernel library is loaded or whole in the cache (built, or imported): load() builds nothing."""
        return self.loaded or build.valid_output(build.build_key(self.key)) is not None

    def load(self) -> "CompiledOp":
        """Build (or find in the cache) and load the kernel library."""
        if self._op is None:
            self._op = Kernel(build.library(self.unit))
        return self

    def check_widths(self, call: Call) -> None:
        """TMA moves whole 16-byte groups along a tensor's contiguous dimension: A's and B's (K, or M / N
        where passed transposed) and N for the [M, N] outputs must fill them. K = 0 has no k-tile, which the
        kernels' mainloop waits for."""
        m, n, k, _ = call.mnkl
        if k == 0:
            raise UnsupportedError(f"{self._where}: K = 0 (A and B have no columns): the kernel's mainloop needs at "
                                   "least one k-tile\n  fix: backend='reference' (what 'auto' falls back to) applies "
                                   "the epilogue to the zero accumulator")
        for name, t, along, extent in (("A", call.a, "M", m), ("B", call.b, "N", n)):
            along, extent = ("K", k) if t.stride(-1) == 1 else (along, extent)
            per16 = 16 // t.element_size()
            if extent % per16:
                raise UnsupportedError(f"{self._where}: {name} is read along {along} (its contiguous dimension) in "
                                       f"16-byte groups, so {along} = {extent} must be a multiple of {per16}\n  fix: "
                                       f"pad {along} to a multiple of {per16}, or use backend='reference'")
        for name, dt, kind in self._outputs:
            per16 = 16 // dt.itemsize
            if kind == "mn" and n % per16:
                raise UnsupportedError(f"{self._where}: output '{name}' is [M, {n}] {dt}; the kernel stores its rows "
                                       f"with TMA in 16-byte groups, so N must be a multiple of {per16}\n  fix: pad N "
                                       f"(B's rows) to a multiple of {per16}, or use backend='reference'")

    def check_out(self, call: Call, out: dict | None) -> None:
        """Names, shapes, dtypes and layouts of preallocated outputs. `call` and `out` are folded."""
        if not out:
            return
        names = [name for name, _, _ in self._outputs]
        unknown = set(out) - set(names)
        if unknown:
            raise checks.fail(self._where, f"out has {sorted(unknown)}, which the epilogue does not produce "
                              f"(its outputs: {names})")
        m, n, _, l = call.mnkl
        lead = (l,) if call.a.dim() == 3 else ()
        for name, dt, kind in self._outputs:
            t = out.get(name)
            if t is not None:
                _check_out(self._where, name, t, OUTPUT_SHAPES[kind][1](lead, m, n), dt, call, tma=kind == "mn")

    def launch(self, call: Call, out: dict | None, layout: tuple | None = None, table=None) -> dict[str, torch.Tensor]:
        """Allocate the outputs not in `out` and launch on the current stream. `call` and `out` are folded
        and checked (check_out), except for aliasing, which depends on the tensors, not their layouts.
        layout: the call's layout (_call_layout), under which the kernel keeps its argument block;
        table: a function giving the C++ warm path's table (runtime/warm.py) to add this call's layout
        to, where that path can repeat the launch (or None: no table)."""
        m, n, _, l = call.mnkl
        lead = (l,) if call.a.dim() == 3 else ()
        if out and len(out) > 1:
            _check_distinct(self._where, out)
        outs, written, staged = {}, {}, []  # written: what the kernel writes (a staging copy where TMA cannot)
        for name, dt, kind in self._outputs:
            t = out.get(name) if out else None
            if t is None:
                t = torch.empty(OUTPUT_SHAPES[kind][1](lead, m, n), dtype=dt, device=call.a.device)
            else:
                _check_alias(self._where, name, t, call)
            outs[name] = written[name] = t
            if kind == "mw" and not checks.tma_rows(t):
                written[name] = _padded_like(t)
                staged.append((t, written[name]))
        if self._op is None:
            self.load()
        plan = self.plan
        inputs = [_input(call.tensors[i], i in self._widened, i in self._wide) for i in plan.inputs]
        d = written.get("D") if plan.d_dtype else None
        scalars = [call.scalars[s] for s in plan.scalars]
        aux = [written[o[0]] for o in plan.outputs]
        self._op(call.a, call.b, d, inputs, scalars, aux, layout)
        for t, buffer in staged:
            t.copy_(buffer)
        if (table is not None and not out and not staged and not call.batch and isinstance(self._op, Kernel)
                and not self.epilogue.program.aliases  # (its C++ makes a tensor per output)
                and all(t is call.tensors[i] for t, i in zip(inputs, plan.inputs)) and (table := table())):
            self._add_layout(table, call, d, inputs, scalars, aux)
        return self.epilogue.aliased(outs)

    def _add_layout(self, table, call: Call, d, inputs: list, scalars: list, aux: list) -> None:
        """The warm path's entry for a launch that just ran with these tensors (runtime/warm.py): the same
        launch for every later call of its layout."""
        plan, value = self.plan, self._call_values
        first = 3 if d is not None else 2
        ins = [(0, 0, call.a), (1, 1, call.b), *((value[i], first + j, t) for j, (i, t) in enumerate(zip(plan.inputs,
                                                                                                       inputs)))]
        ins += [(value[name], -1, t) for name, t in call.tensors.items() if name not in plan.inputs]
        outs = [("D", 2, d)] if d is not None else []
        outs += [(o[0], first + len(inputs) + j, t) for j, (o, t) in enumerate(zip(plan.outputs, aux))]
        scalar_slots = [(value[s], j) for j, s in enumerate(plan.scalars)]
        scalar_slots += [(value[s], -1) for s in call.scalars if s not in plan.scalars]
        tensors = [call.a, call.b, *([d] if d is not None else []), *inputs, *aux]
        warm.add(table, self._op, tensors, len(scalars), ins, outs, scalar_slots,
                 [(value[c], v) for c, v in call.consts.items()])

    def run(self, A, B, operands: dict, out: dict | None, layout: tuple | None = None,
            table=None) -> dict[str, torch.Tensor]:
        """Launch a checked call (of the call layout `layout`, if known): fold a batch into M, launch, unfold."""
        call = _fold_batch(self.epilogue, _unpack(self._kinds, A, B, operands))
        return _unfold_batch(self.launch(call, _fold_batch_out(self.epilogue, out, call), layout, table), call)

    def __call__(self, A, B, /, *, out: dict | None = None, **operands) -> dict[str, torch.Tensor]:
        if out is None and self._table:
            outs = self._table.call(A, B, operands)  # a layout launched before: in C++
            if outs is not None:
                return outs
        layout = _call_layout(self._kinds, A, B, operands, out)
        grads = self._checked.get(layout)  # whether an input requires grad, for a layout checked before
        if grads is None:
            self._check(A, B, operands, out)
            grads = remember(self._checked, layout, _requires_grad(A, B, operands))
        if grads and torch.is_grad_enabled():  # as cd.gemm: no derivative
            return _recorded(self._where, lambda: self.run(A, B, operands, None, layout), A, B, operands, out)
        # offered to the warm path (which keeps a layout once, and only the newest ones)
        return self.run(A, B, operands, out, layout, self._warm_table if out is None else None)

    def _warm_table(self):
        if self._table is None:
            self._table = warm.table(self._kinds)
        return self._table

    def _check(self, A, B, operands: dict, out: dict | None) -> None:
        call = _normalize(self.epilogue, A, B, operands, out)
        dtypes = _check_call(self.epilogue, call, out, cutlass=True, accumulate=self.plan.reads_d, instead=_KERNEL_ONLY)
        got = (call.a.dtype, layouts(call), tuple(sorted(dtypes.items())), _consts_key(call.consts))
        if got != self._expects:
            what = ("A/B dtype", "A/B layouts", "operand dtypes", "cd.Const values")
            diff = [f"{w}: compiled for {e}, called with {g}" for w, e, g in zip(what, self._expects, got) if e != g]
            raise checks.fail(self._where, "this op was compiled for other operands (" + "; ".join(diff) + ")",
                              "compile an op for these operands (cd.compile), or call cd.gemm")
        call = _fold_batch(self.epilogue, call)
        self.check_widths(call)
        self.check_out(call, _fold_batch_out(self.epilogue, out, call))

    def __repr__(self) -> str:
        return f"<CompiledOp {self.epilogue.name} key={self.key} op=coda_dsl::{self.op_name}>"


def _padded_like(t: torch.Tensor) -> torch.Tensor:
    """Uninitialized, t's shape and dtype, rows padded to whole 16-byte groups (a view without the padding)."""
    per16, cols = 16 // t.element_size(), t.shape[-1]
    return torch.empty(*t.shape[:-1], -(-cols // per16) * per16, dtype=t.dtype, device=t.device)[..., :cols]


def _input(t: torch.Tensor, widened: bool, wide: bool) -> torch.Tensor:
    """An operand as the kernel reads it: an N/2-wide VecN as N columns (each value twice); a [M, 2N] tensor
    (moved by TMA as 32-bit words) copied to 16-byte aligned rows where its own are not."""
    if widened:
        return t.repeat_interleave(2, dim=-1)
    if wide and not checks.tma_rows(t):
        return _padded_like(t).copy_(t)
    return t


def _check_out(where: str, name: str, t: torch.Tensor, shape, dtype, call: Call, tma: bool | None = True) -> None:
    """A preallocated output; tma: its layout as the kernel stores it (TMA rows, or a vector; None: any)."""
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise checks.fail(where, f"out['{name}'] is {checks.described(t)}, expected {dtype} {list(shape)}")
    if t.device != call.a.device:
        raise checks.fail(where, f"out['{name}'] is on {t.device}, A on {call.a.device}")
    checks.output(where, f"out['{name}']", t)
    if tma is not None:
        (checks.tma_layout if tma else checks.vector)(where, f"out['{name}']", t)
    if tma is False and not t.is_contiguous():  # atomics and finishing kernels address a batch's row at l * M or N
        raise checks.fail(where, f"out['{name}'] must be contiguous: the kernel writes one batch's statistics right "
                          "after the other's", f"pass a contiguous tensor as out['{name}']")


def _check_alias(where: str, name: str, t: torch.Tensor, call: Call) -> None:
    for src_name, src in [("A", call.a), ("B", call.b), *call.tensors.items()]:
        if checks.overlaps(t, src):
            raise checks.fail(where, f"out['{name}'] shares memory with input {src_name}: the kernel would read "
                              "values it has already overwritten", "pass a separate output tensor")


def _check_distinct(where: str, out: dict) -> None:
    """Outputs whose memory meets would overwrite each other (D would hold an auxiliary output's values);
    views of one buffer apart from each other (its rows, say) are separate outputs."""
    given = [(name, t) for name, t in out.items() if isinstance(t, torch.Tensor)]
    for i, (name, t) in enumerate(given):
        if other := next((o for o, u in given[:i] if checks.overlaps(t, u)), None):
            raise checks.fail(where, f"out['{name}'] shares memory with out['{other}']: one output would overwrite "
                              "the other (views of one buffer must not interleave)", "pass a separate tensor for each "
                              "output, or views of one buffer that lie apart (e.g. its rows)")


def epilogue_of(api: str, epilogue, operands: dict) -> Epilogue:
    """The epilogue a call of `api` (cd.gemm, cd.linear, cd.compile) runs: identity if none; an epilogue
    passed by keyword or in another argument's place, or anything not an @cd.epilogue, is explained."""
    def usage(name: str = "epilogue") -> str:
        return f"{api}({name}, A, B, ...)" if api == "cd.compile" else f"{api}(A, B, {name}, ...)"
    if epilogue is None and "epilogue" in operands:  # cd.gemm(x, w, epilogue=fn)
        name = getattr(operands["epilogue"], "name", "fn")
        raise OperandError(f"{api}: the epilogue is positional: {usage(name)}, not epilogue={name}")
    if isinstance(epilogue, torch.Tensor):  # cd.gemm(fn, x, w) or cd.compile(x, w, fn)
        raise OperandError(f"{api}: a tensor was passed where the epilogue goes: the order is {usage()}")
    ep = identity if epilogue is None else epilogue
    if not isinstance(ep, Epilogue):
        raise EpilogueError(f"{api}: the epilogue must be a function decorated with @cd.epilogue, got {ep!r}\n  fix: "
                            "put @cd.epilogue above its def (or pass cd.epilogue(fn))")
    return ep


def _flag(ep: Epilogue, name: str, value) -> None:
    if not isinstance(value, bool):  # 1 or "yes" would pass `in (True, False)` or truthiness
        meant = isinstance(value, (int, float)) and value in (0, 1)
        raise checks.fail(_where(ep), f"{name} must be True or False, not {value!r}",
                          f"{name}={bool(value)!r} if that was meant" if meant else f"{name}=True or {name}=False")


def _config(ep: Epilogue, config) -> Config | None:
    """A call's config as a Config, checked whatever the backend (a typo is an error, not ignored)."""
    if config is None or isinstance(config, Config):
        return config
    if not isinstance(config, str):
        raise OperandError(f"{_where(ep)}: config must be a cd.Config or its string form, not {config!r}")
    try:
        return Config.parse(config)
    except ValueError as e:
        raise checks.fail(_where(ep), str(e), f"pass e.g. config='{Config().text}'") from None


def _fold_batch(ep: Epilogue, call: Call) -> Call:
    """For the kernel: a 3-D A with one 2-D weight is one GEMM of L*M rows; batched operands follow.
    What cannot follow (per-batch column vectors, statistics over m) is refused with the fix."""
    if call.a.dim() != 3 or call.b.dim() != 2:
        return call
    if call.a.stride(-1) != 1:  # folding would copy A into the other layout than its specialization's
        raise UnsupportedError(f"{_where(ep)}: a 3-D A passed transposed ([L, K, M] storage) with a 2-D B: the "
                               "kernel folds L into M, which needs A contiguous along K\n  fix: pass "
                               "A.contiguous(), or B as [L, N, K]: B.expand(L, -1, -1).contiguous()")
    kinds, cross = _facts(ep).kinds, list(_facts(ep).cross_batch)
    l, m = call.a.shape[0], call.a.shape[1]
    per_batch_n = [n for n, t in call.tensors.items() if kinds[n] == "vec_n" and t.dim() == 2]
    if cross or per_batch_n:
        raise UnsupportedError(
            f"{_where(ep)}: with a 3-D A and a 2-D B the kernel runs one GEMM over all L*M rows, so "
            f"{'reductions over m ' + str(cross) if cross else 'per-batch VecN operands ' + str(per_batch_n)} "
            "cannot be computed per batch\n  fix: pass B as [L, N, K]: B.expand(L, -1, -1).contiguous()")
    tensors = {}
    for name, t in call.tensors.items():
        if kinds[name] == "tensor":
            t = (t if t.dim() == 3 else t.expand(l, *t.shape)).reshape(l * m, t.shape[-1])
        elif kinds[name] == "vec_m":
            t = (t if t.dim() == 2 else t.expand(l, m)).reshape(l * m)
        tensors[name] = t
    return Call(call.a.reshape(l * m, -1), call.b, tensors, call.scalars, call.consts, (l,))


def _fold_batch_out(ep: Epilogue, out: dict | None, call: Call) -> dict | None:
    if not out or not call.batch:
        return out
    folded = {}
    for k, v in out.items():  # views, so the kernel writes into the caller's tensors
        try:
            folded[k] = v.view(-1, *v.shape[2:]) if isinstance(v, torch.Tensor) and v.dim() >= 2 else v
        except RuntimeError:
            raise checks.fail(_where(ep), f"out['{k}'] cannot be viewed as one [L*M, ...] block (strides "
                              f"{list(v.stride())})", f"pass a contiguous tensor: out['{k}'].contiguous()") from None
    return folded


def _unfold_batch(outs: dict[str, torch.Tensor], call: Call) -> dict[str, torch.Tensor]:
    if not call.batch:
        return outs
    unfolded = {}  # by tensor: an alias stays the same tensor as the output it is
    return {k: unfolded.setdefault(id(v), v.reshape(*call.batch, -1, *v.shape[1:])) for k, v in outs.items()}


# ---------------------------------------------------------------------------------------------
# Specialization cache (memory; the disk cache lives in build/)
# ---------------------------------------------------------------------------------------------
_ops: dict[tuple, CompiledOp] = {}
_lock = threading.Lock()


def _output_dtypes(ep: Epilogue, ab: str, out: dict | None) -> tuple[tuple[str, str], ...]:
    res = []
    for o in ep.program.outputs:
        d = o.dtype or ab
        if out and isinstance(out.get(o.name), torch.Tensor) and o.dtype is None:
            d = checks.dtype_of(_where(ep), f"out['{o.name}']", out[o.name])
        res.append((o.name, d))
    return tuple(res)


def signature(ep: Epilogue, ab: str, b_layout: str, operand_dtypes: dict[str, str], consts: dict[str, float],
              config: Config | None = None, deterministic: bool = False, accumulate: bool = False,
              out: dict | None = None, a_layout: str = "mk") -> Signature:
    """The one place where a call's options become a Signature, so `coda-dsl emit` shows what cd.gemm builds."""
    return Signature(ab, b_layout, tuple(sorted(operand_dtypes.items())), _output_dtypes(ep, ab, out),
                     tuple(sorted(consts.items())), config or Config(), deterministic, accumulate, a_layout)


def layouts(call: Call) -> tuple[str, str]:
    """(A's, B's) memory layout: "mk" / "km" (A passed as X.t()), "nk" (an nn.Linear weight) / "kn"."""
    return "mk" if call.a.stride(-1) == 1 else "km", "nk" if call.b.stride(-1) == 1 else "kn"


def call_key(ep: Epilogue, call: Call, operand_dtypes: dict[str, str], out: dict | None,
             deterministic: bool = False, accumulate: bool = False) -> tuple:
    """What selects a call's specialization, as plain values: the warm path's cache key (a Signature
    is built only on a miss)."""
    outs = tuple((k, v.dtype) for k, v in out.items() if isinstance(v, torch.Tensor)) if out else ()
    return (ep, call.a.dtype, layouts(call), tuple(operand_dtypes.items()), outs,
            _consts_key(call.consts), deterministic, accumulate)


def specialization(ep: Epilogue, call: Call, operand_dtypes: dict[str, str], out: dict | None,
                   config: Config | None, deterministic: bool = False, accumulate: bool = False,
                   key: tuple | None = None) -> CompiledOp:
    """The CompiledOp of a checked call's specialization, made once per call key and config (from
    options instead of tensors: cli.specialization_from_options)."""
    cache_key = (key or call_key(ep, call, operand_dtypes, out, deterministic, accumulate), config)
    op = _ops.get(cache_key)
    if op is None:
        with _lock:
            op = _ops.get(cache_key)
            if op is None:
                a_layout, b_layout = layouts(call)
                sig = signature(ep, checks.dtype_of(_where(ep), "A", call.a), b_layout, operand_dtypes, call.consts,
                                config, deterministic, accumulate, out, a_layout)
                op = _ops[cache_key] = CompiledOp.create(ep, sig)
    return op


def gemm(A, B, epilogue: Epilogue | None = None, /, *, out: dict | None = None, backend: str = "auto",
         config: Config | str | None = None, deterministic: bool = False, accumulate: bool = False,
         tune: bool | None = None, **operands) -> dict[str, torch.Tensor]:
    """D = epilogue(A @ B^T, operands...) in one fused kernel. A: [M, K] (or [L, M, K]); B: [N, K]
    (an nn.Linear weight; pass W.t() for [K, N] storage) or [L, N, K]. Returns {output name: tensor}.

    backend: "cutlass" (sm_90 GPU), "reference" (PyTorch, any device) or "auto" (cutlass where it
    can run, else reference with a warning). out: preallocated outputs by name. deterministic:
    reductions bit-identical run to run (per-tile partials combined in a fixed order) instead of
    fp32 atomics. accumulate: D += epilogue value, in place in out["D"] (fp32 or the epilogue's
    D dtype), with no extra pass over memory. config: tile/cluster/schedule (Config or its text);
    by default a configuration tuned earlier on this device for this kind of shape, else a good
    default; tune=True (or set_tuning(True)) measures the candidates now and records the winner.
    """
    table_key = None
    if out is None and accumulate is False and deterministic.__class__ is bool and tune.__class__ in (bool, type(None)):
        try:
            table_key = (epilogue, backend, config, deterministic, tuning.enabled if tune is None else tune)
            known = _tables.get(table_key)
        except TypeError:  # an unhashable option: the checks below explain it
            table_key = known = None
        if known and not torch.compiler.is_compiling():
            outs = known.call(A, B, operands)  # a layout launched before: in C++ (runtime/warm.py)
            if outs is not None:
                return outs
    ep = epilogue_of("cd.gemm", epilogue, operands)
    checks.backend(_where(ep), backend)
    if torch.compiler.is_compiling():
        if accumulate:
            raise UnsupportedError(f"{_where(ep)}: accumulate=True inside torch.compile is not supported yet; "
                                   "write D + epilogue(...) functionally there")
        _flag(ep, "deterministic", deterministic)
        _check_out_dict(ep, out)
        check_operands(ep, operands)
        return traced_gemm(ep, A, B, out, backend, config, deterministic, operands)
    if config is not None and not isinstance(config, (Config, str)):
        raise OperandError(f"{_where(ep)}: config must be a cd.Config or its string form, not {config!r}")
    _flag(ep, "deterministic", deterministic)
    _flag(ep, "accumulate", accumulate)
    if tune is not None:
        _flag(ep, "tune", tune)
    tune = tuning.enabled if tune is None else tune
    options = (backend, config, deterministic, accumulate, tune)
    warm_key = (options, _call_layout(_facts(ep).kinds, A, B, operands, out))
    hit = _warm.get(ep, {}).get(warm_key)  # (op, whether an input requires grad): a layout checked before
    table = (lambda: _warm_table(table_key, ep)) if table_key is not None else None
    if hit is not None and not (hit[1] and torch.is_grad_enabled()):
        return hit[0].run(A, B, operands, out, warm_key, table)
    if not (torch.is_grad_enabled() and _requires_grad(A, B, operands)):  # what autograd does not record
        return _gemm(ep, A, B, out, options, operands, warm_key, table)
    return _recorded(_where(ep), lambda: hit[0].run(A, B, operands, None, warm_key) if hit else
                     _gemm(ep, A, B, None, options, operands, warm_key), A, B, operands, out)


def _requires_grad(A, B, operands: dict) -> bool:
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in (A, B, *operands.values()))


def _recorded(where: str, run, A, B, operands: dict, out: dict | None) -> dict[str, torch.Tensor]:
    """A call autograd records (cd.gemm's or a CompiledOp's): run() outside autograd (the reference backend's
    graph would not be the kernel's derivative either), its outputs linked to the inputs that require grad
    so that a backward through them raises; out= refused, as torch's own ops refuse it."""
    if out:
        raise OperandError(f"{where}: out= with inputs that require grad: autograd cannot record writes into given "
                           "tensors\n  fix: call cd.linear(A, B, epilogue, ...) to train, or run under torch.no_grad()")
    with torch.no_grad():
        outs = run()
    inputs = [t for t in (A, B, *operands.values()) if isinstance(t, torch.Tensor) and t.requires_grad]
    return dict(zip(outs, _NoDerivative.apply(where, len(outs), *outs.values(), *inputs)))


class _NoDerivative(torch.autograd.Function):
    """cd.gemm's outputs when autograd records the call: a backward through them raises, on every backend
    (the kernel has no derivative, nor has torch.compile's custom op; cd.linear derives one)."""

    @staticmethod
    def forward(ctx, where: str, n: int, *outs_and_inputs):
        ctx.where = where
        return tuple(o.detach() for o in outs_and_inputs[:n])  # inputs only to link the outputs to them

    @staticmethod
    def backward(ctx, *grads):
        raise UnsupportedError(f"{ctx.where}: cd.gemm has no derivative\n  fix: call cd.linear(A, B, epilogue, ...) "
                               "for a trainable layer (its backward is derived), or detach what needs none")


def _gemm(ep: Epilogue, A, B, out: dict | None, options: tuple, operands: dict, warm_key: tuple,
          table=None) -> dict[str, torch.Tensor]:
    """cd.gemm's first call of a layout: checked, specialized and launched; the op is kept for the warm
    path under warm_key (the options and the call's layout), and the launch offered to the C++ warm path's
    table (a function giving it; CompiledOp.launch)."""
    backend, config, deterministic, accumulate, tune = options
    call = _normalize(ep, A, B, operands, out)
    cfg = _config(ep, config)
    use_cutlass = backend == "cutlass" or (backend == "auto" and _cutlass_available(call.a.device))
    dtypes = _check_call(ep, call, out, use_cutlass, accumulate)
    if not use_cutlass:
        return run_reference(ep, call, out, accumulate)
    key = call_key(ep, call, dtypes, out, deterministic, accumulate)
    spec = lambda cfg: specialization(ep, call, dtypes, out, cfg, deterministic, accumulate, key)  # noqa: E731
    try:
        folded = _fold_batch(ep, call)
        op = spec(cfg if cfg is not None else _choose_config(spec, folded, tune, key))
        op.check_widths(folded)
    except UnsupportedError as e:
        if backend == "cutlass":
            raise
        warnings.warn(f"coda_dsl: running on the reference backend (slow): {e}", stacklevel=3)
        return run_reference(ep, call, out, accumulate)
    folded_out = _fold_batch_out(ep, out, folded)
    op.check_out(folded, folded_out)
    if _collected is not None and not op.loaded:  # inside prebuild(fn): note the kernel, build it later
        _collected.setdefault(op.key, op)
        return run_reference(ep, call, out, accumulate)
    remember(_warm.setdefault(ep, {}), warm_key, (op, _requires_grad(A, B, operands)))
    return _unfold_batch(op.launch(folded, folded_out, table=table), folded)


def _warm_table(key: tuple, ep: Epilogue):
    table = _tables.get(key)
    if table is None:
        table = remember(_tables, key, warm.table(_facts(ep).kinds))
    return table


register_eager(gemm)  # what the torch.compile custom op runs


def compile(epilogue: Epilogue | None, A, B, /, *, out: dict | None = None, config: Config | str | None = None,
            deterministic: bool = False, accumulate: bool = False, **operands) -> CompiledOp:  # noqa: A001
    """The specialization (CompiledOp) for these operands' dtypes and layouts: rendered now, built (or
    found in the cache) at its first call, op.load(), or cd.prebuild([op, ...]) with others in parallel.
    A CompiledOp is a kernel: it needs an sm_90 GPU (UnsupportedError elsewhere; cd.gemm falls back to
    the reference backend instead). config: the kernel's (default: the shape-free Config(), not the shape
    rule cd.gemm applies per call). out: tensors whose dtypes (and layouts) the kernel is built for; the
    call passes its own out= each time. epilogue None: cd.identity, as in cd.gemm."""
    ep = epilogue_of("cd.compile", epilogue, operands)
    for name, why in (("backend", "a CompiledOp is a kernel and always runs it"),
                      ("tune", "pass the config= to build (cd.gemm(..., tune=True) measures and records one)")):
        if name in operands:
            raise OperandError(f"cd.compile: {name}= is an option of cd.gemm, not of cd.compile: {why}")
    call = _normalize(ep, A, B, operands, out)
    config = _config(ep, config)
    _flag(ep, "deterministic", deterministic)
    _flag(ep, "accumulate", accumulate)
    # as cd.gemm(backend="cutlass"): never a useless build
    dtypes = _check_call(ep, call, out, cutlass=True, accumulate=accumulate, instead=_KERNEL_ONLY)
    return specialization(ep, call, dtypes, out, config, deterministic, accumulate)


# (call key, shape bucket) -> (config, whether it was measured on this device)
_configs: dict[tuple, tuple[Config, bool]] = {}
# cd.gemm's warm path: epilogue -> {(call options, call layout): (the op that call checked and chose,
# whether an input requires grad)}
_warm: dict[Epilogue, dict[tuple, tuple[CompiledOp, bool]]] = {}
# and its C++ part (runtime/warm.py): (epilogue, backend, config, deterministic, tune) as passed -> a table
_tables: dict[tuple, object] = {}


def _choose_config(spec, call: Call, tune: bool, key: tuple) -> Config:
    """The recorded choice for this device and shape bucket, else (tuning now if asked) the default.
    Decided once per process and bucket: the warm path reads no file and builds no Signature."""
    default = tuning.default(*call.mnkl, gpu=tuning.gpu_name(call.a.device))[0]  # shapes of one bucket may differ
    key = (key, tuning.bucket(*call.mnkl), default)
    choice = _configs.get(key)
    if choice is None or (tune and not choice[1]):
        config = tuning.recorded(call.a.device, spec(tuning.DEFAULT).plan.canonical, tuning.DEFAULT, call.mnkl)
        if config is None and tune:
            config = tuning.tune(spec, lambda op: op.launch(call, None), call.a.device, call.mnkl)
        choice = _configs[key] = (config or default, config is not None)
        _warm.clear()  # calls that chose before this may now choose otherwise
        _tables.clear()
    return choice[0]


def clear() -> None:
    """Forget every in-process specialization, config choice and cd.gemm warm-path entry (Python and C++), as
    a fresh process would start: the next call specializes, chooses its config (recorded or default) and
    checks again. A CompiledOp kept by the caller keeps its own (its kernel does not change).
    Built kernels stay in the disk cache (`coda-dsl cache clear` removes those)."""
    with _lock:
        _ops.clear()
        _configs.clear()
        _warm.clear()
        _tables.clear()


_collected: dict[str, CompiledOp] | None = None  # while prebuild(fn) runs fn: the kernels its calls need


def prebuild(what, /, *args, jobs: int | None = None, **kwargs) -> int:
    """Build kernels before their first calls, in one parallel ninja run (else each first call builds its
    own, one after another). `what`: a list of CompiledOps (cd.compile's), or a function, which then
    runs once, what(*args, **kwargs), with every cd.gemm whose kernel is not loaded yet computed by the
    reference backend instead (same results, slowly) and its kernel noted; those are then built. Run
    the function on the shapes the real calls will have: they choose each kernel's configuration
    (e.g. a training step on a real batch, with its backward). Process-wide while it runs, backward
    threads included. Returns the number of kernels asked for (built or found in the cache)."""
    global _collected
    if callable(what) and not isinstance(what, (Epilogue, CompiledOp)):  # those are callable too: taken as items
        with _lock:
            if _collected is not None:
                raise RuntimeError("coda_dsl.prebuild(fn): already collecting kernels (another prebuild(fn) runs)")
            _collected = {}
        try:
            what(*args, **kwargs)
        finally:
            with _lock:
                ops, _collected = list(_collected.values()), None
        if not ops:
            warnings.warn("coda_dsl.prebuild: no kernel to build: every cd.gemm in the function found its kernel "
                          "loaded, or ran where no kernel runs (CPU tensors, no sm_90 GPU, backend='reference'). "
                          "On a machine without a GPU, `coda-dsl build` builds a kernel", stacklevel=2)
            return 0
    else:
        ops = list(what) if hasattr(what, "__iter__") and not isinstance(what, str) else [what]
        if wrong := [o for o in ops if not isinstance(o, CompiledOp)]:
            raise OperandError(f"coda_dsl.prebuild: got {checks.described(wrong[0])}, not a CompiledOp: prebuild takes "
                               "a list of cd.compile(...)'s ops, or a function whose calls it builds for\n  fix: cd.prebuild("
                               "[cd.compile(epilogue, A, B, **operands), ...]), or cd.prebuild(lambda: model(x))")
    build.build_units([op.unit for op in ops], jobs=jobs)
    return len(ops)


_warned_fallback = False


def _cutlass_available(device: torch.device) -> bool:
    global _warned_fallback
    if checks.cutlass_runs_on(device):
        return True
    if not _warned_fallback:
        _warned_fallback = True
        why = checks.old_runtime() if checks.is_sm90(device) else f"no sm_90 GPU for tensors on {device}"
        warnings.warn(f"coda_dsl: {why}; running epilogues on the (slow) reference backend. "
                      "Pass backend='reference' to silence this.", stacklevel=4)
    return False


def run_reference(ep: Epilogue, call: Call, out: dict | None, accumulate: bool = False):
    ab = checks.dtype_of(_where(ep), "A", call.a, fp64=True)
    program = specialize(ep.program, call.consts)
    # fp64 A and B: every output in fp64, the math's precision (None keeps it)
    out_dtypes = {o.name: None for o in ep.program.outputs} if ab == checks.REFERENCE_FP64 else \
        dict(_output_dtypes(ep, ab, out))
    operands = {**call.tensors, **call.scalars}
    if accumulate:  # D (an [M, N] one: accumulate_into_d refuses others) is read before the outputs' checks
        program = accumulate_into_d(program)
        d, (m, n, _, _) = out["D"], call.mnkl
        lead = torch.broadcast_shapes(call.a.shape[:-2], call.b.shape[:-2])
        _check_out(_where(ep), "D", d, OUTPUT_SHAPES["mn"][1](lead, m, n), d.dtype, call, tma=None)
        operands[reference.PRIOR_D_OPERAND] = d
    res = reference.evaluate(program, call.a, call.b, operands, out_dtypes)
    # each output a tensor of its own, as the kernel's are: not an operand returned as is, not the storage of
    # another output (one value stored twice), not a view (of a broadcast, say: torch forbids changing a
    # custom Function's view outputs in place, cd.linear's)
    taken = {t.untyped_storage().data_ptr() for t in (call.a, call.b, *call.tensors.values())}
    for name, r in res.items():
        if r._is_view() or r.untyped_storage().data_ptr() in taken:
            res[name] = r = r.clone()
        taken.add(r.untyped_storage().data_ptr())
    if out:
        for name, t in out.items():  # all of them before the first write: a refused call writes nothing
            if name not in res:
                raise OperandError(f"{_where(ep)}: out has '{name}', which is not an output of the epilogue "
                                   f"({list(res)})")
            _check_out(_where(ep), name, t, res[name].shape, res[name].dtype, call, tma=None)
        _check_distinct(_where(ep), out)
        for name, t in out.items():
            t.copy_(res[name])
            res[name] = t
    return ep.aliased(res)
