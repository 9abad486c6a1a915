"""reasoning-gym lessons (pipeline.environments.reasoning_gym_env): rewards are the library's own scores of the same
answers, train and eval seeds are disjoint, difficulty levels and mixes, and bad configs refused at start."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import reasoning_gym
import yaml
from reasoning_gym.factory import create_curriculum
from reasoning_gym.utils import extract_answer

from pipeline.config import ConfigError
from pipeline.config.curriculum import CurriculumConfig, EnvConfig, LessonConfig
from pipeline.curriculum import fold_prompts, initial_state
from pipeline.environments import reasoning_gym_env
from pipeline.environments.base import PromptSkip, SampleSpec, draw_skipping
from pipeline.environments.reasoning_gym_env import ReasoningGymEnv, extract, extract_strict
from pipeline.environments.scripted import ScriptedContext
from pipeline.environments.time_limit import TimeLimitExceeded, run_with_time_limit
from pipeline.environments.tokenizer import build_tiny_tokenizer
from pipeline.process.exits import Exit

ROOT = Path(__file__).resolve().parents[1]


def _library_entry(task: str, config: dict, example_id: str) -> tuple[dict, object]:
    """The entry the library itself makes for an example id `<task>-<item seed>` (the documented rule)."""
    name, _, seed = example_id.rpartition("-")
    assert name == task
    ds = reasoning_gym.create_dataset(task, seed=int(seed), size=1, **config)
    return ds[0], ds


def _answers(entry: dict) -> list[str]:
    """A right answer, a wrong one, a partly right one (the oracle inside more text) and unparsable ones."""
    right = str(entry["answer"])
    return [
        f"thinking...\n<answer>{right}</answer>",
        "<answer>certainly not this</answer>",
        f"<answer>{right} or maybe 12345</answer>",
        f"{right} (no tags)",
        "",
    ]


@pytest.mark.parametrize(
    ("task", "config"),
    [("chain_sum", {}), ("leg_counting", {}), ("basic_arithmetic", {}), ("word_sorting", {}), ("simple_equations", {})],
)
def test_rewards_equal_the_library_scorer(task: str, config: dict) -> None:
    env = ReasoningGymEnv(task, config, n_eval=8)
    examples = env.examples(4, np.random.default_rng(0), "train") + env.examples(2, np.random.default_rng(0), "eval")
    seen = set()
    for ex in examples:
        entry, ds = _library_entry(task, config, ex.example_id)
        assert ex.prompt == entry["question"]
        for text in _answers(entry):
            got = env.score(ex, text)
            want = ds.score_answer(extract_answer(text), entry)  # type: ignore[attr-defined]
            assert got.reward == pytest.approx(want), (task, text)
            assert got.success == (want >= 1.0)
            assert got.ground_truth == str(entry["answer"])
            assert got.extracted_answer == extract_answer(text)
            seen.add(round(want, 6))
    assert 1.0 in seen and 0.0 in seen  # right and wrong both occurred


def test_sample_fills_text_answer_and_ground_truth_on_rollouts() -> None:
    tok = build_tiny_tokenizer()
    env = ReasoningGymEnv("chain_sum", answer_format="first_line", n_eval=4)
    # answers the right sum for even item seeds, a wrong one for odd ones
    spec = SampleSpec(6, 2, 1.0, 16, None, "train")
    exs = env.examples(6, np.random.default_rng(3), "train")
    truth = {ex.prompt: str(ex.target[0]["answer"]) for ex in exs}

    def answer(prompt: str) -> str:
        q = next(q for q in truth if q and q in prompt)
        return truth[q] if sum(map(ord, q)) % 2 == 0 else truth[q] + "1"

    res = env.sample(ScriptedContext(tok, answer), spec, np.random.default_rng(3))
    assert not res.failures and len(res.groups) == 6
    rewards = []
    for g in res.groups:
        for r in g.rollouts:
            entry, ds = _library_entry("chain_sum", {}, r.example_id)
            assert r.ground_truth == str(entry["answer"])
            assert r.extracted_answer == r.response_text.strip()
            assert r.episode_reward == pytest.approx(ds.score_answer(r.extracted_answer, entry))  # type: ignore[attr-defined]
            rewards.append(r.episode_reward)
    assert 0.0 <= min(rewards) < 1.0 and max(rewards) == 1.0


def test_strict_format_scores_only_a_response_that_is_the_answer_alone() -> None:
    """A policy that stops ending its response after `</answer>` (it writes on until `max_tokens`) must not be paid
    for the answer inside: with `strict_format` such text scores 0 as a parse failure, the exact format the library's
    score, and without it the library's convention (last tag) is kept."""
    cfg = {"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 1, "operators": ["+"]}
    strict = ReasoningGymEnv("basic_arithmetic", cfg, n_eval=4, strict_format=True)
    loose = ReasoningGymEnv("basic_arithmetic", cfg, n_eval=4)
    (ex,) = strict.examples(1, np.random.default_rng(0), "eval")
    entry, ds = _library_entry("basic_arithmetic", cfg, ex.example_id)
    right = str(entry["answer"])
    for text in (f"<answer>{right}</answer>", f" <answer> {right} </answer>\n"):
        got = strict.score(ex, text)
        assert got.extracted_answer == right and got.reward == ds.score_answer(right, entry) == 1.0  # type: ignore[attr-defined]
    extra = (
        f"<answer>{right}</answer>7</",
        f"so <answer>{right}</answer>",
        f"<answer>1</answer><answer>{right}</answer>",
    )
    for text in extra:
        got = strict.score(ex, text)
        assert (got.reward, got.success, got.extracted_answer, got.info["parse_failure"]) == (0.0, False, None, 1.0)
        assert loose.score(ex, text).reward == ds.score_answer(extract_answer(text), entry)  # type: ignore[attr-defined]
    assert extract_strict("\\boxed{3}", "boxed") == "3" and extract_strict("so \\boxed{3}", "boxed") is None
    assert extract_strict("12", "last_number") == "12" and extract_strict("1 2", "last_number") is None
    assert extract_strict("a\nb", "first_line") is None


def test_train_and_eval_item_seeds_are_disjoint_and_eval_is_fixed() -> None:
    env = ReasoningGymEnv("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}, n_eval=64)
    eval_ids = [ex.example_id for ex in env.examples(64, np.random.default_rng(1), "eval")]
    assert eval_ids == [ex.example_id for ex in env.examples(64, np.random.default_rng(99), "eval")]
    eval_seeds = {int(i.rsplit("-", 1)[1]) for i in eval_ids}
    assert eval_seeds == set(range(0, 64))
    train = env.examples(300, np.random.default_rng(2), "train")
    train_seeds = {int(ex.example_id.rsplit("-", 1)[1]) for ex in train}
    assert not train_seeds & eval_seeds
    assert min(train_seeds) >= 64
    # the problem space is small (2 one-digit terms): seed-disjoint examples would repeat eval questions; with
    # dedupe_eval (the default) no train question is an eval question
    eval_questions = {ex.prompt for ex in env.examples(64, np.random.default_rng(1), "eval")}
    assert not {ex.prompt for ex in train} & eval_questions
    loose = ReasoningGymEnv(
        "chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}, n_eval=64, dedupe_eval=False
    )
    assert {ex.prompt for ex in loose.examples(300, np.random.default_rng(2), "train")} & eval_questions


HANGING_NUMBER_SEQUENCE = 1012332337
"""An item seed for which reasoning-gym's number_sequence squares its terms until they have billions of digits (a
rollout worker hung on it for good in a run of the basic_arithmetic recipe's sizes on number_sequence)."""


@pytest.mark.timeout(120, method="thread")  # never returns without the limit; a signal-method timer would turn it off
def test_an_item_whose_generator_never_ends_fails_that_example_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reasoning_gym_env, "ITEM_TIME_LIMIT_S", 0.5)  # the default, when item_time_limit_s is unset
    env = ReasoningGymEnv("number_sequence", {}, seed=HANGING_NUMBER_SEQUENCE, n_eval=2, dedupe_eval=False)
    handler = signal.getsignal(signal.SIGALRM)
    t0 = time.monotonic()
    hung, fine = env.examples(2, np.random.default_rng(0), "eval")
    assert time.monotonic() - t0 < 10
    assert hung.prompt is None and hung.example_id == f"number_sequence-{HANGING_NUMBER_SEQUENCE}"
    assert hung.error and "took over 0.5 s" in hung.error and str(HANGING_NUMBER_SEQUENCE) in hung.error
    assert fine.prompt and fine.error is None  # the next seed's item is made as usual
    assert signal.getsignal(signal.SIGALRM) is handler and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    set_here = ReasoningGymEnv(
        "number_sequence", {}, seed=HANGING_NUMBER_SEQUENCE, n_eval=1, dedupe_eval=False, item_time_limit_s=0.25
    )
    (hung,) = set_here.examples(1, np.random.default_rng(0), "eval")
    assert hung.error and "took over 0.25 s (item_time_limit_s)" in hung.error


@pytest.mark.timeout(120, method="thread")  # `make test`'s --timeout sets an interval timer, which turns the limit off
def test_the_time_limit_interrupts_on_the_main_thread_only_and_never_over_another_timer() -> None:
    def spin() -> str:
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            pass
        return "done"

    with pytest.raises(TimeLimitExceeded, match=r"after 0\.1 s"):
        run_with_time_limit(spin, 0.1)
    assert run_with_time_limit(lambda: 7, 0.1) == 7 and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    out: list[str] = []
    thread = threading.Thread(target=lambda: out.append(run_with_time_limit(spin, 0.1)))
    thread.start()
    thread.join()
    assert out == ["done"]  # SIGALRM reaches the main thread only: elsewhere the call runs unlimited
    previous = signal.signal(signal.SIGALRM, lambda *_: None)
    signal.setitimer(signal.ITIMER_REAL, 30.0)  # somebody else's timer (math-verify's) is left alone
    try:
        assert run_with_time_limit(spin, 0.1) == "done" and signal.getitimer(signal.ITIMER_REAL)[0] > 25
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0.0)
        signal.signal(signal.SIGALRM, previous)


