"""A multi-turn environment with a calculator tool: proves the rollout format carries turns and tool calls.

Protocol of an episode (at most `max_turns` policy turns, each at most `max_tokens` new tokens):
1. The policy answers the prompt (`"What is EXPR?\\n"` by default).
2. If a turn's text (up to the first stop/EOS token) contains `<calc>E</calc>` and turns remain, the turn
   is cut right after `</calc>`, E is evaluated by `safe_eval` (digits, `.`, `+ - * /`, parentheses and
   spaces only; no `eval`), and `<result>VALUE</result>` is appended (or `<result>error: WHY</result>` for a
   malformed expression, counted in `tool_errors`). The policy then continues from the whole transcript.
3. Otherwise the episode ends. Reward 1.0 iff the final answer equals the problem's value, else 0.0.
   The final answer: the text after "Answer:" when present, else the last number of the response, where
   `<calc>...</calc>` and `<result>...</result>` spans are ignored.

Tokens the environment inserts carry logprob 0.0 and `response_loss_mask` 0; policy tokens carry their
sampled logprob and mask 1; the episode reward sits on the last policy token. When `</calc>` is a single
token of the tokenizer it is added to the generation stop tokens so the policy pauses for the tool.
A generation error fails every example of that generation batch (an `ExampleFailure` with the reason).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, TypeVar

import numpy as np

from pipeline.environments.base import (
    Completion,
    EnvGroup,
    Environment,
    EnvRollout,
    ExampleFailure,
    InferenceContext,
    SampleResult,
    SampleSpec,
    check_completions,
    check_mode,
    draw_seed,
    effective_stop_tokens,
    encode_prompt,
    group_key,
    summarize,
    token_rewards_for,
)
from pipeline.environments.generation import GenerationRequest
from pipeline.environments.turns import Episode, play_turns

CALL_OPEN, CALL_CLOSE = "<calc>", "</calc>"
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"
MAX_EXPR_CHARS = 200
MAX_DEPTH = 32


class ToolError(ValueError):
    """A calculator expression is malformed or cannot be evaluated; the message says why."""


_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d+)?|\.\d+)|(\S))")


def _lex(expr: str) -> list[str]:
    out: list[str] = []
    pos = 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:  # only trailing whitespace left
            break
        if m.group(1) is not None:
            out.append(m.group(1))
        else:
            ch = m.group(2)
            if ch not in "+-*/()":
                raise ToolError(f"unexpected character {ch!r} at position {m.start(2)}")
            out.append(ch)
        pos = m.end()
    return out


def safe_eval(expr: str) -> Fraction:
    """Exact value of an arithmetic expression over numbers, `+ - * /`, unary signs and parentheses.

    Grammar: expr := term (('+'|'-') term)* ; term := factor (('*'|'/') factor)* ;
    factor := ('+'|'-') factor | NUMBER | '(' expr ')'. Raises ToolError (never anything else) for an
    empty/too long (> 200 chars)/too deeply nested expression, a bad character, bad syntax, or division by 0.
    """
    if len(expr) > MAX_EXPR_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPR_CHARS} characters")
    toks = _lex(expr)
    if not toks:
        raise ToolError("empty expression")
    pos = 0

    def peek() -> str | None:
        return toks[pos] if pos < len(toks) else None

    def take() -> str:
        nonlocal pos
        t = toks[pos]
        pos += 1
        return t

    def parse_expr(depth: int) -> Fraction:
        v = parse_term(depth)
        while peek() in ("+", "-"):
            v = v + parse_term(depth) if take() == "+" else v - parse_term(depth)
        return v

    def parse_term(depth: int) -> Fraction:
        v = parse_factor(depth)
        while peek() in ("*", "/"):
            op = take()
            rhs = parse_factor(depth)
            if op == "*":
                v = v * rhs
            elif rhs == 0:
                raise ToolError("division by zero")
            else:
                v = v / rhs
        return v

    def parse_factor(depth: int) -> Fraction:
        if depth > MAX_DEPTH:
            raise ToolError(f"expression nested deeper than {MAX_DEPTH}")
        t = peek()
        if t is None:
            raise ToolError("unexpected end of expression")
        take()
        if t == "+":
            return parse_factor(depth + 1)
        if t == "-":
            return -parse_factor(depth + 1)
        if t == "(":
            v = parse_expr(depth + 1)
            if peek() != ")":
                raise ToolError("missing ')'")
            take()
            return v
        if t in "*/)":
            raise ToolError(f"unexpected {t!r}")
        return Fraction(t)

    value = parse_expr(0)
    if pos != len(toks):
        raise ToolError(f"unexpected {toks[pos]!r} after a complete expression")
    return value


def format_value(v: Fraction) -> str:
    """An integer value as an integer literal; otherwise a decimal with up to 10 significant digits."""
    return str(v.numerator) if v.denominator == 1 else f"{float(v):.10g}"


def run_tool(expr: str) -> tuple[str, bool]:
    """The tool's reply text `<result>VALUE</result>` (or `<result>error: WHY</result>`) and whether it erred."""
    try:
        return f"{RESULT_OPEN}{format_value(safe_eval(expr))}{RESULT_CLOSE}", False
    except ToolError as e:
        return f"{RESULT_OPEN}error: {e}{RESULT_CLOSE}", True


