"""Benchmarks (not tests): hybridpar vs PyTorch-native parallelism (``run``, ``native``) and
collective microbenchmarks (``collectives``)."""
