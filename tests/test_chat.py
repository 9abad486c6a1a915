"""Instruct models: chat-formatted lessons (prompts rendered by the tokenizer's chat template), the chat client
(`/v1/chat/completions` with tools) against a loopback server answering in vLLM's format (`tests/fake_servers.py`),
and the multi-turn calculator-tool environment, end to end through the rollout manager into rollout rows."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fake_servers import FakeServer

from pipeline.config import (
    ConfigError,
    CurriculumConfig,
    EnvConfig,
    LessonConfig,
    ModelSpec,
    OpenAIInferenceConfig,
    SamplingParams,
)
from pipeline.environments import SampleSpec, ScriptedContext
from pipeline.environments.base import encode_prompt
from pipeline.environments.cats import CatsEnv
from pipeline.environments.chat import ChatRequest, ChatTranscript, ChatTurn, TranscriptMismatch, parse_tool_calls
from pipeline.environments.chat_calculator import CALCULATOR_TOOL, ChatCalculatorEnv
from pipeline.environments.tokenizer import BOS_ID, EOS_ID, check_chat_lessons, load_tokenizer, render_chat
from pipeline.process.exits import Exit
from policy.inference import BackendContext
from policy.inference.openai import OpenAIBackend, OpenAIResponseError
from policy.rollout_manager import RolloutManager
from schemas import ROLLOUT

SPEC = ModelSpec(hidden_dim=32, intermediate_dim=64, num_layers=1, num_heads=2, num_kv_heads=2, max_seq_len=256)
CHAT_ENV = EnvConfig("pipeline.environments.chat_calculator.ChatCalculatorEnv", {"max_turns": 3})


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer("builtin:tiny")


@pytest.fixture
def server(tok: Any) -> Iterator[FakeServer]:
    srv = FakeServer("vllm", "/m", tok)
    yield srv
    srv.stop()


@pytest.fixture
def backend(server: FakeServer, tok: Any) -> Iterator[OpenAIBackend]:
    b = OpenAIBackend(OpenAIInferenceConfig(openai_base_url=f"{server.url}/v1", openai_model="policy@7"), tok)
    yield b
    b.shutdown()


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


# --- chat-formatted prompts -------------------------------------------------------------------------------------


def test_builtin_tokenizer_renders_chat_prompts(tok: Any) -> None:
    ids = render_chat(tok, user("What is 2+3?"))
    assert ids[0] == BOS_ID and tok.decode(ids) == "<bos>user\nWhat is 2+3?<eos><bos>assistant\n"
    assert encode_prompt(tok, "What is 2+3?", chat=True) == ids
    assert encode_prompt(tok, "What is 2+3?") == [BOS_ID, *tok.encode("What is 2+3?")]  # plain lessons unchanged
    with_tools = tok.decode(render_chat(tok, user("hi"), [CALCULATOR_TOOL]))
    assert with_tools == "<bos>system\nTools: calculator<eos><bos>user\nhi<eos><bos>assistant\n"


def test_chat_lessons_render_prompts_with_the_template(tok: Any) -> None:
    ctx = ScriptedContext(tok, ["cats"])
    spec = SampleSpec(2, 1, 1.0, 8, None, "train", chat=True)
    res = CatsEnv().sample(ctx, spec, np.random.default_rng(0))
    prompts = [r.prompt_tokens for g in res.groups for r in g.rollouts]
    assert len(prompts) == 2 and all(tok.decode(p).endswith("<eos><bos>assistant\n") for p in prompts)
    assert ctx.calls[0][0] == prompts and all(p[:3] == render_chat(tok, user("x"))[:3] for p in prompts)


def test_a_chat_lesson_needs_a_chat_template(tok: Any) -> None:
    plain = copy.deepcopy(tok)
    plain.chat_template = None
    lessons = {"a": LessonConfig("a"), "b": LessonConfig("b", chat=True)}
    check_chat_lessons(lessons, tok)
    check_chat_lessons({"a": LessonConfig("a")}, plain)
    with pytest.raises(ConfigError, match=r"lessons\.b\.chat=True: the tokenizer \(/tok\) has no chat template"):
        check_chat_lessons(lessons, plain, "/tok")
    cur = CurriculumConfig(lessons={"b": LessonConfig("b", chat=True)})
    with pytest.raises(ConfigError, match=r"lessons\.b\.chat"):
        RolloutManager(OpenAIInferenceConfig(openai_base_url="http://127.0.0.1:9/v1"), SPEC, cur, plain, None)


# --- tool calls and transcripts -----------------------------------------------------------------------------


def test_parse_tool_calls() -> None:
    text = 'Let me see. <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call> ok'
    content, calls = parse_tool_calls(text)
    assert content == "Let me see.  ok"
    assert calls == [{"id": "call_0", "type": "function",
                      "function": {"name": "calculator", "arguments": '{"expression": "1+2"}'}}]  # fmt: skip
    assert parse_tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert parse_tool_calls("<tool_call>[1]</tool_call>")[1] == []


def test_transcript_keeps_sampled_tokens_and_masks_insertions() -> None:
    from pipeline.environments import Completion

    tr = ChatTranscript()
    tr.add(ChatTurn([1, 5], Completion([7, 2], [-0.5, -0.25], "stop"), {}))
    tr.add(ChatTurn([1, 5, 7, 2, 9, 9], Completion([8, 2], [-1.0, -2.0], "stop"), {}))
    assert (tr.prompt_tokens, tr.tokens, tr.mask) == ([1, 5], [7, 2, 9, 9, 8, 2], [1, 1, 0, 0, 1, 1])
    assert tr.logprobs == [-0.5, -0.25, 0.0, 0.0, -1.0, -2.0] and tr.turns == 2
    with pytest.raises(TranscriptMismatch, match="first difference at token 3"):
        tr.add(ChatTurn([1, 5, 7, 3, 9], Completion([8], [-1.0], "stop"), {}))


# --- the chat client against a loopback server --------------------------------------------------------------


def test_chat_client_sends_tools_and_returns_exact_ids(server: FakeServer, backend: OpenAIBackend, tok: Any) -> None:
    convs = [user("What is 3*4?"), user("hello")]
    turns = backend.chat(ChatRequest(convs, [CALCULATOR_TOOL], temperature=1.0, max_tokens=64, seed=1))
    bodies = [b for m, p, b in server.requests if p == "/v1/chat/completions"]
    assert len(bodies) == 2 and all(b["tools"] == [CALCULATOR_TOOL] and b["tool_choice"] == "auto" for b in bodies)
    assert all(b["logprobs"] is True and b["return_token_ids"] and b["return_tokens_as_token_ids"] for b in bodies)
    call, plain = turns
    assert call.prompt_tokens == render_chat(tok, convs[0], [CALCULATOR_TOOL])
    assert call.message["tool_calls"][0]["function"] == {"name": "calculator", "arguments": '{"expression": "3*4"}'}
    assert call.completion.tokens[-1] == EOS_ID and call.completion.finish_reason == "stop"
    assert call.completion.logprobs == [-0.5] * len(call.completion.tokens)
    assert tok.decode(call.completion.tokens).startswith("<tool_call>")
    assert plain.message == {"role": "assistant", "content": "I do not know."}
    assert backend.last_served_steps == {7}
    short = backend.chat(ChatRequest([user("hello")], None, temperature=1.0, max_tokens=3, seed=1))[0]
    assert len(short.completion.tokens) == 3 and short.completion.finish_reason == "length"


def test_chat_budget_fits_max_seq_len(server: FakeServer, tok: Any) -> None:
    """With `max_seq_len`, a turn's `max_tokens` is cut so prompt + turn fit; a prompt that leaves no room raises."""
    from policy.inference import PromptTooLongError

    conv = user("What is 2*2?")
    n = len(render_chat(tok, conv, [CALCULATOR_TOOL]))
    config = OpenAIInferenceConfig(openai_base_url=f"{server.url}/v1")
    b = OpenAIBackend(config, tok, max_seq_len=n + 5)
    try:
        [turn] = b.chat(ChatRequest([conv], [CALCULATOR_TOOL], temperature=1.0, max_tokens=64, seed=0))
        body = [x for m, p, x in server.requests if p == "/v1/chat/completions"][-1]
        assert body["max_tokens"] == 5 and len(turn.completion.tokens) == 5
        assert turn.completion.finish_reason == "length"
        b.max_seq_len = n
        with pytest.raises(PromptTooLongError):
            b.chat(ChatRequest([conv], [CALCULATOR_TOOL], temperature=1.0, max_tokens=64, seed=0))
    finally:
        b.shutdown()