_SPANS = re.compile(
    rf"{re.escape(CALL_OPEN)}.*?(?:{re.escape(CALL_CLOSE)}|$)|{re.escape(RESULT_OPEN)}.*?(?:{re.escape(RESULT_CLOSE)}|$)",
    re.S,
)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_ANSWER = re.compile(r"answer\s*[:=]?\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)


def final_answer(text: str) -> Fraction | None:
    """The final answer of a transcript: the number after the last 'Answer:' outside tool spans, else the
    last number outside tool spans; None when there is none."""
    clean = _SPANS.sub(" ", text)
    m = _ANSWER.findall(clean)
    if m:
        return Fraction(m[-1])
    nums = _NUMBER.findall(clean)
    return Fraction(nums[-1]) if nums else None


def answer_rollout(
    env_name: str,
    expr: str,
    target: Fraction,
    text: str,
    *,
    prompt: list[int],
    tokens: list[int],
    logprobs: list[float],
    mask: list[int],
    finish_reason: str,
    info: dict[str, float],
) -> EnvRollout:
    """The scored rollout of one arithmetic episode (both calculator environments): reward 1 when the final
    answer in `text` equals `target`, else 0, on the loss-masked response tokens; `info` gains `parse_failure`
    (1 when `text` holds no final answer). Copies the token lists."""
    answer = final_answer(text)
    reward = 1.0 if answer is not None and answer == target else 0.0
    return EnvRollout(
        env_name=env_name,
        example_id=expr,
        prompt_tokens=list(prompt),
        response_tokens=list(tokens),
        response_logprobs=list(logprobs),
        token_rewards=token_rewards_for(len(tokens), reward, mask),
        response_loss_mask=list(mask),
        episode_reward=reward,
        truncated=finish_reason == "length",
        finish_reason=finish_reason,
        info={**info, "parse_failure": float(answer is None)},
    )


def _encode_plain(tokenizer: Any, text: str) -> list[int]:
    """Encode without special tokens where the tokenizer supports the flag."""
    try:
        return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
    except TypeError:
        return [int(t) for t in tokenizer.encode(text)]


def _find_call(tokenizer: Any, tokens: list[int]) -> tuple[int, str] | None:
    """(k, expr) for the first complete `<calc>expr</calc>` in decode(tokens), where tokens[:k] is the shortest
    prefix whose text contains it; None when there is no complete call."""
    text = str(tokenizer.decode(tokens))
    start = text.find(CALL_OPEN)
    end = text.find(CALL_CLOSE, start + len(CALL_OPEN)) if start >= 0 else -1
    if start < 0 or end < 0:
        return None
    expr = text[start + len(CALL_OPEN) : end]
    for k in range(1, len(tokens) + 1):
        prefix = str(tokenizer.decode(tokens[:k]))
        s = prefix.find(CALL_OPEN)
        if s >= 0 and prefix.find(CALL_CLOSE, s + len(CALL_OPEN)) >= 0:
            return k, expr
    return len(tokens), expr


@dataclass
class _Episode:
    example: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    unanswered_calls: int = 0
    done: bool = False


@dataclass(frozen=True)
class _Sampling:
    """The generation settings of one `sample` call."""

    n_generations: int
    temperature: float
    max_tokens: int
    stop_tokens: list[int]


def _generate_turn(
    ctx: InferenceContext,
    turn: int,
    prompts: list[list[int]],
    active: list[_Episode],
    sampling: _Sampling,
    rng: np.random.Generator,
) -> list[Completion]:
    """One completion per active episode, in order.

    Turn 0 asks for `n_generations` completions of each prompt (the episodes are ordered example by example,
    `n_generations` each, and all are active); later turns continue each active episode's transcript once.
    """
    if turn == 0:
        outs = check_completions(
            ctx.generate(
                GenerationRequest(
                    prompts,
                    n=sampling.n_generations,
                    temperature=sampling.temperature,
                    max_tokens=sampling.max_tokens,
                    stop_tokens=sampling.stop_tokens,
                    seed=draw_seed(rng),
                )
            ),
            len(prompts),
            sampling.n_generations,
        )
        return [c for per_prompt in outs for c in per_prompt]
    outs = check_completions(
        ctx.generate(
            GenerationRequest(
                [prompts[e.example] + e.tokens for e in active],
                n=1,
                temperature=sampling.temperature,
                max_tokens=sampling.max_tokens,
                stop_tokens=sampling.stop_tokens,
                seed=draw_seed(rng),
            )
        ),
        len(active),
        1,
    )
    return [per_prompt[0] for per_prompt in outs]


_E = TypeVar("_E", bound=Episode)


class ArithmeticProblems:
    """Integer expressions of `n_terms` operands in 1..`max_operand` joined by `+ - *`, a fixed eval list
    (`eval_problems`, set by the environment from its own seeded generator), and the groups of a played call."""

    name: str
    max_turns: int
    n_terms: int
    max_operand: int
    eval_problems: list[str]

    def _init_problems(self, max_turns: int, n_terms: int, max_operand: int, eval_seed: list[int], n_eval: int) -> None:
        """Check (each >= 1, else ValueError naming it) and keep the shared knobs, and draw the fixed eval list
        of `n_eval` problems from `default_rng(eval_seed)`."""
        for name, v in (("max_turns", max_turns), ("n_terms", n_terms), ("max_operand", max_operand)):
            if v < 1:
                raise ValueError(f"{name}={v!r}: must be >= 1")
        self.max_turns = max_turns
        self.n_terms = n_terms
        self.max_operand = max_operand
        erng = np.random.default_rng(eval_seed)
        self.eval_problems = [self._problem(erng) for _ in range(n_eval)]
        # Training draws skip the eval problems, unless those are a large share of every problem there is (a tiny
        # problem space, where skipping them could leave few or no problems to train on).
        space = max_operand**n_terms * 3 ** (n_terms - 1)
        held_out = frozenset(self.eval_problems)
        self._held_out = held_out if space >= 4 * len(held_out) else frozenset()

    def _problem(self, rng: np.random.Generator) -> str:
        nums = rng.integers(1, self.max_operand + 1, size=self.n_terms)
        ops = rng.choice(np.array(["+", "-", "*"]), size=self.n_terms - 1)
        return str(int(nums[0])) + "".join(f"{op}{int(x)}" for op, x in zip(ops, nums[1:], strict=True))

    def problems(self, n: int, rng: np.random.Generator, mode: str) -> list[str]:
        """`n` expressions: the first `n` of the fixed eval list, cycling (eval), or drawn with rng (train), a draw
        that is one of the eval problems drawn again (so no evaluated problem is trained on) unless they are over a
        quarter of all the problems there are."""
        check_mode(mode)
        if mode == "eval":
            return [self.eval_problems[i % len(self.eval_problems)] for i in range(n)]
        out: list[str] = []
        while len(out) < n:
            expr = self._problem(rng)
            if expr not in self._held_out:
                out.append(expr)
        return out

    def answer_result(
        self,
        exprs: Sequence[str],
        episodes: Sequence[_E],
        failed: set[int],
        failures: list[ExampleFailure],
        rng: np.random.Generator,
        n_examples: int,
        rollout: Callable[[str, Fraction, _E], EnvRollout],
    ) -> SampleResult:
        """The result of a call whose episodes are played (`play_turns`): one group per example not in `failed`, in
        order, keyed by `group_key` (drawn from `rng`), of `rollout(expression, its value, episode)` for each of
        its episodes in order; metrics by `summarize`, an episode a success when its reward is >= 1 (answered)."""
        groups: list[EnvGroup] = []
        for i, expr in enumerate(exprs):
            if i in failed:
                continue
            target = safe_eval(expr)
            rollouts = [rollout(expr, target, e) for e in episodes if e.example == i]
            groups.append(EnvGroup(group_key(self.name, expr, rng), rollouts))
        metrics = summarize(groups, failures, n_examples=n_examples, success=lambda r: r.episode_reward >= 1.0)
        return SampleResult(groups, failures, metrics)


class CalculatorEnv(ArithmeticProblems, Environment):
    """Arithmetic word-free problems solved with an optional calculator tool (see the module docstring).

    Problems: `n_terms` integer operands in [1, max_operand] joined by random `+ - *` (train: drawn with the
    call's rng; eval: a fixed list of `n_eval` problems from `default_rng([seed, 2])`). Example ids are the
    expressions. Metrics add `turns`, `tool_calls`, `tool_errors`, `unanswered_calls` (a call in the last
    allowed turn) and `parse_failure` (no final number), each as `_mean` and `_total`.
    """

    name = "calculator"

    def __init__(
        self,
        max_turns: int = 3,
        n_terms: int = 3,
        max_operand: int = 99,
        seed: int = 0,
        *,
        prompt_template: str = "What is {expr}?\n",
        n_eval: int = 256,
        max_prompt_tokens: int | None = None,
        add_bos: bool = True,
    ) -> None:
        self._init_problems(max_turns, n_terms, max_operand, [seed, 2], n_eval)
        if max_prompt_tokens is not None and max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens={max_prompt_tokens!r}: must be >= 1 or None")
        self.prompt_template = prompt_template
        self.max_prompt_tokens = max_prompt_tokens
        self.add_bos = add_bos

    def sample(self, ctx: InferenceContext, spec: SampleSpec, rng: np.random.Generator) -> SampleResult:
        check_mode(spec.mode)
        n_examples, n_generations, mode = spec.n_examples, spec.n_generations, spec.mode
        tok = ctx.tokenizer
        stop = effective_stop_tokens(tok, spec.stop_tokens)
        close_ids = _encode_plain(tok, CALL_CLOSE)
        gen_stop = sorted(stop | ({close_ids[0]} if len(close_ids) == 1 else set()))
        sampling = _Sampling(n_generations, spec.temperature, spec.max_tokens, gen_stop)
        exprs, prompts, failures = self._encode_problems(tok, self.problems(n_examples, rng, mode), spec.chat)
        episodes = [_Episode(example=i) for i in range(len(exprs)) for _ in range(n_generations)]
        failed = self._play(ctx, exprs, prompts, episodes, sampling, stop, rng, failures)

        def rollout(expr: str, target: Fraction, e: _Episode) -> EnvRollout:
            return self._rollout(tok, prompts[e.example], expr, target, e, stop)

        return self.answer_result(exprs, episodes, failed, failures, rng, n_examples, rollout)

    def _encode_problems(
        self, tok: Any, problems: Sequence[str], chat: bool = False
    ) -> tuple[list[str], list[list[int]], list[ExampleFailure]]:
        """(expressions, their prompt tokens, failures): a prompt longer than `max_prompt_tokens` fails its example."""
        failures: list[ExampleFailure] = []
        exprs: list[str] = []
        prompts: list[list[int]] = []
        for expr in problems:
            prompt = encode_prompt(tok, self.prompt_template.format(expr=expr), add_bos=self.add_bos, chat=chat)
            if self.max_prompt_tokens is not None and len(prompt) > self.max_prompt_tokens:
                failures.append(
                    ExampleFailure(
                        expr,
                        f"prompt has {len(prompt)} tokens > max_prompt_tokens={self.max_prompt_tokens}",
                    )
                )
                continue
            exprs.append(expr)
            prompts.append(prompt)
        return exprs, prompts, failures

    def _play(
        self,
        ctx: InferenceContext,
        exprs: list[str],
        prompts: list[list[int]],
        episodes: list[_Episode],
        sampling: _Sampling,
        stop: set[int],
        rng: np.random.Generator,
        failures: list[ExampleFailure],
    ) -> set[int]:
        """Play every episode turn by turn (`play_turns`); returns the indices of the examples that failed."""
        return play_turns(
            self.name,
            episodes,
            exprs,
            self.max_turns,
            lambda turn, active: _generate_turn(ctx, turn, prompts, active, sampling, rng),
            lambda ep, comp, last: self._advance(ctx.tokenizer, ep, comp, stop, last_turn=last),
            failures,
        )

    def _advance(
        self,
        tok: Any,
        ep: _Episode,
        comp: Completion,
        stop: set[int],
        *,
        last_turn: bool,
    ) -> None:
        """Append one policy turn (and the tool's reply, when it called the tool and turns remain)."""
        toks = [int(t) for t in comp.tokens]
        if len(comp.logprobs) != len(toks):
            raise ValueError(f"completion has {len(toks)} tokens but {len(comp.logprobs)} logprobs")
        ep.turns += 1
        body = toks
        for j, t in enumerate(toks):
            if t in stop:
                body = toks[:j]
                break
        call = _find_call(tok, body)
        if call is None or last_turn:
            ep.unanswered_calls += int(call is not None)
            ep.tokens += toks
            ep.logprobs += [float(x) for x in comp.logprobs]
            ep.mask += [1] * len(toks)
            ep.finish_reason = comp.finish_reason
            ep.done = True
            return
        k, expr = call
        reply, erred = run_tool(expr)
        ep.tool_calls += 1
        ep.tool_errors += int(erred)
        reply_tokens = _encode_plain(tok, reply)
        ep.tokens += toks[:k] + reply_tokens
        ep.logprobs += [float(x) for x in comp.logprobs[:k]] + [0.0] * len(reply_tokens)
        ep.mask += [1] * k + [0] * len(reply_tokens)

    def _rollout(
        self,
        tok: Any,
        prompt: list[int],
        expr: str,
        target: Fraction,
        ep: _Episode,
        stop: set[int],
    ) -> EnvRollout:
        if not ep.done:  # ran out of turns while still calling the tool (cannot happen: last turn finishes)
            ep.finish_reason = "length"
        return answer_rollout(
            self.name,
            expr,
            target,
            str(tok.decode([t for t in ep.tokens if t not in stop])),
            prompt=prompt,
            tokens=ep.tokens,
            logprobs=ep.logprobs,
            mask=ep.mask,
            finish_reason=ep.finish_reason,
            info={
                "turns": float(ep.turns),
                "tool_calls": float(ep.tool_calls),
                "tool_errors": float(ep.tool_errors),
                "unanswered_calls": float(ep.unanswered_calls),
            },
        )
