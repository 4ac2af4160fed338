"""The studies' checks import the studies by module name, as the scripts import each other."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing downloads at test time
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

STUDIES = str(Path(__file__).resolve().parents[1])
if STUDIES not in sys.path:
    sys.path.insert(0, STUDIES)
