"""hybridpar: hybrid-parallel (dp x tp x pp) training on torch.distributed."""
from .config import Config, ConfigError, load_config, validate

__version__ = "0.1.0"


def train(config: Config | None = None, *, model=None):
    """Train with ``config`` (defaults if None), spawning dp*tp*pp local ranks unless already
    inside a torchrun job. ``model``: your own model, as a ``ModelSpec``-returning function
    ``(ModelConfig) -> ModelSpec`` defined at module level, or ``"package.module:attr"``
    (the ranks import it; default: ``config.model``). Returns rank 0's last-step metrics (a
    dict) with ``.history`` (every step's metrics) and ``.checkpoint``."""
    from .cli.main import check_model, run_train

    config = config or Config()
    if model is not None and not config.model.spec:  # validate as a user model, not as Llama
        import dataclasses
        name = model if isinstance(model, str) else f"{model.__module__}:{model.__qualname__}"             if hasattr(model, "__qualname__") else "user model"
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, spec=name))
    validate(config)
    check_model(config, model)  # one clear error here, not one per spawned rank
    return run_train(config, model=model)


__all__ = ["Config", "ConfigError", "load_config", "validate", "train", "__version__"]
