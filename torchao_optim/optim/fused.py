"""The fused group step on CUDA: each parameter group is one or two kernel launches, whatever its shapes.

A :class:`GroupPlan` holds, for the parameters of one group that share a device and dtypes, the device
tables the multi-tensor kernels read (pointers, sizes, the program -> (tensor, block) map) and the group's
step counts, to which each parameter's ``state["step"]`` is an alias. Plans are rebuilt only when the set
of parameters with gradients changes. Gradients move: ``zero_grad(set_to_none=True)`` frees them and
backward allocates new ones, often elsewhere; so their addresses are a table of their own, refreshed with
one non-blocking copy from pinned memory when they changed.
Parameters the kernels do not cover (other formats, amsgrad, non-contiguous tensors, CPU) take the
per-parameter compiled path.
"""
from __future__ import annotations

import functools
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from torchao_optim.quant import dynamic_map_spec
from torchao_optim.state import DTQ8bitTensor

__all__ = ["triton_available", "GroupPlan", "plan_group"]

FP32_STATE_BLOCK = 1024  # elements per program for fp32 state
DTQ8_ROWS = 4  # quantization blocks per program for 8-bit state


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401

        from torchao_optim.kernels import triton_adam  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


def _alias0d(base: Tensor, i: int) -> Tensor:
    """Element i of ``base`` as a 0-d tensor sharing its storage, with no view relation (see adam._alias)."""
    return base.new_empty(0).set_(base.untyped_storage(), base.storage_offset() + i, (), ())


def kind_of(p: Tensor, state, amsgrad: bool) -> Optional[str]:
    """"dtq8" or "fp32" if a fused kernel can update ``p``, else None."""
    if amsgrad or p.device.type != "cuda" or not p.is_contiguous() or not p.grad.is_contiguous():
        return None
    from torchao_optim.kernels.triton_adam import TRITON_DTYPES

    if p.dtype not in TRITON_DTYPES or p.grad.dtype not in TRITON_DTYPES:
        return None
    m, v = state["exp_avg"], state["exp_avg_sq"]
    if type(m) is DTQ8bitTensor and type(v) is DTQ8bitTensor:
        bs = m.block_size
        if m.signed and not v.signed and v.block_size == bs and bs & (bs - 1) == 0 and bs <= 4096:
            return "dtq8"
        return None
    if type(m) is Tensor and type(v) is Tensor and m.dtype == v.dtype == torch.float32 and m.is_contiguous() \
            and v.is_contiguous():
        return "fp32"
    return None


