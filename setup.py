"""coda_dsl: GEMM epilogues written in Python, fused into CUTLASS Hopper (sm_90a) kernels.

Kernels are generated and built at run time (per specialization, cached), so installing builds
nothing. templates/ and csrc/ ship inside the package as coda_dsl/_data/ for a regular install; an
editable install reads them from the repository.
"""
from setuptools import find_packages, setup

setup(
    name="coda_dsl",
    version="0.1.0",
    description="A Python DSL for GEMM epilogues, lowered to CUTLASS 3.x Hopper epilogue visitor trees",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="BSD-3-Clause",
    license_files=["LICENSE"],
    python_requires=">=3.10",
    packages=find_packages(include=["coda_dsl", "coda_dsl.*"]) + ["coda_dsl._data.templates", "coda_dsl._data.csrc"],
    package_dir={"coda_dsl._data.templates": "templates", "coda_dsl._data.csrc": "csrc"},
    package_data={"coda_dsl._data.templates": ["*.j2"], "coda_dsl._data.csrc": ["coda_dsl/*.h"], "coda_dsl.runtime": ["*.cpp"]},
    install_requires=[
        "torch>=2.7",  # 2.11 on the H200 machines; a CUDA 12.8+ build (the runtime's library API; 2.7: the first cu128)
        "nvidia-cutlass>=4.0",  # its wheel carries the CUTLASS C++ headers
        "jinja2>=3.0",
        "ninja",
        "pybind11",
    ],
    extras_require={"test": ["pytest>=7", "transformers>=5"]},  # transformers: tests/test_nn.py's HF reference
    entry_points={"console_scripts": ["coda-dsl=coda_dsl.cli:main"]},
)
