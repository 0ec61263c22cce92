"""Benchmarks and measurement tools (never timed tests): ``bench/`` (hybridpar vs PyTorch-native,
collectives), ``memory_bench``, ``calibrate`` and ``validate`` (the planner against measured
steps), ``plot``."""
