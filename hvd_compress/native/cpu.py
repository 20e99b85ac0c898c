"""This machine's CPU, and the CPU features a build of the native kernels needs; stdlib only.

A build with ``-march=native`` (the default of :func:`hvd_compress.native.loader.march`)
dies with ``SIGILL`` on a CPU that lacks one of the building CPU's extensions. So every
build writes a *record* beside the library (:func:`record_path`, JSON): the extensions its
compiler flags enabled, read from the compiler's predefined macros (``-dM -E``) and named
as ``/proc/cpuinfo`` names them (:data:`FEATURE_MACROS`). The loader compares the record
with :func:`cpu_info` before loading the library (:func:`missing`), and ``version.cpp``
compiles the same list into the library (``hvdc_cpu_features()``), so a record that is not
the library's own is caught before any kernel runs.

Only x86-64 extensions that compiled C++ may contain are checked (vector sets, bit
manipulation, carry-less multiply); system features (SGX, XSAVE, TSX, AMX, ...) are not.
On other architectures the record lists nothing and every CPU passes.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")

FEATURE_MACROS: dict[str, str] = {
    "__SSE3__": "pni", "__SSSE3__": "ssse3", "__SSE4_1__": "sse4_1", "__SSE4_2__": "sse4_2",
    "__CRC32__": "sse4_2", "__POPCNT__": "popcnt", "__LAHF_SAHF__": "lahf_lm",
    "__GCC_HAVE_SYNC_COMPARE_AND_SWAP_16": "cx16", "__SSE4A__": "sse4a",
    "__AVX__": "avx", "__AVX2__": "avx2", "__FMA__": "fma", "__FMA4__": "fma4",
    "__XOP__": "xop", "__F16C__": "f16c", "__BMI__": "bmi1", "__BMI2__": "bmi2",
    "__LZCNT__": "abm", "__ABM__": "abm", "__TBM__": "tbm", "__MOVBE__": "movbe",
    "__ADX__": "adx", "__PRFCHW__": "3dnowprefetch", "__PCLMUL__": "pclmulqdq",
    "__AES__": "aes", "__SHA__": "sha_ni", "__GFNI__": "gfni", "__VAES__": "vaes",
    "__VPCLMULQDQ__": "vpclmulqdq", "__AVXVNNI__": "avx_vnni",
    "__AVX512F__": "avx512f", "__AVX512CD__": "avx512cd", "__AVX512BW__": "avx512bw",
    "__AVX512DQ__": "avx512dq", "__AVX512VL__": "avx512vl", "__AVX512IFMA__": "avx512ifma",
    "__AVX512VBMI__": "avx512vbmi", "__AVX512VBMI2__": "avx512_vbmi2",
    "__AVX512VNNI__": "avx512_vnni", "__AVX512BITALG__": "avx512_bitalg",
    "__AVX512VPOPCNTDQ__": "avx512_vpopcntdq", "__AVX512BF16__": "avx512_bf16",
    "__AVX512FP16__": "avx512_fp16", "__AVX512VP2INTERSECT__": "avx512_vp2intersect",
}
"""Compiler macro -> the ``/proc/cpuinfo`` flag of the extension it says the code may use
(GCC and Clang define these for the ``-march``/``-m`` options in force). ``version.cpp``
holds the same table; a test keeps the two equal."""

RECORD_FORMAT = 1


@dataclass(frozen=True)
class CpuInfo:
    """The running machine's CPU: ``model`` (the distinct model names, joined by `` / ``)
    and ``flags``, the feature flags that *every* logical CPU has (a thread may run on any
    of them; hybrid or mixed machines differ between cores). ``known`` is false when the
    machine has no ``/proc/cpuinfo`` or it lists no flags: then ``flags`` is empty and
    :func:`missing` checks nothing."""

    model: str
    flags: frozenset[str]
    known: bool = True

    def identity(self) -> str:
        """Model and flags in one string: what ``-march=native`` builds for."""
        return f"{self.model}\n{' '.join(sorted(self.flags))}"


def parse_cpuinfo(text: str) -> CpuInfo:
    """A :class:`CpuInfo` from the text of ``/proc/cpuinfo`` (x86 ``flags`` or Arm
    ``Features`` lines; model from ``model name``, else ``Hardware``)."""
    models: list[str] = []
    flags: frozenset[str] | None = None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key in ("model name", "Hardware") and value not in models:
            models.append(value)
        elif key in ("flags", "Features"):
            these = frozenset(value.split())
            flags = these if flags is None else flags & these
    model = " / ".join(models) or platform.processor() or platform.machine()
    return CpuInfo(model, flags or frozenset(), known=flags is not None)


@functools.cache
def _read() -> CpuInfo:
    try:
        return parse_cpuinfo(CPUINFO.read_text())
    except OSError:
        return CpuInfo(platform.processor() or platform.machine(), frozenset(), known=False)


def cpu_info() -> CpuInfo:
    """This machine's CPU (``/proc/cpuinfo``, read once per process). The one reader of it:
    the native loader and the tests' headers use this."""
    return _read()


def features_of(macros: Iterable[str]) -> list[str]:
    """The ``/proc/cpuinfo`` flags of the extensions that ``macros`` (names of defined
    preprocessor macros) enable, sorted, each once."""
    return sorted({FEATURE_MACROS[m] for m in macros if m in FEATURE_MACROS})


def compiled_features(command: Sequence[str]) -> list[str]:
    """The extensions a compile command enables: ``command`` (the compiler and its flags,
    ``-march`` included, no sources or ``-o``) is run with ``-x c++ -dM -E`` on an empty
    input, and its predefined macros are mapped by :func:`features_of`. ``RuntimeError``
    with the compiler's message if it fails."""
    result = subprocess.run([*command, "-x", "c++", "-dM", "-E", os.devnull],
                            capture_output=True, text=True, timeout=120)
    if result.returncode:
        raise RuntimeError(f"{' '.join(command)} -dM -E failed: {result.stderr.strip()}")
    macros = [line.split()[1] for line in result.stdout.splitlines()
              if line.startswith("#define ") and len(line.split()) >= 2]
    return features_of(macros)


def record_path(library: Path) -> Path:
    """Where the record of ``library`` lives: beside it, ``<library file name>.cpu.json``."""
    return library.with_name(library.name + ".cpu.json")


def write_record(library: Path, command: Sequence[str], march: str, source_hash: str) -> Path:
    """Write the record of a library built by ``command`` (see :func:`compiled_features`)
    with ``-march=march`` from sources of ``source_hash``; atomically (a reader sees the
    old record or the new one). Returns the record's path."""
    record = {"format": RECORD_FORMAT, "march": march, "source_hash": source_hash,
              "machine": platform.machine(), "compiler": list(command),
              "features": compiled_features(command)}
    path = record_path(library)
    fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
    with os.fdopen(fd, "w") as out:
        json.dump(record, out, indent=1)
        out.write("\n")
    os.replace(tmp, path)
    return path


def read_record(library: Path) -> dict | None:
    """The record of ``library``; ``None`` if it has none, or one this code cannot read (an
    older or newer format, or not JSON)."""
    try:
        record = json.loads(record_path(library).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT \
            or not isinstance(record.get("features"), list):
        return None
    return record


def missing(features: Iterable[str], cpu: CpuInfo | None = None) -> list[str]:
    """The ``features`` (``/proc/cpuinfo`` names) that the running CPU (``cpu``, default
    :func:`cpu_info`) lacks, sorted; none when its flags are unknown."""
    cpu = cpu_info() if cpu is None else cpu
    if not cpu.known:
        return []
    return sorted(set(features) - cpu.flags)
