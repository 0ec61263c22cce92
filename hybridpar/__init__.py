"""hybridpar: hybrid-parallel (dp x tp x pp) training on torch.distributed."""
from .config import Config, ConfigError, load_config, validate
# Load the submodule hybridpar.train now: its first import would otherwise set the package
# attribute ``train`` to the module, hiding the function below (e.g. after one in-process run).
from . import train as _train_module  # noqa: E402,F401

__version__ = "0.1.0"


def train(config: Config | None = None) -> dict | None:
    """Train with ``config`` (defaults if None), spawning dp*tp*pp local ranks unless already
    inside a torchrun job; returns rank 0's last-step metrics."""
    from .cli import run_train

    config = config or Config()
    validate(config)
    return run_train(config)


__all__ = ["Config", "ConfigError", "load_config", "validate", "train", "__version__"]
