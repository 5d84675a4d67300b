"""accelerate with our optimizer: ``Accelerator.prepare`` wraps it (and loads its state_dict before the first
step), gradient accumulation steps it once per window, and ``save_state``/``load_state`` resume a run as exactly
as they resume torch.optim.AdamW."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from tiny_training import (  # noqa: E402
    assert_resumes_as_closely_as_torch,
    max_abs_diff,
    mlp,
    regression_batch,
    snapshot,
)

import torchao_optim  # noqa: E402
from torchao_optim import DTQ8bitTensor  # noqa: E402

STEPS = 4  # optimizer steps before the checkpoint, and as many after it
ACCUMULATE = 2


def prepared(cls):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    model = mlp()
    opt = cls(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    # each item is a micro-batch's seed, shuffled by a seeded sampler: a resumed run sees the same data only if
    # accelerate restores the sampler and skips what was seen
    loader = torch.utils.data.DataLoader(
        range(4 * STEPS * ACCUMULATE), batch_size=1, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    return (accelerator, *accelerator.prepare(model, opt, loader, scheduler))


def train(accelerator, model, opt, scheduler, batches, steps):
    for _ in range(steps * ACCUMULATE):
        x, y = regression_batch(int(next(batches)))
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            scheduler.step()
            opt.zero_grad()


def resume_difference(cls, checkpoint):
    """Max abs difference between a run interrupted after STEPS optimizer steps and resumed with load_state, and
    the same run uninterrupted."""
    accelerator, model, opt, loader, scheduler = prepared(cls)
    batches = iter(loader)
    train(accelerator, model, opt, scheduler, batches, STEPS)
    accelerator.save_state(checkpoint)
    train(accelerator, model, opt, scheduler, batches, STEPS)
    uninterrupted = snapshot(model)

    accelerator, model, opt, loader, scheduler = prepared(cls)
    accelerator.load_state(checkpoint)
    batches = iter(accelerator.skip_first_batches(loader, STEPS * ACCUMULATE))
    train(accelerator, model, opt, scheduler, batches, STEPS)
    inner = opt.optimizer  # accelerate's AcceleratedOptimizer wraps ours
    assert inner.state[model[0].weight]["step"].item() == 2 * STEPS  # once per accumulation window
    return max_abs_diff(snapshot(model), uninterrupted), inner


def test_prepare_accumulate_save_and_load_state(tmp_path):
    ours, opt = resume_difference(torchao_optim.AdamW8bit, tmp_path / "ours")
    torchs, _ = resume_difference(torch.optim.AdamW, tmp_path / "torch")
    assert_resumes_as_closely_as_torch(ours, torchs)

    assert type(opt) is torchao_optim.AdamW8bit
    assert isinstance(opt.state[opt.param_groups[0]["params"][0]]["exp_avg"], DTQ8bitTensor)  # 64x128 weight
    saved = torch.load(os.path.join(tmp_path / "ours", "optimizer.bin"), weights_only=True)
    assert isinstance(saved["state"][0]["exp_avg"], DTQ8bitTensor)
