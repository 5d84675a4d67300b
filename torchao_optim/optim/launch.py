"""Every launch of the fused step, in one place: a plan (:mod:`torchao_optim.optim.fused`) run on its executor.

A plan is data: pointer tables, sizes, the program map, its layouts' tables and flags. Its rule
(:class:`~torchao_optim.rules.FusedRule`) says the rest: its number of states (which kernel family runs it), its
element update in each family's form (Triton's, C's) and its coefficients. Three launches:

- Triton, two or three states (Adam, RMSprop with momentum; AdEMAMix, Adam with amsgrad, centered RMSprop with
  momentum): Adam's coefficients kernel advances the step counts and writes the coefficient rows (one launch for every
  plan of a group on a device, made by the first plan's: ``fused._share_coefficients``); a rule without one advances
  them as below. Then ``adam_kernel`` with the rule's element update, its third state under ``N_STATES=3``.
- Triton, one state (SGD, Lion, Adagrad, RMSprop): the step counts advance and the rule's coefficient function
  writes the rows (a few small torch launches), then ``momentum_kernel`` with the rule's element update.
- CPU: each state's own step count advances, the rule's coefficient function writes the rows, then one call of
  the C step (``kernels/cpu_step.c``, built with the rule's C update: ``kernels.cpu.cpu_rule``) runs it; it takes
  one to three states (AdEMAMix, centered RMSprop and Adam with amsgrad carry three).

A kernel runs only a rule that gives what it needs; any other is refused, naming the rule and what it lacks (the
planner, ``fused.py``, leaves such a rule's parameters to the compiled path before they get here: a rule with no Triton
update takes the C step on the CPU and the compiled path on CUDA).
"""

from __future__ import annotations

import torch
from torch import Tensor

from torchao_optim.kernels import triton_interpreter
from torchao_optim.kernels.cpu import CPU_DTYPES, MAX_STATES, cpu_rule, state_kind
from torchao_optim.state.layout import PLAIN_FP32, SCALE_KINDS

__all__ = ["run"]

MIN_BLOCKS_PER_THREAD = 64  # CPU: a thread is worth starting for at least this many blocks (16K elements at 256)


def run(plan, hyperparams: Tensor, maximize: bool = False, stochastic_round: bool = False, **options) -> None:
    """One step of every parameter of ``plan``. ``hyperparams``: the group's tensor, as the rule's coefficients take
    it; then the optimizer's launch flags: ``maximize``, ``stochastic_round`` (bf16 parameters only) and the rule's
    option by its name (``FusedRule.option``: Adam's ``decoupled``, SGD's ``nesterov``)."""
    rule = plan.rule
    option = bool(options.pop(rule.option, False)) if rule.option is not None else False
    if options:
        raise TypeError(f"rule {rule.name!r} takes no launch setting {sorted(options)} (its option: {rule.option!r})")
    if plan.executor == "cpu":
        return _run_cpu(plan, hyperparams, option, maximize, stochastic_round)
    if len(plan.layouts) in (2, 3):
        return _run_two_or_three_states(plan, hyperparams, option, maximize, stochastic_round)
    if len(plan.layouts) == 1:
        return _run_one_state(plan, hyperparams, option, maximize, stochastic_round)
    raise NotImplementedError(
        f"rule {rule.name!r} carries {len(plan.layouts)} states {rule.state_keys}: the Triton kernels take one to three"
    )


def _triton_update(rule, n_states: int, n_coefs: int | None):
    """The rule's element update for the Triton kernel of ``n_states`` states, which reads ``n_coefs`` coefficients
    (None: as many as the rule has)."""
    if rule.triton_update is None:
        raise NotImplementedError(
            f"rule {rule.name!r} declares no Triton element update (FusedRule.triton_update): "
            f"the fused Triton kernels cannot run it; give it one (docs/adding-a-rule.md), "
            f"or leave its parameters to the compiled path (fused=False)"
        )
    if n_coefs is not None and rule.n_coefs != n_coefs:
        raise NotImplementedError(
            f"rule {rule.name!r} has {rule.n_coefs} coefficients {rule.coefficient_names}, "
            f"but the Triton kernel of {n_states} state(s) reads {n_coefs}"
        )
    return rule.triton_update()


def _advance(plan, hyperparams: Tensor, option: bool) -> None:
    """The step counts and coefficient rows this plan's launch advances and writes (``plan.coefs_for``: its own, or
    those of every plan of its group on its device; None: an earlier plan's launch does): in one launch of the
    rule's coefficients kernel where it has one, else with its coefficient function."""
    if plan.coefs_for is None:
        return
    steps, coefs = plan.coefs_for
    if plan.rule.triton_coefficients is not None:
        n = len(steps)
        plan.rule.triton_coefficients()[(1,)](
            steps, hyperparams, coefs, n, option, N_POW2=max(16, 1 << (n - 1).bit_length()), PDL=plan.pdl, num_warps=4
        )
    else:
        steps.add_(1)
        coefs.copy_(plan.rule.coefficients(steps, hyperparams, option))  # (n_tensors, n_coefs), fp32


