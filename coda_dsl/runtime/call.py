"""One call's arguments, checked before anything runs: names, numbers, shapes, dtypes, devices, layouts,
out= tensors and their aliasing, a batch folded into M for the kernel, and the facts of an epilogue that
every call needs (derived once). cd.gemm, cd.compile, a CompiledOp and cd.linear share them."""
from __future__ import annotations

import difflib
import numbers
import weakref
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

import torch

from ..dsl import RESERVED, Epilogue, identity
from ..errors import EpilogueError, OperandError, UnsupportedError
from ..ir import graph as ir
from ..ir.ops import REDUCTIONS
from ..passes.widths import infer as infer_widths, load_widths, width_text
from ..passes.plan import MAX_DIM, Config
from . import checks


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


def with_aliases(ep: Epilogue, outs: dict) -> dict:
    """A call's stored outputs by name, with each alias of the program (ir.Program.aliases) added: the tensor
    of the output it is."""
    for name, same in ep.program.aliases:
        outs[name] = outs[same]
    return outs


def where_of(ep: Epilogue) -> str:
    """The prefix of a call's messages (cd.gemm's, a CompiledOp's, cd.linear's): the epilogue called."""
    return ep.program.title


def normalize(ep: Epilogue, a, b, operands: dict, out: dict | None = None) -> Call:
    where = where_of(ep)
    check_out_dict(ep, out)
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
        raise checks.fail(where, f"batched B {list(b.shape)} needs A of shape [{b.shape[0]}, M, K], got "
                          f"{list(a.shape)}")

    check_operands(ep, operands)
    return unpack(facts_of(ep).kinds, a, b, operands)


def check_operands(ep: Epilogue, operands: dict) -> None:
    """The operands' names against the epilogue's, and its numbers (also while torch.compile traces)."""
    where = where_of(ep)
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


def check_out_dict(ep: Epilogue, out) -> None:
    if out is not None and not isinstance(out, dict):
        raise checks.fail(where_of(ep), f"out must be a dict of output name -> tensor, got {type(out).__name__}",
                          "pass out={'D': tensor, ...}")
    for name, same in ep.program.aliases if out else ():
        if name in out:
            raise checks.fail(where_of(ep), f"out has '{name}', which is output '{same}': the same value, stored once "
                              f"and returned as the tensor of '{same}'", f"pass out={{'{same}': tensor}} for both")


def unpack(kinds: dict[str, str], a, b, operands: dict) -> Call:
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


def consts_key(consts: dict[str, float]) -> tuple:
    return tuple(sorted((k, _const_key(v)) for k, v in consts.items()))


_MISSING = object()  # its part of a layout, `object`, is no tensor's or number's: it fails the checks


def call_layout(kinds: dict[str, str], a, b, operands: dict, out: dict | None) -> tuple:
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
    where = where_of(ep)
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
    facts = facts_of(ep)
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
KERNEL_ONLY = "compute it with cd.gemm(A, B, epilogue, ..., backend='reference') (a CompiledOp is a kernel)"


def check_call(ep: Epilogue, call: Call, out: dict | None, cutlass: bool, accumulate: bool,
                instead: str = "pass backend='reference'") -> dict[str, str]:
    """The checks of a normalized call (cd.gemm's, cd.compile's, a CompiledOp's); returns operand dtypes."""
    if accumulate and not (out and isinstance(out.get("D"), torch.Tensor)):
        if ep.program.output("D") is None:
            raise checks.fail(where_of(ep), "accumulate=True adds into D, and this epilogue has no D output",
                              "return a D (or the value to add, as {'D': value}), or call without accumulate=True")
        if out and "D" in out:
            raise checks.fail(where_of(ep), f"out['D'] is {type(out['D']).__name__}: accumulate=True adds into a "
                              "tensor", "pass out={'D': tensor}")
        raise checks.fail(where_of(ep), "accumulate=True adds into an existing D", "pass it as out={'D': tensor}")
    if cutlass:
        checks.require_cutlass(where_of(ep), call.a.device, instead)
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


_known_facts: "weakref.WeakKeyDictionary[Epilogue, _Facts]" = weakref.WeakKeyDictionary()


