"""Memory accounting of one rank.

``peak_memory_bytes``: the CUDA allocator's high-water mark, or on CPU the process's peak
resident set (what the OS had to give this rank, including Python and libraries).

``ActivationMeter`` + ``state_bytes``: a tracked breakdown that means the same on CPU and GPU:
parameter, gradient and optimizer-state bytes, and the peak bytes of activations that autograd
keeps for backward (tensors saved by the forward of micro-batches still in flight, parameters
excluded, each storage counted once per micro-batch).
"""
from __future__ import annotations

import contextlib
import contextvars
import resource
import sys

import torch

_current: contextvars.ContextVar = contextvars.ContextVar("hybridpar_activation_meter", default=None)


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


class ActivationMeter:
    def __init__(self, params):
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.state_ptrs: set = set()  # the step's working weights: state, not activations
        self.by_key: dict = {}
        self.live = 0
        self.peak = 0
        self._seen: set | None = None
        self._bytes = 0

    def record(self, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        ptr, nbytes = _storage_key(t)
        if ptr in self.param_ptrs or ptr in self.state_ptrs or ptr in self._seen:
            return
        self._seen.add(ptr)
        self._bytes += nbytes

    @contextlib.contextmanager
    def forward(self, key):
        """Count what the forward of ``key`` = (chunk, mb) saves for its backward."""
        self._seen, self._bytes = set(), 0

        def pack(t):
            self.record(t)
            return t

        token = _current.set(self)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield
        finally:
            _current.reset(token)
        if torch.is_grad_enabled():
            self.by_key[key] = self._bytes
            self.live += self._bytes
            self.peak = max(self.peak, self.live)

    def exclude(self, tensors) -> None:
        """Tensors of this step that are state, not activations (the working weights); they
        replace the previous step's (their storages may since be reused)."""
        self.state_ptrs = {t.untyped_storage().data_ptr() for t in tensors}

    def release(self, key) -> None:
        self.live -= self.by_key.pop(key, 0)

    def reset(self) -> None:
        self.by_key.clear()
        self.live = self.peak = 0


def record_saved(*tensors) -> None:
    """For code that keeps tensors for backward outside autograd's hooks (checkpointing)."""
    meter = _current.get()
    if meter is not None:
        for t in tensors:
            meter.record(t)


def state_bytes(params, grad_buffers, optimizer) -> dict[str, int]:
    def nbytes(ts):
        return sum(t.numel() * t.element_size() for t in ts)

    opt = [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return {"params": nbytes(params), "grads": nbytes(grad_buffers), "optimizer": nbytes(opt)}
