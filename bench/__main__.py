"""`python -m bench [args]`: run every epilogue benchmark (see bench/epilogues.py for the options)."""
import sys

from .epilogues import main

sys.exit(main())
