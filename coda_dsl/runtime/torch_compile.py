"""torch.compile around coda_dsl: elementwise steps written as torch ops, run fused on CUDA (torch.compile
turns a chain of ops into a kernel or two; eagerly, each op is a pass over memory, often in fp32; on the
CPU, and inside a graph that torch.compile is tracing anyway, the function runs as written), and epilogues
made by functions, which Dynamo must call rather than trace."""
from __future__ import annotations

import functools
import threading
import types
from typing import Callable

import torch

from ..dsl import Epilogue
from ..errors import EpilogueError


def on_cuda(fn: Callable) -> Callable:
    """fn, compiled when its first tensor argument is on CUDA (on the CPU, and inside a graph torch.compile
    is tracing anyway, it runs as written). torch.compile's default, automatic dynamic shapes: sizes
    start static (index math by constants; a layer's token count rarely changes), and only a dimension
    seen to change becomes symbolic on the one recompile. (dynamic=True made every size symbolic: integer
    division by runtime values in every element's index.)"""
    compiled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if first is None or not first.is_cuda or torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        if compiled is None:
            compiled = torch.compile(fn)
        return compiled(*args, **kwargs)

    call.eager = fn  # for tests: the same function, never compiled
    return call


def constant_under_compile(fn: Callable) -> Callable:
    """Mark fn as torch.compiler.assume_constant_result does (Dynamo calls it while it traces, instead of
    tracing it, and keeps its result as a constant of the graph), without importing torch._dynamo (1.5 s)."""
    fn._dynamo_marked_constant = True
    return fn


def _nan_free(v):
    """A value as made_once's key holds it: NaN (which equals no NaN) as one marker."""
    return "nan" if isinstance(v, float) and v != v else v


def made_once(make: Callable) -> Callable:
    """make(*args, **kwargs), called once per argument values (told apart by repr: 0.0 and -0.0 too) and
    kept for the process's life; callable inside torch.compile(fullgraph=True), which then calls make
    instead of tracing it (a pass over the IR, the DSL's tracer) and reads what it made as an attribute of
    a plain object (Dynamo reads that as it is; a dict it has read before, from its own copy, which lacks
    what an untraced call added since: a second new entry in one graph was a KeyError)."""
    names: dict[tuple, str] = {}
    made = types.SimpleNamespace()
    lock = threading.Lock()

    @constant_under_compile
    def name(*args, **kwargs) -> str:
        kw = tuple(sorted(kwargs.items()))
        key = (repr((args, kw)), tuple(map(_nan_free, args)), tuple((k, _nan_free(v)) for k, v in kw))  # repr: ±0.0
        if key not in names:
            value = make(*args, **kwargs)  # first: make may itself make another (the names must not shift)
            with lock:
                if key not in names:
                    setattr(made, attr := f"made{len(names)}", value)
                    names[key] = attr
        return names[key]

    @functools.wraps(make)
    def get(*args, **kwargs):
        return getattr(made, name(*args, **kwargs))
    return get


def epilogue_factory(fn: Callable) -> Callable:
    """Decorator for a function of hashable arguments that makes an epilogue (one per activation, cap value,
    ...): each epilogue is made once per arguments (made_once), and the function may be called inside
    torch.compile(fullgraph=True), which calls it while tracing instead of tracing the DSL's tracer (a
    number it traces symbolically is specialized: it shapes the kernel)."""
    if not callable(fn) or isinstance(fn, Epilogue):
        raise EpilogueError(f"cd.epilogue_factory decorates a function that makes an epilogue, not {fn!r}\n  fix: "
                            "@cd.epilogue_factory\ndef make(cap): return cd.epilogue(lambda acc: ...)")

    @made_once
    def made(*args, **kwargs) -> Epilogue:
        ep = fn(*args, **kwargs)
        if not isinstance(ep, Epilogue):
            raise EpilogueError(f"{fn.__qualname__} is a cd.epilogue_factory but returned {type(ep).__name__}, "
                                "not an epilogue\n  fix: return the epilogue it makes (cd.epilogue(f))")
        if ep.made_by is None:  # pickled as this call (the epilogue's own function may be a closure)
            ep.made_by = (get, args, tuple(kwargs.items()))
        return ep

    @functools.wraps(fn)
    def get(*args, **kwargs) -> Epilogue:
        if any(isinstance(v, torch.Tensor) for v in (*args, *kwargs.values())):
            raise EpilogueError(f"{fn.__qualname__} (a cd.epilogue_factory) takes constants, not tensors: its "
                                "epilogue is made once per argument values\n  fix: pass a Python number (float(t)), "
                                "or make the value an operand of the epilogue (cd.Scalar)")
        if torch.compiler.is_compiling():  # (Dynamo traces this function: no hash() of symbolic numbers)
            args, kwargs = tuple(map(guarded_constant, args)), {k: guarded_constant(v) for k, v in kwargs.items()}
        else:
            try:
                hash((args, tuple(kwargs.items())))
            except TypeError:
                raise EpilogueError(f"{fn.__qualname__} (a cd.epilogue_factory) takes hashable constants (numbers, "
                                    "strings, tuples): its epilogue is made once per argument values\n  fix: pass "
                                    "a tuple instead of a list") from None
        return made(*args, **kwargs)
    get.makes_epilogues = True  # what the CLI tells apart from a plain function
    return get


def guarded_constant(value):
    """A number as a Python constant while Dynamo traces (a float input is traced symbolically: guarded to
    its value here), for what shapes a kernel."""
    if isinstance(value, (bool, int, float)):
        from torch.fx.experimental.symbolic_shapes import guard_scalar
        return guard_scalar(value)
    return value