def test_levels_follow_the_library_curriculum() -> None:
    cur = create_curriculum("chain_sum")
    cur.set_global_level(3)
    want = cur.generate_configuration({})
    env = ReasoningGymEnv("chain_sum", level=3, config={"allow_negation": True})
    got = env.specs[0].config
    assert got["max_terms"] == want.max_terms and got["max_digits"] == want.max_digits
    assert got["allow_negation"] is True  # config wins over the level
    one = ReasoningGymEnv("chain_sum", levels={"num_digits": 2})
    assert one.specs[0].config["max_digits"] == cur.attributes["num_digits"].levels[2]
    assert one.specs[0].config["max_terms"] == cur.attributes["num_terms"].levels[0]


def test_mix_draws_each_task_by_weight_and_scores_with_its_own_scorer() -> None:
    tasks = [{"task": "chain_sum", "weight": 3}, {"task": "leg_counting", "weight": 1, "level": 1}]
    env = ReasoningGymEnv(tasks=tasks, n_eval=8)
    exs = env.examples(400, np.random.default_rng(0), "train")
    names = [ex.example_id.rsplit("-", 1)[0] for ex in exs]
    share = names.count("chain_sum") / len(names)
    assert 0.65 < share < 0.85, share
    for ex in exs[:20]:
        task = ex.example_id.rsplit("-", 1)[0]
        entry, ds = _library_entry(task, env.specs[[s.task for s in env.specs].index(task)].config, ex.example_id)
        assert ex.prompt == entry["question"]
        text = f"<answer>{entry['answer']}</answer>"
        assert env.score(ex, text).reward == pytest.approx(ds.score_answer(extract_answer(text), entry))  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("text", "fmt", "want"),
    [
        ("so <answer> 12 </answer> and <answer>13</answer>", "tag", "13"),
        ("no tags", "tag", None),
        ("x = \\boxed{\\frac{1}{2}} done", "boxed", "\\frac{1}{2}"),
        ("first 3, then -1,250.5 apples", "last_number", "-1250.5"),
        ("\n  42 \nmore", "first_line", "42"),
        ("   ", "full", None),
    ],
)
def test_answer_extraction_conventions(text: str, fmt: str, want: str | None) -> None:
    assert extract(text, fmt) == want


