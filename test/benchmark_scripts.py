"""Load a script of benchmarks/ as a module, for the tests of the benchmarks."""

import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_benchmark(name: str, module_name: str = None):
    """``benchmarks/<name>.py`` as a module registered under ``module_name`` (default ``name``): classes and
    dataclasses defined there look their module up in ``sys.modules`` (while it executes, and for pickling)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))  # the scripts import their shared table (optimizers.py)
    spec = importlib.util.spec_from_file_location(module_name or name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run_benchmark_modules(monkeypatch, *names: str) -> dict:
    """Run ``benchmarks/<name>.py`` for each of ``names``, in order, as ``benchmark_convergence.py --formats_from``
    loads a module, and return the last one's namespace. The state formats and optimizers they register are forgotten
    after the test (``monkeypatch`` restores both tables), so that the other tests' sweeps over every registered
    format do not see them; each module runs again, so its registrations reach this test's tables."""
    import importlib
    import runpy

    from torchao_optim.state import registry

    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    optimizers = importlib.import_module("optimizers")  # the benchmarks' shared table, the one the scripts import
    monkeypatch.setattr(registry, "_FORMATS", dict(registry._FORMATS))
    monkeypatch.setattr(optimizers, "_REGISTERED", dict(optimizers._REGISTERED))
    namespace = {}
    for name in names:
        namespace = runpy.run_path(str(BENCHMARKS / f"{name}.py"))
    return namespace
