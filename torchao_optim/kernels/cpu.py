"""The fused step on the CPU: ``cpu_step.c`` with the rules' C updates, built on first use and called through
``ctypes``.

The C file is the CPU's twin of the Triton kernels: it reads a plan's pointer table, coefficient rows and encoder
tables (``optim/launch.py`` calls it) and knows no format and no rule. Each rule's element update is C source in the
rule's own file (``FusedRule.c_source``, a function named ``c_name``): :func:`step_source` puts the sources of the
rules a build serves into the C file, in place of its marker line, with the table the step calls them through
(name, number of states, number of coefficients, function), and :func:`cpu_rule` finds a rule's library and index.
The package's rules (``rules.BUILT_IN_RULES``) are built together, once; a rule from elsewhere (a user's, a test's)
gets a library of its own on first use, so it is fused with no change here.

A library is compiled with the C compiler ``torch.compile`` itself needs on the CPU (``$CC``, else ``cc``, ``gcc`` or
``clang``), for the machine it runs on (``-march=native``), and cached under ``$TORCHAO_OPTIM_CACHE_DIR`` (default
``~/.cache/torchao_optim``), keyed by its whole source (the C file and every rule's), the compiler and the CPU, so a
cluster sharing a home directory builds once per kind of CPU. A first build takes about a second; nothing is built at
install. Only built libraries are cached: a failed build is tried again by the next process.

Where no compiler works, :func:`cpu_kernels` returns None (with one warning saying why) and the optimizers use
the compiled path, as they do for everything this file does not cover.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from torchao_optim.rules import BUILT_IN_RULES

__all__ = [
    "cpu_kernels",
    "cpu_kernels_available",
    "cpu_kernels_status",
    "cpu_dtypes",
    "cpu_rules",
    "cpu_rule",
    "quantize_nearest_cpu",
    "step_source",
]

SOURCE = Path(__file__).with_name("cpu_step.c")
MARKER = "/* TORCHAO_OPTIM_RULES */"  # the line of SOURCE the rules' updates and their table replace
# -ffp-contract=off: no fused multiply-adds, so each operation rounds as the compiled path's does;
# -fno-math-errno: sqrtf may become a vector instruction; -fno-trapping-math: the update's selects may become
# vector blends where there are no mask registers (AVX2). Neither changes a result, only errno and FP flags.
FLAGS = [
    "-O3",
    "-std=c11",
    "-shared",
    "-fPIC",
    "-pthread",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-fno-trapping-math",
]
NATIVE = ["-march=native"]
# GCC's tuning for recent x86 CPUs turns vector gathers off and loads table entries one lane at a time; the
# decode and the encoder are table loads, and measured 1.7x faster with gathers (GCC only: tried first).
GATHER = ["-mtune-ctrl=use_gather_2parts,use_gather_4parts,use_gather"]
CPU_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
MAX_STATES = 3  # a rule's states the C step carries at most (cpu_step.c's MAX_STATES)
KINDS = {32: 0, 4: 4, 8: 8}  # a state's kind in cpu_step.c by its layout's bits: plain fp32, or codes of 4 or 8 bits
FACTORED = 1  # the kind of a factored state (StateLayout.scale "factored": row and column means, no codes)


def state_kind(layout) -> int:
    """A state's kind in cpu_step.c: factored, or by its layout's bits."""
    return FACTORED if layout.scale == "factored" else KINDS[layout.bits]


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_signature() -> str:
    """What the built file depends on besides its source and compiler: the instruction set it was built for."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()} {flags}"


