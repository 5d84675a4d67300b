"""Variants of the 4-bit state, for finding which choice closes its gap to fp32 AdamW on the language-model benchmark.

Loaded by ``benchmark_convergence.py --formats_from benchmarks/fourbit_variants.py`` (the ``125m-4bitvar-s<seed>``
parts of ``benchmarks/lm_quality.sh``), it registers, for the benchmark only (the library's ``"4bit"`` is
unchanged), each as one change from ``"4bit"`` (quadratic map for ``exp_avg``, blocks of 128):

- ``AdamW-4bit_dyn``: format ``"4bit_dyn"``, ``exp_avg``'s codebook the 4-bit dynamic tree map (``first_moment =
  "dynamic"``, torchao's and the 4-bit paper's);
- ``AdamW-4bit_vdyn``: format ``"4bit_vdyn"``, ``exp_avg_sq``'s codebook the unsigned 4-bit dynamic tree map with
  ``never_zero`` (``second_moment = "dynamic"``) instead of the linear map without zero, whose smallest level,
  1/16 of the block's absmax, overestimates every smaller value and so shrinks its update;
- ``AdamW-4bit_bal``, ``AdamW-4bit_lin``, ``AdamW-4bit_nrm``: ``exp_avg``'s codebook one with both -1.0 and 1.0
  (``fourbit.balanced_map``: quadratic, linear or normal-quantile levels) instead of the quadratic map, whose lowest
  level, -0.766, stores a block whose largest element is negative 23% short;
- ``AdamW-4bit_vsq``: ``exp_avg_sq``'s codebook ``fourbit.square_map`` (an even grid of its square root, down to
  1/256 of the absmax) instead of the linear map (down to 1/16); ``AdamW-4bit_bal_vsq`` and ``AdamW-4bit_dyn_vsq``
  pair it with the balanced and the dynamic ``exp_avg`` maps, ``AdamW-4bit_lin_vsq`` with the balanced linear one;
- ``AdamW-4bit_rank1_nrm``: ``"4bit_rank1"`` (rank-1 normalization of ``exp_avg_sq``) with the balanced normal map
  for ``exp_avg``;
- ``AdamW-4bit_sr``: format ``"4bit_sr"``, both states' codes rounded stochastically, unbiased, from a hash of each
  element's position and value (:func:`stochastic_codes`), on the per-parameter compiled path; ``AdamW-4bit_srm``,
  ``exp_avg``'s only;
- ``AdamW-4bit_floor``: format ``"4bit_floor"``, torchao's floor on the block scales (each block's absmax clipped at
  1e-12: :class:`FourBitFloorTensor`), on the compiled path; ``AdamW-4bit_dyn_floor`` with torchao's ``exp_avg`` map
  too, which is torchao's ``AdamW4bit`` state;
- ``AdamW-m4v8``: format ``"m4v8"``, ``exp_avg`` as in ``"4bit"`` and ``exp_avg_sq`` on the 8-bit dynamic map
  (:class:`FourBitFirstEightBitSecondTensor`; 8-bit codes for both, so about 2.07 bytes per parameter), on the compiled
  path;
- ``AdamW-4bit_b64``: format ``"4bit_b64"``, blocks of 64 (0.5 + 4/64 bytes per element and state: 1.13 bytes per
  parameter for Adam's two, against 1.06);
- ``AdamW4bit-emb8``: ``"4bit"``, but the parameters of the param groups without weight decay keep 8-bit state
  (``"dtq8"``): in ``gpt.py``'s groups the embeddings, biases and LayerNorm weights (those under ``min_quant_size``,
  4096 elements, keep fp32 state in any case, so on ``gpt125m`` this is the two embeddings);
- ``AdamW4bit-small8``: ``"4bit"``, but every parameter of at most :data:`SMALL` elements keeps 8-bit state: on
  ``gpt125m`` and ``gpt350m`` the two embeddings and the output head (the matrices of the blocks are larger).

Every variant but ``AdamW-4bit_sr``, ``AdamW-4bit_srm``, the ``_floor`` ones and ``AdamW-m4v8`` takes the fused path
(``fast_path_layout()``), so it trains at 4-bit speed. A signed linear map for ``exp_avg`` is not among them: the
library holds none (``quant`` has the dynamic map and the unsigned linear one). Loading this file again registers
nothing new.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)  # optimizers.py, when this file is loaded on its own
import optimizers  # noqa: E402  (the table every benchmark shares; it puts this checkout first)
import torch  # noqa: E402

import torchao_optim  # noqa: E402
from torchao_optim.quant import pack_nibbles, quantize_nearest  # noqa: E402
from torchao_optim.quant.blockwise import block_absmax, normalize  # noqa: E402
from torchao_optim.quant.rounding import mix32  # noqa: E402
from torchao_optim.state import DTQ8bitTensor, FourBitRank1Tensor, FourBitTensor, register_state_format  # noqa: E402
from torchao_optim.state.fourbit import quadratic_map  # noqa: E402
from torchao_optim.state.layout import StateLayout  # noqa: E402


def stochastic_codes(y: torch.Tensor, codebook: tuple[float, ...]) -> torch.Tensor:
    """Codes (uint8) of ``y`` (fp32 in [-1, 1]) rounded stochastically between the two ``codebook`` values around each
    element: the upper one with probability ``(y - lower) / (upper - lower)``, so that the decoded value is ``y`` on
    average (below the smallest value, the smallest). The random bits are a hash of the element's position and of
    ``y``'s own bits: the same state always gets the same codes, so a resumed run stores what an uninterrupted one does,
    and a value that changes draws new bits."""
    levels = torch.tensor(codebook, dtype=torch.float32, device=y.device)
    upper = torch.searchsorted(levels, y.contiguous()).clamp(1, len(codebook) - 1)
    lo, hi = levels[upper - 1], levels[upper]
    share = ((y - lo) / (hi - lo)).clamp(0.0, 1.0)
    position = torch.arange(y.numel(), device=y.device, dtype=torch.int64).view(y.shape)
    pattern = y.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    bits = mix32(position ^ mix32(pattern)) >> 8  # 24 random bits
    draw = bits.to(torch.float32) * 2.0**-24  # in [0, 1)
    return torch.where(draw < share, upper, upper - 1).to(torch.uint8)


class FourBitStochasticTensor(FourBitTensor):
    """``"4bit"`` with its codes rounded stochastically (:func:`stochastic_codes`) instead of to the nearest value, for
    both states or (``stochastic_states = "signed"``) ``exp_avg`` only. The fused kernels round to the nearest, so it
    takes the per-parameter compiled path (no fused layout)."""

    stochastic_states = "both"

    def fused_layout(self):
        return None

    @classmethod
    def quantize_fields(cls, x, **attrs):
        if cls.stochastic_states == "signed" and not attrs["signed"]:
            return super().quantize_fields(x, **attrs)
        layout = cls.layout_of(attrs)
        absmax = block_absmax(x, layout.block_size)
        codes = stochastic_codes(normalize(x, absmax, layout.block_size), layout.codebook)
        return {layout.codes: pack_nibbles(codes), layout.scales: absmax}


# torchao's low-bit states clip each block's absmax at this before scaling (torchao/optim/quant_utils.py, scale_tensor)
TORCHAO_SCALE_FLOOR = 1e-12


class FourBitFloorTensor(FourBitTensor):
    """``"4bit"`` with torchao's floor on its block scales: each block's absmax clipped at :data:`TORCHAO_SCALE_FLOOR`,
    so that a block of ``exp_avg_sq`` under 1e-12 decodes to at least 1/16 of it (the linear map's smallest value), a
    denominator of at least 2.5e-7, and a block of ``exp_avg`` under it keeps only the codes it takes against 1e-12.
    On the per-parameter compiled path (no fused layout)."""

    def fused_layout(self):
        return None

    @classmethod
    def quantize_fields(cls, x, **attrs):
        layout = cls.layout_of(attrs)
        absmax = block_absmax(x, layout.block_size).clamp_min(TORCHAO_SCALE_FLOOR)
        codes = quantize_nearest(normalize(x, absmax, layout.block_size), layout.codebook, layout.never_zero)
        return {layout.codes: pack_nibbles(codes), layout.scales: absmax}


class FourBitFirstEightBitSecondTensor(DTQ8bitTensor):
    """``exp_avg`` as ``"4bit"`` stores it (the quadratic map's 16 values, blocks of 128), held in 8-bit codes, and
    ``exp_avg_sq`` as ``"dtq8"`` does (the 8-bit dynamic map), in blocks of 128: ``"4bit"`` with an exact-enough second
    moment, to tell the two states' shares of 4-bit state's error apart. On the compiled path (no fused layout)."""

    default_block_size = 128

    def fused_layout(self):
        return None

    @classmethod
    def layout(cls, *, signed: bool, block_size: int) -> StateLayout:
        if not signed:
            return super().layout(signed=False, block_size=block_size)
        return StateLayout(codes="codes", scales="absmax", block_size=block_size, codebook=quadratic_map())


# Parameters of at most this many elements keep 8-bit state in AdamW4bit-small8: 2**19 takes gpt350m's position
# embedding (512 x 1024) and leaves out gpt125m's attention projections (768 x 768).
SMALL = 2**19

# format name: (class name, the class attributes it changes from its base's[, the base: FourBitTensor if not given])
FORMATS = {
    "4bit_dyn": ("FourBitDynamicTensor", {"first_moment": "dynamic"}),
    "4bit_vdyn": ("FourBitDynamicSecondTensor", {"second_moment": "dynamic"}),
    "4bit_b64": ("FourBitBlock64Tensor", {"default_block_size": 64}),
    "4bit_bal": ("FourBitBalancedTensor", {"first_moment": "balanced"}),
    "4bit_lin": ("FourBitBalancedLinearTensor", {"first_moment": "balanced_linear"}),
    "4bit_nrm": ("FourBitBalancedNormalTensor", {"first_moment": "balanced_normal"}),
    "4bit_vsq": ("FourBitSquareSecondTensor", {"second_moment": "square"}),
    "4bit_bal_vsq": ("FourBitBalancedSquareTensor", {"first_moment": "balanced", "second_moment": "square"}),
    "4bit_dyn_vsq": ("FourBitDynamicSquareTensor", {"first_moment": "dynamic", "second_moment": "square"}),
    "4bit_lin_vsq": ("FourBitLinearSquareTensor", {"first_moment": "balanced_linear", "second_moment": "square"}),
    "4bit_rank1_nrm": ("FourBitRank1NormalTensor", {"first_moment": "balanced_normal"}, FourBitRank1Tensor),
    "4bit_sr": ("FourBitStochasticRoundedTensor", {}, FourBitStochasticTensor),
    "4bit_srm": ("FourBitStochasticFirstTensor", {"stochastic_states": "signed"}, FourBitStochasticTensor),
    "m4v8": ("FourBitFirstEightBitSecondVariant", {}, FourBitFirstEightBitSecondTensor),
    "4bit_floor": ("FourBitFlooredTensor", {}, FourBitFloorTensor),
    "4bit_dyn_floor": ("FourBitDynamicFlooredTensor", {"first_moment": "dynamic"}, FourBitFloorTensor),
}


def _split_groups(params, eight_bit, name: str) -> list[dict]:
    """``params`` (parameters, or param groups) as param groups with ``state_format`` set: ``"dtq8"`` for each
    parameter where ``eight_bit(p, group, groups)``, ``"4bit"`` for the others; a group split in two keeps its
    other settings in both."""
    params = list(params)
    groups = params if params and isinstance(params[0], dict) else [{"params": params}]
    groups = [dict(g, params=list(g["params"])) for g in groups]
    out = []
    for group in groups:
        chosen = [eight_bit(p, group, groups) for p in group["params"]]
        for state_format, pick in (("4bit", False), ("dtq8", True)):
            members = [p for p, c in zip(group["params"], chosen) if c is pick]
            if members:
                out.append(dict(group, params=members, state_format=state_format))
    if not out:
        raise ValueError(f"{name}: no parameters to optimize")
    return out


def _undecayed_group(p, group, groups) -> bool:
    decays = [g.get("weight_decay") for g in groups]
    if not any(decays) or all(decays):
        raise ValueError(
            "AdamW4bit-emb8 keeps the parameters of the groups without weight decay (embeddings, biases, norms) "
            f"in 8-bit, so it needs groups with and without weight decay; got weight decays {decays}"
        )
    return not group.get("weight_decay")


def _small(p, group, groups) -> bool:
    return p.numel() <= SMALL


def _four_bit_with_8bit(eight_bit, name: str):
    def make(params, lr, weight_decay, betas, eps, compile):
        groups = _split_groups(params, eight_bit, name)
        return torchao_optim.AdamW(
            groups, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, compile=compile, state_format="4bit"
        )

    return make


OPTIMIZERS = {
    "AdamW4bit-emb8": (
        "torchao_optim.AdamW: 4bit state, dtq8 for the param groups without weight decay",
        _undecayed_group,
    ),
    "AdamW4bit-small8": (f"torchao_optim.AdamW: 4bit state, dtq8 for parameters of at most {SMALL} elements", _small),
}


def register() -> list[str]:
    """Register the variant formats (where not yet registered) and optimizers; returns the optimizer names."""
    for name, (cls_name, attrs, *base) in FORMATS.items():
        if name not in torchao_optim.list_state_formats():
            bases = tuple(base) or (FourBitTensor,)
            register_state_format(name)(type(cls_name, bases, {**attrs, "__module__": __name__}))
    for name, (description, eight_bit) in OPTIMIZERS.items():
        optimizers.register_optimizer(
            optimizers.OptimizerEntry(name, description, _four_bit_with_8bit(eight_bit, name), None, "4bit")
        )
    return [f"AdamW-{name}" for name in FORMATS] + list(OPTIMIZERS)


VARIANTS = register()
