"""What an executable needs from the machine it runs on: the ``machine`` key part.

XLA:CPU compiles for the host's instruction set (LLVM's host CPU features), and its loader
rejects an executable compiled for another ("Machine type used for XLA:CPU compilation doesn't
match the machine type for execution", jax-ml/jax #38445). Fleets mix machine kinds (Intel with
and without AVX-512, AMD, arm64), so the key of a CPU executable holds the architecture
(``platform.machine()``) and the instruction-set features of the host, read from the operating
system (``/proc/cpuinfo`` on Linux, ``sysctl`` on macOS), normalised (lower case) and sorted.
Only instruction-set extensions count: flags about the kernel, the hypervisor, power or
vulnerabilities differ between machines that run the same code and would split a fleet's
entries for nothing.

On GPU the key already holds the device kind (``NVIDIA H100 80GB HBM3``) and the platform
version (with the CUDA or ROCm version); this part adds the compute capability where the
device reports one. TPU device kinds name the chip generation. The host CPU is not part of a
GPU or TPU key: XLA compiles device code there.
"""

from __future__ import annotations

import functools
import hashlib
import platform
import subprocess
import sys
from typing import Any

__all__ = ["cpu_features", "cpu_kind", "machine_part"]

# x86 /proc/cpuinfo flags that are instruction-set extensions LLVM can compile for (names as the
# Linux kernel spells them: "pni" is SSE3, "abm" is LZCNT); any "avx*", "amx*", "sse*" too.
_X86_ISA = frozenset({
    "mmx", "cx8", "cmov", "cx16", "pni", "ssse3", "fma", "fma4", "f16c", "movbe", "popcnt",
    "aes", "pclmulqdq", "vpclmulqdq", "vaes", "gfni", "sha_ni", "xsave", "xsaveopt", "xsavec",
    "xsaves", "rdrand", "rdseed", "adx", "bmi1", "bmi2", "abm", "lahf_lm", "3dnowprefetch",
    "clflushopt", "clwb", "movdiri", "movdir64b", "serialize", "cldemote", "waitpkg", "xop",
    "tbm", "lwp", "rtm", "hle", "fsgsbase", "invpcid", "rdpid", "prefetchwt1", "wbnoinvd",
    "pku", "sha512", "sm3", "sm4", "tsxldtrk", "uintr", "enqcmd", "ptwrite", "kl",
})
_X86_PREFIXES = ("avx", "amx", "sse")
# arm64 "Features" (Linux) that are not instruction-set extensions
_ARM_NOT_ISA = frozenset({"evtstrm", "cpuid"})
# x86 levels, newest first, then arm64's: the short name a machine kind is shown with
_LEVELS = (("avx512f", "avx512"), ("avx2", "avx2"), ("avx", "avx"), ("sse4_2", "sse4.2"),
           ("sve2", "sve2"), ("sve", "sve"))


def _is_isa(flag: str, arch: str) -> bool:
    if arch in ("x86_64", "amd64", "i386", "i686"):
        return flag in _X86_ISA or flag.startswith(_X86_PREFIXES)
    return flag not in _ARM_NOT_ISA


def _read_cpu_features() -> list[str]:
    """The host's CPU feature flags as the operating system reports them (unfiltered)."""
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                for line in f:
                    name, _, value = line.partition(":")
                    if name.strip().lower() in ("flags", "features"):  # x86 / arm64
                        return value.split()
        except OSError:
            pass
    elif sys.platform == "darwin":
        if platform.machine() == "arm64":
            out = _sysctl(["hw.optional"])
            return [line.split(":")[0].rpartition(".")[2] for line in out.splitlines()
                    if line.rstrip().endswith(": 1") and ".arm." in line]
        out = _sysctl(["-n", "machdep.cpu.features", "machdep.cpu.leaf7_features"])
        return out.replace("\n", " ").split()
    return []


def _sysctl(args: list[str]) -> str:
    try:
        return subprocess.run(["sysctl", *args], capture_output=True, text=True, timeout=5,
                              check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


@functools.lru_cache(maxsize=1)
def cpu_features() -> tuple[str, ...]:
    """This host's instruction-set features: lower case, sorted, de-duplicated (empty when the
    operating system does not say)."""
    arch = platform.machine().lower()
    flags = {f.strip().lower().replace(".", "_") for f in _read_cpu_features() if f.strip()}
    return tuple(sorted(f for f in flags if _is_isa(f, arch)))


@functools.lru_cache(maxsize=1)
def cpu_kind() -> str:
    """This host's machine kind, as the ``machine`` key part of a CPU executable: the
    architecture, the newest x86 vector level (``avx512``, ``avx2``, ...) and a digest of every
    instruction-set feature, e.g. ``x86_64 avx512 3f9c2a1b``. Two machines share entries
    exactly when this text is the same."""
    arch = platform.machine().lower() or "unknown"
    features = cpu_features()
    level = next((name for flag, name in _LEVELS if flag in features), "")
    digest = hashlib.sha256(" ".join(features).encode()).hexdigest()[:8]
    return " ".join(p for p in (arch, level, digest) if p)


def machine_part(device: Any) -> str:
    """The ``machine`` key part for executables on ``device``'s platform: the host's
    :func:`cpu_kind` on CPU; the compute capability on GPU (``cc 9.0``) when the device has
    one; ``-`` otherwise (the device kind in the ``device`` part says it all)."""
    if getattr(device, "platform", "") == "cpu":
        return cpu_kind()
    capability = getattr(device, "compute_capability", None)
    return f"cc {capability}" if capability else "-"