def _cache_dir() -> Path:
    root = os.environ.get("TORCHAO_OPTIM_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torchao_optim"


def _build(compiler: str, source: str) -> Path:
    """The shared library of ``source`` (:func:`step_source`) for this machine, compiled if the cache does not hold it
    yet.

    Only a built library is cached on disk; a failure is remembered for this process only (:func:`cpu_kernels`
    is cached, so it is never retried there). A failure may pass (a build killed midway, a full disk, a compiler
    repaired or replaced), and a marker on disk would keep every later process from trying a healthy compiler
    again; a flag set the compiler refuses for good costs a later process one failed run, which fails at once."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    user = shlex.split(os.environ.get("TORCHAO_OPTIM_CFLAGS", ""))  # e.g. a sanitizer, to check the C step
    errors = []
    for extra in (NATIVE + GATHER + user, NATIVE + user, user):  # the first set the compiler takes
        digest = hashlib.sha256(
            b"\0".join([source.encode(), version.encode(), " ".join(FLAGS + extra).encode(), _cpu_signature().encode()])
        ).hexdigest()[:16]
        target = _cache_dir() / f"cpu_step_{digest}.so"
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        # built under a temporary name and renamed: a build killed midway, or one running in another process,
        # never leaves a partial file under the name that is loaded
        fd, tmp = tempfile.mkstemp(prefix=f"{target.stem}.", suffix=".tmp", dir=target.parent)
        os.close(fd)
        try:  # the source from standard input: its #line directives name the files its parts come from
            run = subprocess.run(
                [compiler, *FLAGS, *extra, "-x", "c", "-", "-o", tmp, "-lm"],
                input=source,
                capture_output=True,
                text=True,
            )
            if run.returncode == 0:
                os.replace(tmp, target)
                return target
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        errors.append(run.stderr.strip()[-1500:] or f"exit status {run.returncode}")
    raise RuntimeError(f"{compiler} could not build {SOURCE.name}: {errors[-1]}")


def _c_rule(rule) -> tuple:
    """What the C step's build takes of a rule: ``(c_name, number of states, number of coefficients, c_source)``."""
    return (rule.c_name, len(rule.state_keys), rule.n_coefs, rule.c_source)


BUILT_IN = tuple(rule for rule in BUILT_IN_RULES if rule.c_source is not None)  # built together, in this order
_BUILT_IN_INDEX = {_c_rule(rule): i for i, rule in enumerate(BUILT_IN)}  # a launch's lookup, every step


def step_source(rules) -> str:
    """The C step's source for ``rules`` (:class:`~torchao_optim.rules.FusedRule` objects with a C update):
    ``cpu_step.c`` with, in place of its marker line, each distinct rule source, a wrapper per rule that calls its
    function in the table's form, and the table ``RULES`` of them, in the order of ``rules`` (a rule's index in it is
    its position there). ``#line`` directives name where each part comes from, so that a compiler's message points
    at the rule."""
    rules = [_c_rule(rule) for rule in rules]
    template = SOURCE.read_text()
    before, marker, after = template.partition(MARKER + "\n")
    if not marker:
        raise RuntimeError(f"{SOURCE.name} has no line {MARKER!r}")
    parts = ['#line 1 "cpu_step.c"\n', before]
    sources: dict[str, str] = {}  # each distinct source once (rules may share one), named by its first rule
    for name, _, _, source in rules:
        sources.setdefault(source, name)
    for source, name in sources.items():
        parts.append(f'#line 1 "{name} (FusedRule.c_source)"\n{source.strip()}\n')
    parts.append('#line 1 "kernels/cpu.py: the table of rules"\n')
    for i, (name, n_states, _, _) in enumerate(rules):
        states = ", ".join(f"s{k}" for k in range(n_states))
        unused = "".join(f"    (void)s{k};\n" for k in range(n_states, MAX_STATES))  # the buffers it has not
        parts.append(
            f"static void rule_{i}(const Job *job, float *p, const float *g, float *s0, float *s1, float *s2, int n, "
            f"const float *c) {{\n{unused}    {name}(p, g, {states}, n, c, job->option);\n}}\n"
        )
    entries = "".join(
        f'    {{"{name}", {n_states}, {n_coefs}, rule_{i}}},\n' for i, (name, n_states, n_coefs, _) in enumerate(rules)
    )
    parts.append(
        "static const struct {\n    const char *name;\n    int n_states, n_coefs;\n    update_fn update;\n} "
        f"RULES[] = {{\n{entries}}};\n"
    )
    parts += [f'#line {before.count(chr(10)) + 2} "cpu_step.c"\n', after]
    return "".join(parts)


_failure: str | None = None  # why the step could not be built, once cpu_kernels() has tried


def cpu_kernels_status() -> dict:
    """What a bug report needs about the fused CPU step: the compiler, the cache directory, whether the step was
    built (building it if it was not yet) and, where it could not be, why."""
    lib = cpu_kernels()
    return {
        "compiler": _compiler(),
        "compiler_version": _compiler_version(_compiler()),
        "cache_dir": str(_cache_dir()),
        "built": lib is not None,
        "library": getattr(lib, "_name", None),
        "error": _failure,
    }


def _compiler_version(compiler: str | None) -> str | None:
    if compiler is None:
        return None
    try:
        run = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return run.stdout.splitlines()[0].strip() if run.returncode == 0 and run.stdout else None


@functools.cache
def cpu_kernels() -> ctypes.CDLL | None:
    """The library of the package's rules, loaded (built on first call); None (after one warning) where it cannot be
    built."""
    try:
        return _load(BUILT_IN)
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        global _failure
        _failure = f"{type(err).__name__}: {err}"
        warnings.warn(
            f"torchao_optim: the fused CPU step could not be built ({err}); CPU parameters take the "
            f"compiled path (torch.compile), which is correct but slower",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


@functools.cache
def _rule_library(rule) -> ctypes.CDLL:
    """The library of one rule the package's library lacks, built on first use; kept for the process."""
    return _load((rule,))


def _load(rules) -> ctypes.CDLL:
    """The C step for ``rules``, built if the cache lacks it, loaded and set up."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found ($CC, cc, gcc, clang)")
    return open_library(_build(compiler, step_source(rules)))


def open_library(path) -> ctypes.CDLL:
    """A built C step (a file :func:`_build` wrote), loaded and set up: its functions' signatures, and torch's OpenMP
    team handed over where there is one. Tools load another tree's build with it (``benchmarks/ab_cpu_step.py``)."""
    lib = ctypes.CDLL(str(path))
    fn = lib.torchao_optim_cpu_step
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    fn.argtypes = [i64] + [ptr] * 6 + [ptr, ptr, ptr, i32, i32, ptr] * MAX_STATES + [i32] * 10 + [i64]
    fn.restype = i32
    lib.torchao_optim_cpu_encode.argtypes = [ptr, ptr, i64, ptr, ptr, i32, i32, i32]
    lib.torchao_optim_cpu_encode.restype = None
    lib.torchao_optim_cpu_use_openmp.argtypes = [ptr, ptr, ptr]
    lib.torchao_optim_cpu_has_fp16.restype = i32
    team = _torch_openmp()
    if team is not None:
        lib.torchao_optim_cpu_use_openmp(*team)
    return lib


def _torch_openmp():
    """(GOMP_parallel, omp_get_thread_num, omp_get_num_threads) of the OpenMP runtime torch runs its CPU ops on,
    as addresses, or None (another parallel backend, or a runtime this cannot find): the C step then starts
    threads of its own."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/lib" in line and ("omp" in line.split("/")[-1])}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            runtime = ctypes.CDLL(path)  # already loaded: the same handle
            names = ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads")
            return tuple(ctypes.cast(getattr(runtime, name), ctypes.c_void_p).value for name in names)
        except (OSError, AttributeError):
            continue
    return None


def cpu_kernels_available() -> bool:
    """Whether the fused CPU step can run here (builds it on the first call)."""
    return cpu_kernels() is not None


def cpu_dtypes() -> dict:
    """The parameter and gradient dtypes the built step takes (fp16 only where the compiler has ``_Float16``),
    with their codes in ``cpu_step.c``."""
    lib = cpu_kernels()
    if lib is None:
        return {}
    return {d: c for d, c in CPU_DTYPES.items() if d != torch.float16 or lib.torchao_optim_cpu_has_fp16()}


def cpu_rules() -> tuple:
    """The rules the package's library implements, in the order of its table: ``(name, number of states, number of
    coefficients)`` each; empty where the step could not be built."""
    lib = cpu_kernels()
    return () if lib is None else _rule_table(lib)


@functools.cache
def _rule_table(lib: ctypes.CDLL) -> tuple:
    lib.torchao_optim_cpu_rule_name.restype = ctypes.c_char_p
    lib.torchao_optim_cpu_rule_name.argtypes = [ctypes.c_int]
    lib.torchao_optim_cpu_rule_states.argtypes = [ctypes.c_int]
    lib.torchao_optim_cpu_rule_coefs.argtypes = [ctypes.c_int]
    return tuple(
        (
            lib.torchao_optim_cpu_rule_name(i).decode(),
            lib.torchao_optim_cpu_rule_states(i),
            lib.torchao_optim_cpu_rule_coefs(i),
        )
        for i in range(lib.torchao_optim_cpu_rule_count())
    )


def cpu_rule(rule) -> tuple[ctypes.CDLL, int]:
    """``(library, index)``: the C step that runs ``rule`` (a :class:`~torchao_optim.rules.FusedRule`) and the
    rule's index in its table: the package's library for a package rule, else one built with the rule's C source
    (on first use; a compiler's error raises RuntimeError naming the rule). Raises NotImplementedError, naming the
    rule, for one without a C update or with more than three states."""
    if rule.c_source is None:
        raise NotImplementedError(
            f"rule {rule.name!r} declares no C update (FusedRule.c_source): the fused CPU step cannot run it; "
            f"give it one (docs/adding-a-rule.md), or leave its parameters to the compiled path (fused=False)"
        )
    if not 1 <= len(rule.state_keys) <= MAX_STATES:
        raise NotImplementedError(
            f"rule {rule.name!r} carries {len(rule.state_keys)} states {rule.state_keys}: the fused CPU step takes "
            f"one to {MAX_STATES}"
        )
    index = _BUILT_IN_INDEX.get(_c_rule(rule))
    if index is not None:
        return cpu_kernels(), index
    try:
        return _rule_library(rule), 0
    except RuntimeError as err:
        raise RuntimeError(f"the fused CPU step for rule {rule.name!r} could not be built: {err}") from err


def quantize_nearest_cpu(
    y: torch.Tensor, codebook, never_zero: bool = False, compact: bool = True, form: str = "two_loads"
) -> torch.Tensor:
    """``torchao_optim.quant.quantize_nearest`` through this file's encoder (for tests): uint8 codes of ``y``
    (fp32 in [-1, 1], on the CPU). ``form="one_load"`` takes ``codec.flat_keyed``'s one table (the form the step uses
    where the codebook allows, ``kernels.tables.flat_shift``; ValueError where it does not); else the two tables of
    ``codec.BucketTables``, with ``compact=False`` the path of two table loads even where the codebook allows the
    first table in registers (``cpu_step.c``, ``make_encoder``)."""
    from torchao_optim.kernels.tables import CPU_FLAT_MAX_BITS
    from torchao_optim.quant import bucket_tables
    from torchao_optim.quant.codec import flat_keyed

    shift = 0
    if form == "one_load":
        one = flat_keyed(tuple(codebook), never_zero, CPU_FLAT_MAX_BITS)
        if one is None:
            raise ValueError(f"codebook {tuple(codebook)} needs more than {CPU_FLAT_MAX_BITS} bits per exponent")
        (level1, shift), level2 = one, one[0]
    else:
        tables = bucket_tables(tuple(codebook), never_zero)
        level1, level2 = tables.level1_by_bits(), tables.level2_with_bounds()
    y = y.detach().to(torch.float32).contiguous()
    out = torch.empty(y.shape, dtype=torch.uint8)
    cpu_kernels().torchao_optim_cpu_encode(
        y.data_ptr(),
        out.data_ptr(),
        y.numel(),
        level1.data_ptr(),
        level2.data_ptr(),
        int(compact),
        shift,
        int(min(codebook) < 0),
    )
    return out
