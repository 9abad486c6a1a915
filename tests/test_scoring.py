"""Scorers (`pipeline.scoring`) and the judged environment (`pipeline.environments.judged`).

The judge is tested against a real HTTP server on loopback that speaks the OpenAI completions format (a stand-in
for a third-party judge endpoint, whose replies each test chooses), through the judge's real httpx client: score
rules, retries after 5xx, timeouts, a refused connection, the concurrency bound. The reward model is a tiny
randomly initialised Llama sequence-classification model written with `save_pretrained` (no hub), checked
against torch run on each pair alone.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeline.config.base import ConfigError
from pipeline.environments import SampleSpec, ScriptedContext
from pipeline.environments.exact_answer import normalize_answer
from pipeline.environments.judged import JudgedEnv
from pipeline.environments.tokenizer import load_tokenizer
from pipeline.process.ports import reserve_port
from pipeline.scoring import ScorerConfigError, ScoreRequest, build_scorer, check_scorer

Reply = Callable[[dict[str, Any]], tuple[int, Any, float]]
"""request body -> (HTTP status, JSON body, seconds to wait before answering)."""


class JudgeServer:
    """A loopback OpenAI-style server: `/v1/completions` and `/v1/chat/completions` answered by `reply`."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.bodies: list[tuple[str, dict[str, Any]]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.headers: list[str | None] = []
        lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    owner.bodies.append((self.path, body))
                    owner.headers.append(self.headers.get("Authorization"))
                    owner.in_flight += 1
                    owner.max_in_flight = max(owner.max_in_flight, owner.in_flight)
                try:
                    status, obj, wait = owner.reply(body)
                    time.sleep(wait)
                finally:
                    # counted out before the reply is sent: once the client has it, it may send its next request
                    # before this thread runs again (a loaded machine), which is not a request beyond the bound
                    with lock:
                        owner.in_flight -= 1
                try:
                    data = json.dumps(obj).encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def completion(text: str, chat: bool = False) -> dict[str, Any]:
    choice = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
    return {"choices": [{"index": 0, "finish_reason": "stop", **choice}]}


@pytest.fixture
def serve() -> Iterator[Callable[[Reply], JudgeServer]]:
    servers: list[JudgeServer] = []

    def start(reply: Reply) -> JudgeServer:
        servers.append(JudgeServer(reply))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def _judge(base_url: str, **kw: Any) -> Any:
    return build_scorer({"type": "judge", "base_url": base_url, "chat": False, "retry_backoff_s": 0.01, **kw})


REQS = [
    ScoreRequest(prompt=f"task {i}", response=f"answer {i}", example_id=f"e{i}", ground_truth=str(i)) for i in range(6)
]


def test_number_rule_scores_each_request_in_order_from_the_rendered_prompt(serve: Any) -> None:
    # the judge "rates" each response with the number in it: the score must follow each request, in order
    def reply(body: dict[str, Any]) -> tuple[int, Any, float]:
        n = int(body["prompt"].split("R=answer ")[1].split(";")[0])
        return 200, completion(f"thinking... <score>{2 * n}</score>"), 0.01 * (6 - n)

    srv = serve(reply)
    judge = _judge(srv.base_url, prompt="P={prompt}; R={response}; A={answer}", model="m", max_concurrency=3)
    out = judge.score_batch(REQS)
    judge.close()
    assert [o.ok for o in out] == [True] * 6
    assert [o.value for o in out] == pytest.approx([2 * i / 10 for i in range(6)])  # score_range [0, 10] -> [0, 1]
    assert [o.extracted for o in out] == [str(2 * i) for i in range(6)]
    prompts = sorted(b["prompt"] for _, b in srv.bodies)
    assert prompts == sorted(f"P=task {i}; R=answer {i}; A={i}" for i in range(6))
    assert {p for p, _ in srv.bodies} == {"/v1/completions"}
    assert all(b["model"] == "m" and b["temperature"] == 0.0 for _, b in srv.bodies)
    assert 2 <= srv.max_in_flight <= 3  # concurrent, and bounded by max_concurrency


def test_unparsable_and_out_of_range_replies_are_failures_with_their_reason(serve: Any) -> None:
    replies = iter(["no score here", "<score>11</score>", "<score>7</score>"])
    srv = serve(lambda body: (200, completion(next(replies)), 0.0))
    judge = _judge(srv.base_url, max_concurrency=1)
    out = judge.score_batch(REQS[:3])
    judge.close()
    assert out[0].value is None and "no match of score_pattern" in str(out[0].reason) and out[0].raw == "no score here"
    assert out[1].value is None and "outside score_range [0, 10]" in str(out[1].reason)
    assert out[2].ok and out[2].value == pytest.approx(0.7)


