"""The `server` backend: an OpenAI-compatible server the rollout worker owns (or is pointed at), told to load each
committed policy from the run root, and confirmed to serve it before sampling.

Built by `make_backend` for a `ServerInferenceConfig` (`inference: {type: server, adapter: levanter|sglang|vllm,
command: ..., ...}`). Sampling goes through `OpenAIBackend` (token ids + logprobs as the server sampled them,
never re-tokenised; prompt lengths checked against the server's `usage.prompt_tokens` / `prompt_token_ids`).

Promises
- `attach(run_root, model_spec_json)` names the run root; with `command`, the first `load_policy` starts the
  server as a child process (placeholders `{python}`: this interpreter, `sys.executable`; `{port}`, `{host}`,
  `{api_key}`, `{announce_file}`, `{run_root}`, `{step}`, `{policy_dir}`, `{hf_dir}`, `{model_json}`), waits until
  it is ready (`startup_timeout_s`) and loads the step. The child's PATH starts with this interpreter's folder (a
  virtual environment's `bin/`), so a plain `python` in the command is the same environment's Python, not the
  machine's.
- No port is handed over (`pipeline.process.ports`). With `port: 0` and a server that announces
  (`adapter: levanter`, rlpipe's launcher), `{port}` is 0: the child binds a port itself and writes the bound
  `host:port` to the file named in `RLPIPE_SERVER_ANNOUNCE` (also `{announce_file}`); the worker waits for it
  (while checking that the child lives) and talks to that address only. A server that must be given a number
  (vLLM, SGLang) gets one the worker picks; a start that finds it taken (the child exits saying "address already
  in use", or a foreign server answers the identity check) is stopped and retried on another port, at most
  `PORT_CLASH_RETRIES` times, and is neither a start nor a config error. A fixed `port` is used as given.
- Identity: every start gets a fresh secret (`RLPIPE_SERVER_TOKEN` in the child's environment, and in the
  adapter's `secret_env` where it has one: `VLLM_API_KEY` for vLLM; and `{api_key}`), sent with every request as
  `Authorization: Bearer <secret>`. Before the first request the worker asks the adapter's `identity_route` with it
  (must be 200) and, when the server checks the secret (rlpipe's launcher, vLLM, or a command that passes
  `{api_key}`), with a wrong one (must be 401). Anything else is a foreign server: one line,
  `ServerLoadError("a foreign server answers on HOST:PORT: GET /route -> 404 ...")`. Without `command`, the same
  check runs before the first request when `api_key_env` names the server's key.
- Start-up rule: a server that exits before it is ready, on its FIRST start, cannot start at all (a bad
  command, a missing module, a fixed port in use): `ServerStartError`, a `ConfigError` on `inference.command`, so
  the worker exits with `Exit.CONFIG` (2) and the job runner does not restart it. A restarted server that exits
  before it is ready, or one not ready within `startup_timeout_s`, is a `ServerLoadError` (exit 1, restarted).
  Either message names the server's log (`logs/<step>/<attempt>.server.log`; on a gs:// run root its gs:// URL,
  where the worker uploads it, not the temporary local file it is written to) and the last error line in it.
- `load_policy(step)`: publishes nothing itself; the adapter (`policy.inference.adapters`) tells the server to
  load `policies/step-S` (or its `hf/` folder), then `served_policy_step()` is polled until it reports `step`
  (`load_timeout_s`, else `ServerLoadError`). Only then is `loaded_step` set and sampling allowed.
- A child server that died (any signal, SIGKILL included) is restarted (at most `max_restarts` times; a new
  secret, and a new port when the worker owns it) and told to load `loaded_step` again: by `load_policy` and by
  `generate`, which then retries the call once. Rows are tagged with the step the server reports; a call
  spanning two steps is re-rolled by the rollout manager.
- `chat` (multi-turn chat environments, `/v1/chat/completions`) is restarted and retried the same way.
- `shutdown` terminates the child server (SIGTERM, then SIGKILL after 10 s).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx

from pipeline.config import ConfigError, ServerInferenceConfig
from pipeline.environments.chat import ChatRequest, ChatTurn
from pipeline.process.parent_watch import tied_command
from pipeline.process.ports import (
    ANNOUNCE_ENV,
    TOKEN_ENV,
    Announcement,
    address_in_use,
    candidate_port,
    connect_host,
    new_secret,
    read_announcement,
    url_host,
)
from policy.inference.adapters import ServerLoadError, make_adapter
from policy.inference.base import BackendBuild, GenerationRequest
from policy.inference.openai import OpenAIBackend, OpenAIBackendError
from policy.inference.registry import register_backend

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

PORT_CLASH_RETRIES = 5
"""Starts in a row on a port the worker picked that another program held, each retried on a new port."""
POLL_S = 0.05
"""How often a starting server's announcement, identity and health are checked."""
IDENTITY_TIMEOUT_S = 5.0
"""Seconds an identity request may take."""


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


