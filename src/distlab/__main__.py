"""``python -m distlab run -n N script.py``: see :mod:`distlab.launch`."""
import sys

from .launch import main

sys.exit(main())
