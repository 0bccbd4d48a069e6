"""Rotary position embedding in the epilogue of the Q/K (or fused QKV) projection.

Column pairs (2j, 2j+1) rotate by an angle: (x0 cos - x1 sin, x0 sin + x1 cos), the interleaved
(GPT-J) convention. Columns that must not rotate (V in a fused QKV) get cos 1, sin 0 (tables) or an
inverse frequency of 0 (positions). For the half-split (Llama/NeoX) convention, permute each
head's weight rows with `neox_to_interleaved` (or the indices `neox_to_interleaved_rows`) for Q and K alike: attention scores are
q·k sums over a head's dimensions, which a common permutation leaves unchanged.
"""
from __future__ import annotations

import numbers

import torch

import coda_dsl as cd  # the library is written against the public API, like user code


def rotate(acc, cos, sin):  # column pairs (x0, x1) turned by the angle of cos, sin
    x0, x1 = cd.pairs(acc)
    return cd.interleave(x0 * cos - x1 * sin, x0 * sin + x1 * cos)


@cd.epilogue
def rope_tables(acc, cos: cd.Tensor, sin: cd.Tensor):
    """cos, sin: [M, N/2] (one angle per row and column pair)."""
    return rotate(acc, cos, sin)


@cd.epilogue
def rope_positions(acc, pos: cd.VecM, inv_freq: cd.VecN):
    """pos: [M] token positions; inv_freq: [N/2] per column pair (0 for columns that pass through).
    The angle is computed in fp32 in the epilogue."""
    angle = pos * inv_freq
    return rotate(acc, cd.cos(angle), cd.sin(angle))


def _check_head_dim(head_dim: int) -> None:
    if not (isinstance(head_dim, numbers.Integral) and head_dim > 0 and head_dim % 2 == 0):
        raise cd.OperandError(f"head_dim must be a positive even number (it holds rotation pairs), got {head_dim!r}")


def neox_to_interleaved(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """w's rows (heads of head_dim) in the order that turns half-split (i, i + d/2) rotation pairs into
    adjacent ones, as a [heads, d/2, 2, ...] view (no copy): W_q and W_k so permuted, with rope_*, give
    the NeoX/Llama rotation (up to the same permutation of q and k)."""
    _check_head_dim(head_dim)
    if w.shape[0] % head_dim:
        raise cd.OperandError(f"w has {w.shape[0]} rows, not a whole number of heads of head_dim {head_dim}")
    return w.unflatten(0, (-1, 2, head_dim // 2)).transpose(1, 2)


def neox_to_interleaved_rows(n_heads: int, head_dim: int) -> torch.Tensor:
    """The row order of neox_to_interleaved as indices: W_q[perm]."""
    return neox_to_interleaved(torch.arange(n_heads * head_dim), head_dim).reshape(-1)


def rope_frequencies(n_cols: int, head_dim: int, base: float = 10000.0, rotate_cols: int | None = None):
    """inv_freq [n_cols / 2] for rope_positions: per head, 1 / base^(2i / head_dim); pairs at or after
    `rotate_cols` (e.g. V of a fused QKV) get 0, i.e. no rotation."""
    _check_head_dim(head_dim)
    for name, cols in (("n_cols", n_cols), ("rotate_cols", rotate_cols)):
        if cols is not None and cols % 2:
            raise cd.OperandError(f"{name} = {cols} is odd: RoPE turns column pairs")
    i = torch.arange(n_cols // 2) % (head_dim // 2)
    inv = 1.0 / base ** (2.0 * i / head_dim)
    if rotate_cols is not None:
        inv[rotate_cols // 2:] = 0.0
    return inv.float()
