"""Elementwise steps written as torch ops, run fused on CUDA: torch.compile turns a chain of ops into a
kernel or two (eagerly, each op is a pass over memory, often in fp32). On the CPU, and inside a graph
that torch.compile is tracing anyway, the function runs as written."""
from __future__ import annotations

import functools
from typing import Callable

import torch


def on_cuda(fn: Callable) -> Callable:
    """fn, compiled when its first tensor argument is on CUDA. torch.compile's default, automatic dynamic
    shapes: sizes start static (index math by constants; a layer's token count rarely changes), and only
    a dimension seen to change becomes symbolic on the one recompile. (dynamic=True made every size
    symbolic: integer division by runtime values in every element's index.)"""
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
