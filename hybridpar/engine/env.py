"""What the launcher and the OS told this process, read without importing torch (the CLI answers
a config error before torch is loaded)."""
from __future__ import annotations

import os


def under_launcher() -> bool:
    """True inside a torchrun / elastic-launch worker (the launcher sets these)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def usable_cores() -> list[int]:
    """The cores this process may run on: its affinity mask (a container's cpuset, taskset,
    numactl), or every core where the OS has none (macOS). ``os.cpu_count()`` counts the
    machine's, which a container may not have."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))
