"""`python -m coda_dsl ...` is the `coda-dsl` command."""
from .cli import main

raise SystemExit(main())
