"""Re-scoring committed rollout files with a new scorer into new files, the old files untouched: the loop of
`python -m steps.rescore` (JAX-free).

Reads   run.json (the tokenizer), rollouts/step-P/*.parquet committed by their ready markers (verified reads)
Writes  rescored/<name>/step-P/<worker>-<seq>.parquet + its ready marker, one per source file

Each new file holds the source file's rows (same `rollout_id`s, tokens and logprobs) with `response_text` filled
(decoded from `response_tokens` with the run's tokenizer for rows written before schema version 3),
`reward_components` = the row's old components (or its old reward as `original` when it had none) plus the
scorer's value under the scorer's name, `episode_reward` = `base_weight` × old reward + `weight` × score and the
per-token reward on the last policy token. Rows the scorer failed are left out and listed with their reasons in
the ready marker. Lineage: the ready marker names `source_file` and `source_sha256` (the source's committed
digest), the scorer (`scorer`, without secrets) and `base_weight`. Source files are only read.

Exactly once: a source file whose rescored file is committed is skipped (`pending_files`); a run killed between
writing a data file and its marker rewrites that file on the next run (the commit protocol of `pipeline.store`), so
rerunning never duplicates a file.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from pipeline.config import RescoreStepConfig
from pipeline.environments.base import token_rewards_for
from pipeline.scoring import Scorer, ScoreRequest
from pipeline.store import layout
from pipeline.store.storage import RunStore
from schemas import ROLLOUT

logger = logging.getLogger("rlpipe.rescore")

SECRET_FIELDS = ("api_key",)
ORIGINAL = "original"
"""The component name a row's old reward is kept under when the row had no components."""


def run_decoder(store: RunStore, spec: str | None) -> Callable[[list[int]], str]:
    """Token ids -> text, cut at the first EOS, special tokens skipped (`spec` or run.json's tokenizer)."""
    from pipeline.environments.tokenizer import load_tokenizer
    from pipeline.store.run_state import read_run_record

    if spec is None:
        spec = str(read_run_record(store)["config"].get("model", {}).get("tokenizer", "builtin:tiny"))
    tok = load_tokenizer(spec)
    eos = tok.eos_token_id

    def decode(ids: list[int]) -> str:
        cut = [int(t) for t in ids]
        if eos is not None and int(eos) in cut:
            cut = cut[: cut.index(int(eos))]
        return str(tok.decode(cut, skip_special_tokens=True))

    return decode


def source_files(store: RunStore, steps: list[int] | None) -> list[str]:
    """The committed rollout files of `steps` (None: all), in path order."""
    wanted = None if steps is None else set(steps)
    out: list[str] = []
    for folder in store.list(layout.ROLLOUTS):
        try:
            step = layout.parse_step(folder)
        except ValueError:
            continue
        if wanted is None or step in wanted:
            out += store.list_committed(folder)
    return sorted(out)


def pending_files(store: RunStore, cfg: RescoreStepConfig) -> list[str]:
    """The selected committed rollout files whose rescored file under `cfg.name` is not committed yet, at most
    `cfg.max_files` of them."""
    todo = [
        f
        for f in source_files(store, cfg.steps)
        if not store.exists(layout.ready_marker(layout.rescored_file(cfg.name, f)))
    ]
    return todo if cfg.max_files is None else todo[: cfg.max_files]


def rescore_rows(
    rows: list[dict[str, Any]], outcomes: list[Any], name: str, weight: float, base_weight: float
) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """(new rows, failures) of scored `rows` (see the module docstring)."""
    new: list[dict[str, Any]] = []
    failures: list[dict[str, str]] = []
    for row, o in zip(rows, outcomes, strict=True):
        if not o.ok:
            failures.append({"rollout_id": row["rollout_id"], "reason": str(o.reason)})
            continue
        old = float(row["episode_reward"])
        comps = dict(row["reward_components"] or []) or {ORIGINAL: old}
        comps[name] = float(o.value)
        reward = base_weight * old + weight * float(o.value)
        new.append(
            {
                **row,
                "reward_components": comps,
                "episode_reward": reward,
                "token_rewards": token_rewards_for(len(row["response_tokens"]), reward, row["response_loss_mask"]),
            }
        )
    return new, failures


def rescore_file(
    store: RunStore,
    cfg: RescoreStepConfig,
    src: str,
    decode: Callable[[list[int]], str],
    scorer: Scorer,
    *,
    name: str,
    weight: float,
) -> int | None:
    """Re-score committed rollout file `src` with `scorer` (component `name`, weighted `weight`) into
    `rescored/<cfg.name>/` and commit it; the number of rows the scorer failed, or None when nothing was committed
    (`src` is quarantined, or its rescored file was committed meanwhile)."""
    table = store.read_committed(src, ROLLOUT)
    if table is None:
        logger.warning("rescore %s: %s is quarantined; skipped", cfg.name, src)
        return None
    rows = table.to_pylist()
    for r in rows:  # rows written before schema version 3 carry no text: decode their tokens once
        if not r["response_text"]:
            r["response_text"] = decode(r["response_tokens"])
    requests = [
        ScoreRequest(
            prompt=decode(r["prompt_tokens"]),
            response=r["response_text"],
            example_id=r["example_id"],
            ground_truth=r["ground_truth"],
        )
        for r in rows
    ]
    new, failures = rescore_rows(rows, scorer.score_batch(requests), name, weight, cfg.base_weight)
    rel = layout.rescored_file(cfg.name, src)
    extra = {
        "source_file": src,
        "source_sha256": store.read_marker(src).sha256,
        "rescore_name": cfg.name,
        "scorer": {k: v for k, v in cfg.scorer.items() if k not in SECRET_FIELDS},
        "base_weight": cfg.base_weight,
        "n_failures": len(failures),
        "failures": failures[:200],
    }
    out = pa.Table.from_pylist(new, schema=ROLLOUT.schema) if new else ROLLOUT.schema.empty_table()
    if not store.commit_data(rel, out, ROLLOUT, extra=extra):
        return None
    logger.info("rescore %s: %s -> %s (%d rows, %d failed)", cfg.name, src, rel, len(new), len(failures))
    return len(failures)
