"""What the launcher told this process, read from the environment without importing torch (the
CLI answers a config error before torch is loaded)."""
from __future__ import annotations

import os


def under_launcher() -> bool:
    """True inside a torchrun / elastic-launch worker (the launcher sets these)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)
