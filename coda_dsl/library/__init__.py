"""Ready epilogues for Transformer blocks, each a few lines of DSL (they run on every backend)."""
from .cross_entropy import linear_cross_entropy
from .gated import (geglu, interleave_gate_up, linear_swiglu, reglu, swiglu, swiglu_backward,
                    swiglu_keep_preactivation)
from .rmsnorm import gain_wgrad, rms_consumer, rms_producer, rmsnorm_linear
from .rope import neox_to_interleaved, neox_to_interleaved_rows, rope_frequencies, rope_positions, rope_tables

__all__ = ["linear_cross_entropy", "geglu", "interleave_gate_up", "linear_swiglu", "reglu", "swiglu", "swiglu_backward",
           "swiglu_keep_preactivation", "gain_wgrad", "rms_consumer", "rms_producer", "rmsnorm_linear",
           "neox_to_interleaved", "neox_to_interleaved_rows", "rope_frequencies", "rope_positions", "rope_tables"]