def facts_of(ep: Epilogue) -> _Facts:
    facts = _known_facts.get(ep)
    if facts is None:
        nodes = list(ir.walk(ep.program))
        facts = _known_facts[ep] = _Facts(
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
    q = facts_of(ep).n_multiple
    return None if n % q == 0 else (f"N = {n} is not a multiple of {q}, but the epilogue works on column "
                                    f"{'pairs' if q == 2 else f'groups of {q}'} (cd.pairs)")


def index_operands(ep: Epilogue) -> frozenset[str]:
    """The operands read as int64 column indices, by cd.take or cd.onehot (their dtype is INDEX_DTYPE,
    never a choice)."""
    return facts_of(ep).indices


def check_out_tensor(where: str, name: str, t: torch.Tensor, shape, dtype, call: Call, tma: bool | None = True) -> None:
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


def check_alias(where: str, name: str, t: torch.Tensor, call: Call) -> None:
    for src_name, src in [("A", call.a), ("B", call.b), *call.tensors.items()]:
        if checks.overlaps(t, src):
            raise checks.fail(where, f"out['{name}'] shares memory with input {src_name}: the kernel would read "
                              "values it has already overwritten", "pass a separate output tensor")


def check_distinct(where: str, out: dict) -> None:
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


def check_flag(ep: Epilogue, name: str, value) -> None:
    if not isinstance(value, bool):  # 1 or "yes" would pass `in (True, False)` or truthiness
        meant = isinstance(value, (int, float)) and value in (0, 1)
        raise checks.fail(where_of(ep), f"{name} must be True or False, not {value!r}",
                          f"{name}={bool(value)!r} if that was meant" if meant else f"{name}=True or {name}=False")


def config_of(ep: Epilogue, config) -> Config | None:
    """A call's config as a Config, checked whatever the backend (a typo is an error, not ignored)."""
    if config is None or isinstance(config, Config):
        return config
    if not isinstance(config, str):
        raise OperandError(f"{where_of(ep)}: config must be a cd.Config or its string form, not {config!r}")
    try:
        return Config.parse(config)
    except ValueError as e:
        raise checks.fail(where_of(ep), str(e), f"pass e.g. config='{Config().text}'") from None


def fold_batch(ep: Epilogue, call: Call) -> Call:
    """For the kernel: a 3-D A with one 2-D weight is one GEMM of L*M rows; batched operands follow.
    What cannot follow (per-batch column vectors, statistics over m) is refused with the fix."""
    if call.a.dim() != 3 or call.b.dim() != 2:
        return call
    if call.a.stride(-1) != 1:  # folding would copy A into the other layout than its specialization's
        raise UnsupportedError(f"{where_of(ep)}: a 3-D A passed transposed ([L, K, M] storage) with a 2-D B: the "
                               "kernel folds L into M, which needs A contiguous along K\n  fix: pass "
                               "A.contiguous(), or B as [L, N, K]: B.expand(L, -1, -1).contiguous()")
    kinds, cross = facts_of(ep).kinds, list(facts_of(ep).cross_batch)
    l, m = call.a.shape[0], call.a.shape[1]
    per_batch_n = [n for n, t in call.tensors.items() if kinds[n] == "vec_n" and t.dim() == 2]
    if cross or per_batch_n:
        raise UnsupportedError(
            f"{where_of(ep)}: with a 3-D A and a 2-D B the kernel runs one GEMM over all L*M rows, so "
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


def fold_batch_out(ep: Epilogue, out: dict | None, call: Call) -> dict | None:
    if not out or not call.batch:
        return out
    folded = {}
    for k, v in out.items():  # views, so the kernel writes into the caller's tensors
        try:
            folded[k] = v.view(-1, *v.shape[2:]) if isinstance(v, torch.Tensor) and v.dim() >= 2 else v
        except RuntimeError:
            raise checks.fail(where_of(ep), f"out['{k}'] cannot be viewed as one [L*M, ...] block (strides "
                              f"{list(v.stride())})", f"pass a contiguous tensor: out['{k}'].contiguous()") from None
    return folded


def unfold_batch(outs: dict[str, torch.Tensor], call: Call) -> dict[str, torch.Tensor]:
    if not call.batch:
        return outs
    unfolded = {}  # by tensor: an alias stays the same tensor as the output it is
    return {k: unfolded.setdefault(id(v), v.reshape(*call.batch, -1, *v.shape[1:])) for k, v in outs.items()}


def layouts(call: Call) -> tuple[str, str]:
    """(A's, B's) memory layout: "mk" / "km" (A passed as X.t()), "nk" (an nn.Linear weight) / "kn"."""
    return "mk" if call.a.stride(-1) == 1 else "km", "nk" if call.b.stride(-1) == 1 else "kn"


def any_requires_grad(A, B, operands: dict) -> bool:
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in (A, B, *operands.values()))


def recorded_call(where: str, run, A, B, operands: dict, out: dict | None) -> dict[str, torch.Tensor]:
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
