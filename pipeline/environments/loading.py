"""Building an environment named in config: `load_environment(EnvConfig)` and `import_object(dotted path)`."""

from __future__ import annotations

import importlib
import inspect
from typing import TYPE_CHECKING, Any

from pipeline.environments.base import Environment, EnvironmentLoadError

if TYPE_CHECKING:
    from pipeline.config import EnvConfig


def import_object(path: str) -> Any:
    """Import `package.module.Name`; raise ImportError/AttributeError naming the missing part."""
    module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ImportError(f"{path!r} is not a dotted path like 'package.module.Name'")
    module = importlib.import_module(module_name)
    if not hasattr(module, attr):
        raise AttributeError(f"module {module_name!r} has no attribute {attr!r}")
    return getattr(module, attr)


def load_environment(cfg: EnvConfig) -> Environment:
    """Build the environment `cfg.env_class(**cfg.env_args)`.

    Raises EnvironmentLoadError naming `cfg.env_class` and the cause: unknown module, unknown class,
    not an `Environment` subclass, keyword arguments the constructor does not accept, or any error the
    constructor raised (e.g. a missing data file, named in the message).
    """
    path = cfg.env_class
    module_name, _, cls_name = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise EnvironmentLoadError(path, f"cannot import module {module_name!r}: {type(e).__name__}: {e}") from e
    cls = getattr(module, cls_name, None)
    if cls is None:
        raise EnvironmentLoadError(path, f"module {module_name!r} has no attribute {cls_name!r}")
    if not (inspect.isclass(cls) and issubclass(cls, Environment)):
        raise EnvironmentLoadError(path, f"{cls!r} is not a subclass of pipeline.environments.Environment")
    if inspect.isabstract(cls):
        raise EnvironmentLoadError(path, "class is abstract")
    args = dict(cfg.env_args)
    try:
        inspect.signature(cls).bind(**args)
    except TypeError as e:
        raise EnvironmentLoadError(path, f"bad env_args {sorted(args)}: {e}") from e
    try:
        return cls(**args)
    except Exception as e:
        raise EnvironmentLoadError(path, f"constructor failed: {type(e).__name__}: {e}") from e
