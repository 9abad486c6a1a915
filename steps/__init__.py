"""rlpipe's step programs, one per `python -m steps.<name>`: each parses its config and runs `main(config)`.

The steps (learn, make_batches, rollout, evaluate), the job (`run`) and the tools (demo, export, gc, replay,
forkserver) are thin programs: the JAX code they run lives in `policy/`, the rest of the machinery in `pipeline/`,
and `cli` is the one command-line shape they share.
"""

import os
import sys
from collections.abc import MutableMapping


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


if sys.argv[:1] == ["-m"]:  # while `python -m steps.<name>` locates the module, sys.argv[0] is "-m"
    step_process_defaults()
