"""The one command-line shape of every step program (`python -m steps.<name>`).

`run_program(ConfigClass, main)` configures logging once, parses the step config with draccus (`--config_path
file.yaml` plus dotted flags such as `--train.max_lag 2`; a switched choice such as `--loss.type gspo` starts from
that type's defaults, and `--curriculum.lessons.<id>.<field> v` sets a lesson's field: see
pipeline/config/overrides.py), runs `main(config)` and returns its int as the process exit code. A bad config (a
`ConfigError`, a value draccus cannot decode, an unknown flag, a missing config file) is reported as ONE line on
stderr naming the field and the value, with exit code 2 and no traceback. Every other expected failure (an
`ExpectedFailure` of `pipeline.process.exits`: damaged input 7, storage fault 8, no progress 9; storage that cannot
be reached, 75, which the job runner restarts with backoff; a lease held by another process 6 or lost 5; a wait
that timed out 4; also when it caused another error) is one line `error: <label>: <message>` with its code from
the one table (`expected_failure`, docs/reference/exit-codes.md); anything else propagates (a traceback is the
right report of a bug).

Before `main` runs, a step config whose contract fields (model, train, optimizer, loss, curriculum) differ from
its run root's run.json is refused the same way, unless `--allow_config_change true` is given (taken off the
command line like `--log_level`; the change is then recorded in run.json's history).

The log level is `--log_level LEVEL` (taken off the command line before draccus sees it) or the
`LOGLEVEL` environment variable; INFO by default.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import functools
import gc
import importlib
import io
import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TypeVar

import draccus

from pipeline.config import ConfigError, dump_yaml, resolve_overrides
from pipeline.process.exits import LABELS, Exit, ExpectedFailure
from pipeline.process.interrupts import interrupted, stop_signals
from pipeline.run_contract import ALLOW_CHANGE_FLAG
from pipeline.store.committed import StorageUnavailableError
from pipeline.store.faults import storage_fault
from pipeline.store.lease import LeaseHeldError, LeaseLostError
from pipeline.store.poll import WaitTimeout

C = TypeVar("C")
A = TypeVar("A")

READ_ONLY_CONFIGS = frozenset({"EvaluateStepConfig", "ReplayConfig"})
"""Configs of programs that only read a run: refused on a run root without run.json (nothing is created)."""
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
QUIET_LIBRARIES = ("datasets",)
"""Libraries logged from WARNING up only, as their own default verbosity is: `datasets` notes at INFO which
frameworks it found at import (and, with the `USE_TORCH=0` a step sets to skip loading PyTorch, says "Disabling
PyTorch because USE_TF is set", which is untrue)."""

logger = logging.getLogger("rlpipe.cli")


class UsageError(ValueError):
    """The command line or the config file cannot give a valid config; the message is one line naming the
    field and the value."""


def configure_logging(level: str | None = None) -> None:
    """Log records of every library to stderr, one line each, at `level` (else $LOGLEVEL, else INFO)."""
    name = (level or os.environ.get("LOGLEVEL") or "INFO").upper()
    logging.basicConfig(level=name if name in logging.getLevelNamesMapping() else "INFO", format=LOG_FORMAT)
    for library in QUIET_LIBRARIES:  # their INFO lines are start-up notes; their warnings still show
        logging.getLogger(library).setLevel(max(logging.WARNING, logging.getLogger().level))


def pop_log_level(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """(the value of `--log_level`, the other arguments): the flag belongs to the program, not to its config."""
    return pop_flag(argv, "--log_level")


def pop_flag(argv: Sequence[str], flag: str) -> tuple[str | None, list[str]]:
    """(the value of `flag` — `flag V` or `flag=V` — or None, the other arguments)."""
    rest: list[str] = []
    value = None
    it = iter(argv)
    for a in it:
        if a == flag:
            value = next(it, None)
        elif a.startswith(f"{flag}="):
            value = a.split("=", 1)[1]
        else:
            rest.append(a)
    return value, rest


def parse_bool(flag: str, value: str | None) -> bool:
    """`true`/`false` (any case) of a command-line flag; UsageError naming the flag otherwise."""
    if value is None:
        return False
    if value.lower() not in ("true", "false"):
        raise UsageError(f"{flag}={value!r}: expected true or false")
    return value.lower() == "true"


def program_name(main: Callable[..., object]) -> str:
    """`steps.learn` for a program's `main`, also when it runs as `python -m steps.learn` (module `__main__`)."""
    module = getattr(main, "__module__", None) or "step"
    if module == "__main__":
        return f"steps.{os.path.splitext(os.path.basename(sys.argv[0]))[0]}"
    return module


def check_against_run(config: object, program: str, allow_change: bool) -> None:
    """Refuse (RunConfigMismatchError, a ConfigError) a step config whose contract fields differ from its run
    root's run.json, unless `allow_change` (then recorded in run.json's history); and (ConfigError) a local run root
    that is a regular file. A run root that becomes a file later is a storage fault (exit 8) at the first write.
    A training step started on its own beside a live job is refused (StepBesideJobError, exit 6)."""
    from pipeline.jobs.job_lease import refuse_beside_a_live_job
    from pipeline.run_contract import check_step_config
    from pipeline.store.storage import RunStore, require_run

    store_config = getattr(config, "store", None)
    if store_config is None:
        return
    store = RunStore(store_config.run_root, store_config.storage_options or None)
    if store.is_local and os.path.isfile(store.root):  # as `steps.run` refuses it: exit 2 by every entry point
        raise ConfigError("store.run_root", store.url, "is a file, not a folder")
    if type(config).__name__ in READ_ONLY_CONFIGS:
        require_run(store)
    check_step_config(store, config, by=program, allow_change=allow_change)
    refuse_beside_a_live_job(store, program)  # a training step on its own beside a live job: exit 6, one line


def one_line(error: BaseException) -> str:
    """The most specific message of a config error chain, on one line (a `ConfigError` if there is one)."""
    chain = list(error_chain(error))
    config_errors = [c for c in chain if isinstance(c, ConfigError)]
    if config_errors:
        chosen: BaseException = config_errors[0]
    elif isinstance(error, FileNotFoundError) and error.filename:
        return f"config file not found: {error.filename}"
    else:
        # draccus's outer errors ("Couldn't instantiate class X") say less than the first one that names a field
        named = [c for c in chain if "`" in str(c)]
        chosen = named[0] if named else chain[-1] if isinstance(error, draccus.utils.ParsingError) else error
    return " ".join(str(chosen).split())


def _yaml_safe(value: str) -> str:
    """`value` as draccus should read it: unchanged when YAML reads it, else as a quoted YAML string. draccus
    YAML-decodes every command-line value, so a plain string YAML cannot parse (`{python} -m server --port {port}`,
    which opens a flow mapping) would end in a YAML traceback, and `{python}` alone would be read as the mapping
    {python: null}; quoted, each is the string it says."""
    import yaml

    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        return json.dumps(value)  # a JSON string is a YAML double-quoted scalar
    if isinstance(parsed, dict) and parsed and all(v is None for v in parsed.values()):
        return json.dumps(value)  # `{python}`: a placeholder, not a mapping of keys without values
    return value


def _quote_unparsable(args: Sequence[str]) -> list[str]:
    """Command-line flags with each value YAML cannot parse quoted (`_yaml_safe`); everything else as given."""
    out: list[str] = []
    after_flag = False
    for a in args:
        if a.startswith("--"):
            flag, eq, value = a.partition("=")
            out.append(f"{flag}={_yaml_safe(value)}" if eq else a)
            after_flag = not eq
        else:
            out.append(_yaml_safe(a) if after_flag else a)
            after_flag = False
    return out


def parse_config(config_class: type[C], argv: Sequence[str]) -> C:
    """`config_class` from `--config_path` and dotted flags; raises UsageError (one line naming the field and
    the value) instead of printing draccus's traceback or argparse's usage text."""
    captured = io.StringIO()
    try:
        # Choice switches (`--loss.type gspo`: the new type's defaults) and dict-entry fields
        # (`--curriculum.lessons.cats.chat true`) are applied to the file's mapping first (pipeline.config.overrides).
        mapping, args = resolve_overrides(config_class, argv)
        args = _quote_unparsable(args)
        with contextlib.ExitStack() as stack:
            if mapping is not None:
                folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="rlpipe-config-"))
                path = os.path.join(folder, "config.yaml")
                with open(path, "w", encoding="utf-8") as f:
                    f.write(dump_yaml(mapping))
                args = ["--config_path", path, *args]
            with contextlib.redirect_stderr(captured):
                return draccus.parse(config_class, args=args)
    except SystemExit as e:  # argparse: unknown flag, bad choice; `--help` exits 0 and keeps its text
        if not e.code:
            sys.stderr.write(captured.getvalue())
            raise
        lines = [ln for ln in captured.getvalue().splitlines() if "error:" in ln]
        message = lines[-1].split("error:", 1)[1].strip() if lines else f"bad arguments {list(argv)}"
        raise UsageError(message) from None
    except (ConfigError, draccus.utils.ParsingError, FileNotFoundError, ValueError, TypeError) as e:
        raise UsageError(one_line(e)) from None


