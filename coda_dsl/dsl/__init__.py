"""The user-facing DSL: @epilogue, operand kinds, traced values and the functions on them."""
from __future__ import annotations

import hashlib
import importlib
import inspect
import itertools
import weakref
from typing import Callable

from ..errors import EpilogueError, UnsupportedError
from ..ir import graph as ir
from ..passes.widths import infer as infer_widths
from . import ops
from .trace import Reduction, Value, signature_params, trace
from .types import Acc, Const, Scalar, Tensor, VecM, VecN

# keyword arguments of cd.gemm; an operand may not take these names
RESERVED = {"out", "backend", "config", "accumulate", "deterministic", "tune"}


class Epilogue:
    """A traced epilogue program. Pass it to cd.gemm (or cd.compile) with the operands it declares."""

    _by_uid: "weakref.WeakValueDictionary[str, Epilogue]" = weakref.WeakValueDictionary()
    _count = itertools.count()

    def __init__(self, fn: Callable, name: str | None = None):
        self.fn = fn
        name = name or fn.__name__
        defined_at, params = signature_params(fn, RESERVED)
        program = trace(fn, params, name, defined_at)
        infer_widths(program)  # values of two widths meeting: an error at definition, like the rest
        self._adopt(program)
        self.__doc__ = fn.__doc__

    # a derived backward's: each saved_* operand -> the output of its forward kernel it is (cd.saved_operands)
    saved_from: dict[str, str] | None = None

    @classmethod
    def of_program(cls, program: ir.Program, saved_from: dict[str, str] | None = None) -> "Epilogue":
        """An epilogue of a program built by a pass (e.g. a derived backward), not traced from a function."""
        ep = cls.__new__(cls)
        ep.fn, ep.saved_from = None, saved_from
        ep._adopt(program)
        return ep

    def _adopt(self, program: ir.Program) -> None:
        self.program = program
        self.name, self.defined_at, self.params = program.name, program.defined_at, program.params
        self.output_names = tuple(o.name for o in program.outputs)
        # names this epilogue inside torch.compile graphs: unique in the process (the count), and a digest of
        # the program, so that a graph made elsewhere (torch.export, a cache) never finds another epilogue
        digest = hashlib.sha256(ir.format_program(program).encode()).hexdigest()[:12]
        self.uid = f"{self.name}#{next(self._count)}.{digest}"
        Epilogue._by_uid[self.uid] = self

    @classmethod
    def by_uid(cls, uid: str) -> "Epilogue":
        try:
            return cls._by_uid[uid]
        except KeyError:
            raise UnsupportedError(f"a graph calls coda_dsl epilogue {uid!r}, which this process has not made (or no "
                                   "longer holds): graphs that call coda_dsl ops (torch.export'ed programs among them) "
                                   "run in the process that made them, with the epilogue still referenced") from None

    # An epilogue is immutable: copy.deepcopy of a model holding one shares it. Pickled by reference, as
    # functions are: its module and name, or the cd.epilogue_factory and arguments that made it
    # (made_by, set by the factory).
    made_by: tuple | None = None

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        if self.made_by is not None:
            return _made, self.made_by
        module = getattr(self.fn, "__module__", None)
        for qualname in (getattr(self.fn, "__qualname__", ""), self.name):  # a decorated def; a named lambda
            try:
                if module and "<" not in qualname and _named(module, qualname) is self:
                    return _named, (module, qualname)
            except ImportError:  # a file run as a script under another name (the CLI's targets)
                pass
        raise TypeError(f"epilogue '{self.name}' ({self.defined_at}) cannot be pickled: it is pickled by reference, "
                        "and nothing importable names it\n  fix: define it at the top level of a module (or make it "
                        "with a cd.epilogue_factory defined there)")

    def __call__(self, *args, **kwargs):
        raise TypeError(f"epilogue '{self.name}' is not called directly: use cd.gemm(A, B, {self.name}, "
                        f"{', '.join(p.name + '=...' for p in self.params)})")

    def __repr__(self) -> str:
        return f"<coda_dsl epilogue {self.name} ({self.defined_at})>"


def _named(module: str, qualname: str):
    """What `module.qualname` names (an unpickled epilogue), or None where an attribute is missing."""
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


def _made(factory: Callable, args: tuple, kwargs: tuple) -> "Epilogue":
    """An unpickled epilogue of a cd.epilogue_factory: the same call (kwargs as (name, value) pairs)."""
    return factory(*args, **dict(kwargs))


def epilogue(fn: Callable | None = None, *, name: str | None = None):
    """Decorator: trace `fn(acc, operand: kind, ...)` into an epilogue program.

    Returns "D": value, or a dict of named outputs (D plus any auxiliary outputs and reductions).
    """
    if fn is None:
        return lambda f: epilogue(f, name=name)
    if not (inspect.isfunction(fn) or inspect.ismethod(fn)):  # a partial, callable object or builtin: no code to name
        raise EpilogueError(f"cd.epilogue decorates a function (def, lambda or method), not {fn!r}\n  fix: @cd.epilogue\n"
                            "def f(acc, ...): ... (a function of constants: cd.epilogue_factory)")
    return Epilogue(fn, name)


identity = Epilogue(lambda acc: {"D": acc}, name="identity")

__all__ = ["Epilogue", "epilogue", "identity", "Value", "Reduction", "Tensor", "VecN", "VecM", "Scalar",
           "Const", "Acc", "ops", "RESERVED"]
