"""The export step: write a committed policy as a Hugging Face (transformers-loadable) folder.

Reads:  `run.json` (the run's own job config: the model's shape and tokenizer), `policies/step-S/` (committed).
Writes: the output folder (`config.json`, weights, tokenizer files), local or an fsspec URL. A policy trained
        with `model.lora` is exported merged (base + adapters folded into full weights); with `--peft true`,
        `<out>/peft/` also gets the adapters as a PEFT folder (`adapter_config.json`, `adapter_model.safetensors`)
        whose `base_model_name_or_path` is `model.hf_checkpoint`, or else `<out>/peft/base/`, the base weights
        (policy 0) exported as an HF folder.

The model flags need not be retyped: the model section recorded in the run root's run.json is used unless
`--model.*` flags are given (then those win, for a run root without run.json).

Run:
  python -m steps.export --store.run_root runs/demo --step 12 --out /tmp/hf     # policy 12
  python -m steps.export --store.run_root runs/demo --out /tmp/hf               # the newest committed policy
  make export RUN=runs/demo STEP=12 OUT=/tmp/hf
  python -m steps.export --store.run_root runs/lora --out /tmp/hf --peft true   # merged + PEFT adapter folder
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

import draccus

from pipeline.config import ConfigError, ExportConfig, ModelSpec
from pipeline.store import layout, run_state
from pipeline.store.storage import RunStore

logger = logging.getLogger("steps.export")


def main(config: ExportConfig) -> int:
    """Export policy `config.step` (default: the newest) to `config.out`; returns 0."""
    store = RunStore(config.store.run_root, config.store.storage_options or None)
    spec = config.model or recorded_model(store)
    export(store, spec, config.step, config.out, peft=config.peft)
    return 0


def recorded_model(store: RunStore) -> ModelSpec:
    """The model section of the run root's run.json; ConfigError naming `model` when there is none."""
    if not store.exists(layout.RUN_CONFIG):
        raise ConfigError(
            "store.run_root", store.root, f"has no {layout.RUN_CONFIG} to read the model from: give --model.… flags"
        )
    record = json.loads(store.get(layout.RUN_CONFIG))
    try:
        return draccus.decode(ModelSpec, record["config"]["model"])
    except (KeyError, TypeError, draccus.utils.ParsingError) as e:
        raise ConfigError("model", None, f"{store.full_path(layout.RUN_CONFIG)} has no readable model ({e})") from e


def export(store: RunStore, spec: ModelSpec, step: int | None, out: str, *, peft: bool = False) -> str:
    """Write policy `step` (None: the newest committed) of `store` as an HF folder `out`; returns `out`.

    `peft`: also the PEFT adapter folder `<out>/peft/` (ConfigError naming `peft` when the policy has no adapters)."""
    from pipeline.environments.tokenizer import load_tokenizer
    from policy import model as M
    from policy import policy_format as pf

    if step is None:
        step = run_state.latest_policy_step(store)
    if step is None:  # one line, exit 2: there is nothing to export yet
        raise ConfigError("store.run_root", store.url, f"no committed policy to export ({layout.POLICIES}/ holds none)")
    tokenizer = load_tokenizer(spec.tokenizer)
    try:
        model = pf.read_policy(store, step, spec, M.model_vocab_size(tokenizer))
    except pf.PolicyNotFoundError as e:
        raise ConfigError("step", step, f"not a committed policy of {store.url} ({e})") from None
    if peft:  # refused before anything is written
        lora_spec = _policy_lora(store, step)
    pf.export_hf(model, out, tokenizer, family=spec.family)
    if peft:
        export_peft(store, spec, step, lora_spec, f"{out.rstrip('/')}/peft", tokenizer)
    logger.info("exported policy %d to %s", step, out)
    return out


def _policy_lora(store: RunStore, step: int) -> Any:
    from policy import policy_format as pf

    spec = pf.marker_lora(pf.policy_metadata(store, step).extra)
    if spec is None:
        raise ConfigError(
            "peft", True, f"policy {step} of {store.url} has no LoRA adapters (trained without model.lora)"
        )
    return spec


def export_peft(store: RunStore, spec: ModelSpec, step: int, lora_spec: Any, out: str, tokenizer: Any) -> None:
    """The adapters of policy `step` as a PEFT folder `out`; its base is `spec.hf_checkpoint` or, without one,
    policy 0 exported to `<out>/base/`."""
    from policy import model as M
    from policy import policy_format as pf

    vocab = M.model_vocab_size(tokenizer)
    base = pf.read_policy(store, 0, spec, vocab)  # policy 0 is the base: its adapters' B is zero
    loraized = pf.read_policy_adapters(store, step, base)
    base_ref = spec.hf_checkpoint
    if base_ref is None:
        base_ref = f"{out}/base"
        pf.export_hf(base, base_ref, tokenizer, family=spec.family)
    pf.export_peft(loraized, lora_spec, out, base_ref)


def cli(argv: list[str] | None = None) -> int:
    """`python -m steps.export [--config_path F] [--field value …]`; returns the exit code."""
    from steps.cli import run_program

    return run_program(ExportConfig, main, argv)


if __name__ == "__main__":
    sys.exit(cli())