def test_chat_prompt_ids_without_server_ids(server: FakeServer, backend: OpenAIBackend, tok: Any) -> None:
    """A server that returns no prompt ids: the local template's rendering is used only if the server's prompt
    token count matches it; a tokenizer without a template cannot tell, and the turn is refused."""
    server.chat_prompt_ids = False
    req = ChatRequest([user("What is 1+1?")], [CALCULATOR_TOOL], temperature=1.0, max_tokens=64, seed=1)
    [turn] = backend.chat(req)
    assert turn.prompt_tokens == render_chat(tok, req.conversations[0], [CALCULATOR_TOOL])
    full = tok.apply_chat_template([*req.conversations[0], turn.message], tools=[CALCULATOR_TOOL], tokenize=True)
    assert turn.completion.tokens == list(full)[len(turn.prompt_tokens) :]
    backend.tokenizer = copy.deepcopy(tok)
    backend.tokenizer.chat_template = None
    with pytest.raises(OpenAIResponseError, match="no prompt_token_ids"):
        backend.chat(req)


# --- the multi-turn tool environment ------------------------------------------------------------------------


def check_episode(tok: Any, r: Any) -> None:
    """A two-turn tool episode: sampled tokens with mask 1, the tool result the template adds with mask 0."""
    assert r.episode_reward == 1.0
    if hasattr(r, "info"):  # an EnvRollout (rows do not carry the env's info)
        assert r.info["tool_calls"] == 1.0 and r.info["turns"] == 2.0
    assert 0 in r.response_loss_mask and r.response_loss_mask[0] == 1 and r.response_loss_mask[-1] == 1
    inserted = [t for t, m in zip(r.response_tokens, r.response_loss_mask, strict=True) if m == 0]
    value = str(eval(r.example_id))  # the env's own problem: digits and + - *
    assert tok.decode(inserted) == f"<bos>tool\n{value}<eos><bos>assistant\n"
    assert all(lp == 0.0 for lp, m in zip(r.response_logprobs, r.response_loss_mask, strict=True) if m == 0)
    assert r.token_rewards[-1] == 1.0 and sum(r.token_rewards) == 1.0
    assert tok.decode(r.response_tokens).endswith(f"Answer: {value}<eos>")


