"""``python -m torchao_optim``: what a bug report needs, in one paste.

Versions (torchao_optim, torch, triton, Python, the C compiler), the devices, which fused executors run here and why
the others do not, the cache directories, and the registered state formats.
"""

from __future__ import annotations

import os
import platform
import sys


def report() -> str:
    import torch

    import torchao_optim
    from torchao_optim.kernels import triton_interpreter
    from torchao_optim.kernels.cpu import cpu_kernels_status
    from torchao_optim.optim.fused import fused_available

    lines = [
        f"torchao_optim {torchao_optim.__version__} ({os.path.dirname(torchao_optim.__file__)})",
        f"python {platform.python_version()} on {platform.platform()}",
        f"torch {torch.__version__} (CUDA {torch.version.cuda}, {torch.get_num_threads()} CPU threads)",
    ]
    try:
        import triton

        lines.append(f"triton {triton.__version__}")
    except Exception as err:  # noqa: BLE001 - any import failure is the answer
        lines.append(f"triton: not importable ({type(err).__name__}: {err})")
    cpu = cpu_kernels_status()
    lines.append(
        f"C compiler: {cpu['compiler'] or 'none found ($CC, cc, gcc, clang)'}; {cpu['compiler_version'] or ''}"
    )
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        lines.append(f"CUDA devices: {', '.join(names)}")
    else:
        lines.append("CUDA devices: none")
    lines.append("fused executors:")
    if fused_available("cuda"):
        lines.append("  CUDA (Triton kernels): available")
    elif not torch.cuda.is_available():
        lines.append("  CUDA (Triton kernels): not here (no CUDA device)")
    else:
        lines.append("  CUDA (Triton kernels): not here (Triton or its kernels cannot be imported; see above)")
    if cpu["built"]:
        lines.append(f"  CPU (C step): available ({cpu['library']})")
    else:
        lines.append(f"  CPU (C step): not here ({cpu['error']}); CPU parameters take the compiled path")
    interp = (
        "on (TRITON_INTERPRET=1: fused=True runs the Triton kernels on CPU tensors)" if triton_interpreter() else "off"
    )
    lines.append(f"  Triton interpreter: {interp}")
    lines.append(f"cache directories: C step {cpu['cache_dir']} ($TORCHAO_OPTIM_CACHE_DIR)")
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        lines.append(f"  torch.compile (inductor) {cache_dir()} ($TORCHINDUCTOR_CACHE_DIR)")
    except Exception:  # noqa: BLE001 - a private helper of torch's, absent in some versions
        pass
    lines.append(f"state formats: {', '.join(torchao_optim.list_state_formats())}")
    return "\n".join(lines)


def main() -> int:
    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
