"""Where the compiled path's first step goes: one ``step()`` of ``AdamW(state_format=..., fused=False)`` over the
ViT-B geometry on CUDA, in this process, with empty inductor and Triton caches, then the compiler's own timers
(``torch._dynamo.utils.compile_times``: tracing, AOT autograd, inductor's lowering and code generation, the wait
for Triton's compiles) over 0.05 s.

    python benchmarks/profile_compile.py --format dtq8
    python benchmarks/profile_compile.py --format 4bit_rank1 --option compile_threads=1
    python benchmarks/profile_compile.py --format dtq8 --warm    # a trivial compile first: the process's one-time costs

Run each in a fresh process (a process compiles the compiler stack's first use once). Python's bytecode caches
count: where they cannot be written (``PYTHONDONTWRITEBYTECODE``, a read-only installation) every process compiles
the compiler's modules from source again; ``PYTHONPYCACHEPREFIX`` gives them a place.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

_cache = tempfile.mkdtemp(prefix="profile_compile_")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_cache, "inductor")
os.environ["TRITON_CACHE_DIR"] = os.path.join(_cache, "triton")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_step import GEOMETRIES, set_inductor_options  # noqa: E402

import torchao_optim  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--format", default="dtq8", help="state format of the optimizer")
    ap.add_argument("--geometry", default="vit_b", choices=sorted(GEOMETRIES))
    ap.add_argument(
        "--option",
        action="append",
        default=[],
        help="an inductor config to set first, as name=value (a Python literal), e.g. compile_threads=1",
    )
    ap.add_argument("--warm", action="store_true", help="compile a trivial function first and time it")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_compile.py needs a CUDA device")
    set_inductor_options(args.option)
    if args.warm:
        start = time.perf_counter()
        torch.compile(lambda x: (x * 2).sum(-1), dynamic=True)(torch.randn(64, 256, device="cuda"))
        torch.cuda.synchronize()
        print(f"a trivial function's compile: {time.perf_counter() - start:.2f} s")
    params = [torch.nn.Parameter(torch.randn(s, device="cuda") * 0.02) for s in GEOMETRIES[args.geometry]()]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torchao_optim.AdamW(params, lr=1e-3, state_format=args.format, fused=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    opt.step()
    torch.cuda.synchronize()
    print(f"{args.format} {args.geometry} {' '.join(args.option)}: first step {time.perf_counter() - start:.2f} s")
    names, values = torch._dynamo.utils.compile_times(repr="csv", aggregate=True)
    for name, value in zip(names, values):
        if float(value) > 0.05:
            print(f"  {name}: {float(value):.2f} s")


if __name__ == "__main__":
    main()
