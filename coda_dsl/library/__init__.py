"""Ready epilogues for Transformer blocks, each a few lines of DSL (they run on every backend)."""
from .rmsnorm import rms_consumer, rms_producer, rmsnorm_linear

__all__ = ["rms_consumer", "rms_producer", "rmsnorm_linear"]
