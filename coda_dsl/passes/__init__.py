"""Passes over the IR: constant binding and folding, validation, lowering into an EVT plan."""
from .lower import lower, validate
from .plan import Config, Plan, Signature
from .simplify import accumulate_into_d, rounding_in_stores, specialize

__all__ = ["Config", "Plan", "Signature", "accumulate_into_d", "lower", "rounding_in_stores", "specialize",
           "validate"]
