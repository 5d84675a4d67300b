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