EXIT_TABLE: Mapping[type[BaseException], Exit] = {
    LeaseHeldError: Exit.LEASE_HELD,
    LeaseLostError: Exit.LEASE_LOST,
    WaitTimeout: Exit.TIMEOUT,
}
"""Expected failures raised by the store's own classes (not `ExpectedFailure`s) and their exit codes: with
`ExpectedFailure.exit_code`, `StorageUnavailableError` (75) and config errors (2), the one table every step program
ends with (docs/reference/exit-codes.md)."""


def expected_failure(error: BaseException) -> tuple[int, str] | None:
    """(exit code, one line naming the object or field) for an expected failure: `error` or an error in its
    cause/context chain (a step's thread may wrap it) that is an `ExpectedFailure`, a `StorageUnavailableError`, an
    `EXIT_TABLE` class, or an `OSError` the storage refused for good (`pipeline.store.faults.FAULT_ERRNOS`, with a
    file name); None for anything else (a bug: a traceback is the right report)."""
    for current in error_chain(error):
        if isinstance(current, ExpectedFailure):
            return current.exit_code, str(current)
        if isinstance(current, StorageUnavailableError):
            return Exit.STORAGE_UNAVAILABLE, str(current).removeprefix("storage unavailable: ")
        for kind, code in EXIT_TABLE.items():
            if isinstance(current, kind):
                return code, str(current)
        if isinstance(current, OSError) and current.filename:
            fault = storage_fault(str(current.filename), current)
            if fault is not None:
                return fault.exit_code, str(fault)
    return None