def _one_line(text: str, limit: int = 300) -> str:
    return " ".join(text.split())[:limit]


class ServerProcess:
    """A server started from a command line as a child process (its own process group), restartable, tied to this
    process: it is stopped once this process is gone (`pipeline.process.parent_watch.tied_command`).

    `secrets`: strings of `argv` shown as `<secret>` when the command is logged."""

    def __init__(self, argv: list[str], log_path: str | None = None) -> None:
        self.argv = argv
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.secrets: list[str] = []
        self._log_offset = 0

    def start(self, env: dict[str, str] | None = None) -> None:
        """Start (or restart) the process, `env` added to its environment; its output goes to `log_path`
        (appended) or is inherited."""
        self._log_offset = 0
        if self.log_path and os.path.exists(self.log_path):
            self._log_offset = os.path.getsize(self.log_path)
        full_env = {**child_env(), **(env or {})}
        # tied to this process: a step that dies (a SIGKILL included) takes its server with it, not leaving it to
        # hold the port, the memory and the accelerator
        argv = tied_command(self.argv, full_env)
        if self.log_path:
            with open(self.log_path, "ab") as out:  # the child has its own copy of the descriptor
                self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                             start_new_session=True, env=full_env)  # fmt: skip
        else:
            self.proc = subprocess.Popen(argv, start_new_session=True, env=full_env)
        self.starts += 1
        logger.info("started server pid %d: %s", self.proc.pid, self.shown())

    def shown(self) -> str:
        """The command line as it may be logged (secrets hidden)."""
        line = shlex.join(self.argv)
        for secret in self.secrets:
            line = line.replace(secret, "<secret>")
        return line

    def output_since_start(self, max_bytes: int = 65536) -> str:
        """What the current incarnation wrote to its log (its last `max_bytes`; empty without a log)."""
        if not self.log_path:
            return ""
        try:
            with open(self.log_path, "rb") as f:
                size = os.path.getsize(self.log_path)
                f.seek(max(self._log_offset, size - max_bytes))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

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


class _PortClash(Exception):
    """A start on a port the worker picked found it taken (retried on another port)."""


