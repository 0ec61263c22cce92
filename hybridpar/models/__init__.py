"""Models described to the engine by a ``ModelSpec`` (``spec.py``): the built-in ``llama``,
``vit``, ``resnet`` and ``unet``, or the user's own through ``model.spec = "package.module:attr"``."""
from __future__ import annotations

import importlib
import os
import sys

from ..config import ConfigError, ModelConfig
from .spec import CROSS_ENTROPY, ModelSpec

__all__ = ["ModelSpec", "CROSS_ENTROPY", "spec_for", "resolve"]


def resolve(obj, m: ModelConfig) -> ModelSpec:
    """A ModelSpec from a spec, a function ``(ModelConfig) -> ModelSpec`` or an import path
    ``"package.module:attr"`` naming either."""
    if isinstance(obj, str):
        module, _, attr = obj.partition(":")
        if not module or not attr:
            raise ConfigError(f"model.spec={obj!r} must be 'package.module:attr'")
        if os.getcwd() not in sys.path:  # as `python -m` would: the user's package beside them
            sys.path.insert(0, os.getcwd())
        try:
            obj = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"model.spec={obj!r} cannot be loaded: {e}") from None
    if callable(obj) and not isinstance(obj, ModelSpec):
        obj = obj(m)
    if not isinstance(obj, ModelSpec):
        raise ConfigError(f"model.spec gave a {type(obj).__name__}, not a hybridpar ModelSpec")
    return obj


def spec_for(m: ModelConfig) -> ModelSpec:
    """The spec of the model ``m`` names: ``m.spec`` if set, else the built-in ``m.name``."""
    if m.spec:
        return resolve(m.spec, m)
    if m.name == "vit":
        from .vit import vit_spec
        return vit_spec(m)
    if m.name == "resnet":
        from .resnet import resnet_spec
        return resnet_spec(m)
    if m.name == "unet":
        from .unet import unet_spec
        return unet_spec(m)
    from .llama import llama_spec
    return llama_spec(m)
