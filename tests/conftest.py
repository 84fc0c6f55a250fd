"""Shared test setup. Others add fixtures here; keep each one small.

``tests/`` has no ``__init__.py`` (pytest runs with ``--import-mode=importlib``),
so helper modules such as ``snapshot_factory`` are made importable by putting
this directory on ``sys.path``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
