"""Benchmarks of coda_dsl against cuBLAS, eager PyTorch and torch.compile (run on an sm_90 GPU)."""
