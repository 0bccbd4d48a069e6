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


class Packer:
    """abi.h's block for the calls of one layout: the CallArgs header, a TensorArg per tensor (data
    pointer, rank, three sizes, three strides; the unused dimensions are zero bytes, the format's
    padding), then the scalars as doubles. Counts, ranks, sizes and strides are read once; a call
    fills in only the data pointers, the stream, the workspace and the scalars (one struct.pack)."""

    def __init__(self, tensors: list[torch.Tensor], n_scalars: int, device: int, workspace_size: int):
        self.device, self.workspace_size = device, workspace_size
        self._struct = struct.Struct(_format(tuple(t.dim() for t in tensors), n_scalars))
        self._values = [len(tensors), n_scalars, device, 0, 0, workspace_size]
        self._pointers = []  # where each tensor's data pointer goes in _values
        for t in tensors:
            self._pointers.append(len(self._values))
            self._values += (0, t.dim(), *t.shape, *t.stride())

    def pack(self, tensors: list[torch.Tensor], scalars: list[float], stream: int, workspace: int) -> bytes:
        values = self._values.copy()
        values[3], values[4] = stream, workspace
        for at, t in zip(self._pointers, tensors):
            values[at] = t.data_ptr()
        return self._struct.pack(*values, *scalars)

    def template(self) -> bytes:
        """The block with every pointer, the stream, the workspace and the scalars zero (runtime/warm.py)."""
        return self._struct.pack(*self._values, *[0.0] * self._values[1])  # the header's scalar count


def pack_call(tensors: list[torch.Tensor], scalars: list[float], device: int, stream: int, workspace: int,
              workspace_size: int) -> bytes:
    """abi.h's block for one call (Packer, for a single call)."""
    return Packer(tensors, len(scalars), device, workspace_size).pack(tensors, scalars, stream, workspace)


@functools.cache
def _format(ranks: tuple[int, ...], n_scalars: int) -> str:
    if any(r > 3 for r in ranks):
        raise ValueError(f"kernel operands have at most 3 dimensions, got ranks {list(ranks)}")
    return "=6q" + "".join(f"qq{r}q{8 * (3 - r)}x{r}q{8 * (3 - r)}x" for r in ranks) + f"{n_scalars}d"


def remember(memo: dict, key, value):
    """memo[key] = value, returned; a memo of many shapes or layouts is forgotten rather than grown
    without bound."""
    if len(memo) >= 1024:
        memo.clear()
    memo[key] = value
    return value


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
        self._packers: dict[tuple, Packer] = {}  # call layout -> its Packer

    def _error(self) -> KernelError:
        return KernelError(self._message.value.decode(errors="replace"))

    def __call__(self, a: torch.Tensor, b: torch.Tensor, d: torch.Tensor | None, inputs: list[torch.Tensor],
                 scalars: list[float], outputs: list[torch.Tensor], layout: tuple | None = None) -> None:
        """layout: a key that fixes every tensor's rank, sizes and strides and the device (the caller's
        checked call layout): its block is then packed from what its first call read."""
        tensors = [a, b, *inputs, *outputs] if d is None else [a, b, d, *inputs, *outputs]
        packer = self._packers.get(layout) if layout is not None else None
        if packer is None:
            packer = self._packer(tensors, scalars)
            if layout is not None:
                remember(self._packers, layout, packer)
        size, device = packer.workspace_size, packer.device
        # held until the launch is queued: freed after it, the caching allocator reuses it in stream order
        workspace = torch.empty(size, dtype=torch.uint8, device=a.device) if size else None
        args = packer.pack(tensors, scalars, current_stream(device), workspace.data_ptr() if size else 0)
        if self._launch(args, self._message, _MESSAGE_BYTES):
            raise self._error()

    @property
    def launch_address(self) -> int:
        """coda_launch's address, for the C++ warm path (runtime/warm.py)."""
        return ctypes.cast(self._launch, ctypes.c_void_p).value

    def template(self, tensors: list[torch.Tensor], n_scalars: int) -> tuple[bytes, int]:
        """The block of a call of these tensors' layout (Packer.template) and its workspace bytes."""
        packer = self._packer(tensors, [0.0] * n_scalars)
        return packer.template(), packer.workspace_size

    def _packer(self, tensors: list[torch.Tensor], scalars: list[float]) -> Packer:
        device = tensors[0].get_device()
        # The workspace depends on the problem's M, N, K, L and the device's SM count, not on strides
        # or pointers: asked once per shape (the launch checks it is large enough).
        key = (tensors[0].shape, tensors[1].shape, device)
        size = self._workspace.get(key)
        if size is None:
            query, n = pack_call(tensors, scalars, device, 0, 0, 0), _INT64(0)
            if self._size(query, ctypes.byref(n), self._message, _MESSAGE_BYTES):
                raise self._error()
            size = remember(self._workspace, key, n.value)
        return Packer(tensors, len(scalars), device, size)
