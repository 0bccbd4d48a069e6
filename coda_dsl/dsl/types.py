"""Operand kinds, written as annotations on an epilogue's parameters (after the accumulator)."""
from __future__ import annotations


class _Kind:
    kind = ""

    def __init_subclass__(cls, kind: str = "", **kw):
        super().__init_subclass__(**kw)
        cls.kind = kind


class Tensor(_Kind, kind="tensor"):
    """A full [M, N] (or [L, M, N]) operand, read tile by tile (e.g. a residual)."""


class VecN(_Kind, kind="vec_n"):
    """One value per output column n, shape [N] (or [L, N]): a bias, a per-feature scale."""


class VecM(_Kind, kind="vec_m"):
    """One value per output row m, shape [M] (or [L, M]): a per-token scale such as rstd."""


class Scalar(_Kind, kind="scalar"):
    """A runtime number: changing it never recompiles."""


class Const(_Kind, kind="const"):
    """A compile-time number, baked into the kernel: each distinct value costs a build."""


class Acc(_Kind, kind="acc"):
    """Optional annotation of the first parameter, the fp32 accumulator of A @ B^T."""


_BY_NAME = {c.__name__: c for c in (Tensor, VecN, VecM, Scalar, Const, Acc)}


def kind_of(annotation) -> str | None:
    """The operand kind an annotation names (classes or their string spelling), else None."""
    if isinstance(annotation, str):  # unresolved string annotation, e.g. "cd.VecN"
        annotation = _BY_NAME.get(annotation.rsplit(".", 1)[-1])
    if isinstance(annotation, type) and issubclass(annotation, _Kind) and annotation is not Acc:
        return annotation.kind
    return None


def annotation_of(kind: str) -> str:
    """The annotation that declares an operand kind: "vec_n" -> "cd.VecN"."""
    return next(f"cd.{name}" for name, c in _BY_NAME.items() if c.kind == kind)