def test_a_finite_training_pool_makes_prompts_recur_so_skip_records_fire() -> None:
    cfg = {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2}
    env = ReasoningGymEnv("chain_sum", cfg, n_eval=16, n_train_items=8)
    assert env.train_seed_range() == range(16, 24)
    drawn = [ex.example_id for ex in env.examples(64, np.random.default_rng(2), "train")]
    assert {int(i.rsplit("-", 1)[1]) for i in drawn} == set(range(16, 24))  # every pool item, no eval seed
    # without a pool the same draws practically never repeat a prompt, so no record could reach skip_after
    free = ReasoningGymEnv("chain_sum", cfg, n_eval=16)
    assert len({ex.example_id for ex in free.examples(64, np.random.default_rng(2), "train")}) == 64
    # the pool's prompts get records: four of them hopeless twice in a row are passed over by the next draws
    lesson = LessonConfig("rg", env=EnvConfig("reasoning_gym", {"task": "chain_sum", "n_train_items": 8}))
    state = initial_state(CurriculumConfig(lessons={"rg": lesson}, skip_after=2, retest_rate=0.0))
    hopeless = sorted(set(drawn))[:4]
    for slot in (1, 2):
        state = fold_prompts(state, "rg", [(i, 0.0) for i in hopeless], slot)
    skip = PromptSkip(state.skipped_prompts("rg"), 0.0)
    assert skip.example_ids == set(hopeless)
    rng = np.random.default_rng(3)
    got, m = draw_skipping(lambda k: env.examples(k, rng, "train"), 32, rng, skip, lambda e: e.example_id)
    # half the pool is skipped: without skipping ~16 of 32 draws would be theirs; only the fill of the last round is
    again = sum(e.example_id in skip.example_ids for e in got)
    assert len(got) == 32 and again == m["n_retested_prompts"] <= 4 and m["n_skipped_prompts"] >= 16, (again, m)


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"task": "chain_sums"}, "task"),
        ({"task": "chain_sum", "config": {"bogus": 1}}, "config.bogus"),
        ({"task": "chain_sum", "config": {"min_terms": 5, "max_terms": 2}}, "config"),
        ({"task": "chain_sum", "level": 99}, "level"),
        ({"task": "chain_sum", "levels": {"nope": 1}}, "levels"),
        ({"tasks": [{"task": "chain_sum"}, {"task": "leg_counting", "weight": 0}]}, "tasks[1].weight"),
        ({"tasks": [{"task": "chain_sum", "cfg": {}}]}, "tasks[0]"),
        ({"task": "chain_sum", "answer_format": "xml"}, "answer_format"),
        ({"task": "chain_sum", "strict_format": "yes"}, "strict_format"),
        ({"task": "chain_sum", "n_train_items": 0}, "n_train_items"),
        ({"task": "chain_sum", "n_train_items": 2.5}, "n_train_items"),
        ({"task": "chain_sum", "item_time_limit_s": 0}, "item_time_limit_s"),
        ({"task": "chain_sum", "item_time_limit_s": "10"}, "item_time_limit_s"),
        ({}, "task"),
    ],
)
def test_bad_args_are_config_errors_naming_the_argument(args: dict, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        ReasoningGymEnv.check_args(args)
    assert e.value.field == field


def test_short_name_and_unknown_task_is_one_line_exit_2(tmp_path: Path) -> None:
    assert EnvConfig("reasoning_gym").env_class == "pipeline.environments.reasoning_gym_env.ReasoningGymEnv"
    cfg = yaml.safe_load((ROOT / "configs/test_cats.yaml").read_text())
    cfg["store"]["run_root"] = str(tmp_path / "run")
    cfg["curriculum"]["lessons"]["cats"]["env"] = {"env_class": "reasoning_gym", "env_args": {"task": "chain_sums"}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run(
        [sys.executable, "-m", "steps.run", "--config_path", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == Exit.CONFIG, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "curriculum.lessons.cats.env.env_args.task='chain_sums'" in lines[0], proc.stderr
    assert not (tmp_path / "run").exists()


def test_an_assertion_without_a_message_names_the_field_and_its_source_line() -> None:
    """reasoning-gym's `assert self.max_complexity >= 1` has no message: the refusal still names the config key
    (the one the assertion's source line mentions) and quotes the line."""
    with pytest.raises(ConfigError) as e:
        ReasoningGymEnv.check_args({"task": "number_sequence", "config": {"max_complexity": 0}})
    assert e.value.field == "config.max_complexity" and e.value.value == 0
    assert "AssertionError at number_sequences.py:" in str(e.value) and "max_complexity >= 1" in str(e.value)
    with pytest.raises(ConfigError) as e:  # a line naming two given keys: the keys given are listed
        ReasoningGymEnv.check_args({"tasks": [{"task": "chain_sum", "config": {"min_terms": 5, "max_terms": 2}}]})
    assert e.value.field == "tasks[0].config" and "config keys given: ['max_terms', 'min_terms']" in str(e.value)


def test_a_lesson_whose_reference_answers_cannot_be_produced_is_refused_at_start(tmp_path: Path) -> None:
    """On the examples the prompt check draws, each reference answer is rendered in the lesson's format
    (`<answer>N</answer>` under `strict_format`) and must fit `max_tokens` and score full reward: answers longer than
    `max_tokens` refuse the lesson naming the max_tokens field, a format that extracts nothing from the answer (a
    word answer read as `last_number`) names the lesson's env_args; a lesson that can be answered passes."""
    from pipeline.config import CurriculumConfig, LessonConfig, ModelSpec, RolloutStepConfig, SamplingParams
    from pipeline.environments.start_checks import check_lessons

    def worker(env_args: dict, max_tokens: int) -> RolloutStepConfig:
        lesson = LessonConfig("rg", env=EnvConfig("reasoning_gym", {"n_eval": 4, **env_args}))
        cur = CurriculumConfig(lessons={"rg": lesson}, default_sampling=SamplingParams(max_tokens=max_tokens))
        return RolloutStepConfig(model=ModelSpec(max_seq_len=256), curriculum=cur)

    tok = build_tiny_tokenizer()
    sums = {"task": "chain_sum", "config": {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2}}
    strict = {**sums, "strict_format": True}
    check_lessons(worker(strict, 12), tok)  # `<answer>`, a sign and 1-3 digits, `</answer>`: 8 to 11 tokens
    with pytest.raises(ConfigError) as e:
        check_lessons(worker(strict, 7), tok)
    assert e.value.field == "curriculum.default_sampling.max_tokens" and e.value.value == 7
    assert "lesson 'rg': none of the 16 reference answers drawn can be produced" in str(e.value)
    assert re.search(r"the reference answer '<answer>-?\d+</answer>' has \d+ tokens > max_tokens=7", str(e.value))
    with pytest.raises(ConfigError) as e:
        check_lessons(worker({"task": "spell_backward", "answer_format": "last_number"}, 32), tok)
    assert e.value.field == "curriculum.lessons.rg.env.env_args"
    assert "extracts no answer and scores 0 under the lesson's own scorer" in str(e.value)
