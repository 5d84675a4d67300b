"""The fused CUDA kernels compile for a GPU with the installed Triton, on any machine.

Triton's interpreter, which runs the kernels in the CPU tests, executes them as Python: it never compiles them,
so a construct the compiler rejects (a branch compiled for a shape it does not fit, say) passes there and fails
on the first GPU. Here the Adam kernel is compiled to SASS for sm_90 (Triton's CUDA backend and its bundled
tools, no GPU) in the configurations the built-in formats use, in a process of its own without the
interpreter, under the register cap the planner gives it (``optim.fused.REGISTER_CAPS``), and must not spill
registers to the stack.
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _backend_tools():
    if importlib.util.find_spec("triton") is None:
        return False
    import triton

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    return all(os.path.exists(os.path.join(tools, name)) for name in ("ptxas", "nvdisasm", "cuobjdump"))


@pytest.mark.skipif(not _backend_tools(), reason="Triton with its CUDA backend's tools is not installed")
@pytest.mark.parametrize("dtype,bits,block", [("fp32", 8, 256), ("bf16", 8, 256), ("fp32", 4, 128), ("bf16", 4, 128)])
def test_adam_kernel_compiles_for_sm90_without_spilling(dtype, bits, block):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, "-W", "ignore", str(ROOT / "benchmarks" / "count_instructions.py"),
                           "--dtype", dtype, "--bits", str(bits), "--block", str(block), "--json"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    assert stats["stack_bytes"] == 0, stats
    assert stats["instructions"] > 0 and stats["per_thread"] == 8, stats
