"""Where the non-Python parts of coda_dsl live, for both install modes.

A plain `pip install .` copies `templates/` and `csrc/` into `coda_dsl/_data/`; an editable install
(or a checkout on sys.path) leaves them at the repo root, next to the package dir.
"""
from __future__ import annotations

from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent.parent  # .../coda_dsl


def _data_dir(name: str) -> Path:
    installed = _PACKAGE_DIR / "_data" / name
    return installed if installed.is_dir() else _PACKAGE_DIR.parent / name


def templates_dir() -> Path:
    return _data_dir("templates")


def csrc_dir() -> Path:
    return _data_dir("csrc")


def generator_sources() -> list[Path]:
    """The files a kernel's text comes from: the template, the hand-written headers every kernel
    includes and codegen's own spelling of a plan (codegen/*.py)."""
    return sorted([*templates_dir().glob("*.j2"), *csrc_dir().rglob("*.h"), *(_PACKAGE_DIR / "codegen").glob("*.py")])
