"""``python -m distlab run -n N script.py``: see :mod:`distlab.launch` and ``python -m distlab run --help``."""
import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
