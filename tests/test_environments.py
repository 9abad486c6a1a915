"""Environments: scoring on crafted completions (through a scripted inference context), data loading,
the calculator tool turn, and load_environment errors."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import EnvConfig
from pipeline.environments import (
    Completion,
    EnvironmentLoadError,
    SampleResult,
    SampleSpec,
    ScriptedContext,
    load_environment,
    rollout_from_completion,
    token_rewards_for,
)
from pipeline.environments.arithmetic import (
    ArithmeticEnv,
    arithmetic_reward,
    parse_answer,
)
from pipeline.environments.calculator import (
    CalculatorEnv,
    ToolError,
    final_answer,
    run_tool,
    safe_eval,
)
from pipeline.environments.cats import PROBE_PROMPTS, CatsEnv, says_cat
from pipeline.environments.exact_answer import ExactAnswerEnv, normalized_match
from pipeline.environments.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer("builtin:tiny")


def run(
    env: Any,
    ctx: Any,
    *,
    n: int = 2,
    g: int = 3,
    mode: str = "train",
    seed: int = 0,
    **kw: Any,
) -> SampleResult:
    args = {"temperature": 1.0, "max_tokens": 32, "stop_tokens": None} | kw
    return env.sample(ctx, SampleSpec(n_examples=n, n_generations=g, mode=mode, **args), np.random.default_rng(seed))


def check_contract(res: SampleResult, g: int) -> None:
    for group in res.groups:
        assert len(group.rollouts) == g
        for r in group.rollouts:
            n = len(r.response_tokens)
            assert len(r.response_logprobs) == len(r.token_rewards) == len(r.response_loss_mask) == n
            assert r.prompt_tokens == group.rollouts[0].prompt_tokens
            assert sum(r.token_rewards) == pytest.approx(r.episode_reward)
            assert r.truncated == (r.finish_reason == "length")
    assert len({grp.key for grp in res.groups}) == len(res.groups)


# ------------------------------------------------------------------------------ helpers


def test_token_rewards_on_last_policy_token() -> None:
    assert token_rewards_for(3, 0.5) == [0.0, 0.0, 0.5]
    assert token_rewards_for(4, 1.0, [1, 1, 0, 0]) == [0.0, 1.0, 0.0, 0.0]
    assert token_rewards_for(0, 1.0) == []
    r = rollout_from_completion("e", "x", [1], Completion([5, 6], [-0.1, -0.2], "length"), 0.7)
    assert r.truncated and r.response_loss_mask == [1, 1] and r.token_rewards == [0.0, 0.7]
    with pytest.raises(ValueError, match="logprobs"):
        rollout_from_completion("e", "x", [1], Completion([5, 6], [-0.1], "stop"), 0.7)


# ------------------------------------------------------------------------------ cats


def test_cats_scoring(tok: Any) -> None:
    env = CatsEnv(cap=4)
    res = run(
        env,
        ScriptedContext(tok, ["cats cats", "no dogs", "cat " * 10]),
        n=2,
        g=3,
        max_tokens=8,
    )
    check_contract(res, 3)
    assert not res.failures
    rewards = [r.episode_reward for r in res.groups[0].rollouts]
    assert rewards == [0.5, 0.0, 1.0]
    assert res.groups[0].rollouts[2].truncated
    assert res.metrics["success_rate"] == pytest.approx(4 / 6)
    assert res.metrics["truncation_rate"] == pytest.approx(2 / 6)
    assert res.metrics["mean_reward"] == pytest.approx(0.5)
    assert res.metrics["cat_count_total"] == 2 * (2 + 0 + 8)
    # the response is cut at EOS: text after it does not count
    eos_ctx = ScriptedContext(tok, ["no<eos>cats"])
    assert run(env, eos_ctx, n=1, g=1).groups[0].rollouts[0].episode_reward == 0.0


def test_cats_deterministic_and_eval_stream(tok: Any) -> None:
    env = load_environment(EnvConfig())
    a = run(env, ScriptedContext(tok, ["cat"]), n=5, seed=3)
    b = run(env, ScriptedContext(tok, ["cat"]), n=5, seed=3)
    assert [g.key for g in a.groups] == [g.key for g in b.groups]
    assert [g.rollouts[0].prompt_tokens for g in a.groups] == [g.rollouts[0].prompt_tokens for g in b.groups]
    ev = run(env, ScriptedContext(tok, ["cat"]), n=7, g=1, mode="eval")
    assert [tok.decode(g.rollouts[0].prompt_tokens, skip_special_tokens=True) for g in ev.groups] == list(PROBE_PROMPTS)
    assert len(PROBE_PROMPTS) == 7 and says_cat("A Cat!") and not says_cat("dog")
    with pytest.raises(ValueError, match="mode"):
        run(env, ScriptedContext(tok, ["cat"]), mode="test")


def test_prompt_too_long_is_a_failure(tok: Any) -> None:
    res = run(CatsEnv(max_prompt_tokens=2), ScriptedContext(tok, ["cat"]), n=3)
    assert not res.groups and len(res.failures) == 3
    assert "max_prompt_tokens=2" in res.failures[0].reason
    assert res.metrics["n_failures"] == 3


def test_generation_error_is_a_failure(tok: Any) -> None:
    res = run(CatsEnv(), ScriptedContext(tok, ["cat"], fail=RuntimeError("engine died")), n=2)
    assert not res.groups and len(res.failures) == 2
    assert all("engine died" in f.reason for f in res.failures)


# ------------------------------------------------------------------------------ arithmetic


def test_arithmetic_partial_credit_rule() -> None:
    assert arithmetic_reward(57, 57) == 1.0
    assert arithmetic_reward(47, 57) == 0.5  # same length, same last digit
    assert arithmetic_reward(58, 57) == 0.25  # same length only
    assert arithmetic_reward(7, 57) == 0.25  # same last digit only
    assert arithmetic_reward(123, 57) == 0.0
    assert arithmetic_reward(None, 57) == 0.0
    assert parse_answer(" 42 \nmore") == 42
    assert parse_answer("42 cats") is None
    assert parse_answer("") is None


@pytest.mark.parametrize("difficulty,lo,hi", [("easy", 0, 9), ("medium", 10, 99), ("hard", 100, 999)])
def test_arithmetic_problems_and_scoring(tok: Any, difficulty: str, lo: int, hi: int) -> None:
    env = ArithmeticEnv(difficulty=difficulty, seed=1)

    def answer(prompt: str) -> str:
        a, b = prompt.removeprefix("<bos>").removesuffix("=").split("+")
        assert lo <= int(a) <= hi and lo <= int(b) <= hi
        return f"{int(a) + int(b)}\n"

    res = run(env, ScriptedContext(tok, answer), n=4, g=2)
    check_contract(res, 2)
    assert res.metrics["success_rate"] == 1.0 and res.metrics["mean_reward"] == 1.0
    assert all(g.rollouts[0].env_name == f"arithmetic-{difficulty}" for g in res.groups)
    wrong = run(env, ScriptedContext(tok, ["x"]), n=4, g=2)
    assert wrong.metrics["mean_reward"] == 0.0 and wrong.metrics["parse_failure_total"] == 8


def test_arithmetic_eval_stream_is_fixed(tok: Any) -> None:
    env = ArithmeticEnv("medium", seed=0)
    a = run(env, ScriptedContext(tok, ["1"]), n=6, g=1, mode="eval", seed=1)
    b = run(env, ScriptedContext(tok, ["1"]), n=6, g=1, mode="eval", seed=2)
    assert [g.rollouts[0].example_id for g in a.groups] == [g.rollouts[0].example_id for g in b.groups]
    with pytest.raises(ValueError, match="difficulty"):
        ArithmeticEnv("impossible")


# ------------------------------------------------------------------------------ exact answer

ROWS = [
    {"id": "q0", "prompt": "capital of France?", "answer": "Paris"},
    {"id": "q1", "prompt": "2+2?", "answer": "4"},
    {"id": "q2", "prompt": "no answer here"},
]


def _answer_from(prompt: str) -> str:
    return "Answer: paris." if "France" in prompt else "4"


def test_exact_answer_jsonl(tok: Any, tmp_path) -> None:
    p = tmp_path / "data.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    env = ExactAnswerEnv(str(p))
    res = run(env, ScriptedContext(tok, _answer_from), n=3, g=2, mode="eval")
    check_contract(res, 2)
    assert [g.rollouts[0].example_id for g in res.groups] == ["q0", "q1"]
    assert res.metrics["mean_reward"] == 1.0
    assert len(res.failures) == 1 and res.failures[0].example_id == "q2"
    assert "'answer'" in res.failures[0].reason and "row 2" in res.failures[0].reason
    wrong = run(env, ScriptedContext(tok, ["London"]), n=2, g=1, mode="eval")
    assert wrong.metrics["mean_reward"] == 0.0


def test_exact_answer_parquet_via_load_environment(tok: Any, tmp_path) -> None:
    p = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS[:2]), p)
    env = load_environment(
        EnvConfig(
            "pipeline.environments.exact_answer.ExactAnswerEnv",
            {"path": f"file://{p}", "id_field": None},
        )
    )
    res = run(env, ScriptedContext(tok, _answer_from), n=6, g=1, mode="train")
    assert not res.failures and res.metrics["mean_reward"] == 1.0
    assert {g.rollouts[0].example_id for g in res.groups} <= {"row-0", "row-1"}


def test_exact_answer_multiple_choice_and_custom_verifier(tok: Any, tmp_path, monkeypatch) -> None:
    p = tmp_path / "mc.jsonl"
    p.write_text(json.dumps({"prompt": "Pick the cat", "choices": ["dog", "cat"], "answer": 1}) + "\n")
    env = ExactAnswerEnv(str(p), choices_field="choices")
    seen: list[str] = []
    res = run(
        env,
        ScriptedContext(tok, lambda pr: seen.append(pr) or "B"),
        n=1,
        g=1,
        mode="eval",
    )
    assert "\nA. dog\nB. cat" in seen[0] and res.metrics["mean_reward"] == 1.0
    mod = tmp_path / "my_verifiers.py"
    mod.write_text(
        textwrap.dedent("""
        def half(response, answer):
            return 0.5
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    env2 = ExactAnswerEnv(str(p), choices_field="choices", verifier="my_verifiers.half")
    assert run(env2, ScriptedContext(tok, ["B"]), n=1, g=1).metrics["mean_reward"] == 0.5
    with pytest.raises(ValueError, match=r"my_verifiers\.nope"):
        ExactAnswerEnv(str(p), verifier="my_verifiers.nope")
    sys.modules.pop("my_verifiers", None)
    assert normalized_match("The answer is  PARIS!", "paris") == 1.0


