"""PyTorch Lightning with our optimizer: returned by ``configure_optimizers`` with a per-step scheduler, under
gradient accumulation, gradient clipping, bf16 autocast and bf16 parameters, and resumed with
``fit(ckpt_path=...)`` as exactly as torch.optim.AdamW is."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

L = pytest.importorskip("lightning")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
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


class Regression(L.LightningModule):
    def __init__(self, optimizer_cls, **optimizer_kwargs):
        super().__init__()
        self.net = mlp()
        self.optimizer_cls, self.optimizer_kwargs = optimizer_cls, optimizer_kwargs

    def training_step(self, batch, batch_idx):
        # the data is a function of the micro-batch's index, which Lightning restores on resume: a resumed run sees
        # the same batches without a resumable data loader
        x, y = regression_batch(batch_idx)
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = self.optimizer_cls(self.parameters(), lr=1e-2, weight_decay=0.01, **self.optimizer_kwargs)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        return torch.utils.data.DataLoader(range(100 * STEPS * ACCUMULATE), batch_size=1)


def fit(module, root, precision, ckpt_path=None, callbacks=()):
    trainer = L.Trainer(
        max_steps=2 * STEPS,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=0.5,
        precision=precision,
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        logger=False,
        enable_model_summary=False,
        enable_checkpointing=bool(callbacks),
        callbacks=list(callbacks),
        default_root_dir=str(root),
    )
    with warnings.catch_warnings():
        # a mid-epoch checkpoint with a plain data loader: the data here does not depend on the loader's position
        warnings.filterwarnings("ignore", message=".*resuming from a checkpoint that ended before the epoch ended.*")
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*callbacks used to create the checkpoint need to be provided.*")
        warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\)` is deprecated.*")
        trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


def resume_difference(cls, root, precision, **optimizer_kwargs):
    """Max abs difference between a run resumed from its checkpoint after STEPS optimizer steps and the run
    uninterrupted; and the checkpoint's path."""
    uninterrupted = Regression(cls, **optimizer_kwargs)
    checkpoints = ModelCheckpoint(dirpath=str(root), every_n_train_steps=STEPS, save_top_k=-1)
    fit(uninterrupted, root / "full", precision, callbacks=[checkpoints])
    checkpoint = os.path.join(root, f"epoch=0-step={STEPS}.ckpt")
    resumed = Regression(cls, **optimizer_kwargs)
    trainer = fit(resumed, root / "resumed", precision, ckpt_path=checkpoint)
    assert trainer.precision == precision
    opt = trainer.optimizers[0]
    assert type(opt) is cls
    assert opt.state[resumed.net[0].weight]["step"].item() == 2 * STEPS  # once per accumulation window
    assert resumed.net[0].weight.dtype == (torch.bfloat16 if precision == "bf16-true" else torch.float32)
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 2 * STEPS
    return max_abs_diff(snapshot(resumed), snapshot(uninterrupted)), checkpoint


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_configure_optimizers_fit_and_resume(tmp_path, precision):
    # bf16 parameters ("bf16-true") are written back with stochastic rounding, whose random bits are a function of
    # the step: a resumed run rounds as the uninterrupted one
    options = {"bf16_stochastic_round": True} if precision == "bf16-true" else {}
    ours, checkpoint = resume_difference(torchao_optim.AdamW8bit, tmp_path / "ours", precision, **options)
    torchs, _ = resume_difference(torch.optim.AdamW, tmp_path / "torch", precision)
    assert_resumes_as_closely_as_torch(ours, torchs)

    # the checkpoint holds our 8-bit state as it is
    saved = torch.load(checkpoint, weights_only=True)["optimizer_states"][0]
    assert isinstance(saved["state"][0]["exp_avg"], DTQ8bitTensor)  # the 64x128 weight
    assert type(saved["state"][3]["exp_avg"]) is torch.Tensor  # the 8-element bias
