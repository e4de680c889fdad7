"""Which x86 instruction sets this processor can execute, by executing them.

/proc/cpuinfo lists what the processor advertises, not what a process may run: on
Sapphire-Rapids-class machines that list amx_tile/amx_int8, ggml's AMX kernel
(`tinygemm_kernel_amx`) died with SIGILL (the kernel grants the tile data only on request,
and a virtual machine may not pass it through at all). So each set is probed here: a tiny C
program that executes one instruction of the set (for AVX512 one of each of F, CD, VL, DQ
and BW: ggml's GGML_AVX512 compiles with all five) is compiled with the set's flags and run
in a child process; exit 0 means the set works, anything else (SIGILL, a compiler that lacks
the flag, a refused AMX permission) means it is left out.

The results are cached in `cache_home()/llama.cpp/instruction-sets-<key>.json`, keyed by the
processor's model, its advertised flags, the kernel's release and PROBE_VERSION, so a probe
costs one compile-and-run per set once per machine (about a second with a warm compiler).

    select(results) -> (cmake options, the sets built with)   # pure: what bench.llama_cpp builds
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from triforce_core.config import cache_home

PROBE_VERSION = 1  # bump when a probe's program or flags change: older cached results are then ignored

_AVX512_FLAGS = ("-mavx512f", "-mavx512cd", "-mavx512vl", "-mavx512dq", "-mavx512bw")
_AMX_SETUP = """
#include <sys/syscall.h>
#include <unistd.h>
#include <string.h>
struct tile_config { unsigned char palette, start_row, reserved[14]; unsigned short colsb[16]; unsigned char rows[16]; };
static int amx_setup(void) {
    /* ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18): without it a tile op is SIGILL */
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return 1;
    struct tile_config c; memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 3; t++) { c.colsb[t] = 64; c.rows[t] = 16; }
    _tile_loadconfig(&c);
    return 0;
}
"""

# name -> (compiler flags, the body of main: it must use its volatile inputs and return 0)
PROBES: dict[str, tuple[tuple[str, ...], str]] = {
    "SSE42": (("-msse4.2",), "volatile unsigned x = 7; return _mm_crc32_u32(x, x) == 1234567u;"),
    "AVX": (("-mavx",), (
        "volatile float x = 1; __m256 a = _mm256_set1_ps(x); a = _mm256_add_ps(a, a);"
        " return _mm256_cvtss_f32(a) != 2;")),
    "AVX2": (("-mavx2",), (
        "volatile int x = 1; __m256i a = _mm256_set1_epi32(x); a = _mm256_add_epi32(a, a);"
        " return _mm256_extract_epi32(a, 0) != 2;")),
    "FMA": (("-mavx", "-mfma"), (
        "volatile float x = 2; __m256 a = _mm256_set1_ps(x); a = _mm256_fmadd_ps(a, a, a);"
        " return _mm256_cvtss_f32(a) != 6;")),
    "F16C": (("-mavx", "-mf16c"), (
        "volatile unsigned short h = 0x3c00; __m128 a = _mm_cvtph_ps(_mm_set1_epi16(h));"
        " return _mm_cvtss_f32(a) != 1;")),
    "BMI2": (("-mbmi2",), "volatile unsigned x = 0xff, m = 0xf0; return _pdep_u32(x, m) != 0xf0;"),
    "AVX512": (_AVX512_FLAGS, (
        "volatile int x = 1; volatile float y = 1;"
        " __m512i i = _mm512_set1_epi32(x); __m512 f = _mm512_set1_ps(y);"
        " f = _mm512_add_ps(f, f);"                                       # F
        " __m512i c = _mm512_conflict_epi32(i);"                          # CD
        " __m512i b = _mm512_add_epi8(i, i);"                             # BW
        " f = _mm512_and_ps(f, f);"                                       # DQ
        " __m256 v = _mm256_maskz_add_ps(0xff, _mm512_castps512_ps256(f), _mm512_castps512_ps256(f));"  # VL
        " return _mm512_cvtss_f32(f) != 2 || _mm512_cvtsi512_si32(b) != 2"
        " || _mm512_cvtsi512_si32(c) != 0 || _mm256_cvtss_f32(v) != 4;")),
    "AVX512_VBMI": ((*_AVX512_FLAGS, "-mavx512vbmi"), (
        "volatile char x = 5; __m512i a = _mm512_set1_epi8(x);"
        " a = _mm512_permutexvar_epi8(_mm512_setzero_si512(), a); return _mm512_cvtsi512_si32(a) != 0x05050505;")),
    "AVX512_VNNI": ((*_AVX512_FLAGS, "-mavx512vnni"), (
        "volatile int x = 0x01010101; __m512i a = _mm512_set1_epi32(x);"
        " a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), a, a); return _mm512_cvtsi512_si32(a) != 4;")),
    "AVX512_BF16": ((*_AVX512_FLAGS, "-mavx512bf16"), (
        "volatile float x = 1; __m512 a = _mm512_set1_ps(x);"
        " __m512bh h = _mm512_cvtne2ps_pbh(a, a); __m512 d = _mm512_dpbf16_ps(_mm512_setzero_ps(), h, h);"
        " return _mm512_cvtss_f32(d) != 2;")),
    "AVX_VNNI": (("-mavx2", "-mavxvnni"), (
        "volatile int x = 0x01010101; __m256i a = _mm256_set1_epi32(x);"
        " a = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), a, a); return _mm256_extract_epi32(a, 0) != 4;")),
    "AMX_TILE": (("-mamx-tile",), "if (amx_setup()) return 1; _tile_zero(0); _tile_release(); return 0;"),
    "AMX_INT8": (("-mamx-tile", "-mamx-int8"), (
        "if (amx_setup()) return 1; _tile_zero(0); _tile_zero(1); _tile_zero(2);"
        " _tile_dpbssd(0, 1, 2); _tile_release(); return 0;")),
    "AMX_BF16": (("-mamx-tile", "-mamx-bf16"), (
        "if (amx_setup()) return 1; _tile_zero(0); _tile_zero(1); _tile_zero(2);"
        " _tile_dpbf16ps(0, 1, 2); _tile_release(); return 0;")),
}
SETS = tuple(PROBES)  # ggml's CMake option for a set is GGML_<name>

# A set ggml uses only on top of others (its code assumes them; e.g. the AVX512 paths use FMA's
# intrinsics): built only when they are built too.
REQUIRES = {
    "AVX2": ("AVX",), "FMA": ("AVX",), "F16C": ("AVX",), "AVX_VNNI": ("AVX2",),
    "AVX512": ("AVX2", "FMA", "F16C"), "AVX512_VBMI": ("AVX512",), "AVX512_VNNI": ("AVX512",),
    "AVX512_BF16": ("AVX512",), "AMX_TILE": ("AVX512",), "AMX_INT8": ("AMX_TILE", "AVX512_VNNI"),
    "AMX_BF16": ("AMX_TILE", "AVX512_BF16"),
}
# Never built, whatever the probe says: ggml's AMX kernel died with SIGILL where the tile probe
# passed on the same machine; building it would need a probe of the built llama-bench itself.
NEVER = frozenset({"AMX_TILE", "AMX_INT8", "AMX_BF16"})


class ProbeError(RuntimeError):
    """The processor could not be probed (no C compiler): reported as one line."""


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def select(executable: dict[str, bool]) -> tuple[list[str], list[str]]:
    """Probe results {set: executes} -> (ggml's cmake options, every set named ON or OFF with
    GGML_NATIVE=OFF; the sets built with, in SETS' order). A set is built when it executes, is
    not in NEVER and every set it requires is built.

    >>> select({"AVX": True, "AVX2": True, "FMA": True, "F16C": False})[1]
    ['AVX', 'AVX2', 'FMA']
    """
    built: list[str] = []
    for name in SETS:
        if executable.get(name) and name not in NEVER and all(r in built for r in REQUIRES.get(name, ())):
            built.append(name)
    options = ["-DGGML_NATIVE=OFF"] + [f"-DGGML_{n}={'ON' if n in built else 'OFF'}" for n in SETS]
    return options, built


def folder_key(built: list[str]) -> str:
    """A folder-name part that differs with the sets built with ("avx-avx2-fma..."; "generic" for none)."""
    return "-".join(n.lower().replace("_", "") for n in built) or "generic"


def find_compiler() -> str:
    """$CC, else cc, gcc or clang on the PATH; a ProbeError in one line when none is there."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise ProbeError("probing the processor's instruction sets needs a C compiler: none of $CC, cc, gcc, clang "
                     "is on the PATH (e.g. apt-get install gcc)")


