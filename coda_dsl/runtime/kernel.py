"""The call into a built kernel library: its two `extern "C"` functions (csrc/coda_dsl/abi.h) reached
through ctypes. Tensors go as plain data (pointer, rank, sizes, strides), the stream is torch's current
one on A's device, the workspace comes from torch's caching allocator (safe under CUDA graph capture),
and a refusal comes back as a KernelError with the kernel's message. Every check of shapes, strides,
alignment, aliasing and devices happened before (runtime/op.py, runtime/checks.py)."""
from __future__ import annotations

import ctypes
import functools
import struct

import torch

from ..errors import KernelError

_INT64 = ctypes.c_int64
_MESSAGE_BYTES = 1024


def pack_call(tensors: list[torch.Tensor], scalars: list[float], device: int, stream: int, workspace: int,
              workspace_size: int) -> bytes:
    """abi.h's block for one call, in one struct.pack: the CallArgs header; a TensorArg per tensor (data
    pointer, rank, three sizes, three strides; the unused dimensions are zero bytes, the format's
    padding); the scalars as doubles."""
    values = [len(tensors), len(scalars), device, stream, workspace, workspace_size]
    ranks = []
    for t in tensors:
        shape = t.shape
        values.append(t.data_ptr())
        values.append(len(shape))
        values += shape
        values += t.stride()
        ranks.append(len(shape))
    values += scalars
    return struct.pack(_format(tuple(ranks), len(scalars)), *values)


@functools.cache
def _format(ranks: tuple[int, ...], n_scalars: int) -> str:
    if any(r > 3 for r in ranks):
        raise ValueError(f"kernel operands have at most 3 dimensions, got ranks {list(ranks)}")
    return "=6q" + "".join(f"qq{r}q{8 * (3 - r)}x{r}q{8 * (3 - r)}x" for r in ranks) + f"{n_scalars}d"


def current_stream(device: int) -> int:
    """torch's current stream on `device`, as the raw cudaStream_t (what a launch in C++ would use)."""
    return torch._C._cuda_getCurrentRawStream(device)


class Kernel:
    """A loaded kernel library, called like the torch op it replaces: (a, b, d, inputs, scalars, outputs)."""

    def __init__(self, library: ctypes.CDLL):
        # a PyDLL: its calls hold the GIL, so one message buffer serves every thread
        self._size = library.coda_workspace_size
        self._size.argtypes = [ctypes.c_char_p, ctypes.POINTER(_INT64), ctypes.c_char_p, _INT64]
        self._size.restype = ctypes.c_int
        self._launch = library.coda_launch
        self._launch.argtypes = [ctypes.c_char_p, ctypes.c_char_p, _INT64]
        self._launch.restype = ctypes.c_int
        self._message = ctypes.create_string_buffer(_MESSAGE_BYTES)
        self._workspace: dict[tuple, int] = {}  # (A's shape, B's shape, device) -> workspace bytes

    def _error(self) -> KernelError:
        return KernelError(self._message.value.decode(errors="replace"))

    def __call__(self, a: torch.Tensor, b: torch.Tensor, d: torch.Tensor | None, inputs: list[torch.Tensor],
                 scalars: list[float], outputs: list[torch.Tensor]) -> None:
        tensors = [a, b, *inputs, *outputs] if d is None else [a, b, d, *inputs, *outputs]
        device = a.get_device()
        # The workspace depends on the problem's M, N, K, L and the device's SM count, not on strides
        # or pointers: asked once per shape (the launch checks it is large enough).
        key = (a.shape, b.shape, device)
        size = self._workspace.get(key)
        if size is None:
            query, n = pack_call(tensors, scalars, device, 0, 0, 0), _INT64(0)
            if self._size(query, ctypes.byref(n), self._message, _MESSAGE_BYTES):
                raise self._error()
            if len(self._workspace) >= 1024:  # many shapes: forget them rather than grow without bound
                self._workspace.clear()
            size = self._workspace[key] = n.value
        # held until the launch is queued: freed after it, the caching allocator reuses it in stream order
        workspace = torch.empty(size, dtype=torch.uint8, device=a.device) if size else None
        args = pack_call(tensors, scalars, device, current_stream(device),
                         workspace.data_ptr() if workspace is not None else 0, size)
        if self._launch(args, self._message, _MESSAGE_BYTES):
            raise self._error()
