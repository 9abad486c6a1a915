"""Loopback HTTP servers implementing exactly the weight-reload endpoints and payloads of the pinned SGLang and vLLM
versions (see `policy/inference/adapters/sglang.py` and `vllm.py`), plus `/v1/completions` in vLLM's response
format (token ids, prompt token ids, logprobs) and, given a tokenizer with a chat template, `/v1/chat/completions`
in vLLM's format (`prompt_token_ids`, choice `token_ids`, `message.tool_calls`, `logprobs.content` entries named
`token_id:<id>`; see `policy/inference/openai_chat.py`). They record every request they receive.

As a program, `python tests/fake_servers.py launcher --host H --port P [--step S] [--api_key K] [--key_env NAME]`
is a stand-in of
rlpipe's levanter launcher (`policy.inference.adapters.levanter_server`) without JAX, speaking the same address and
identity protocol through the same helpers (`pipeline.process.ports`, `pipeline.process.listener`): it binds its
own port (`--port 0`: one the kernel picks; a port in use: it exits, saying so), announces the bound address in
`RLPIPE_SERVER_ANNOUNCE`, and refuses with 401, on every route, a request without the secret of
`RLPIPE_SERVER_TOKEN` (or `--api_key`, as vLLM and SGLang take it, or the variable `--key_env` names, as vLLM reads
`VLLM_API_KEY`). It serves `/health`, `/v1/models`,
`POST /rlpipe/load_policy`, `GET /rlpipe/policy_step` (`{"step", "pid"}`: its own process id, so a client can tell
which server answered) and vLLM's reload routes (`/collective_rpc`, `/reset_prefix_cache`).

The chat "model" is scripted: after a user message asking "What is EXPR?" it calls the `calculator` tool with
EXPR; after a tool message it answers "Answer: <tool result>"; otherwise "I do not know.". The sampled ids are the
tokens the chat template renders for that assistant message (so later prompts extend the transcript exactly).
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeServer:
    """`kind` "sglang" or "vllm"; serves on 127.0.0.1:<free port> in a daemon thread."""

    def __init__(self, kind: str, model_path: str, tokenizer: Any = None) -> None:
        self.kind = kind
        self.model_path = model_path
        self.tokenizer = tokenizer
        self.chat_prompt_ids = True
        """False: answer chats without `prompt_token_ids` / `token_ids` (as vLLM < 0.10.2 and SGLang do)."""
        self.chat_logprob = -0.5
        self.requests: list[tuple[str, str, Any]] = []
        self.echo_prompt_shift = 0
        """Nonzero: the prompt ids the server says it saw are shifted by this much (a misbehaving server)."""
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, obj: Any) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                owner.requests.append(("GET", self.path, None))
                code, obj = owner.get(self.path)
                self._send(code, obj)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                owner.requests.append(("POST", self.path, body))
                code, obj = owner.post(self.path, body)
                self._send(code, obj)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def get(self, path: str) -> tuple[int, Any]:
        if path == "/health":
            return 200, {}
        if self.kind == "sglang" and path == "/get_model_info":
            return 200, {"model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True}
        if path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": "policy", "object": "model"}]}
        return 404, {"detail": "Not Found"}

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        if self.kind == "sglang" and path == "/update_weights_from_disk":
            self.model_path = body["model_path"]
            return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
        if self.kind == "vllm" and path == "/collective_rpc":
            if body["method"] == "update_config":
                self.model_path = body["args"][0]["model_config"]["model"]
            return 200, {"results": [None]}
        if self.kind == "vllm" and path == "/reset_prefix_cache":
            return 200, {}
        if path == "/v1/completions":
            return 200, self.completion(body)
        if path == "/v1/chat/completions" and self.tokenizer is not None:
            return 200, self.chat(body)
        return 404, {"detail": "Not Found"}

    def completion(self, body: dict[str, Any]) -> dict[str, Any]:
        """vLLM's completion format: `token_ids`, `prompt_token_ids`, `logprobs.token_logprobs` per choice."""
        choices = []
        for prompt in body["prompt"]:
            for _ in range(body.get("n", 1)):
                ids = [(7 + k) % 100 + 4 for k in range(body["max_tokens"])]
                choices.append({"index": len(choices), "text": "", "finish_reason": "length", "token_ids": ids,
                                "prompt_token_ids": [t + self.echo_prompt_shift for t in prompt],
                                "logprobs": {"tokens": [f"token_id:{t}" for t in ids],
                                             "token_logprobs": [-1.0] * len(ids)}})  # fmt: skip
        return {"id": "cmpl-1", "object": "text_completion", "model": body["model"], "choices": choices}

    def _assistant(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        last = messages[-1]
        m = re.search(r"What is (.+?)\?", str(last.get("content") or ""))
        if last["role"] == "user" and m:
            args = json.dumps({"expression": m.group(1)})
            call = {"id": f"chatcmpl-tool-{len(self.requests)}", "type": "function",
                    "function": {"name": "calculator", "arguments": args}}  # fmt: skip
            return {"role": "assistant", "content": None, "tool_calls": [call]}
        if last["role"] == "tool":
            return {"role": "assistant", "content": f"Answer: {last['content']}", "tool_calls": []}
        return {"role": "assistant", "content": "I do not know.", "tool_calls": []}

    def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """vLLM's chat completion format for the scripted assistant turn (see the module docstring)."""
        tok, messages, tools = self.tokenizer, body["messages"], body.get("tools")
        msg = self._assistant(messages)
        prompt = list(tok.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=True))
        full = list(tok.apply_chat_template([*messages, msg], tools=tools, tokenize=True))
        assert full[: len(prompt)] == prompt, "the template does not extend the prompt"
        ids, finish = full[len(prompt) :], "tool_calls" if msg["tool_calls"] else "stop"
        if len(ids) > body["max_tokens"]:
            ids, finish, msg = (
                ids[: body["max_tokens"]],
                "length",
                {"role": "assistant", "content": "", "tool_calls": []},
            )
        content = [{"token": f"token_id:{t}", "logprob": self.chat_logprob, "bytes": None, "top_logprobs": []}
                   for t in ids]  # fmt: skip
        choice: dict[str, Any] = {"index": 0, "message": msg, "logprobs": {"content": content}, "finish_reason": finish}
        out: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion", "model": body["model"],
                               "choices": [choice],
                               "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                                         "total_tokens": len(prompt) + len(ids)}}  # fmt: skip
        if self.chat_prompt_ids and body.get("return_token_ids"):
            out["prompt_token_ids"] = prompt
            choice["token_ids"] = ids
        return out

    def stop(self) -> None:
        self.httpd.shutdown()


