"""Which backend class serves which inference config class, and the one factory.

A backend module registers its class for its config class (a registered `pipeline.config.InferenceConfig`
subclass) with `@register_backend(ConfigClass)`; `make_backend(config, ...)` builds the backend registered for
`type(config)` through its `from_config`. Adding a backend is one module here (imported by
`policy/inference/__init__.py`) plus one registered config subclass in `pipeline/config/model.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from pipeline.config import InferenceConfig
from policy.inference.base import BackendBuild, InferenceBackend

B = TypeVar("B", bound=type[InferenceBackend])

_BACKENDS: dict[type[InferenceConfig], type[InferenceBackend]] = {}


def register_backend(config_class: type[InferenceConfig]) -> Callable[[B], B]:
    """Class decorator: the decorated backend serves `config_class` (one backend per config class)."""

    def decorate(backend_class: B) -> B:
        known = _BACKENDS.get(config_class)
        if known is not None and known is not backend_class:
            raise ValueError(f"{config_class.__name__} already served by {known.__name__}")
        _BACKENDS[config_class] = backend_class
        return backend_class

    return decorate


def backend_class(config: InferenceConfig) -> type[InferenceBackend]:
    """The backend class registered for `type(config)`; ValueError naming the config type otherwise."""
    for cls in type(config).__mro__:
        if cls in _BACKENDS:
            return _BACKENDS[cls]
    raise ValueError(
        f"inference type {type(config).__name__}: no backend registered "
        f"(known: {sorted(c.__name__ for c in _BACKENDS)})"
    )


def make_backend(
    config: InferenceConfig,
    model: Any,
    tokenizer: Any,
    max_seq_len: int,
    *,
    compute_dtype: str | None = None,
    fast_compile: bool = False,
) -> InferenceBackend:
    """The backend `config`'s type names, sampling from `model` with sequences of at most `max_seq_len` tokens.

    `compute_dtype=None`: float32 on CPU, bfloat16 on an accelerator (in-process backends). `fast_compile`
    (dense only): lowest XLA optimisation level, about half the CPU compile time and slower execution (tests).
    """
    build = BackendBuild(model, tokenizer, max_seq_len, compute_dtype, fast_compile)
    return backend_class(config).from_config(config, build)