def report(code: int, message: str) -> None:
    """Print `error: <label>: <message>` on one line on stderr; under the job runner (`RLPIPE_STEP`,
    `RLPIPE_ATTEMPT` set) also write it to `pipeline.jobs.step_logs.reason_path`, off the run root, so the runner
    can name the cause when the step log cannot be written (a full run root). A stderr that refuses the line (a
    full disk) is replaced by /dev/null, so that later writes cannot turn the exit into a traceback."""
    line = f"error: {LABELS.get(code, 'failed')}: {' '.join(message.split())}"
    path = reason_path()
    if path is not None:
        with contextlib.suppress(OSError):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(line + "\n")
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process


def run_command(
    parse: Callable[[list[str]], A],
    main: Callable[[A], int],
    argv: Sequence[str] | None = None,
) -> int:
    """Configure logging, `parse(argv)` (default: sys.argv[1:]), run `main(parsed)`, return the exit code.

    A `UsageError` or `ConfigError` (from `parse` or from `main`) gives one stderr line and Exit.CONFIG; any other
    expected failure (`expected_failure`: an `ExpectedFailure`, a `StorageUnavailableError`, a lease or wait error, a
    storage-refused write; also as the cause of another error) gives one stderr line `error: <label>: <message>`
    and its code from the one table (`pipeline.process.exits.LABELS`, `EXIT_TABLE`); Ctrl-C (KeyboardInterrupt,
    also wrapped) gives one line and Exit.INTERRUPTED, SIGTERM one line and Exit.TERMINATED
    (`pipeline.process.interrupts`); anything else propagates (a traceback).
    """
    level, args = pop_log_level(sys.argv[1:] if argv is None else argv)
    configure_logging(level)
    # A crash in native code (SIGSEGV, SIGABRT, ...) prints every thread's Python stack on stderr (the step's log),
    # so a fatal error names where it happened instead of a bare exit -11.
    with contextlib.suppress(Exception):  # a stderr without a file descriptor (embedded use): no handler
        faulthandler.enable()
    # The program's modules are imported by now; their objects live as long as the process. Frozen, the cyclic
    # collector stops walking them at every full collection, which JAX's tracing triggers often (~1/3 of the CPU
    # of tracing a sampler program in a process that was not forked from the frozen fork server).
    gc.freeze()
    # Ctrl-C anywhere (a wait, JAX compiling, a training step) unwinds the program (its `finally` blocks run) and ends
    # it with one line and 130; SIGTERM with one line and 143 (pipeline.process.interrupts).
    with stop_signals():
        try:
            return int(main(parse(args)))
        except KeyboardInterrupt:
            return interrupted()
        except (UsageError, ConfigError) as e:
            report(Exit.CONFIG, one_line(e))
            return Exit.CONFIG
        except Exception as e:
            if any(isinstance(c, KeyboardInterrupt) for c in error_chain(e)):  # a Ctrl-C a step's code wrapped
                return interrupted()
            config = config_error(e)
            if config is not None:  # a ConfigError a step's thread wrapped
                report(Exit.CONFIG, one_line(config))
                return Exit.CONFIG
            expected = expected_failure(e)
            if expected is None:
                raise
            code, message = expected
            logger.debug("expected failure (exit %d)", code, exc_info=e)
            report(code, message)
            return code