def test_chat_calculator_env_against_the_server(backend: OpenAIBackend, tok: Any) -> None:
    ctx = BackendContext(tok, backend)
    res = ChatCalculatorEnv(max_turns=3).sample(ctx, SampleSpec(3, 2, 1.0, 64, None, "train"), np.random.default_rng(0))
    assert res.failures == [] and len(res.groups) == 3
    for g in res.groups:
        assert len(g.rollouts) == 2
        for r in g.rollouts:
            check_episode(tok, r)
            assert r.prompt_tokens == render_chat(tok, user(f"What is {r.example_id}? Use the calculator tool."),
                                                  [CALCULATOR_TOOL])  # fmt: skip
    assert ctx.calls == 2 and ctx.served_steps == {7} and res.metrics["tool_calls_total"] == 6.0


def test_chat_calculator_env_locally_through_the_template(tok: Any) -> None:
    """Without a chat endpoint the template renders the conversation and tool calls are parsed from the text; later
    turns continue the transcript on the ids the model sampled, so a tool call the template would render otherwise
    plays its episode on its own ids instead of failing the example."""

    def script(prompt_text: str) -> str:
        if "<bos>tool\n" in prompt_text:
            return "Answer: " + prompt_text.split("<bos>tool\n")[-1].split("<eos>")[0]
        expr = prompt_text.split("What is ")[-1].split("?")[0]
        return f'<tool_call>{{"name": "calculator", "arguments": {json.dumps({"expression": expr})}}}</tool_call>'

    res = ChatCalculatorEnv().sample(ScriptedContext(tok, script), SampleSpec(2, 2, 1.0, 64, None, "train"),
                                     np.random.default_rng(1))  # fmt: skip
    assert res.failures == [] and len(res.groups) == 2
    for g in res.groups:
        for r in g.rollouts:
            check_episode(tok, r)

    def off_template(prompt_text: str) -> str:  # JSON without spaces, text after the call: re-renders otherwise
        if "<bos>tool\n" in prompt_text:
            return "Answer: " + prompt_text.split("<bos>tool\n")[-1].split("<eos>")[0]
        expr = prompt_text.split("What is ")[-1].split("?")[0]
        return f'<tool_call>{{"name":"calculator","arguments":{{"expression":"{expr}"}}}}</tool_call> so'

    for max_tokens in (64, 60):  # 60: the first turn is cut before its EOS (finish "length")
        res = ChatCalculatorEnv(max_turns=2).sample(ScriptedContext(tok, off_template),
                                                    SampleSpec(2, 1, 1.0, max_tokens, None, "train"),
                                                    np.random.default_rng(1))  # fmt: skip
        assert res.failures == [] and len(res.groups) == 2
        for g in res.groups:
            (r,) = g.rollouts
            check_episode(tok, r)
            first = [int(t) for t in tok.encode(off_template(f"What is {r.example_id}?"))] + [EOS_ID]
            assert r.response_tokens[: len(first)] == first[:max_tokens]  # the sampled ids, as sampled


