"""The epilogue IR (graph.py) and the elementwise op table (ops.py)."""
from .graph import Node, Output, Param, Program, format_program

__all__ = ["Node", "Output", "Param", "Program", "format_program"]
