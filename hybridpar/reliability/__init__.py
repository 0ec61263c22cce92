"""Failing clearly: the error taxonomy and exit codes, injected faults (``errors``), per-rank
activity marks, heartbeats and the deadline watchdog (``watchdog``)."""