class SplitWords(ScriptedContext):
    """Samples the scripted texts with the word `calculator` as its characters' ids: the same text, ids that the
    tokenizer never produces for it (what a sampling policy can do)."""

    def generate(self, request: Any) -> Any:
        word = self.tokenizer.convert_tokens_to_ids("calculator")
        chars = [int(t) for t in self.tokenizer.convert_tokens_to_ids(list("calculator"))]
        out = super().generate(request)
        for comps in out:
            for c in comps:
                split = [x for t in c.tokens for x in (chars if t == word else [t])]
                c.tokens, c.logprobs = split, [-1.0] * len(split)
        return out


def test_chat_calculator_env_keeps_non_canonical_sampled_ids(tok: Any) -> None:
    """A first turn sampled as ids that re-render to other ids continues on its own ids: the episode is played and
    rewarded, its response holds the sampled ids, and the tool result follows them (no TranscriptMismatch)."""

    def script(prompt_text: str) -> str:
        if "<bos>tool\n" in prompt_text:
            return "Answer: " + prompt_text.split("<bos>tool\n")[-1].split("<eos>")[0]
        expr = prompt_text.split("What is ")[-1].split("?")[0]
        return f'<tool_call>{{"name": "calculator", "arguments": {json.dumps({"expression": expr})}}}</tool_call>'

    ctx = SplitWords(tok, script)
    res = ChatCalculatorEnv(max_turns=2).sample(ctx, SampleSpec(3, 2, 1.0, 80, None, "train"),
                                                np.random.default_rng(2))  # fmt: skip
    assert res.failures == [] and len(res.groups) == 3
    chars = [int(t) for t in tok.convert_tokens_to_ids(list("calculator"))]
    for g in res.groups:
        for r in g.rollouts:
            check_episode(tok, r)
            at = next(i for i in range(len(r.response_tokens)) if r.response_tokens[i : i + len(chars)] == chars)
            assert all(m == 1 for m in r.response_loss_mask[: at + len(chars)])
    # the second turn's prompt is the first turn's prompt and sampled ids, then the template's tool message
    second = ctx.calls[1][0][0]
    assert tok.decode(second).endswith("<eos><bos>assistant\n") and chars[0] in second


def test_chat_lesson_rows_through_the_rollout_manager(server: FakeServer, tok: Any) -> None:
    sampling = SamplingParams(temperature=0.7, max_tokens=64, top_p=0.9, top_k=5, min_p=0.05)
    cur = CurriculumConfig(lessons={"calc": LessonConfig("calc", env=CHAT_ENV, sampling_params=sampling, chat=True)})
    inference = OpenAIInferenceConfig(openai_base_url=f"{server.url}/v1", openai_model="policy@4")
    manager = RolloutManager(inference, SPEC, cur, tok, None)
    try:
        batch, metrics = manager.sample_batch("calc", 2, 2, "train", 0, weight_step=4, worker_id="w")
    finally:
        manager.shutdown()
    assert batch is not None and len(batch.rows) == 4 and metrics["failures"] == 0
    rows = ROLLOUT.from_table(ROLLOUT.to_table(batch.rows))
    for r in rows:
        check_episode(tok, r)
        assert (r.temperature, r.top_p, r.top_k, r.min_p) == pytest.approx((0.7, 0.9, 5, 0.05))
        assert r.policy_step == 4
    bodies = [b for m, p, b in server.requests if p == "/v1/chat/completions"]
    assert all((b["top_p"], b["top_k"], b["min_p"]) == (0.9, 5, 0.05) for b in bodies)