def test_label_and_match_rules_and_chat_route(serve: Any) -> None:
    srv = serve(lambda body: (200, completion(body["messages"][-1]["content"].split("|")[1], chat=True), 0.0))
    label = build_scorer(
        {"type": "judge", "base_url": srv.base_url, "prompt": "x|{response}|", "rule": "label",
         "score_pattern": r"(?i)\b(yes|no|maybe)\b", "labels": {"Yes": 1.0, "no": 0.0},
         "system_prompt": "You judge.", "api_key": "sekrit"}
    )  # fmt: skip
    reqs = [ScoreRequest("p", r) for r in ("YES indeed", "well no", "maybe", "nothing")]
    out = label.score_batch(reqs)
    label.close()
    assert [o.value for o in out[:2]] == [1.0, 0.0]
    assert "label 'maybe' is not one of ['no', 'yes']" in str(out[2].reason)
    assert "no match" in str(out[3].reason)
    assert srv.bodies[0][0] == "/v1/chat/completions"
    assert srv.bodies[0][1]["messages"][0] == {"role": "system", "content": "You judge."}
    assert set(srv.headers) == {"Bearer sekrit"}
    match = build_scorer({"type": "judge", "base_url": srv.base_url, "prompt": "x|{response}|", "rule": "match",
                          "score_pattern": "(?i)yes"})  # fmt: skip
    assert [o.value for o in match.score_batch(reqs)] == [1.0, 0.0, 0.0, 0.0]
    match.close()


def test_transport_failures_are_retried_then_fail_with_the_cause(serve: Any) -> None:
    calls: list[int] = []

    def flaky(body: dict[str, Any]) -> tuple[int, Any, float]:
        calls.append(1)
        return (503, {"error": "busy"}, 0.0) if len(calls) < 3 else (200, completion("<score>10</score>"), 0.0)

    srv = serve(flaky)
    judge = _judge(srv.base_url, max_retries=2)
    (out,) = judge.score_batch(REQS[:1])
    assert out.ok and out.value == 1.0 and len(calls) == 3  # two 503s retried, the third attempt scored
    judge.close()
    slow = serve(lambda body: (200, completion("<score>1</score>"), 2.0))
    judge = _judge(slow.base_url, max_retries=1, timeout_s=0.2)
    (out,) = judge.score_batch(REQS[:1])
    judge.close()
    assert out.value is None and "failed after 2 attempt(s): timed out after 0.2s" in str(out.reason)
    assert out.latency_s >= 0.4
    bad = serve(lambda body: (400, {"error": {"message": "prompt too long"}}, 0.0))
    judge = _judge(bad.base_url, max_retries=3)
    (out,) = judge.score_batch(REQS[:1])
    judge.close()
    assert "HTTP 400" in str(out.reason) and "prompt too long" in str(out.reason) and len(bad.bodies) == 1
    with reserve_port() as held:  # bound, never listening, held: a connection is refused, nobody else can take it
        port = held.port
        judge = _judge(f"http://127.0.0.1:{port}/v1", max_retries=1)
        (out,) = judge.score_batch(REQS[:1])
        judge.close()
    assert out.value is None and "ConnectError" in str(out.reason) and f"127.0.0.1:{port}" in str(out.reason)


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"type": "judge"}, "base_url"),
        ({"type": "judge", "base_url": "http://x/v1", "rule": "vibes"}, "rule"),
        ({"type": "judge", "base_url": "http://x/v1", "score_pattern": "(unclosed"}, "score_pattern"),
        ({"type": "judge", "base_url": "http://x/v1", "prompt": "{prompt} {oops}"}, "prompt"),
        ({"type": "judge", "base_url": "http://x/v1", "rule": "label"}, "labels"),
        ({"type": "judge", "base_url": "http://x/v1", "timeout_s": 0}, "timeout_s"),
        ({"type": "judge", "base_url": "http://x/v1", "max_concurency": 2}, "max_concurency"),
        ({"type": "reward_model", "path": "/no/such/folder"}, "path"),
        ({"type": "function", "function": "no_such_module.fn"}, "function"),
        ({"type": "rm"}, "type"),
    ],
)
def test_bad_scorer_specs_name_the_field(spec: dict[str, Any], field: str) -> None:
    with pytest.raises(ScorerConfigError) as e:
        check_scorer(spec)
    assert e.value.field == field


# -- the judged environment ------------------------------------------------------------------------------------


