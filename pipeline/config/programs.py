"""The configs of the programs a person runs against an existing run root (not job steps): `steps.export` and
`steps.replay`. Their flags are documented with the step programs' in the configuration reference."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.config.model import ModelSpec
from pipeline.config.steps import StoreConfig


@dataclass(frozen=True)
class ExportConfig:
    """`python -m steps.export`: write a committed policy as a transformers-loadable folder."""

    store: StoreConfig = field(default_factory=StoreConfig)
    """The run root whose committed policy is exported."""
    model: ModelSpec | None = None
    """The policy's model; None: the model recorded in the run root's run.json."""
    step: int | None = None
    """Policy step to export; None: the newest committed policy."""
    out: str = "hf_export"
    """Output folder (local or fsspec URL)."""
    peft: bool = False
    """Also write the policy's LoRA adapters as a PEFT folder `<out>/peft/` (a run trained with `model.lora`)."""


@dataclass(frozen=True)
class ReplayConfig:
    """`python -m steps.replay`: re-train committed batch slots from a committed checkpoint and compare."""

    store: StoreConfig = field(default_factory=StoreConfig)
    """The run root whose checkpoint, batches and policy are replayed (read only)."""
    from_step: int = 0
    """The committed checkpoint to start from (FROM): slots from_step+1..to_step are re-trained."""
    to_step: int | None = None
    """The committed policy to compare with (TO); None: the newest committed policy."""
    scratch: str | None = None
    """Scratch run root for the replayed policy (local or fsspec URL); None: a new temporary folder."""
    keep_scratch: bool = False
    """Keep the temporary scratch folder replay made (removed at the end by default); a `--scratch` is kept."""