def test_server_backend_chats_on_the_policy_it_loaded(tok: Any) -> None:
    """The `server` backend (vLLM adapter) loads a policy, then serves multi-turn chat on it."""
    from pipeline.config import ServerInferenceConfig
    from policy.inference import make_backend

    srv = FakeServer("vllm", "/runs/x/policies/step-00000000/hf", tok)
    config = ServerInferenceConfig(adapter="vllm", openai_base_url=f"{srv.url}/v1", load_timeout_s=5)
    backend = make_backend(config, None, tok, 256)
    try:
        backend.attach("/runs/x")  # type: ignore[attr-defined]
        backend.load_policy(2)  # type: ignore[attr-defined]
        ctx = BackendContext(tok, backend)
        res = ChatCalculatorEnv().sample(ctx, SampleSpec(1, 2, 1.0, 64, None, "eval"), np.random.default_rng(0))
    finally:
        backend.shutdown()
        srv.stop()
    assert res.failures == [] and srv.model_path.endswith("step-00000002/hf")
    for r in res.groups[0].rollouts:
        check_episode(tok, r)


def test_dense_backend_rows_record_controls_and_render_chat_prompts(tok: Any) -> None:
    """The in-process dense backend through the rollout manager: a chat lesson's prompts are the template's
    rendering, every row records temperature / top_p / top_k / min_p, and the eval rows too."""
    import jax

    from pipeline.config import DenseInferenceConfig
    from policy.inference import make_backend
    from policy.model import build_model, model_vocab_size
    from schemas import EVAL_ROW

    spec = ModelSpec(hidden_dim=32, intermediate_dim=64, num_layers=1, num_heads=2, num_kv_heads=2, max_seq_len=64)
    model = build_model(spec, model_vocab_size(tok), key=jax.random.PRNGKey(1))
    backend = make_backend(DenseInferenceConfig(max_seqs=8), model, tok, spec.max_seq_len, fast_compile=True)
    sampling = SamplingParams(temperature=1.5, max_tokens=8, top_k=3, top_p=0.95, min_p=0.01)
    lesson = LessonConfig("cats", chat=True, sampling_params=sampling, eval_sampling_params=sampling)
    cur = CurriculumConfig(lessons={"cats": lesson})
    manager = RolloutManager(DenseInferenceConfig(max_seqs=8), spec, cur, tok, model, backend=backend)
    try:
        batch, _ = manager.sample_batch("cats", 2, 2, "train", 0, weight_step=0, worker_id="w")
        _, ev = manager.evaluate_lesson("cats", 2, "eval", 0, step=0, weight_step=0, worker_id="w")
    finally:
        manager.shutdown()
    assert batch is not None and ev is not None
    for spec_, rows in ((ROLLOUT, batch.rows), (EVAL_ROW, ev.rows)):
        for r in spec_.from_table(spec_.to_table(rows)):
            assert (r.temperature, r.top_p, r.top_k, r.min_p) == pytest.approx((1.5, 0.95, 3, 0.01))
            assert tok.decode(r.prompt_tokens).startswith("<bos>user\n")
            assert tok.decode(r.prompt_tokens).endswith("<eos><bos>assistant\n")