def probe_one(compiler: str, name: str, folder: Path) -> bool:
    """Compile set `name`'s program and run it in a child process: True when it exits 0."""
    flags, body = PROBES[name]
    setup = _AMX_SETUP if name.startswith("AMX") else ""
    source, binary = folder / f"{name}.c", folder / name
    source.write_text(f"#include <immintrin.h>\n{setup}\nint main(void) {{ {body} }}\n")
    built = subprocess.run([compiler, "-O1", *flags, str(source), "-o", str(binary)], check=False, capture_output=True)
    if built.returncode != 0:
        return False  # the compiler lacks the flag or intrinsic: ggml could not be built with it either
    try:
        return subprocess.run([str(binary)], check=False, capture_output=True, timeout=10).returncode == 0  # SIGILL: -4
    except subprocess.TimeoutExpired:
        return False


def probe_all(compiler: str | None = None) -> dict[str, bool]:
    """{set: executes} for every set in SETS, probed now (a few compiles in parallel)."""
    compiler = compiler or find_compiler()
    with tempfile.TemporaryDirectory(prefix="isa-probe-") as tmp, ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        results = pool.map(lambda n: probe_one(compiler, n, Path(tmp)), SETS)
        return dict(zip(SETS, results))


def _machine_key() -> str:
    """The processor as /proc/cpuinfo names it and its advertised flags, the kernel's release."""
    model = flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = value.strip()
    except OSError:
        pass
    text = f"{model}|{flags}|{platform.machine()}|{platform.release()}|{PROBE_VERSION}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def executable_sets(refresh: bool = False) -> dict[str, bool]:
    """The probe's results for this machine, from the cache when it has them."""
    path = cache_home() / "llama.cpp" / f"instruction-sets-{_machine_key()}.json"
    if not refresh:
        try:
            cached = json.loads(path.read_text())
            if set(cached) == set(SETS):
                return cached
        except (OSError, ValueError):
            pass
    results = probe_all()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(results, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache: the next run probes again
    return results