@pytest.fixture
def qa_file(tmp_path: Path) -> str:
    path = tmp_path / "qa.jsonl"
    rows = [{"id": f"q{i}", "prompt": f"what is {i} plus {i}", "answer": str(2 * i)} for i in range(4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_judged_env_records_each_reward_function_and_fails_examples_the_judge_could_not_score(
    serve: Any, qa_file: str
) -> None:
    tok = load_tokenizer("builtin:tiny")

    def reply(body: dict[str, Any]) -> tuple[int, Any, float]:
        # the judge gives 10 when the response contains the reference answer, 0 otherwise; it cannot judge q3
        if "task=what is 3 plus 3" in body["prompt"]:
            return 200, completion("I cannot say."), 0.0
        resp, answer = body["prompt"].split("resp=")[1].split(" ref=")
        return 200, completion(f"<score>{10 if answer in resp else 0}</score>"), 0.0

    srv = serve(reply)
    env = JudgedEnv(
        base={"env_class": "pipeline.environments.exact_answer.ExactAnswerEnv", "env_args": {"path": qa_file}},
        scorers=[{"type": "judge", "name": "judge", "base_url": srv.base_url, "chat": False, "weight": 2.0,
                  "prompt": "task={prompt} resp={response} ref={answer}"},
                 {"type": "function", "name": "exact", "weight": 0.0,
                  "function": "pipeline.environments.exact_answer.normalized_match"}],
        base_weight=0.5,
    )  # fmt: skip
    answers = {"what is 0 plus 0": "0", "what is 1 plus 1": "the answer is 2", "what is 2 plus 2": "5"}

    def script(prompt: str) -> str:
        return next((a for q, a in answers.items() if q in prompt), "3")

    spec = SampleSpec(4, 2, 1.0, 8, None, "eval")
    result = env.sample(ScriptedContext(tok, script), spec, np.random.default_rng(0))
    env.close()
    by_id = {g.rollouts[0].example_id: g for g in result.groups}
    assert sorted(by_id) == ["q0", "q1", "q2"]
    (failure,) = result.failures
    assert failure.example_id == "q3" and "scorer 'judge'" in failure.reason and "no match" in failure.reason
    for ex_id, truth in (("q0", "0"), ("q1", "2"), ("q2", "4")):
        for r in by_id[ex_id].rollouts:
            rule = float(normalize_answer(r.response_text) == normalize_answer(truth))
            judge = 1.0 if truth in r.response_text else 0.0
            assert r.ground_truth == truth
            assert r.reward_components == {"exact_answer": rule, "judge": judge, "exact": rule}
            assert r.episode_reward == pytest.approx(0.5 * rule + 2.0 * judge)
            assert r.token_rewards[-1] == pytest.approx(r.episode_reward) and sum(r.token_rewards) == pytest.approx(
                r.episode_reward
            )
    assert by_id["q1"].rollouts[0].reward_components["judge"] == 1.0  # "the answer is 2" contains "2"
    assert result.metrics["n_scored/judge"] == 6 and result.metrics["n_scorer_failures/judge"] == 2
    assert result.metrics["n_failures"] == 1
    assert result.metrics["reward_component/judge"] == pytest.approx(4 / 6)
    assert result.metrics["scorer_latency_s/judge"] > 0


def test_judged_env_check_args_names_the_bad_argument(qa_file: str) -> None:
    base = {"env_class": "pipeline.environments.exact_answer.ExactAnswerEnv", "env_args": {"path": qa_file}}
    cases = [
        ({"base": base, "scorers": []}, "scorers"),
        ({"base": base, "scorers": [{"type": "judge", "base_url": "ftp://x"}]}, "scorers[0].base_url"),
        ({"base": {"env_class": "pipeline.environments.exact_answer.ExactAnswerEnv", "env_args": {"path": "/no.jsonl"}},
          "scorers": [{"type": "function", "function": "builtins.len"}]}, "base.env_args.path"),
        ({"base": {"env_class": "no.such.Env"}, "scorers": [{"type": "function", "function": "builtins.len"}]},
         "base.env_class"),
        ({"base": base, "scorers": [{"type": "function", "function": "builtins.len"}] * 2}, "scorers[1].name"),
    ]  # fmt: skip
    for args, field in cases:
        with pytest.raises(ConfigError) as e:
            JudgedEnv.check_args(args)
        assert e.value.field == field, (args, str(e.value))


# -- the reward model ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory: pytest.TempPathFactory) -> str:
    torch = pytest.importorskip("torch")
    import transformers

    from pipeline.environments.tokenizer import build_tiny_tokenizer

    folder = tmp_path_factory.mktemp("rm")
    tok = build_tiny_tokenizer()
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=128, num_labels=1, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForSequenceClassification(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def test_reward_model_scores_pairs_in_batches_as_torch_does_one_by_one(tiny_rm: str) -> None:
    import torch
    import transformers

    rm = build_scorer({"type": "reward_model", "name": "rm", "path": tiny_rm, "batch_size": 3})
    reqs = [ScoreRequest(f"tell me about {w}", f" {w} is a nice animal" * (i % 3 + 1)) for i, w in
            enumerate(["cats", "dogs", "fish", "mouse", "kitty"])]  # fmt: skip
    out = rm.score_batch(reqs)
    assert all(o.ok for o in out)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(tiny_rm, local_files_only=True).eval()
    tok = transformers.AutoTokenizer.from_pretrained(tiny_rm, local_files_only=True)
    with torch.no_grad():
        alone = [float(model(**tok(r.prompt + r.response, return_tensors="pt")).logits[0, 0]) for r in reqs]
    assert [o.value for o in out] == pytest.approx(alone, abs=1e-4)
    assert len({round(v, 4) for v in alone}) == len(alone)  # the texts really get different scores
    sig = build_scorer({"type": "reward_model", "path": tiny_rm, "sigmoid": True, "batch_size": 8})
    assert [o.value for o in sig.score_batch(reqs)] == pytest.approx([1 / (1 + np.exp(-v)) for v in alone], abs=1e-4)
