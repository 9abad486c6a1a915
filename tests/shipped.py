"""The shipped configs under configs/, by what they configure: whole jobs, or one step program."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import draccus

from pipeline.config import RLJobConfig
from pipeline.config.rescore import RescoreStepConfig
from pipeline.config.sft import SFTStepConfig

ROOT = Path(__file__).resolve().parents[1]

STEP_CONFIGS: dict[str, type] = {
    "configs/basic_arithmetic_sft.yaml": SFTStepConfig,
    "configs/judge_rescore.yaml": RescoreStepConfig,
    "configs/prime_factorization_sft.yaml": SFTStepConfig,
    "configs/tool_calculator_sft.yaml": SFTStepConfig,
}
"""Shipped configs of a single step program, by the config class they parse as."""

JOB_CONFIGS = sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "configs").glob("*.yaml") if str(p.relative_to(ROOT)) not in STEP_CONFIGS
)
"""Every other shipped config: a whole job (`RLJobConfig`)."""


def sft_run_roots() -> set[str]:
    """The run roots the shipped SFT configs write: what a shipped job's `model.init_policy` may name."""
    roots = set()
    for path, cls in STEP_CONFIGS.items():
        if cls is SFTStepConfig:
            roots.add(draccus.parse(SFTStepConfig, config_path=str(ROOT / path), args=[]).store.run_root)
    return roots


def without_init_policy(cfg: RLJobConfig) -> RLJobConfig:
    """`cfg` with its `model.init_policy` cleared once it names a shipped SFT run (that run's policy exists only after
    its config has run, and its existence is checked at job start)."""
    if not cfg.model.init_policy:
        return cfg
    assert cfg.model.init_policy in sft_run_roots(), f"init_policy {cfg.model.init_policy!r} names no shipped SFT run"
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init_policy=None))