def test_rollout_and_evaluate_steps_refuse_a_chat_lesson_without_a_template(tmp_path: Any) -> None:
    """The rollout and evaluate steps check at start (before waiting for a policy): the rollout step exits with code 2
    and one line naming the field; the evaluator refuses the same way."""
    import subprocess
    import sys

    import draccus

    from pipeline.config import EvaluateStepConfig, RolloutStepConfig, StoreConfig
    from pipeline.environments.tokenizer import save_tiny_tokenizer

    folder = tmp_path / "tok"
    save_tiny_tokenizer(folder)
    config_file = folder / "tokenizer_config.json"
    cfg = json.loads(config_file.read_text())
    cfg.pop("chat_template", None)
    config_file.write_text(json.dumps(cfg))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    assert load_tokenizer(str(folder)).chat_template is None
    common = dict(
        store=StoreConfig(run_root=str(tmp_path / "run")),
        model=ModelSpec(tokenizer=str(folder)),
        curriculum=CurriculumConfig(lessons={"calc": LessonConfig("calc", env=CHAT_ENV, chat=True)}),
    )
    path = tmp_path / "rollout.yaml"
    path.write_text(draccus.dump(RolloutStepConfig(**common)))  # type: ignore[arg-type]
    proc = subprocess.run([sys.executable, "-m", "steps.rollout", "--config_path", str(path)], capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    assert proc.returncode == Exit.CONFIG, proc.stderr[-2000:]
    why = f"lessons.calc.chat=True: the tokenizer ({folder}) has no chat template"
    assert why in proc.stderr and not (tmp_path / "run" / "rollouts").exists()
    from policy.evaluation import Evaluator

    with pytest.raises(ConfigError, match=re.escape(why)):
        Evaluator(EvaluateStepConfig(**common))  # type: ignore[arg-type]


# --- batched rendering (`render_chats`, `chat_prompts`): the ids of one conversation at a time -------------------

# Role markers as plain text (not special tokens) and tool-call ids rendered: BPE merges across message boundaries
# and conversations that differ only in an id render to different texts.
PLAIN_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}{% if m['tool_call_id'] %} {{ m['tool_call_id'] }}{% endif %}] "
    "{{ m['content'] }}{% for c in m['tool_calls'] or [] %} call {{ c['id'] }}: {{ c['function'] | tojson }}"
    "{% endfor %}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)


def call(k: int, expr: str, as_text: bool = True) -> dict[str, Any]:
    args: Any = json.dumps({"expression": expr}) if as_text else {"expression": expr}
    return {"id": f"call_{k}", "type": "function", "function": {"name": "calculator", "arguments": args}}


def conversations() -> list[list[dict[str, Any]]]:
    """First turns, tool turns (one and two calls, arguments as text and as objects), a closing answer, a system
    message, empty content, non-ASCII text, and two conversations that differ only in their call ids."""
    q = user("What is 12*(3+4)? Use the calculator tool.")
    one = [*q, {"role": "assistant", "content": "", "tool_calls": [call(0, "12*(3+4)")]},
           {"role": "tool", "tool_call_id": "call_0", "content": "84"}]  # fmt: skip
    other_id = copy.deepcopy(one)
    other_id[1]["tool_calls"][0]["id"] = other_id[2]["tool_call_id"] = "call_7"
    two = [{"role": "system", "content": "Be brief."}, *user("6×7 and 1-2?"),
           {"role": "assistant", "content": "Two calls.", "tool_calls": [call(0, "6*7", False), call(1, "1-2")]},
           {"role": "tool", "tool_call_id": "call_0", "content": "42"},
           {"role": "tool", "tool_call_id": "call_1", "content": "-1"}]  # fmt: skip
    return [q, user(""), one, other_id, [*one, {"role": "assistant", "content": "Answer: 84"}], two, list(two), q]


@pytest.fixture(scope="module", params=["builtin:tiny", "builtin:bpe", "exported", "plain template"])
def any_tok(request: Any, tmp_path_factory: Any) -> Any:
    from pipeline.environments.tokenizer import save_for_export

    if request.param == "exported":  # a Hugging Face folder whose encode adds BOS, as Llama's: none may be added
        folder = tmp_path_factory.mktemp("tok")
        save_for_export(load_tokenizer("builtin:bpe"), folder)
        exported = load_tokenizer(str(folder))
        assert exported.encode("a")[0] == exported.bos_token_id
        return exported
    if request.param == "plain template":
        t = load_tokenizer("builtin:bpe")
        t.chat_template = PLAIN_TEMPLATE
        return t
    return load_tokenizer(request.param)


def template_ids(tok: Any, messages: list[dict[str, Any]], tools: Any, gen: bool) -> list[int]:
    out: Any = tok.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=gen)
    return [int(t) for t in (out if isinstance(out, list) else out["input_ids"])]


