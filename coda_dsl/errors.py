"""Exceptions shared by every layer. Messages say what is wrong, where, and how to fix it."""


class CodaError(Exception):
    """Base class of every coda_dsl error."""


class EpilogueError(CodaError, TypeError):
    """A mistake in an epilogue's Python code: raised while tracing or checking it, names the user's line."""


class OperandError(CodaError, ValueError):
    """A call-time problem with a tensor or value handed to an op (shape, dtype, device, layout)."""


class UnsupportedError(CodaError, NotImplementedError):
    """Valid request that this version cannot run (e.g. not an sm_90 GPU)."""


class SharedMemoryError(UnsupportedError):
    """A kernel whose buffers cannot fit in a block's shared memory at any config tried (raised before nvcc)."""


class KernelError(CodaError, RuntimeError):
    """A built kernel refused a call (CUTLASS cannot run the problem) or its launch failed; the kernel's
    message says which op, what and the fix."""