@register_backend(ServerInferenceConfig)
class ServerBackend(OpenAIBackend):
    """An `OpenAIBackend` whose server is told which committed policy to serve (see the module docstring)."""

    manages_weights = True

    def __init__(self, config: ServerInferenceConfig, tokenizer: Any, *, max_seq_len: int | None = None) -> None:
        base_url = config.openai_base_url or f"http://{url_host(connect_host(config.host))}:{config.port}/v1"
        config = dataclasses.replace(config, openai_base_url=base_url)
        super().__init__(config, tokenizer, max_seq_len=max_seq_len)
        self.server_config = config
        self.adapter = make_adapter(config.adapter, self._root(base_url), self._client)
        self.root_url = self.adapter.root_url
        url = httpx.URL(base_url)
        self.address = f"{url_host(url.host)}:{url.port or (443 if url.scheme == 'https' else 80)}"
        """`host:port` of the server (for a server that announces, known once it started)."""
        self.process: ServerProcess | None = None
        self.run_root: str | None = None
        self.model_json = "{}"
        self.loaded_step: int | None = None
        self.owns_port = bool(config.command) and config.port == 0
        """The worker chooses the port (`port: 0` with `command`): announced by the server, or picked and retried."""
        self.announced = self.owns_port and self.adapter.announces
        """The server binds its own port and announces it (`{port}` is 0)."""
        self.checks_secret = bool(config.command) and (
            self.adapter.announces or bool(self.adapter.secret_env) or "{api_key}" in (config.command or "")
        )
        """The started server refuses requests without this start's secret (checked before the first request)."""
        if not config.command:
            self.checks_secret = bool(config.api_key_env)
        self._identity_known = False
        self._announce_dir: str | None = None
        if config.command and not self.checks_secret:
            logger.warning(
                "inference.command does not pass {api_key}: the %s server will not check the worker's secret, so a "
                "foreign server on its port cannot be told from it (SGLang: add --api-key {api_key})",
                config.adapter,
            )

    @staticmethod
    def _root(base_url: str) -> str:
        root = base_url.rstrip("/")
        return root[: -len("/v1")] if root.endswith("/v1") else root

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

    def _set_address(self, host: str, port: int) -> None:
        """Talk to the server on `host:port` from now on."""
        self.address = f"{url_host(connect_host(host))}:{port}"
        self.root_url = f"http://{self.address}"
        self.adapter.root_url = self.root_url
        self.set_base_url(f"{self.root_url}/v1")

    def identity(self) -> tuple[str, str]:
        """Ask the server who it is (see the module docstring): ("ours", ""), ("foreign", the one line naming the
        address and what answered) or ("down", why: no answer, or a 5xx)."""
        route = self.adapter.identity_route
        url = f"{self.root_url}{route}"
        try:
            r = self._client.get(url, timeout=IDENTITY_TIMEOUT_S)
        except httpx.HTTPError as e:
            return "down", f"GET {route} failed: {type(e).__name__}"
        if r.status_code >= 500:
            return "down", f"GET {route} -> {r.status_code} {_one_line(r.text)}"
        if r.status_code != 200:
            answer = f"{r.status_code} {_one_line(r.text)}"
            return "foreign", f"a foreign server answers on {self.address}: GET {route} -> {answer}"
        if self.checks_secret:
            try:
                bad = self._client.get(url, headers={"Authorization": f"Bearer {new_secret()}"}, timeout=5.0)
            except httpx.HTTPError as e:
                return "down", f"GET {route} failed: {type(e).__name__}"
            if bad.status_code != 401:
                return "foreign", (
                    f"a foreign server answers on {self.address}: GET {route} with a wrong secret -> "
                    f"{bad.status_code} (the server started for this worker refuses it with 401)"
                )
        return "ours", ""

    def _ensure_server(self, step: int) -> None:
        c = self.server_config
        if not c.command:
            if self.checks_secret and not self._identity_known:
                verdict, why = self.identity()
                if verdict == "foreign":
                    raise ServerLoadError(why)
                self._identity_known = verdict == "ours"
            return
        if self.process is not None and self.process.alive():
            return
        if self.process is not None and self.process.starts > c.max_restarts:
            raise ServerLoadError(f"server died {self.process.starts} times (inference.max_restarts={c.max_restarts})")
        if self.process is not None:
            logger.warning("server pid %s is dead; restarting it", self.process.pid)
        for clash in range(PORT_CLASH_RETRIES + 1):
            try:
                self._start(step)
                return
            except _PortClash as e:
                assert self.process is not None
                self.process.starts -= 1  # somebody else's server on the port: not a start of this one
                if clash == PORT_CLASH_RETRIES:
                    raise ServerLoadError(
                        f"{e}; {clash + 1} ports in a row were taken before the server bound them"
                    ) from None
                logger.warning("%s; starting the server again on another port", e)

    def _start(self, step: int) -> None:
        """Start the child server once and wait until it is ready and is ours (`_PortClash`: the port the worker
        picked was taken)."""
        c = self.server_config
        assert c.command is not None
        policy_dir, hf_dir = self._dirs(step)
        secret = new_secret()
        port = 0 if self.announced else candidate_port(c.host) if self.owns_port else c.port
        if self._announce_dir is None:
            self._announce_dir = tempfile.mkdtemp(prefix="rlpipe-server-")
        announce_file = os.path.join(self._announce_dir, "address.json")
        if os.path.exists(announce_file):
            os.remove(announce_file)
        fields = {"port": port, "host": c.host, "api_key": secret, "announce_file": announce_file,
                  "run_root": self.run_root, "step": step, "python": sys.executable, "policy_dir": policy_dir,
                  "hf_dir": hf_dir, "model_json": self.model_json}  # fmt: skip
        argv = [a.format(**fields) for a in shlex.split(c.command)]
        if self.process is None:
            self.process = ServerProcess(argv, getattr(self, "_log_path", None))
        else:
            self.process.argv = argv
        self.process.secrets = [secret]
        if hasattr(self.adapter, "forget"):
            self.adapter.forget()
        self.set_api_key(secret)
        if not self.announced:
            self._set_address(c.host, port)
        env = {TOKEN_ENV: secret, ANNOUNCE_ENV: announce_file}
        if self.adapter.secret_env:
            env[self.adapter.secret_env] = secret
        self.process.start(env)
        deadline = time.monotonic() + c.startup_timeout_s
        if self.announced:
            where = self._wait_for_announcement(announce_file, deadline)
            self._set_address(where.host, where.port)
            logger.info("server pid %s announced %s", where.pid, self.address)
        last = ""
        while True:
            verdict, why = self.identity()  # first: a foreign server on a given port answers before ours exits
            if verdict == "foreign":
                self.process.stop()
                if self.owns_port and not self.announced:
                    raise _PortClash(why)
                raise ServerLoadError(why)
            if verdict == "ours" and self.adapter.healthy():
                return
            last = why or "not healthy yet"
            if not self.process.alive():
                if self.owns_port and not self.announced and address_in_use(self.process.output_since_start()):
                    raise _PortClash(f"port {port} on {c.host} was taken before the server bound it")
                self._exited()
            if time.monotonic() > deadline:
                raise ServerLoadError(
                    f"server {self.root_url} not ready after {c.startup_timeout_s}s ({last})" + self._log_hint()
                )
            time.sleep(POLL_S)

    def _wait_for_announcement(self, path: str, deadline: float) -> Announcement:
        assert self.process is not None
        while True:
            found = read_announcement(path)
            if found is not None:
                return found
            if not self.process.alive():
                self._exited()
            if time.monotonic() > deadline:
                raise ServerLoadError(
                    f"the server did not announce its address within {self.server_config.startup_timeout_s}s"
                    + self._log_hint()
                )
            time.sleep(POLL_S)

    def _exited(self) -> None:
        """Raise for a child that exited before it was ready (see the module docstring's start-up rule)."""
        assert self.process is not None and self.process.proc is not None
        why = f"the server exited with {self.process.proc.returncode} before it was ready"
        if self.process.starts == 1:
            raise ServerStartError(str(self.server_config.command), why + self._log_hint())
        raise ServerLoadError(why + self._log_hint())

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
        return self._restarting("generation", lambda: super(ServerBackend, self).generate(request))

    def chat(self, request: ChatRequest) -> list[ChatTurn]:
        """As `OpenAIBackend.chat`; a dead child server is restarted, reloaded and the call retried once."""
        return self._restarting("a chat call", lambda: super(ServerBackend, self).chat(request))

    def _restarting(self, what: str, call: Callable[[], _T]) -> _T:
        """`call()`; when it fails because the child server died, restart and reload it and call once more."""
        try:
            return call()
        except OpenAIBackendError:
            if self.loaded_step is None or not self._died():
                raise
            logger.warning("server died during %s; restarting it with policy %d", what, self.loaded_step)
            self.load_policy(self.loaded_step)
            return call()

    def shutdown(self) -> None:
        """Close the client and stop a child server."""
        if self.process is not None:
            self.process.stop()
        if self._announce_dir is not None:
            shutil.rmtree(self._announce_dir, ignore_errors=True)
        super().shutdown()