def test_render_chats_gives_each_conversation_its_template_ids(any_tok: Any) -> None:
    """Every conversation, with and without the generation prompt, mixed in one call, with tools and without: the
    ids `apply_chat_template(tokenize=True)` gives it alone (repeated conversations included)."""
    from pipeline.environments.tokenizer import render_chats

    convs = conversations()
    chats = [(c, gen) for c in convs for gen in (True, False)] + [(convs[0], True), (convs[2], False)]
    for tools in (None, [CALCULATOR_TOOL]):
        want = [template_ids(any_tok, c, tools, gen) for c, gen in chats]
        assert render_chats(any_tok, chats, tools) == want
        assert render_chats(any_tok, chats[:1], tools) == want[:1]
    assert render_chats(any_tok, [], None) == []
    text = any_tok.apply_chat_template(convs[2], tokenize=False)
    assert text.count("call_0") == (2 if any_tok.chat_template == PLAIN_TEMPLATE else 0)


def continued_alone(tok: Any, messages: list[dict[str, Any]], tools: Any, prefix: list[int]) -> list[int]:
    """The continuation as computed before batching: four `apply_chat_template` calls for one conversation."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    head, full = template_ids(tok, messages[: last + 1], tools, False), template_ids(tok, messages, tools, True)
    opened = template_ids(tok, messages[:last], tools, True)
    closed = template_ids(tok, [*messages[:last], {"role": "assistant", "content": ""}], tools, False)
    assert full[: len(head)] == head and closed[: len(opened)] == opened
    end = closed[len(opened) :]
    keep = max(k for k in range(len(end) + 1) if k == 0 or prefix[-k:] == end[:k])
    return prefix + end[keep:] + full[len(head) :]


def test_chat_prompts_equal_one_conversation_at_a_time(any_tok: Any) -> None:
    """First turns (`render_chat`) and continuations on sampled ids (ending at the turn's EOS, cut before it, and
    ids the tokenizer would not produce) in one batch: each prompt is what one conversation alone gets."""
    from pipeline.environments.chat import chat_prompts, continue_transcript

    tok = any_tok
    convs = [c for c in conversations() if any(m["role"] == "assistant" for m in c)]
    eos = tok.eos_token_id
    sampled = [
        [*render_chat(tok, user("q"), [CALCULATOR_TOOL]), 7, 8, eos],  # stopped at EOS
        [*render_chat(tok, user("q"), [CALCULATOR_TOOL]), 7, 8],  # cut at max_tokens
        [1, 2, 3, 9, 9, 9, eos],
    ]
    batch = [c for c in convs for _ in sampled] + [user("What is 1+1?"), user("hi")]
    prefixes: list[list[int] | None] = [p for _ in convs for p in sampled] + [None, None]
    want = [
        render_chat(tok, c, [CALCULATOR_TOOL]) if p is None else continued_alone(tok, c, [CALCULATOR_TOOL], p)
        for c, p in zip(batch, prefixes, strict=True)
    ]
    assert chat_prompts(tok, batch, [CALCULATOR_TOOL], prefixes) == want
    assert continue_transcript(tok, convs[0], [CALCULATOR_TOOL], sampled[1]) == want[1]
    if tok.chat_template != PLAIN_TEMPLATE:  # a template that ends a turn with EOS: the cut turn gets it added
        assert want[1] == want[0] and want[1][len(sampled[1])] == eos


def test_chat_prompts_refuse_what_one_conversation_at_a_time_refuses(tok: Any) -> None:
    """No chat template, a continued conversation without an assistant message, and a template that renders an
    earlier assistant turn differently once later messages follow (TranscriptMismatch)."""
    from pipeline.environments.chat import chat_prompts, continue_transcript

    plain = copy.deepcopy(tok)
    plain.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        chat_prompts(plain, [user("hi")], None, [None])
    with pytest.raises(ValueError, match="the conversation has none"):
        chat_prompts(tok, [user("hi"), user("hi")], None, [None, [1, 2]])
    forgetful = copy.deepcopy(tok)  # an assistant message's content only when it is the last message
    forgetful.chat_template = (
        "{% for m in messages %}<bos>{{ m['role'] }}\n{% if loop.last or m['role'] != 'assistant' %}"
        "{{ m['content'] }}{% endif %}<eos>{% endfor %}{% if add_generation_prompt %}<bos>assistant\n{% endif %}"
    )
    conv = [*user("hi"), {"role": "assistant", "content": "hello"}, *user("again")]
    assert continue_transcript(tok, conv, None, [5, 6])[:2] == [5, 6]
    with pytest.raises(TranscriptMismatch, match="does not render later messages"):
        chat_prompts(forgetful, [user("hi"), conv], None, [None, [5, 6]])
