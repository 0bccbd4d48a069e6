"""The callable ops: cd.gemm, cd.compile and CompiledOp (the cached, ready-to-launch specialization)."""
from __future__ import annotations

import threading
import warnings

import torch

from .. import build, pipeline
from ..dsl import Epilogue
from ..errors import OperandError, UnsupportedError
from ..ir.ops import DTYPES
from ..passes import accumulate_into_d, specialize
from ..passes.plan import OUTPUT_SHAPES, Config, Signature
from . import checks, reference, tune as tuning, warm
from .call import (KERNEL_ONLY, Call, any_requires_grad, call_layout, check_alias, check_call, check_distinct,
                   check_flag, check_operands, check_out_dict, check_out_tensor, config_of, consts_key, epilogue_of,
                   facts_of, fold_batch, fold_batch_out, layouts, normalize, recorded_call, unfold_batch, unpack,
                   where_of, with_aliases)
from .kernel import Kernel, remember
from .torch_op import register_eager, traced_gemm


class CompiledOp:
    """One built specialization of an epilogue. Call it like cd.gemm, without the epilogue argument."""

    def __init__(self, epilogue: Epilogue, rendered: pipeline.Rendered):
        self.epilogue = epilogue
        self.program, self.plan, self.key, self.cu_text, self.op_name = (
            rendered.program, rendered.plan, rendered.key, rendered.cu_text, rendered.op_name)
        plan = self.plan
        self._op = None
        self._where = where_of(epilogue)
        d = [("D", plan.d_dtype, "mn")] if plan.d_dtype else []
        # (name, torch dtype, shape kind) of D (if stored) and then of what the op receives in `outputs`
        self._outputs = [(name, DTYPES[dt], kind) for name, dt, kind in [*d, *plan.outputs]]
        sig = plan.signature  # what a call must match: the kernel reads memory as these types
        self._expects = (DTYPES[sig.ab_dtype], (sig.a_layout, sig.b_layout), sig.operand_dtypes,
                         consts_key(dict(sig.consts)))
        self._kinds = facts_of(epilogue).kinds
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
                check_out_tensor(self._where, name, t, OUTPUT_SHAPES[kind][1](lead, m, n), dt, call, tma=kind == "mn")

    def launch(self, call: Call, out: dict | None, layout: tuple | None = None, table=None) -> dict[str, torch.Tensor]:
        """Allocate the outputs not in `out` and launch on the current stream. `call` and `out` are folded
        and checked (check_out), except for aliasing, which depends on the tensors, not their layouts.
        layout: the call's layout (call_layout), under which the kernel keeps its argument block;
        table: a function giving the C++ warm path's table (runtime/warm.py) to add this call's layout
        to, where that path can repeat the launch (or None: no table)."""
        m, n, _, l = call.mnkl
        lead = (l,) if call.a.dim() == 3 else ()
        if out and len(out) > 1:
            check_distinct(self._where, out)
        outs, written, staged = {}, {}, []  # written: what the kernel writes (a staging copy where TMA cannot)
        for name, dt, kind in self._outputs:
            t = out.get(name) if out else None
            if t is None:
                t = torch.empty(OUTPUT_SHAPES[kind][1](lead, m, n), dtype=dt, device=call.a.device)
            else:
                check_alias(self._where, name, t, call)
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
        return with_aliases(self.epilogue, outs)

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
        call = fold_batch(self.epilogue, unpack(self._kinds, A, B, operands))
        return unfold_batch(self.launch(call, fold_batch_out(self.epilogue, out, call), layout, table), call)

    def __call__(self, A, B, /, *, out: dict | None = None, **operands) -> dict[str, torch.Tensor]:
        if out is None and self._table:
            outs = self._table.call(A, B, operands)  # a layout launched before: in C++
            if outs is not None:
                return outs
        layout = call_layout(self._kinds, A, B, operands, out)
        grads = self._checked.get(layout)  # whether an input requires grad, for a layout checked before
        if grads is None:
            self._check(A, B, operands, out)
            grads = remember(self._checked, layout, any_requires_grad(A, B, operands))
        if grads and torch.is_grad_enabled():  # as cd.gemm: no derivative
            return recorded_call(self._where, lambda: self.run(A, B, operands, None, layout), A, B, operands, out)
        # offered to the warm path (which keeps a layout once, and only the newest ones)
        return self.run(A, B, operands, out, layout, self._warm_table if out is None else None)

    def _warm_table(self):
        if self._table is None:
            self._table = warm.table(self._kinds)
        return self._table

    def _check(self, A, B, operands: dict, out: dict | None) -> None:
        call = normalize(self.epilogue, A, B, operands, out)
        dtypes = check_call(self.epilogue, call, out, cutlass=True, accumulate=self.plan.reads_d, instead=KERNEL_ONLY)
        got = (call.a.dtype, layouts(call), tuple(sorted(dtypes.items())), consts_key(call.consts))
        if got != self._expects:
            what = ("A/B dtype", "A/B layouts", "operand dtypes", "cd.Const values")
            diff = [f"{w}: compiled for {e}, called with {g}" for w, e, g in zip(what, self._expects, got) if e != g]
            raise checks.fail(self._where, "this op was compiled for other operands (" + "; ".join(diff) + ")",
                              "compile an op for these operands (cd.compile), or call cd.gemm")
        call = fold_batch(self.epilogue, call)
        self.check_widths(call)
        self.check_out(call, fold_batch_out(self.epilogue, out, call))

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
            d = checks.dtype_of(where_of(ep), f"out['{o.name}']", out[o.name])
        res.append((o.name, d))
    return tuple(res)


