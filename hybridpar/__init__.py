"""hybridpar: hybrid-parallel (dp x tp x pp) training on torch.distributed."""
from .config import Config, ConfigError, load_config, validate

__version__ = "0.1.0"


def _check_main_guard(frame) -> None:
    """Spawned ranks import the launching script: a ``train()`` call at its top level, not
    under ``if __name__ == "__main__":``, would run again in every rank (multiprocessing's
    bootstrapping error, a traceback per rank). Found here, before any process starts."""
    import ast
    import sys

    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if frame.f_globals is not getattr(main, "__dict__", None) or not path or frame.f_code.co_name != "<module>":
        return
    try:
        tree = ast.parse(open(path, encoding="utf-8").read())
    except (OSError, SyntaxError, UnicodeDecodeError):
        return
    line = frame.f_lineno
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) \
                and node.lineno <= line <= (node.end_lineno or node.lineno):
            return
    raise ConfigError(f"{path}:{line} calls hybridpar.train() at the top level of the script; every "
                      f"spawned rank imports the script, so put the call under "
                      f"`if __name__ == \"__main__\":`")


def train(config: Config | None = None, *, model=None):
    """Train with ``config`` (defaults if None), spawning dp*tp*pp local ranks unless already
    inside a torchrun job. ``model``: your own model, as a ``ModelSpec``-returning function
    ``(ModelConfig) -> ModelSpec`` defined at module level, or ``"package.module:attr"``
    (the ranks import it; default: ``config.model``). Returns rank 0's last-step metrics (a
    dict) with ``.history`` (every step's metrics) and ``.checkpoint``."""
    import sys

    _check_main_guard(sys._getframe(1))
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
