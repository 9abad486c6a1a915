"""RLJobConfig validation: bad configs are refused before any process starts, naming the field."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import draccus
import pytest
from shipped import JOB_CONFIGS, STEP_CONFIGS, without_init_policy

from pipeline.config import (
    ConfigError,
    CurriculumConfig,
    EnvConfig,
    LessonConfig,
    LessonDependency,
    RLJobConfig,
    SamplingParams,
    TrainParams,
)
from pipeline.jobs.job import RLJob
from pipeline.process.exits import Exit
from pipeline.run_contract import RunConfigMismatchError, check_run_config, contract_diff, encode_config
from pipeline.store.storage import RunStore

ROOT = Path(__file__).resolve().parents[1]


def _demo() -> RLJobConfig:
    return draccus.parse(RLJobConfig, config_path=str(ROOT / "configs/test_cats.yaml"), args=[])


def test_shipped_configs_validate() -> None:
    """Every shipped config parses and validates as what it is; a job that starts from another run's policy
    (`model.init_policy`) names the run root of a shipped SFT config."""
    for path, cls in STEP_CONFIGS.items():
        draccus.parse(cls, config_path=str(ROOT / path), args=[])
    for path in JOB_CONFIGS:
        cfg = draccus.parse(RLJobConfig, config_path=str(ROOT / path), args=[])
        RLJob(without_init_policy(cfg))  # raises on any invalid field


def test_lesson_cycle_is_refused_and_printed() -> None:
    lessons = {
        "a": LessonConfig("a", dependencies=[LessonDependency("b")]),
        "b": LessonConfig("b", dependencies=[LessonDependency("c")]),
        "c": LessonConfig("c", dependencies=[LessonDependency("a")]),
    }
    with pytest.raises(ConfigError) as e:
        CurriculumConfig(lessons=lessons)
    assert "dependency cycle" in str(e.value)
    assert "a -> b -> c -> a" in str(e.value)


def test_unknown_dependency_is_refused() -> None:
    with pytest.raises(ConfigError) as e:
        CurriculumConfig(lessons={"a": LessonConfig("a", dependencies=[LessonDependency("nope")])})
    assert e.value.field == "curriculum.lessons.a.dependencies"
    assert e.value.value == "nope"


def test_unknown_environment_class_is_refused() -> None:
    cfg = _demo()
    bad = dataclasses.replace(
        cfg,
        curriculum=dataclasses.replace(
            cfg.curriculum,
            lessons={"cats": LessonConfig("cats", env=EnvConfig("pipeline.environments.cats.NoSuchEnv"))},
        ),
    )
    with pytest.raises(ConfigError) as e:
        RLJob(bad)
    assert e.value.field == "curriculum.lessons.cats.env.env_class"
    assert "NoSuchEnv" in str(e.value)


def test_unfillable_batch_size_is_refused() -> None:
    cfg = _demo()
    small = SamplingParams(n_prompts=1, n_generations_per_prompt=2, max_tokens=8)
    bad = dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, batch_size=512, replay_buffer_capacity=1024, max_lag=0),
        num_rollout_workers=1,
        curriculum=dataclasses.replace(cfg.curriculum, default_sampling=small),
    )
    with pytest.raises(ConfigError) as e:
        RLJob(bad)
    assert e.value.field == "train.batch_size"
    assert e.value.value == 512


def test_groups_of_one_are_refused() -> None:
    cfg = _demo()
    one = SamplingParams(n_prompts=8, n_generations_per_prompt=1, max_tokens=8)
    bad = dataclasses.replace(cfg, curriculum=dataclasses.replace(cfg.curriculum, default_sampling=one))
    with pytest.raises(ConfigError) as e:
        RLJob(bad)
    assert e.value.field.endswith("n_generations_per_prompt")


@pytest.mark.parametrize(
    ("field", "value"), [("max_lag", -1), ("batch_size", 0), ("advantage_estimator", "ppo2"), ("overlong", "cut")]
)
def test_train_params_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as e:
        TrainParams(**{field: value})  # type: ignore[arg-type]
    assert e.value.field == f"train.{field}"
    assert e.value.value == value


def test_run_root_with_a_different_config_is_refused(tmp_path: Path) -> None:
    cfg = dataclasses.replace(_demo(), store=dataclasses.replace(_demo().store, run_root=str(tmp_path)))
    store = RunStore(str(tmp_path))
    check_run_config(store, cfg)  # writes run.json
    check_run_config(store, cfg)  # same contract: accepted
    other = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_lag=3))
    with pytest.raises(RunConfigMismatchError) as e:
        check_run_config(store, other)
    assert "train.max_lag" in str(e.value)
    # Operational knobs are not part of the contract.
    check_run_config(store, dataclasses.replace(cfg, num_rollout_workers=5))


def test_a_field_newer_than_run_json_is_accepted_at_its_default_only(tmp_path: Path) -> None:
    """A run recorded by an rlpipe without a field (its run.json lacks the key) resumes when the field is at its
    default (the run ran with what the default does), and is refused naming the field when it is not."""
    cfg = dataclasses.replace(_demo(), store=dataclasses.replace(_demo().store, run_root=str(tmp_path)))
    store = RunStore(str(tmp_path))
    check_run_config(store, cfg)
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["config"]["curriculum"].pop("skip_after") == 0  # as an older rlpipe wrote it
    (tmp_path / "run.json").write_text(json.dumps(record))
    check_run_config(store, cfg)
    changed = dataclasses.replace(cfg, curriculum=dataclasses.replace(cfg.curriculum, skip_after=3))
    with pytest.raises(RunConfigMismatchError) as e:
        check_run_config(store, changed)
    assert "curriculum.skip_after: run.json has None, given 3" in str(e.value)


def test_contract_diff_names_nested_fields() -> None:
    a = encode_config(_demo())
    b = encode_config(dataclasses.replace(_demo(), optimizer=dataclasses.replace(_demo().optimizer, learning_rate=1.0)))
    diffs = contract_diff(a, b)
    assert len(diffs) == 1 and diffs[0].startswith("optimizer.learning_rate")


def test_cli_refuses_bad_config_before_starting_anything(tmp_path: Path) -> None:
    run_root = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "steps.run",
            "--config_path",
            str(ROOT / "configs/test_cats.yaml"),
            "--run_root",
            str(run_root),
            "--train.max_lag",
            "-1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "max_lag" in (proc.stderr + proc.stdout)
    assert not (run_root / "run.json").exists()


def test_backend_is_a_registered_choice_with_its_own_fields() -> None:
    from pipeline.config import LocalBackendConfig, RayBackendConfig
    from pipeline.jobs.launchers.base import make_launcher
    from pipeline.jobs.launchers.local import LocalLauncher
    from pipeline.jobs.launchers.ray import RayLauncher

    assert isinstance(_demo().backend, LocalBackendConfig)
    assert isinstance(make_launcher(_demo().backend), LocalLauncher)
    args = ["--backend.type", "ray", "--backend.address", "ray://head:10001", "--backend.resources.rollout_gpus", "1"]
    cfg = draccus.parse(RLJobConfig, config_path=str(ROOT / "configs/test_cats.yaml"), args=args)
    assert cfg.backend == RayBackendConfig(address="ray://head:10001", resources=cfg.backend.resources)
    assert cfg.backend.resources.for_kind("rollout") == (1.0, 1.0)
    assert cfg.backend.resources.for_kind("batches") == (0.5, 0.0)
    assert isinstance(make_launcher(cfg.backend), RayLauncher)
    # the YAML spelling round-trips (`backend: {type: ray, ...}`)
    assert draccus.decode(RLJobConfig, draccus.encode(cfg)) == cfg


def test_step_level_cross_field_checks_name_the_field() -> None:
    from pipeline.config import (
        BatchMakerStepConfig,
        DenseInferenceConfig,
        EvaluateStepConfig,
        LearnerStepConfig,
        ModelSpec,
        RolloutStepConfig,
        validate_batch_maker,
        validate_evaluate,
        validate_learner,
        validate_rollout,
    )

    short = LearnerStepConfig(model=ModelSpec(max_seq_len=16), train=TrainParams(seq_len=32))  # built: checked later
    with pytest.raises(ConfigError) as e:
        validate_learner(short)
    assert e.value.field == "train.seq_len"
    long_sampler = DenseInferenceConfig(max_seq_len=512)  # model.max_seq_len is 256
    for validate, step in ((validate_rollout, RolloutStepConfig), (validate_evaluate, EvaluateStepConfig)):
        with pytest.raises(ConfigError) as e:
            validate(step(inference=long_sampler))  # type: ignore[operator]
        assert e.value.field == "inference.max_seq_len" and e.value.value == 512
    with pytest.raises(ConfigError) as e:
        validate_batch_maker(BatchMakerStepConfig(max_batches=0))
    assert e.value.field == "max_batches"
    with pytest.raises(ConfigError) as e:
        validate_batch_maker(BatchMakerStepConfig(train=TrainParams(seq_len=30, pad_multiple=8)))
    assert e.value.field == "train.pad_multiple"
    cfg = _demo()
    with pytest.raises(ConfigError) as e:
        RLJob(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seq_len=30, pad_multiple=8)))
    assert e.value.field == "train.pad_multiple"


def test_restart_backoff_longer_than_its_cap_is_refused() -> None:
    cfg = _demo()
    RLJob(dataclasses.replace(cfg, restart_backoff_s=0.05, restart_backoff_max_s=0.2))
    with pytest.raises(ConfigError) as e:
        RLJob(dataclasses.replace(cfg, restart_backoff_s=2.0, restart_backoff_max_s=1.0))
    assert e.value.field == "restart_backoff_s" and "restart_backoff_max_s=1.0" in str(e.value)


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def test_out_of_range_value_is_one_line_naming_field_and_value(tmp_path: Path) -> None:
    run_root = tmp_path / "run"
    for args in (
        ["-m", "steps.run", "--config_path", "configs/test_cats.yaml", "--run_root", str(run_root)],
        ["-m", "steps.run", "step", "learn", "--config_path", "configs/test_cats.yaml", "--run_root", str(run_root)],
        ["-m", "steps.learn", "--store.run_root", str(run_root)],
    ):
        proc = _cli(*args, "--train.max_lag", "-1")
        assert proc.returncode == Exit.CONFIG, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "train.max_lag=-1" in lines[0], proc.stderr
        assert "Traceback" not in proc.stderr
    assert not run_root.exists()


def test_allowed_config_change_is_recorded_in_run_json_history(tmp_path: Path) -> None:
    cfg = dataclasses.replace(_demo(), store=dataclasses.replace(_demo().store, run_root=str(tmp_path)))
    store = RunStore(str(tmp_path))
    check_run_config(store, cfg)
    fast = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, learning_rate=0.5))
    with pytest.raises(RunConfigMismatchError) as e:
        check_run_config(store, fast)
    assert e.value.field == "optimizer.learning_rate" and e.value.value == 0.5
    assert "0.003" in str(e.value) and "--allow_config_change" in str(e.value)
    check_run_config(store, fast, allow_change=True, by="steps.learn")
    record = json.loads(store.get("run.json"))
    assert record["config"]["optimizer"]["learning_rate"] == 0.5  # the run's contract is now the new value
    (entry,) = record["history"]
    assert entry["by"] == "steps.learn" and entry["time"]
    assert entry["changes"] == [{"field": "optimizer.learning_rate", "from": 0.003, "to": 0.5}]
    check_run_config(store, fast)  # accepted from now on without the flag
    with pytest.raises(RunConfigMismatchError):
        check_run_config(store, cfg)  # and the old value is now the drift


def test_step_config_is_checked_field_by_field_against_run_json(tmp_path: Path) -> None:
    from pipeline.run_contract import check_step_config

    cfg = dataclasses.replace(_demo(), store=dataclasses.replace(_demo().store, run_root=str(tmp_path)))
    store = RunStore(str(tmp_path))
    steps = RLJob(cfg).to_worker_configs()
    check_step_config(store, steps["learner"], by="steps.learn")  # no run.json yet: nothing to compare
    check_run_config(store, cfg)
    for key in ("learner", "batches", "evaluate"):
        check_step_config(store, steps[key], by=key)  # the job's own step configs match (choice types included)
    check_step_config(store, steps["rollout"][0], by="rollout")
    drifted = dataclasses.replace(steps["batches"], train=dataclasses.replace(cfg.train, max_lag=3))
    with pytest.raises(RunConfigMismatchError) as e:
        check_step_config(store, drifted, by="steps.make_batches")
    assert e.value.field == "train.max_lag" and e.value.value == 3


def test_shared_parameter_objects_are_handed_to_the_steps_as_they_are() -> None:
    args = ["--cadence.policy_interval", "2", "--polling.interval_s", "0.5", "--pacing.max_steps_ahead", "3"]
    cfg = draccus.parse(RLJobConfig, config_path=str(ROOT / "configs/test_cats.yaml"), args=args)
    assert (cfg.cadence.policy_interval, cfg.cadence.checkpoint_interval) == (2, 2)  # flag, then the YAML's
    steps = RLJob(cfg).to_worker_configs()
    assert steps["learner"].cadence is cfg.cadence and steps["learner"].polling is cfg.polling
    assert steps["batches"].polling is cfg.polling
    assert all(r.pacing is cfg.pacing and r.polling is cfg.polling for r in steps["rollout"])
    assert steps["evaluate"].polling.interval_s == 1.0  # the evaluator keeps its own pace
    with pytest.raises(ConfigError) as e:
        dataclasses.replace(cfg.cadence, policy_interval=0)
    assert e.value.field == "cadence.policy_interval" and e.value.value == 0


def test_model_shape_flags_with_an_hf_checkpoint_are_refused_by_name() -> None:
    from pipeline.config import ModelSpec

    ModelSpec(hf_checkpoint="/some/hf/folder", max_seq_len=64)  # the context length stays ours
    with pytest.raises(ConfigError) as e:
        ModelSpec(hf_checkpoint="/some/hf/folder", num_layers=8)
    assert e.value.field == "model.num_layers" and e.value.value == 8
    assert "hf_checkpoint" in str(e.value)
