"""The configs of the programs a person runs against an existing run root (not job steps): `steps.export`,
`steps.replay` and `steps.serve`. Their flags are documented with the step programs' in the configuration reference."""

from __future__ import annotations

import os
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


SERVE_TOKEN_ENV = "RLPIPE_ENDPOINT_TOKEN"
"""The environment variable `steps.serve` reads its bearer token from by default (`ServeConfig.token_env`)."""


@dataclass(frozen=True)
class ServeConfig:
    """`python -m steps.serve`: serve one committed policy of a run root over rlpipe's generate endpoint."""

    run_root: str = ""
    """The run root whose committed policy is served (required)."""
    policy_step: int | None = None
    """The policy to serve; None: the newest committed one."""
    host: str = "127.0.0.1"
    """The address to bind; one that is not loopback needs a bearer token (`token` or `token_env`)."""
    port: int = 8000
    """The port to bind; 0: a port the kernel picks (logged, and announced)."""
    announce_file: str | None = None
    """Write the bound `{"host", "port", "pid"}` here once serving; None: the file named by $RLPIPE_SERVER_ANNOUNCE,
    if set."""
    reuse_port: bool = False
    """Bind `port` with SO_REUSEPORT (a port reserved for it by the program that starts serve)."""
    token: str | None = None
    """Bearer token every request must carry; None: the value of the environment variable `token_env`, if set."""
    token_env: str = SERVE_TOKEN_ENV
    """Environment variable holding the token (read when `token` is not given)."""
    model_name: str = "policy"
    """The model id /v1/models lists."""
    max_seqs: int = 16
    """Most sequences the dense sampler decodes at once."""
    wait_s: float = 3600.0
    """How long to wait for run.json and the policy (seconds)."""

    def bearer_token(self) -> str | None:
        """The token every request must carry: `token`, else the environment variable `token_env`; None: none."""
        return self.token or os.environ.get(self.token_env) or None
