"""Experiment trackers (levanter's) for the learner's per-step metrics, one builder per registered config class.

A new tracker is one registered `TrackerConfig` subclass (pipeline/config/steps.py) plus one function here:

    @register_tracker(MyTrackerConfig)
    def _my_tracker(config: MyTrackerConfig, run: TrackerRun) -> Tracker: ...

`make_tracker(config, run_root)` returns the levanter tracker (None for `type: none`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pipeline.config import (
    ConfigError,
    JsonTrackerConfig,
    NoTrackerConfig,
    TensorboardTrackerConfig,
    TrackerConfig,
    WandbTrackerConfig,
)
from pipeline.run_state import is_local

Tracker = Any
"""A `levanter.tracker.Tracker`: `log(metrics, step=)`, `finish()`."""
T = TypeVar("T", bound=TrackerConfig)


@dataclass(frozen=True)
class TrackerRun:
    """What every tracker is told about the run: its name and the default local folder for its files."""

    name: str
    """`tracker.name`, else the run root's last path component."""
    default_logdir: str
    """`<run root>/trackers` for a local run root, else ./trackers (absolute)."""


TRACKERS: dict[type[TrackerConfig], Callable[[Any, TrackerRun], Tracker | None]] = {}
"""Config class -> builder (exact class match)."""


def register_tracker(config_class: type[T]) -> Callable[[Callable[[T, TrackerRun], Tracker | None]], Any]:
    """Decorator: the builder of the trackers configured by `config_class`."""

    def register(builder: Callable[[T, TrackerRun], Tracker | None]) -> Callable[[T, TrackerRun], Tracker | None]:
        TRACKERS[config_class] = builder
        return builder

    return register


def tracker_run(config: TrackerConfig, run_root: str) -> TrackerRun:
    """The run's tracker name and default folder (see TrackerRun)."""
    local = run_root.split("://", 1)[-1] if is_local(run_root) else None
    logdir = os.path.join(local, "trackers") if local else os.path.abspath("trackers")
    return TrackerRun(name=config.name or run_root.rstrip("/").rsplit("/", 1)[-1] or "rlpipe", default_logdir=logdir)


def tracker_type(config: TrackerConfig) -> str:
    """The registered name of `config`'s class (`tracker.type`)."""
    return TrackerConfig.get_choice_name(type(config))


def make_tracker(config: TrackerConfig, run_root: str) -> Tracker | None:
    """The levanter tracker `config` asks for (None for 'none'), initialised with the run's name.

    Raises ConfigError naming `tracker.type` when no builder is registered or the tracker's package is missing.
    """
    try:
        builder = TRACKERS[type(config)]
    except KeyError:
        raise ConfigError("tracker.type", type(config).__name__, "has no registered tracker builder") from None
    try:
        return builder(config, tracker_run(config, run_root))
    except ImportError as e:
        raise ConfigError("tracker.type", tracker_type(config), f"needs a package that is not installed ({e})") from e


@register_tracker(NoTrackerConfig)
def _no_tracker(config: NoTrackerConfig, run: TrackerRun) -> None:
    return None


@register_tracker(JsonTrackerConfig)
def _json_tracker(config: JsonTrackerConfig, run: TrackerRun) -> Tracker:
    from levanter.tracker.json_logger import JsonLoggerConfig

    return JsonLoggerConfig().init(run.name)


@register_tracker(TensorboardTrackerConfig)
def _tensorboard_tracker(config: TensorboardTrackerConfig, run: TrackerRun) -> Tracker:
    import tensorboardX  # noqa: F401  (levanter imports it only inside init: fail here, by name)
    from levanter.tracker.tensorboard import TensorboardConfig

    logdir = config.logdir or run.default_logdir
    os.makedirs(logdir, exist_ok=True)
    return TensorboardConfig(logdir=logdir).init(run.name)


@register_tracker(WandbTrackerConfig)
def _wandb_tracker(config: WandbTrackerConfig, run: TrackerRun) -> Tracker:
    import wandb  # noqa: F401
    from levanter.tracker.wandb import WandbConfig

    logdir = config.logdir or run.default_logdir
    os.makedirs(logdir, exist_ok=True)
    if config.logdir or "WANDB_DIR" not in os.environ:  # an explicit logdir wins over the environment
        os.environ["WANDB_DIR"] = logdir
    os.environ.setdefault("WANDB_SILENT", "true")
    return WandbConfig(project=config.project, name=run.name, mode=config.mode, save_code=False).init(run.name)
