"""The JAX library of rlpipe: the policy model, losses, checkpoints, inference backends and the RolloutManager.

Imports point one way: `steps` (programs) -> `policy` (this package, JAX) -> `pipeline` (JAX-free run-root
logic) -> `schemas` (declared records and tables).
"""

# First, before any module of this package imports levanter: load levanter's submodules without its package
# `__init__` (which imports datasets, pandas, ray and torch and costs ~10 s per step process). See _imports.py.
from policy import _compile_cache, _hf_structure, _host_malloc, _imports

# glibc's malloc kept from unmapping XLA's freed CPU buffers (a page fault per 4 KiB each step otherwise), before JAX
# starts its threads. See _host_malloc.py.
_host_malloc.install()
_imports.install()
# transformers.models (imported by levanter's models) scans ~1,400 source files at every import: cached on disk.
_hf_structure.install()
# JAX's persistent compilation cache stays writable when its folder holds entries written without a size limit (the
# test suite's): otherwise every step start compiles its programs again. See _compile_cache.py.
_compile_cache.install()
