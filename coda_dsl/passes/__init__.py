"""Passes over the IR: constant binding and folding, validation, lowering into an EVT plan."""
from .lower import lower, validate
from .plan import Config, Plan, Signature
from .simplify import specialize

__all__ = ["Config", "Plan", "Signature", "lower", "specialize", "validate"]