def config_error(error: BaseException) -> ConfigError | None:
    """The ConfigError `error` was caused by (its cause/context chain), else None."""
    return next((e for e in error_chain(error) if isinstance(e, ConfigError)), None)


def error_chain(error: BaseException) -> Iterator[BaseException]:
    """`error`, then what caused it (`__cause__`, else `__context__`), and so on, each once."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def reason_path() -> str | None:
    """Where this process writes its one-line failure reason for the job runner (None: not under the runner)."""
    from pipeline.jobs.step_logs import reason_path as path_of

    step, attempt = os.environ.get("RLPIPE_STEP"), os.environ.get("RLPIPE_ATTEMPT")
    return path_of(step, attempt) if step and attempt else None


def run_program(
    config_class: type[C],
    main: Callable[[C], int],
    argv: Sequence[str] | None = None,
    validate: Callable[[C], object] | None = None,
) -> int:
    """`run_command` for a step program: the config is `config_class` parsed by draccus (and logged), then checked
    by `validate` (the step's own cross-field checks, which `main` may repeat) and against run.json."""

    def parse(args: list[str]) -> C:
        allow, args = pop_flag(args, ALLOW_CHANGE_FLAG)
        config = parse_config(config_class, args)
        if dataclasses.is_dataclass(config):
            logger.info("config: %s", json.dumps(redacted(draccus.encode(config)), default=str, sort_keys=True))
        if validate is not None:
            validate(config)
        check_against_run(config, program_name(main), parse_bool(ALLOW_CHANGE_FLAG, allow))
        return config

    return run_command(parse, main, argv)


SECRET_FIELDS = frozenset({"token"})
"""Config fields whose value is a secret (`steps.serve --token`): logged as `<redacted>`, never as given."""


def redacted(encoded: object) -> object:
    """An encoded config with the value of every `SECRET_FIELDS` field that is set replaced by `<redacted>`."""
    if isinstance(encoded, dict):
        return {k: "<redacted>" if k in SECRET_FIELDS and v is not None else redacted(v) for k, v in encoded.items()}
    if isinstance(encoded, list):
        return [redacted(v) for v in encoded]
    return encoded


def step_main(
    main: Callable[[C], int],
    heavy: Sequence[str] = (),
    early: Callable[[C], int | None] | None = None,
) -> Callable[[C], int]:
    """`main` as its program runs it (`python -m steps.learn`, `rlpipe learn`, `steps.run step learn`): first
    `early(config)`, when given (`steps.early`): an exit code means the step has nothing to do (a scheduled step on a
    finished run) and it ends there, before JAX is imported; then the step's `heavy` modules (its `HEAVY_MODULES`:
    policy.*, hence JAX and levanter) are imported and the collector frozen, then `main(config)` runs.

    A step module imports only light modules at its top, so `run_program` parses and checks the config (a bad one
    is one line, exit 2, found before anything starts; JAX's import alone is ~2 CPU s per process) before this
    imports the heavy ones; the job's fork server imports the same `HEAVY_MODULES` before it forks (steps.forkserver),
    so a forked step finds them loaded."""

    @functools.wraps(main)  # its __module__: `program_name`, the step that refuses a config change
    def run(config: C) -> int:
        if early is not None:
            rc = early(config)
            if rc is not None:
                return rc
        for module in heavy:
            importlib.import_module(module)
        gc.freeze()  # as run_command does: the objects of the modules imported just now live as long as the process
        return int(main(config) or 0)

    return run