def launcher(argv: list[str]) -> int:
    """The stand-in of rlpipe's levanter launcher (see the module docstring); serves until killed."""
    import argparse

    from pipeline.process.listener import BoundedHandler, BoundedHTTPServer
    from pipeline.process.ports import ServerIdentity, bind_listener

    p = argparse.ArgumentParser(prog="fake_servers.py launcher")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--step", type=int, default=0)
    p.add_argument("--api_key", default=None)
    p.add_argument("--key_env", default=None)
    a = p.parse_args(argv)
    identity = ServerIdentity.from_env()
    key = a.api_key or (os.environ[a.key_env] if a.key_env else None)
    if key:
        identity = ServerIdentity(key, identity.announce_file)
    state = {"step": a.step}

    class Handler(BoundedHandler):
        def _send(self, code: int, obj: Any) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("X-Policy-Step", str(state["step"]))
            self.end_headers()
            self.wfile.write(data)

        def _allowed(self) -> bool:
            if identity.check(self.headers):
                return True
            self._send(401, {"error": {"message": "a valid bearer token is required", "code": 401}})
            return False

        def do_GET(self) -> None:
            if not self._allowed():
                return
            if self.path == "/health":
                self._send(200, {"status": "ok"})
            elif self.path == "/rlpipe/policy_step":
                self._send(200, {"step": state["step"], "pid": os.getpid()})
            elif self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": f"policy@step-{state['step']:08d}"}]})
            else:
                self._send(404, {"detail": "Not Found"})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if not self._allowed():
                return
            if self.path == "/rlpipe/load_policy":
                state["step"] = int(body["step"])
                self._send(200, {"step": state["step"]})
            elif self.path == "/collective_rpc":
                self._send(200, {"results": [None]})
            elif self.path == "/reset_prefix_cache":
                self._send(200, {})
            else:
                self._send(404, {"detail": "Not Found"})

    try:
        sock = bind_listener(a.host, a.port)
    except OSError as e:
        print(f"OSError: {e}", file=sys.stderr, flush=True)  # e.g. [Errno 98] Address already in use
        return 1
    server = BoundedHTTPServer.from_socket(sock, Handler, max_connections=16, read_timeout_s=30.0)
    identity.announce(sock)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["launcher"]:
        raise SystemExit("usage: python tests/fake_servers.py launcher [--host H] [--port P] [--step S]")
    raise SystemExit(launcher(sys.argv[2:]))
