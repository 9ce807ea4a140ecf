"""What kind of CPU this is, as the `auto` decisions see it.

Every host-dependent `auto` decision (model.dtype, and through the compute dtype the speed
switches of grpolab/grpo/speed.py) reads the CPU kind from `cpu_kind()` and nothing else:

- `avx2`: an x86 CPU without native bf16 arithmetic (AVX2, AVX-512 without BF16): auto = float32;
- `avx512_bf16`: AVX512-BF16 (e.g. AMD EPYC Zen 4, Intel Cooper Lake): auto = bf16;
- `amx`: AMX-BF16 tiles (Intel Sapphire Rapids and later): auto = bf16;
- `arm_bf16` / `other`: an ARM CPU with / without the BF16 extension (auto = bf16 / float32).

`GRPOLAB_CPU_KIND=avx2|avx512_bf16|amx|arm_bf16|other` makes `auto` decide as that kind would, on
any host (arithmetic the host lacks is emulated by torch: slower, never wrong); tests and CI use it
to run every branch of every decision on one machine.
"""

from __future__ import annotations

import os
from pathlib import Path

CPU_KIND_ENV = "GRPOLAB_CPU_KIND"
CPU_KINDS = ("avx2", "avx512_bf16", "amx", "arm_bf16", "other")
NATIVE_BF16_KINDS = frozenset({"avx512_bf16", "amx", "arm_bf16"})
"""The kinds whose CPUs compute bf16 natively: where `auto` picks bf16."""


def cpu_flags() -> frozenset[str]:
    """The flags (x86) or features (ARM) of the first CPU in /proc/cpuinfo; empty where there is none."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:  # not Linux: no cheap reliable probe
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def detected_cpu_kind(flags: frozenset[str] | None = None) -> str:
    """The kind of the CPU with these flags (default: this host's), ignoring the override."""
    flags = cpu_flags() if flags is None else flags
    if "amx_bf16" in flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512_bf16"
    if "avx2" in flags or "avx" in flags or "sse4_2" in flags:
        return "avx2"
    if "bf16" in flags:  # ARM's BF16 extension (Features: ... bf16 ...)
        return "arm_bf16"
    return "other"


def cpu_kind() -> str:
    """The CPU kind `auto` decides for: $GRPOLAB_CPU_KIND when set (checked), else the detected one."""
    forced = os.environ.get(CPU_KIND_ENV, "").strip()
    if not forced:
        return detected_cpu_kind()
    if forced not in CPU_KINDS:
        raise ValueError(f"{CPU_KIND_ENV}={forced!r} is not one of {', '.join(CPU_KINDS)}")
    return forced


def cpu_supports_bf16() -> bool:
    """True where `cpu_kind()` computes bf16 natively (other CPUs run bf16 autocast emulated, usually
    slower than float32)."""
    return cpu_kind() in NATIVE_BF16_KINDS


def describe_cpu() -> str:
    """One line: the detected kind, the forced one if any, the bf16-relevant flags."""
    flags = cpu_flags()
    shown = sorted(f for f in flags if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "bf16"))
    forced = os.environ.get(CPU_KIND_ENV, "").strip()
    kind = f"{detected_cpu_kind(flags)}" + (f", decided as {forced} ({CPU_KIND_ENV})" if forced else "")
    return f"CPU kind: {kind}; flags: {' '.join(shown) or 'none of avx2/avx512/amx/bf16'}; " \
           f"auto dtype: {'bfloat16' if cpu_supports_bf16() else 'float32'}; cores: {os.cpu_count()}"
