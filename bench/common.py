"""What every benchmark prints about where it ran."""

from __future__ import annotations

import os
import platform
import sys


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (or what `platform` knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def machine_name() -> str:
    """The accelerator JAX uses if it is not the CPU, else the CPU model, core count and load average."""
    jax = sys.modules.get("jax")
    if jax is not None:
        dev = jax.devices()[0]
        if dev.platform != "cpu":
            return f"{dev.device_kind} ({dev.platform}) x{jax.device_count()}"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{cpu_model()}, {os.cpu_count()} cores, load avg {load:.1f}"