def _run_two_or_three_states(plan, hyperparams: Tensor, option: bool, maximize: bool, stochastic_round: bool) -> None:
    """``adam_kernel``: two states as it is tuned for them; a third (``N_STATES=3``) read and written as the first two,
    with the rule's own number of coefficients."""
    from torchao_optim.kernels.triton_adam import N_COEFS, adam_kernel

    n_states = len(plan.layouts)
    update = _triton_update(plan.rule, n_states, N_COEFS if n_states == 2 else None)
    _advance(plan, hyperparams, option)
    if plan.n_programs == 0:
        return  # every shard is empty (more ranks than rows): the steps advance, nothing else does
    m_layout, v_layout = plan.layouts[:2]
    rank1 = _rank1_stats(plan, update, option, maximize)
    if n_states == 3:  # the third state's tables and constants (with two, its tables are None: no argument at all)
        w_layout = plan.layouts[2]
        third = dict(
            N_STATES=3,
            N_COEFS=plan.rule.n_coefs,
            W_QUANT=w_layout.quantized,
            W_BITS=getattr(w_layout, "bits", 8),
            W_SIGNED=getattr(w_layout, "signed", True),
            W_FLAT=plan.flat[2],
            W_SCALE=rank1[2],
        )
        tables = plan.tables
    else:
        third = {}
        tables = plan.tables + (None, None, None)
    plan.compiled = adam_kernel[(plan.n_programs,)](
        plan.ptrs,
        plan.grad_ptrs,
        plan.numels,
        plan.coefs,
        plan.prog_tensor,
        plan.prog_block,
        plan.prog_tiles,
        plan.steps,
        plan.round_info,
        *tables,
        plan.rank1,
        PARAM_DTYPE=plan.param_dtype,
        GRAD_DTYPE=plan.grad_dtype,
        QBLOCK=plan.block,
        BLOCK=plan.tile,
        VEC=plan.vec,
        PREFETCH=plan.prefetch,
        ALIGNED=plan.aligned and plan.grads_aligned,
        PTX=not triton_interpreter(),
        SR=plan.rounds(stochastic_round),
        UPDATE=update,
        OPTION=option,
        MAXIMIZE=maximize,
        M_QUANT=m_layout.quantized,
        M_BITS=getattr(m_layout, "bits", 8),
        V_QUANT=v_layout.quantized,
        V_BITS=getattr(v_layout, "bits", 8),
        M_SIGNED=getattr(m_layout, "signed", True),
        V_SIGNED=getattr(v_layout, "signed", True),
        M_FLAT=plan.flat[0],
        V_FLAT=plan.flat[1],
        PDL=plan.pdl,
        M_SCALE=rank1[0],
        V_SCALE=rank1[1],
        FOLD=plan.fold_sums,
        ROW_TILES=plan.row_tiles,
        **third,
        num_warps=plan.num_warps,
        **({"maxnreg": plan.maxnreg} if plan.maxnreg else {}),
        **({"launch_pdl": True} if plan.pdl else {}),
    )
    if plan.maxnreg and getattr(plan.compiled, "n_spills", 0):
        # the caps were measured on Adam's update; a rule that needs more registers (RMSprop's momentum, whose
        # correctly rounded division keeps its slow path) spills under them: the next launches compile without one
        plan.maxnreg = None
    _rank1_maxima(plan)


def _rank1_stats(plan, update, option: bool, maximize: bool) -> tuple[int, ...]:
    """Each state's kind of scales, as the Triton kernels' ``SCALE`` constexprs take it (its index in
    ``state.layout.SCALE_KINDS``: 0 one per block, 1 rank-1, 2 factored); where a state's scales are over the whole
    matrix, the first pass (``triton_rank1.rank1_stats_kernel``): their new maxima, into ``plan.maxima``, and their
    new sums, into ``plan.sums``, a factored state decoded with its columns over their mean (made first). A plan that
    folds its factored sums into the step (``plan.fold_sums``) has its sums zeroed and its columns made, and no first
    pass."""
    rank1 = tuple(SCALE_KINDS.index(layout.scale) for layout in plan.layouts) + (0,) * (3 - len(plan.layouts))
    if plan.rank1 is None:
        return rank1
    from torchao_optim.kernels.triton_rank1 import rank1_stats_kernel

    plan.maxima.zero_()
    plan.sums.zero_()
    plan.normalize_columns()
    if plan.fold_sums:  # the step kernel takes the sums (FOLD): no first pass
        return rank1
    n_states = len(plan.layouts)
    decode = plan.tables[0::3] + (None,) * (3 - n_states)  # each state's decode table
    flags = {}
    for k, layout in enumerate(plan.layouts):
        flags.update(
            {f"S{k}_QUANT": layout.quantized, f"S{k}_BITS": getattr(layout, "bits", 8), f"S{k}_SCALE": rank1[k]}
        )
    rank1_stats_kernel[(len(plan.stats_tensor),)](
        plan.ptrs,
        plan.grad_ptrs,
        plan.numels,
        plan.coefs,
        plan.rank1,
        plan.stats_tensor,
        plan.stats_tile,
        *decode,
        PARAM_DTYPE=plan.param_dtype,
        GRAD_DTYPE=plan.grad_dtype,
        QBLOCK=plan.block,
        UPDATE=update,
        OPTION=option,
        MAXIMIZE=maximize,
        PTX=not triton_interpreter(),
        ALIGNED=plan.aligned and plan.grads_aligned and plan.tiles_aligned,
        ROWS=plan.stats_tile_shape.rows,
        COLS=plan.stats_tile_shape.cols,
        STRIP=plan.stats_tile_shape.strip,
        ROWWISE=plan.stats_tile_shape.rowwise,
        GROUPED=plan.stats_tile_shape.grouped,
        N_STATES=n_states,
        N_COEFS=plan.rule.n_coefs,
        **flags,
        num_warps=plan.stats_tile_shape.warps,
        **({"maxnreg": plan.stats_tile_shape.maxnreg} if plan.stats_tile_shape.maxnreg else {}),
    )
    plan.rank1_inverses()
    return rank1


