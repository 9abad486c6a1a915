"""The rollout worker's `PolicyFollower` on a real local run root with real committed policies of a tiny model and a
real `RolloutManager` (no step process, no generation): it waits for the first policy (and stops waiting when the
worker stops), moves the sampler to the newest committed policy, never to an older one, and falls back past a
damaged policy, quarantining it, or keeps the one it holds.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from pathlib import Path
from typing import Any

import pytest

from pipeline.config import (
    CurriculumConfig,
    DenseInferenceConfig,
    LessonConfig,
    ModelSpec,
    PollingConfig,
    RolloutStepConfig,
    SamplingParams,
    StoreConfig,
)
from pipeline.environments.tokenizer import load_tokenizer
from pipeline.process.step_kind import StepKind
from pipeline.rollout.follower import PolicyFollower
from pipeline.store import layout
from pipeline.store.notify import waker_for
from pipeline.store.poll import WaitTimeout
from pipeline.store.storage import RunStore
from pipeline.telemetry.metrics import MetricsWriter, read_metrics
from policy.model import build_model, model_template, model_vocab_size
from policy.policy_format import read_policy, write_policy
from policy.rollout_manager import RolloutManager

SPEC = ModelSpec(hidden_dim=32, intermediate_dim=64, num_layers=1, num_heads=2, num_kv_heads=2, max_seq_len=48)
SAMPLING = SamplingParams(n_prompts=2, n_generations_per_prompt=2, max_tokens=8)
CURRICULUM = CurriculumConfig(lessons={"cats": LessonConfig(lesson_id="cats")}, default_sampling=SAMPLING)


def _config(root: Path) -> RolloutStepConfig:
    return RolloutStepConfig(
        store=StoreConfig(run_root=str(root)),
        model=SPEC,
        inference=DenseInferenceConfig(max_seqs=8),
        curriculum=CURRICULUM,
        worker_id="w0",
        polling=PollingConfig(interval_s=0.02),
        wait_for_policy_timeout_s=30.0,
    )


def _follower(store: RunStore, config: RolloutStepConfig, stop: threading.Event, **kw: Any) -> PolicyFollower:
    metrics = MetricsWriter(store, StepKind.ROLLOUT, "w0")
    return PolicyFollower(config, store, stop_event=stop, waker=waker_for(store), metrics=metrics, **kw)


def _damage(root: Path, step: int) -> str:
    """Cut policy `step`'s first weights file short; its path under the run root."""
    weights = sorted(p for p in (root / layout.policy_dir(step)).iterdir() if p.name != "COMMITTED")[0]
    weights.write_bytes(weights.read_bytes()[:100])
    return f"{layout.policy_dir(step)}/{weights.name}"


def test_a_stopped_worker_stops_waiting_for_its_first_policy(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path / "run"))
    stop = threading.Event()
    follower = _follower(store, _config(tmp_path / "run"), stop)
    assert follower.latest_policy() is None and not follower.warm_up()  # no policy, no sampler yet
    stop.set()
    with pytest.raises(WaitTimeout, match="stopped while waiting for the first policy"):
        follower.wait_for_policy()


def test_follower_moves_to_the_newest_intact_policy_never_back(tmp_path: Path, caplog: Any) -> None:
    root = tmp_path / "run"
    store = RunStore(str(root))
    tokenizer = load_tokenizer("builtin:tiny")
    model = build_model(SPEC, model_vocab_size(tokenizer))
    write_policy(store, 0, model)
    loads: list[int] = []

    def load(step: int) -> Any:
        loads.append(step)
        return read_policy(store, step, SPEC, model.Vocab.size)

    manager = RolloutManager(DenseInferenceConfig(max_seqs=8), SPEC, CURRICULUM, tokenizer, model)
    follower = _follower(store, _config(root), threading.Event(), manager=manager, load_model=load)
    try:
        follower.start()
        assert follower.current_step == 0 and follower.policy_step() == 0 and loads == [0]
        assert not follower.sync()  # nothing newer

        write_policy(store, 1, model)
        write_policy(store, 2, model)
        damaged = _damage(root, 2)
        with caplog.at_level(logging.WARNING, logger="pipeline.rollout.follower"):
            assert follower.sync()
        assert follower.current_step == 1 and loads == [0, 2, 1]
        assert store.is_quarantined(damaged) and follower.latest_policy() == 1
        assert "policy 2 is damaged and set aside" in caplog.text and "falling back to policy 1" in caplog.text
        assert follower.noticed_at(2) is not None and follower.weight_load_s > 0

        write_policy(store, 3, model)
        _damage(root, 3)
        assert not follower.sync() and follower.current_step == 1  # only a damaged newer one: keep policy 1
        assert "keeping policy 1" in caplog.text
        assert not follower.sync() and loads == [0, 2, 1, 3]  # a policy set aside is never loaded again
    finally:
        follower.shutdown()
    follower.metrics.flush()
    weights = [r for r in read_metrics(store, "rollout") if r.get("event") == "weights"]
    assert [(w["from_step"], w["policy_step"]) for w in weights] == [(None, 0), (0, 1)]


class _WarmCounter:
    """Stands in for the manager: records the prompts-left bound each warm-up is given."""

    def __init__(self) -> None:
        self.draws: list[float | None] = []

    def warm_up(self, draws_left: float | None = None) -> bool:
        self.draws.append(draws_left)
        return False


def test_warm_up_is_told_how_many_prompts_the_run_has_left(tmp_path: Path) -> None:
    """A following worker's warm-up gets the prompts it may still draw: the rows of the learner steps left after the
    policy it holds, in groups of `n_generations_per_prompt`; no bound before it holds one or when not following."""
    config = _config(tmp_path / "run")
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, num_train_steps=6, batch_size=16))
    store = RunStore(config.store.run_root)
    manager = _WarmCounter()
    follower = _follower(store, config, threading.Event(), manager=manager, load_model=lambda step: None)
    follower.warm_up()
    follower.current_step = 2
    follower.warm_up()
    follower.current_step = 9  # past the end (a run extended, then shortened): nothing left
    follower.warm_up()
    scheduled = _follower(
        store, dataclasses.replace(config, follow=False), threading.Event(), manager=manager, load_model=lambda s: None
    )
    scheduled.current_step = 2
    scheduled.warm_up()
    assert manager.draws == [None, (6 - 2) * 16 / SAMPLING.n_generations_per_prompt, 0.0, None]


def test_policies_are_read_into_one_model_template() -> None:
    """Every policy a worker (or evaluator) loads is read into the same cached template: the model's initialisation is
    traced once per process, not once per policy (`policy.model.model_template`)."""
    vocab = model_vocab_size(load_tokenizer("builtin:tiny"))
    assert model_template(SPEC, vocab) is model_template(SPEC, vocab)
    assert model_template(SPEC, vocab + 1) is not model_template(SPEC, vocab)