def signature(ep: Epilogue, ab: str, b_layout: str, operand_dtypes: dict[str, str], consts: dict[str, float],
              config: Config | None = None, deterministic: bool = False, accumulate: bool = False,
              out: dict | None = None, a_layout: str = "mk") -> Signature:
    """The one place where a call's options become a Signature, so `coda-dsl emit` shows what cd.gemm builds."""
    return Signature(ab, b_layout, tuple(sorted(operand_dtypes.items())), _output_dtypes(ep, ab, out),
                     tuple(sorted(consts.items())), config or Config(), deterministic, accumulate, a_layout)


def call_key(ep: Epilogue, call: Call, operand_dtypes: dict[str, str], out: dict | None,
             deterministic: bool = False, accumulate: bool = False) -> tuple:
    """What selects a call's specialization, as plain values: the warm path's cache key (a Signature
    is built only on a miss)."""
    outs = tuple((k, v.dtype) for k, v in out.items() if isinstance(v, torch.Tensor)) if out else ()
    return (ep, call.a.dtype, layouts(call), tuple(operand_dtypes.items()), outs,
            consts_key(call.consts), deterministic, accumulate)


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
                sig = signature(ep, checks.dtype_of(where_of(ep), "A", call.a), b_layout, operand_dtypes, call.consts,
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
            table_key = (epilogue, backend, config, deterministic, tuning.on if tune is None else tune)
            known = _tables.get(table_key)
        except TypeError:  # an unhashable option: the checks below explain it
            table_key = known = None
        if known and not torch.compiler.is_compiling():
            outs = known.call(A, B, operands)  # a layout launched before: in C++ (runtime/warm.py)
            if outs is not None:
                return outs
    ep = epilogue_of("cd.gemm", epilogue, operands)
    checks.backend(where_of(ep), backend)
    if torch.compiler.is_compiling():
        if accumulate:
            raise UnsupportedError(f"{where_of(ep)}: accumulate=True inside torch.compile is not supported yet; "
                                   "write D + epilogue(...) functionally there")
        check_flag(ep, "deterministic", deterministic)
        check_out_dict(ep, out)
        check_operands(ep, operands)
        return traced_gemm(ep, A, B, out, backend, config, deterministic, operands)
    if config is not None and not isinstance(config, (Config, str)):
        raise OperandError(f"{where_of(ep)}: config must be a cd.Config or its string form, not {config!r}")
    check_flag(ep, "deterministic", deterministic)
    check_flag(ep, "accumulate", accumulate)
    if tune is not None:
        check_flag(ep, "tune", tune)
    tune = tuning.on if tune is None else tune
    options = (backend, config, deterministic, accumulate, tune)
    warm_key = (options, call_layout(facts_of(ep).kinds, A, B, operands, out))
    hit = _warm.get(ep, {}).get(warm_key)  # (op, whether an input requires grad): a layout checked before
    table = (lambda: _warm_table(table_key, ep)) if table_key is not None else None
    if hit is not None and not (hit[1] and torch.is_grad_enabled()):
        return hit[0].run(A, B, operands, out, warm_key, table)
    if not (torch.is_grad_enabled() and any_requires_grad(A, B, operands)):  # what autograd does not record
        return _gemm(ep, A, B, out, options, operands, warm_key, table)
    return recorded_call(where_of(ep), lambda: hit[0].run(A, B, operands, None, warm_key) if hit else
                     _gemm(ep, A, B, None, options, operands, warm_key), A, B, operands, out)


def _gemm(ep: Epilogue, A, B, out: dict | None, options: tuple, operands: dict, warm_key: tuple,
          table=None) -> dict[str, torch.Tensor]:
    """cd.gemm's first call of a layout: checked, specialized and launched; the op is kept for the warm
    path under warm_key (the options and the call's layout), and the launch offered to the C++ warm path's
    table (a function giving it; CompiledOp.launch)."""
    backend, config, deterministic, accumulate, tune = options
    call = normalize(ep, A, B, operands, out)
    cfg = config_of(ep, config)
    use_cutlass = backend == "cutlass" or (backend == "auto" and _cutlass_available(call.a.device))
    dtypes = check_call(ep, call, out, use_cutlass, accumulate)
    if not use_cutlass:
        return run_reference(ep, call, out, accumulate)
    key = call_key(ep, call, dtypes, out, deterministic, accumulate)
    spec = lambda cfg: specialization(ep, call, dtypes, out, cfg, deterministic, accumulate, key)  # noqa: E731
    try:
        folded = fold_batch(ep, call)
        op = spec(cfg if cfg is not None else _choose_config(spec, folded, tune, key))
        op.check_widths(folded)
    except UnsupportedError as e:
        if backend == "cutlass":
            raise
        warnings.warn(f"coda_dsl: running on the reference backend (slow): {e}", stacklevel=3)
        return run_reference(ep, call, out, accumulate)
    folded_out = fold_batch_out(ep, out, folded)
    op.check_out(folded, folded_out)
    if _collected is not None and not op.loaded:  # inside prebuild(fn): note the kernel, build it later
        _collected.setdefault(op.key, op)
        return run_reference(ep, call, out, accumulate)
    remember(_warm.setdefault(ep, {}), warm_key, (op, any_requires_grad(A, B, operands)))
    return unfold_batch(op.launch(folded, folded_out, table=table), folded)


def _warm_table(key: tuple, ep: Epilogue):
    table = _tables.get(key)
    if table is None:
        table = remember(_tables, key, warm.table(facts_of(ep).kinds))
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
    call = normalize(ep, A, B, operands, out)
    config = config_of(ep, config)
    check_flag(ep, "deterministic", deterministic)
    check_flag(ep, "accumulate", accumulate)
    # as cd.gemm(backend="cutlass"): never a useless build
    dtypes = check_call(ep, call, out, cutlass=True, accumulate=accumulate, instead=KERNEL_ONLY)
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
    ab = checks.dtype_of(where_of(ep), "A", call.a, fp64=True)
    program = specialize(ep.program, call.consts)
    # fp64 A and B: every output in fp64, the math's precision (None keeps it)
    out_dtypes = {o.name: None for o in ep.program.outputs} if ab == checks.REFERENCE_FP64 else \
        dict(_output_dtypes(ep, ab, out))
    operands = {**call.tensors, **call.scalars}
    if accumulate:  # D (an [M, N] one: accumulate_into_d refuses others) is read before the outputs' checks
        program = accumulate_into_d(program)
        d, (m, n, _, _) = out["D"], call.mnkl
        lead = torch.broadcast_shapes(call.a.shape[:-2], call.b.shape[:-2])
        check_out_tensor(where_of(ep), "D", d, OUTPUT_SHAPES["mn"][1](lead, m, n), d.dtype, call, tma=None)
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
                raise OperandError(f"{where_of(ep)}: out has '{name}', which is not an output of the epilogue "
                                   f"({list(res)})")
            check_out_tensor(where_of(ep), name, t, res[name].shape, res[name].dtype, call, tma=None)
        check_distinct(where_of(ep), out)
        for name, t in out.items():
            t.copy_(res[name])
            res[name] = t
    return with_aliases(ep, res)
