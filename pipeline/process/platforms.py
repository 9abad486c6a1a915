"""The JAX platforms this machine would compute on, found without importing JAX or probing a device."""

from __future__ import annotations

import importlib.util
import os

GPU_PLUGIN_PACKAGES = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin")


def default_jax_platforms() -> str | None:
    """The JAX_PLATFORMS default of a step process: None (JAX chooses) where libtpu is installed; "cuda,cpu" /
    "rocm,cpu" where a CUDA / ROCm JAX plugin is installed and its device files exist; "cpu" otherwise."""
    if importlib.util.find_spec("libtpu") is not None:
        return None
    plugins = importlib.util.find_spec("jax_plugins")  # the namespace package of JAX's PJRT plugins
    names: list[str] = []
    for folder in (plugins.submodule_search_locations or []) if plugins is not None else []:
        names += os.listdir(folder) if os.path.isdir(folder) else []
    # the plugins' own top-level packages (jax_cuda12_plugin, jax_rocm60_plugin, …)
    names += [n for n in GPU_PLUGIN_PACKAGES if importlib.util.find_spec(n) is not None]
    if any("cuda" in n for n in names) and os.path.exists("/dev/nvidiactl"):
        return "cuda,cpu"
    if any("rocm" in n for n in names) and os.path.exists("/dev/kfd"):
        return "rocm,cpu"
    return "cpu"
