"""rlpipe's step programs, one per `python -m steps.<name>`: each parses its config and runs `main(config)`.

The steps (learn, make_batches, rollout, evaluate), the job (`run`) and the tools (demo, export, gc, replay,
forkserver) are thin programs: the JAX code they run lives in `policy/`, the rest of the machinery in `pipeline/`,
and `cli` is the one command-line shape they share.
"""

import os
import sys
from collections.abc import MutableMapping

from pipeline.process.platforms import default_jax_platforms

__all__ = ["default_jax_platforms", "step_process_defaults"]


def step_process_defaults(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set the environment defaults of a step process where `environ` does not set them (a value there wins)."""
    # A step process never uses PyTorch, but transformers (which levanter imports) loads it eagerly whenever it is
    # installed: about 5 s of every step start on a 2-core machine, paid again at each restart. USE_TORCH=1 keeps it.
    environ.setdefault("USE_TORCH", "0")
    # JAX's persistent compilation cache: a restarted step (crash, scheduled job) and the sibling rollout workers
    # load compiled train / sampling programs instead of compiling them again. JAX_COMPILATION_CACHE_DIR="" turns
    # it off; the size limit turns on JAX's LRU eviction and its file lock between processes.
    environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "rlpipe", "jax"))
    environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))
    # JAX caches only programs that took over a second to compile by default; a step start also compiles a few of
    # 0.3-1 s (the sampler's layer unstacking, prefill and insert of a ~50M model: ~2.5 CPU s per rollout worker
    # start on a 2-core machine, docs/benchmarks.md), which then load from the cache instead.
    environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.25")
    # Unset, JAX probes every platform it knows, TPU first: without libtpu that logs "Unable to initialize backend
    # 'tpu' … libtpu.so" at every step start. The default names the platforms this machine has, found without
    # importing JAX; JAX_PLATFORMS set (even empty: JAX's own probe) is left as it is.
    if "JAX_PLATFORMS" not in environ:
        platforms = default_jax_platforms()
        if platforms is not None:
            environ["JAX_PLATFORMS"] = platforms


if sys.argv[:1] == ["-m"]:  # while `python -m steps.<name>` locates the module, sys.argv[0] is "-m"
    step_process_defaults()
    # glibc's allocator setting for XLA on CPU must come before this process starts any thread (the parent watch
    # below starts one): a thread that allocates first gets an arena of its own, and the threads that later share
    # it (XLA's among them) map every buffer over 64 MiB afresh, a page fault per 4 KiB (policy/_host_malloc.py).
    from policy import _host_malloc

    _host_malloc.install()
    # A step the job runner (or its fork server) started ends when the runner is gone; one started from a shell
    # outlives it (pipeline.process.parent_watch).
    from pipeline.process.parent_watch import end_with_starter

    end_with_starter()
    # Ctrl-C (or SIGTERM) while the program's modules import: one line, 130 (143), not a traceback; the program's
    # own handling (steps.cli.run_command) takes over once it runs.
    from pipeline.process.interrupts import exit_at_once_on_signals

    exit_at_once_on_signals()