def _rank1_maxima(plan) -> None:
    """The new maxima and means become the states' own, once every tile has decoded with the old ones."""
    if plan.rank1 is not None:
        plan.store_statistics()


def _run_one_state(plan, hyperparams: Tensor, option: bool, maximize: bool, stochastic_round: bool) -> None:
    from torchao_optim.kernels.triton_momentum import N_COEFS, momentum_kernel

    update = _triton_update(plan.rule, 1, N_COEFS)
    _advance(plan, hyperparams, option)
    if plan.n_programs == 0:
        return  # every shard is empty (more ranks than rows): the steps advance, nothing else does
    (layout,) = plan.layouts
    rank1 = _rank1_stats(plan, update, option, maximize)
    plan.compiled = momentum_kernel[(plan.n_programs,)](
        plan.ptrs,
        plan.grad_ptrs,
        plan.numels,
        plan.coefs,
        plan.prog_tensor,
        plan.prog_block,
        plan.prog_tiles,
        plan.steps,
        plan.round_info,
        *plan.tables,
        plan.rank1,
        PARAM_DTYPE=plan.param_dtype,
        GRAD_DTYPE=plan.grad_dtype,
        QBLOCK=plan.block,
        BLOCK=plan.tile,
        VEC=plan.vec,
        ALIGNED=plan.aligned and plan.grads_aligned,
        UPDATE=update,
        OPTION=option,
        MAXIMIZE=maximize,
        SR=plan.rounds(stochastic_round),
        S_QUANT=layout.quantized,
        S_BITS=getattr(layout, "bits", 8),
        PTX=not triton_interpreter(),
        S_SIGNED=getattr(layout, "signed", True),
        S_FLAT=plan.flat[0],
        S_SCALE=rank1[0],
        num_warps=plan.num_warps,
    )
    _rank1_maxima(plan)


def _run_cpu(plan, hyperparams: Tensor, option: bool, maximize: bool, stochastic_round: bool) -> None:
    """The step counts advance, the rule's coefficient function writes the rows (as the compiled path computes
    them), then one call of the C step updates every tensor."""
    rule = plan.rule
    lib, index = cpu_rule(rule)
    steps = [s["step"] for s in plan.states]  # each state's own counter (GroupPlan says why)
    torch._foreach_add_(steps, 1)
    plan.steps = torch.stack(steps).to(torch.float32)
    plan.coefs.copy_(rule.coefficients(plan.steps, hyperparams, option))
    # per state slot: decode table, level1, level2, kind, encoder form, rows of rank-1 scales or of a factored state (a
    # slot the rule does not use: NULLs)
    args = []
    for k in range(MAX_STATES):
        if k < len(plan.layouts):
            layout, rows = plan.layouts[k], plan.rows[k]
            args += [t.data_ptr() for t in plan.tables[3 * k : 3 * k + 3]]
            args += [state_kind(layout), plan.flat[k], None if rows is None else rows.data_ptr()]
        else:
            args += [None, None, None, state_kind(PLAIN_FP32), 0, None]
    status = lib.torchao_optim_cpu_step(
        len(plan.params),
        plan.ptrs.data_ptr(),
        plan.grad_ptrs.data_ptr(),
        plan.numels.data_ptr(),
        plan.coefs.data_ptr(),
        plan.steps.data_ptr(),
        plan.round_info.data_ptr(),
        *args,
        len(plan.layouts),
        rule.n_coefs,
        plan.block,
        index,
        CPU_DTYPES[plan.torch_param_dtype],
        CPU_DTYPES[plan.torch_grad_dtype],
        option,
        maximize,
        plan.rounds(stochastic_round),
        torch.get_num_threads(),
        MIN_BLOCKS_PER_THREAD * 256 // plan.block,
    )
    if status != 0:
        raise RuntimeError(
            f"the fused CPU step failed (status {status}) for rule {rule.name!r}, block size {plan.block}"
        )