class GroupPlan:
    """Device tables for one launch over ``params`` (all of one kind, device, param dtype and grad dtype)."""

    def __init__(self, kind: str, params: List[Tensor], states: List[dict]):
        self.kind, self.params = kind, params
        device = params[0].device
        if kind == "dtq8":
            self.block = states[0]["exp_avg"].block_size
            self.rows = DTQ8_ROWS
            rows = [
                [p.data_ptr(), s["exp_avg"].codes.data_ptr(), s["exp_avg"].absmax.data_ptr(),
                 s["exp_avg_sq"].codes.data_ptr(), s["exp_avg_sq"].absmax.data_ptr()]
                for p, s in zip(params, states)
            ]
        else:
            self.block, self.rows = FP32_STATE_BLOCK, 1
            rows = [[p.data_ptr(), s["exp_avg"].data_ptr(), s["exp_avg_sq"].data_ptr()]
                    for p, s in zip(params, states)]
        self.ptrs = torch.tensor(rows, dtype=torch.int64).to(device)
        self.grad_ptrs = torch.zeros(len(params), dtype=torch.int64, device=device)
        self.grad_key: tuple = ()
        numels = torch.tensor([p.numel() for p in params], dtype=torch.int64)
        span = self.block * self.rows  # elements per program
        programs = (numels + span - 1) // span
        self.n_programs = int(programs.sum())
        starts = torch.cumsum(programs, 0) - programs
        prog_tensor = torch.repeat_interleave(torch.arange(len(params), dtype=torch.int32), programs)
        # first block of each program
        prog_block = (torch.arange(self.n_programs, dtype=torch.int64)
                      - torch.repeat_interleave(starts, programs)) * self.rows
        self.numels = numels.to(device)
        self.prog_tensor = prog_tensor.to(device)
        self.prog_block = prog_block.to(torch.int32).to(device)
        # One step counter per parameter, updated by one add_ per launch; state["step"] aliases it.
        self.steps = torch.stack([s["step"].to(device=device, dtype=torch.float32).reshape(()) for s in states])
        for i, s in enumerate(states):
            s["step"] = _alias0d(self.steps, i)
        from torchao_optim.kernels.triton_adam import TRITON_DTYPES

        self.param_dtype = TRITON_DTYPES[params[0].dtype]
        self.grad_dtype = TRITON_DTYPES[params[0].grad.dtype]

    def refresh_grads(self) -> None:
        """Point the kernel at the gradients' current addresses (a copy only when one moved)."""
        key = tuple(p.grad.data_ptr() for p in self.params)
        if key != self.grad_key:
            host = torch.tensor(key, dtype=torch.int64)
            if self.grad_ptrs.is_cuda:  # pinned: the copy does not wait; the host allocator keeps it alive
                host = host.pin_memory()
            self.grad_ptrs.copy_(host, non_blocking=True)
            self.grad_key = key

    def launch(self, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
               decoupled: bool, maximize: bool) -> None:
        from torchao_optim.kernels import triton_adam as k

        self.refresh_grads()
        grid = (self.n_programs,)
        common = dict(PARAM_DTYPE=self.param_dtype, GRAD_DTYPE=self.grad_dtype, BLOCK=self.block,
                      DECOUPLED=decoupled, MAXIMIZE=maximize)
        if self.kind == "dtq8":
            s, u = dynamic_map_spec(True), dynamic_map_spec(False)
            tab_s, tab_u = _map_tables(self.ptrs.device)
            k.adam_dtq8_kernel[grid](
                self.ptrs, self.grad_ptrs, self.numels, self.steps, self.prog_tensor, self.prog_block, tab_s, tab_u,
                lr, beta1, beta2, eps, weight_decay, **common,
                S_NDEC=len(s.lower), S_MAXRANK=s.max_rank, S_ZERO=s.zero_code,
                U_NDEC=len(u.lower), U_MAXRANK=u.max_rank, U_ZERO=u.zero_code, ROWS=self.rows, num_warps=4,
            )
        else:
            k.adam_fp32_kernel[grid](
                self.ptrs, self.grad_ptrs, self.numels, self.steps, self.prog_tensor, self.prog_block,
                lr, beta1, beta2, eps, weight_decay, **common, num_warps=4,
            )
        self.steps.add_(1)


@functools.lru_cache(maxsize=None)
def _map_tables(device: torch.device) -> Tuple[Tensor, Tensor]:
    from torchao_optim.kernels.triton_adam import map_table

    return map_table(dynamic_map_spec(True), device), map_table(dynamic_map_spec(False), device)


def plan_group(cache: Dict, params: List[Tensor], states: List[dict], amsgrad: bool
               ) -> Tuple[List[GroupPlan], List[int]]:
    """The plans covering what the fused kernels can update in ``params`` (reused from ``cache`` while the
    same parameters have gradients), and the indexes of the parameters left to the compiled path."""
    key = tuple(id(p) for p in params)
    if cache.get("key") == key:
        return cache["plans"], cache["rest"]
    buckets: Dict[tuple, List[int]] = {}
    rest = []
    for i, (p, s) in enumerate(zip(params, states)):
        kind = kind_of(p, s, amsgrad)
        if kind is None:
            rest.append(i)
        else:
            block = s["exp_avg"].block_size if kind == "dtq8" else 0
            buckets.setdefault((kind, block, p.device, p.dtype, p.grad.dtype), []).append(i)
    plans = [GroupPlan(b[0], [params[i] for i in idx], [states[i] for i in idx]) for b, idx in buckets.items()]
    cache.update(key=key, plans=plans, rest=rest)
    return plans, rest