def test_exact_answer_missing_file(tmp_path) -> None:
    missing = str(tmp_path / "missing.jsonl")
    with pytest.raises(FileNotFoundError, match=r"missing\.jsonl"):
        ExactAnswerEnv(missing)
    cfg = EnvConfig("pipeline.environments.exact_answer.ExactAnswerEnv", {"path": missing})
    with pytest.raises(EnvironmentLoadError, match=r"missing\.jsonl") as ei:
        load_environment(cfg)
    assert "ExactAnswerEnv" in str(ei.value)


def test_exact_answer_bad_json_names_line(tmp_path) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt": "a", "answer": "b"}\n{not json\n')
    with pytest.raises(ValueError, match="line 2"):
        ExactAnswerEnv(str(p))


def _check(env_args: dict[str, Any]) -> str:
    """The one line the check hook refuses `env_args` with ('' when accepted)."""
    from pipeline.config import ConfigError

    try:
        ExactAnswerEnv.check_args(env_args)
    except ConfigError as e:
        assert "\n" not in str(e)
        return str(e)
    return ""


def test_exact_answer_check_args_refuses_what_construction_would(tmp_path: Any) -> None:
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert _check({"path": str(good)}) == ""  # a row without answer is a per-example failure, not a refusal
    folder = tmp_path / "data"
    folder.mkdir()
    csv = tmp_path / "d.csv"
    csv.write_text("prompt,answer\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": "b"}\n{not json\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert _check({"path": str(tmp_path / "no.jsonl")}).startswith("path=") and "no such file" in _check(
        {"path": str(tmp_path / "no.jsonl")}
    )
    assert "is a folder" in _check({"path": str(folder)})
    assert "unsupported format (.csv)" in _check({"path": str(csv)})
    assert "line 2: invalid JSON" in _check({"path": str(bad)})
    assert "holds no rows" in _check({"path": str(empty)})
    assert "['question']" in _check({"path": str(good), "prompt_field": "question"})
    assert "['choices']" in _check({"path": str(good), "choices_field": "choices"})
    assert _check({"path": str(good), "eval_path": str(csv)}).startswith("eval_path=")
    assert _check({"path": str(good), "file_format": "csv"}).startswith("file_format=")
    txt = tmp_path / "d.txt"
    txt.write_text(good.read_text())
    assert _check({"path": str(txt), "file_format": "jsonl"}) == ""  # the format named, whatever the extension
    pq.write_table(pa.table({"prompt": ["a"], "reply": ["b"]}), tmp_path / "d.parquet")
    assert "['answer']" in _check({"path": str(tmp_path / "d.parquet")})
    (tmp_path / "junk.parquet").write_text("not parquet")
    assert "not a readable parquet file" in _check({"path": str(tmp_path / "junk.parquet")})
    with pytest.raises(ValueError, match="is a folder"):
        ExactAnswerEnv(str(folder), file_format="jsonl")


def test_exact_answer_check_args_of_a_remote_file_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from pipeline.environments import exact_answer

    def hang(*args: Any, **kwargs: Any) -> Any:
        time.sleep(30)

    assert "no such file" in (exact_answer.check_data_file("memory://nope/qa.jsonl") or "")
    monkeypatch.setattr(exact_answer.fsspec.core, "url_to_fs", hang)
    t0 = time.monotonic()
    why = exact_answer.check_data_file("gs://bucket/qa.jsonl", timeout_s=0.5)
    assert why is not None and "could not be looked up within 0.5 s" in why
    assert time.monotonic() - t0 < 5


def test_validators_name_the_lesson_and_the_arg(tmp_path: Any) -> None:
    import dataclasses

    import draccus

    from pipeline.config import ConfigError, RLJobConfig, validate_job
    from pipeline.config.curriculum import LessonConfig

    root = os.path.dirname(os.path.dirname(__file__))
    cfg = draccus.parse(RLJobConfig, config_path=os.path.join(root, "configs/test_cats.yaml"), args=[])
    env = EnvConfig("pipeline.environments.exact_answer.ExactAnswerEnv", {"path": str(tmp_path / "no.jsonl")})
    lesson = LessonConfig(lesson_id="qa", env=env)
    cfg = dataclasses.replace(cfg, curriculum=dataclasses.replace(cfg.curriculum, lessons={"qa": lesson}))
    with pytest.raises(ConfigError) as ei:
        validate_job(cfg)
    assert ei.value.field == "curriculum.lessons.qa.env.env_args.path" and "no such file" in str(ei.value)


# ------------------------------------------------------------------------------ calculator


def test_safe_eval() -> None:
    assert safe_eval("12*(3+4)") == 84
    assert safe_eval(" -2 + 3*-4 ") == -14
    assert safe_eval("7/2") == 3.5
    assert run_tool("1/3") == ("<result>0.3333333333</result>", False)
    for bad, why in [
        ("2+", "end"),
        ("2**3", "unexpected"),
        ("1/0", "zero"),
        ("(1+2", "missing"),
        ("x", "character"),
        ("", "empty"),
        ("__import__('os')", "character"),
        ("1" * 300, "longer"),
        ("(" * 50 + "1", "nested"),
    ]:
        with pytest.raises(ToolError, match=why):
            safe_eval(bad)
    assert final_answer("<calc>1+1</calc><result>2</result> so Answer: 5") == 5
    assert final_answer("<calc>1+1</calc><result>2</result>") is None


def _calc_script(prompt: str) -> str:
    if "<result>" not in prompt:
        expr = prompt.split("What is ")[1].split("?")[0]
        return f"<calc>{expr}</calc> never seen"
    value = prompt.rsplit("<result>", 1)[1].split("</result>")[0]
    return f"\nAnswer: {value}"


def test_calculator_tool_turn_masked(tok: Any) -> None:
    env = CalculatorEnv(max_turns=3)
    ctx = ScriptedContext(tok, _calc_script, logprob=-0.5)
    res = run(env, ctx, n=2, g=2)
    check_contract(res, 2)
    assert not res.failures and res.metrics["mean_reward"] == 1.0
    assert res.metrics["tool_calls_total"] == 4 and res.metrics["tool_errors_total"] == 0
    r = res.groups[0].rollouts[0]
    text = tok.decode(r.response_tokens)
    value = safe_eval(r.example_id)
    assert text == f"<calc>{r.example_id}</calc><result>{value}</result>\nAnswer: {value}<eos>"
    result_ids = tok.encode(f"<result>{value}</result>")
    start = len(tok.encode(f"<calc>{r.example_id}</calc>"))
    assert r.response_tokens[start : start + len(result_ids)] == result_ids
    for i, (m, lp) in enumerate(zip(r.response_loss_mask, r.response_logprobs, strict=True)):
        tool = start <= i < start + len(result_ids)
        assert (m, lp) == ((0, 0.0) if tool else (1, -0.5))
    assert r.token_rewards[-1] == 1.0 and r.response_loss_mask[-1] == 1
    # the close tag is a stop token, so the policy paused for the tool
    assert tok.convert_tokens_to_ids("</calc>") in ctx.calls[0][1]["stop_tokens"]


def test_calculator_malformed_expression_recorded(tok: Any) -> None:
    env = CalculatorEnv(max_turns=2)
    res = run(env, ScriptedContext(tok, ["<calc>2+*x</calc>", "\nAnswer: 3"]), n=1, g=1)
    assert not res.failures
    r = res.groups[0].rollouts[0]
    assert "<result>error: " in tok.decode(r.response_tokens)
    assert res.metrics["tool_errors_total"] == 1 and r.episode_reward == 0.0


def test_calculator_max_turns_and_generation_failure(tok: Any) -> None:
    env = CalculatorEnv(max_turns=1)
    res = run(env, ScriptedContext(tok, ["<calc>1+1</calc>"]), n=1, g=2)
    assert res.metrics["tool_calls_total"] == 0 and res.metrics["unanswered_calls_total"] == 2
    assert all(r.response_loss_mask == [1] * len(r.response_tokens) for r in res.groups[0].rollouts)
    failing = run(env, ScriptedContext(tok, ["1"], fail=TimeoutError("slow")), n=2, g=2)
    assert not failing.groups and len(failing.failures) == 2 and "slow" in failing.failures[0].reason
    trunc = run(CalculatorEnv(), ScriptedContext(tok, ["1 2 3 4 5 6"]), n=1, g=1, max_tokens=3)
    assert trunc.groups[0].rollouts[0].truncated and trunc.metrics["truncation_rate"] == 1.0


# ------------------------------------------------------------------------------ load_environment


@pytest.mark.parametrize(
    "path,args,match",
    [
        ("no_such_pkg.mod.Env", {}, "cannot import module 'no_such_pkg.mod'"),
        ("pipeline.environments.cats.NoSuchEnv", {}, "has no attribute 'NoSuchEnv'"),
        ("pipeline.environments.cats.count_cats", {}, "not a subclass"),
        ("pipeline.environments.base.Environment", {}, "abstract"),
        ("pipeline.environments.cats.CatsEnv", {"kittens": 3}, "bad env_args"),
        (
            "pipeline.environments.arithmetic.ArithmeticEnv",
            {"difficulty": "x"},
            "difficulty",
        ),
    ],
)
def test_load_environment_errors_name_the_path(path: str, args: dict, match: str) -> None:
    with pytest.raises(EnvironmentLoadError, match=match) as ei:
        load_environment(EnvConfig(path, args))
    assert path in str(ei.value)


def test_load_builtin_environments(tmp_path) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps(ROWS[0]) + "\n")
    for cls, args in [
        ("cats.CatsEnv", {}),
        ("arithmetic.ArithmeticEnv", {"difficulty": "hard", "seed": 3}),
        ("exact_answer.ExactAnswerEnv", {"path": str(p)}),
        ("calculator.CalculatorEnv", {"max_turns": 2}),
    ]:
        env = load_environment(EnvConfig(f"pipeline.environments.{cls}", args))
        assert env.name


def test_environments_import_without_jax() -> None:
    import subprocess

    code = (
        "import sys; import pipeline.environments.cats, pipeline.environments.arithmetic, "
        "pipeline.environments.exact_answer, pipeline.environments.calculator, pipeline.environments.tokenizer; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('jax', 'levanter', 'haliax', 'equinox')]; "
        "assert not bad, bad"
    )
    subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )
