"""The `server` backend: an OpenAI-compatible server the rollout worker owns (or is pointed at), told to load each
committed policy from the run root, and confirmed to serve it before sampling.

Built by `make_backend` for a `ServerInferenceConfig` (`inference: {type: server, adapter: levanter|sglang|vllm,
command: ..., ...}`). Sampling goes through `OpenAIBackend` (token ids + logprobs as the server sampled them,
never re-tokenised; prompt lengths checked against the server's `usage.prompt_tokens` / `prompt_token_ids`).

Promises
- `attach(run_root, model_spec_json)` names the run root; with `command`, the first `load_policy` starts the
  server as a child process (placeholders `{python}`: this interpreter, `sys.executable`; `{port}`, `{host}`,
  `{run_root}`, `{step}`, `{policy_dir}`, `{hf_dir}`, `{model_json}`), waits for `/health` (`startup_timeout_s`)
  and loads the step. The child's PATH starts with this interpreter's folder (a virtual environment's `bin/`), so a
  plain `python` in the command is the same environment's Python, not the machine's.
- Start-up rule: a server that exits before its first health check passes, on its FIRST start, cannot start at all
  (a bad command, a missing module): `ServerStartError`, a `ConfigError` on `inference.command`, so the worker
  exits with `Exit.CONFIG` (2) and the job runner does not restart it. A restarted server that exits before it is
  ready, or one not healthy within `startup_timeout_s`, is a `ServerLoadError` (exit 1, restarted). Either message
  names the server's log (`logs/<step>/<attempt>.server.log`; on a gs:// run root its gs:// URL, where the worker
  uploads it, not the temporary local file it is written to) and the last error line in it.
- `load_policy(step)`: publishes nothing itself; the adapter (`policy.inference.adapters`) tells the server to
  load `policies/step-S` (or its `hf/` folder), then `served_policy_step()` is polled until it reports `step`
  (`load_timeout_s`, else `ServerLoadError`). Only then is `loaded_step` set and sampling allowed.
- A child server that died (any signal, SIGKILL included) is restarted (at most `max_restarts` times) and told to
  load `loaded_step` again: by `load_policy` and by `generate`, which then retries the call once. Rows are
  tagged with the step the server reports; a call spanning two steps is re-rolled by the rollout manager.
- `chat` (multi-turn chat environments, `/v1/chat/completions`) is restarted and retried the same way.
- `shutdown` terminates the child server (SIGTERM, then SIGKILL after 10 s).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.config import ConfigError, ServerInferenceConfig
from pipeline.environments.chat import ChatRequest, ChatTurn
from policy.inference.adapters import ServerLoadError, make_adapter
from policy.inference.base import BackendBuild, GenerationRequest
from policy.inference.openai import OpenAIBackend, OpenAIBackendError
from policy.inference.registry import register_backend

logger = logging.getLogger(__name__)


class ServerStartError(ConfigError, ServerLoadError):
    """The child server exited before it was ready on its first start: it cannot start (see the module
    docstring); a `ConfigError` on `inference.command` (exit 2, never restarted)."""

    def __init__(self, command: str, why: str) -> None:
        ConfigError.__init__(self, "inference.command", command, why)


def child_env() -> dict[str, str]:
    """The environment of a child server: this one, with this interpreter's folder first on PATH."""
    env = dict(os.environ)
    bin_dir = os.path.dirname(sys.executable)
    parts = [p for p in env.get("PATH", "").split(os.pathsep) if p and p != bin_dir]
    env["PATH"] = os.pathsep.join([bin_dir, *parts])
    return env


def last_error_line(log_path: str | None, max_bytes: int = 65536) -> str | None:
    """The last line of the log's tail that names an error (`Error`, `error`, `Exception`), else its last
    non-empty line; None without a log or when it is empty."""
    if not log_path:
        return None
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, os.path.getsize(log_path) - max_bytes))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return None
    for line in reversed(lines):
        if "Error" in line or "error" in line or "Exception" in line:
            return line[:500]
    return lines[-1][:500] if lines else None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """A server started from a command line as a child process (its own process group), restartable."""

    def __init__(self, argv: list[str], log_path: str | None = None) -> None:
        self.argv = argv
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        """Start (or restart) the process; its output goes to `log_path` (appended) or is inherited."""
        out = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT if out else None,
                                     start_new_session=True, env=child_env())  # fmt: skip
        self.starts += 1
        logger.info("started server pid %d: %s", self.proc.pid, shlex.join(self.argv))

    def alive(self) -> bool:
        """True while the process runs."""
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        """The process id of the current incarnation."""
        return None if self.proc is None else self.proc.pid

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL after 10 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(10)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)


@register_backend(ServerInferenceConfig)
class ServerBackend(OpenAIBackend):
    """An `OpenAIBackend` whose server is told which committed policy to serve (see the module docstring)."""

    manages_weights = True

    def __init__(self, config: ServerInferenceConfig, tokenizer: Any, *, max_seq_len: int | None = None) -> None:
        port = config.port
        if config.command and port == 0:
            port = free_port(config.host)
        base_url = config.openai_base_url or f"http://{config.host}:{port}/v1"
        config = dataclasses.replace(config, openai_base_url=base_url, port=port)
        super().__init__(config, tokenizer, max_seq_len=max_seq_len)
        self.server_config = config
        root = base_url.rstrip("/")
        self.root_url = root[: -len("/v1")] if root.endswith("/v1") else root
        self.adapter = make_adapter(config.adapter, self.root_url, self._client)
        self.process: ServerProcess | None = None
        self.run_root: str | None = None
        self.model_json = "{}"
        self.loaded_step: int | None = None

    @classmethod
    def from_config(cls, config: Any, build: BackendBuild) -> ServerBackend:
        """A client (and, with `command`, the owner) of the configured server; `model` is unused."""
        return cls(config, build.tokenizer, max_seq_len=build.max_seq_len)

    @property
    def needs_hf(self) -> bool:
        """True when the server loads Hugging Face folders (`policies/step-S/hf/` must exist first)."""
        return self.adapter.needs_hf

    def attach(
        self, run_root: str, model_spec_json: str = "{}", log_path: str | None = None, log_location: str | None = None
    ) -> None:
        """Name the run root whose policies the server loads (and the model spec a launcher needs). The child
        server's output goes to the local file `log_path`; start-up errors name `log_location` (default
        `log_path`): where a user reads that log, e.g. its gs:// URL when `log_path` is a temporary local copy
        uploaded there (and removed when the worker ends)."""
        self.run_root = run_root.rstrip("/")
        self.model_json = model_spec_json
        self._log_path = log_path
        self._log_location = log_location or log_path

    def _dirs(self, step: int) -> tuple[str, str]:
        if self.run_root is None:
            raise RuntimeError("ServerBackend.attach(run_root) was not called")
        policy_dir = f"{self.run_root}/policies/step-{step:08d}"
        return policy_dir, f"{policy_dir}/hf"

    def _ensure_server(self, step: int) -> None:
        c = self.server_config
        if not c.command:
            return
        if self.process is not None and self.process.alive():
            return
        if self.process is not None and self.process.starts > c.max_restarts:
            raise ServerLoadError(f"server died {self.process.starts} times (inference.max_restarts={c.max_restarts})")
        policy_dir, hf_dir = self._dirs(step)
        fields = {"port": c.port, "host": c.host, "run_root": self.run_root, "step": step, "python": sys.executable,
                  "policy_dir": policy_dir, "hf_dir": hf_dir, "model_json": self.model_json}  # fmt: skip
        argv = [a.format(**fields) for a in shlex.split(c.command)]
        if self.process is None:
            self.process = ServerProcess(argv, getattr(self, "_log_path", None))
        else:
            logger.warning("server pid %s is dead; restarting it", self.process.pid)
            self.process.argv = argv
        if hasattr(self.adapter, "forget"):
            self.adapter.forget()
        self.process.start()
        deadline = time.monotonic() + c.startup_timeout_s
        while not self.adapter.healthy():
            if not self.process.alive():
                why = f"the server exited with {self.process.proc.returncode} before it was ready"  # type: ignore[union-attr]
                if self.process.starts == 1:
                    raise ServerStartError(c.command, why + self._log_hint())
                raise ServerLoadError(why + self._log_hint())
            if time.monotonic() > deadline:
                raise ServerLoadError(
                    f"server {self.root_url} not healthy after {c.startup_timeout_s}s" + self._log_hint()
                )
            time.sleep(0.2)

    def _log_hint(self) -> str:
        """`; see <server log's location>: <its last error line>` (empty without a log); the line is read from
        the local file, the location is where the log is kept (`attach`)."""
        path = getattr(self, "_log_path", None)
        if not path:
            return ""
        line = last_error_line(path)
        where = getattr(self, "_log_location", None) or str(Path(path))
        return f"; see {where}" + (f": {line}" if line else "")

    def load_policy(self, step: int) -> float:
        """Make the server serve committed policy `step` and confirm it; returns the seconds it took.

        A child server that dies while loading is restarted and asked again (within `max_restarts`)."""
        t0 = time.monotonic()
        policy_dir, hf_dir = self._dirs(step)
        while True:
            self._ensure_server(step)
            try:
                self.adapter.load(step, policy_dir, hf_dir, self.server_config.load_timeout_s)
                break
            except ServerLoadError:
                if not self._died():
                    raise
                logger.warning("server died while loading policy %d; restarting it", step)
        deadline = time.monotonic() + self.server_config.load_timeout_s
        while (served := self.adapter.served_step()) != step:
            if time.monotonic() > deadline:
                raise ServerLoadError(f"server {self.root_url} reports step {served} after loading {step}")
            time.sleep(0.1)
        self.loaded_step = step
        self.served_step = step
        logger.info("server %s serves policy %d (%.2fs)", self.root_url, step, time.monotonic() - t0)
        return time.monotonic() - t0

    def _died(self) -> bool:
        """True when a child server is gone (a failed request may be seen a moment before its exit is)."""
        if self.process is None or self.process.proc is None:
            return False
        try:
            self.process.proc.wait(2.0)
        except subprocess.TimeoutExpired:
            return False
        return True

    def served_policy_step(self) -> int | None:
        """The step the server reports (through the adapter)."""
        return self.adapter.served_step()

    def generate(self, request: GenerationRequest) -> Any:
        """As `OpenAIBackend.generate`; a dead child server is restarted, reloaded and the call retried once."""
        try:
            return super().generate(request)
        except OpenAIBackendError:
            if self.loaded_step is None or not self._died():
                raise
            logger.warning("server died during generation; restarting it with policy %d", self.loaded_step)
            self.load_policy(self.loaded_step)
            return super().generate(request)

    def chat(self, request: ChatRequest) -> list[ChatTurn]:
        """As `OpenAIBackend.chat`; a dead child server is restarted, reloaded and the call retried once."""
        try:
            return super().chat(request)
        except OpenAIBackendError:
            if self.loaded_step is None or not self._died():
                raise
            logger.warning("server died during a chat call; restarting it with policy %d", self.loaded_step)
            self.load_policy(self.loaded_step)
            return super().chat(request)

    def shutdown(self) -> None:
        """Close the client and stop a child server."""
        if self.process is not None:
            self.process.stop()
        super().shutdown()
