"""PEFT's LoRA with our optimizer over all of a model's parameters: the frozen base weights never get a gradient,
so they keep no state and do not move, weight decay included; the adapters train, with 8-bit state where they
are large enough, and the optimizer's state_dict round-trips bit for bit."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import transformers  # noqa: E402
from tiny_training import SEQ_LEN, VOCAB, snapshot, tiny_gpt2  # noqa: E402

import torchao_optim  # noqa: E402
from torchao_optim import DTQ8bitTensor  # noqa: E402

transformers.logging.set_verbosity_error()

STEPS = 3


def lora_gpt2():
    """LoRA of rank 16 on the attention and MLP input projections: 18k trainable parameters of 131k. The MLP's
    lora_B (256x16 = 4096 elements) gets 8-bit state, the other adapters fp32 state."""
    config = peft.LoraConfig(
        r=16, lora_alpha=32, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True, lora_dropout=0.0
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        return peft.get_peft_model(tiny_gpt2(), config)


def train(model, opt, first_step):
    for step in range(first_step, first_step + STEPS):
        torch.manual_seed(step)  # GPT-2's dropout: the same masks at the same step, resumed or not
        tokens = torch.randint(0, VOCAB, (4, SEQ_LEN))
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad()


def test_lora_adapters_train_and_frozen_weights_keep_no_state():
    model = lora_gpt2()
    start = snapshot(model)
    # all parameters, as a plain loop often passes them; weight decay would move a frozen weight that took a step
    opt = torchao_optim.AdamW8bit(model.parameters(), lr=1e-2, weight_decay=0.1)
    train(model, opt, 0)

    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in name for name in trainable)
    params = dict(model.named_parameters())
    for name, p in params.items():
        if name in trainable:
            assert not torch.equal(p, start[name]), name
            assert opt.state[p]["step"].item() == STEPS
            assert isinstance(opt.state[p]["exp_avg"], DTQ8bitTensor) == (p.numel() >= 4096), name
        else:
            assert torch.equal(p, start[name]), name
            assert p not in opt.state, name
    assert any(isinstance(s["exp_avg"], DTQ8bitTensor) for s in opt.state.values())
    assert len(opt.state_dict()["state"]) == len(trainable)


def test_lora_state_dict_round_trips(tmp_path):
    model = lora_gpt2()
    opt = torchao_optim.AdamW8bit(model.parameters(), lr=1e-2, weight_decay=0.1)
    train(model, opt, 0)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "checkpoint.pt")
    train(model, opt, STEPS)

    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    resumed = lora_gpt2()
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt = torchao_optim.AdamW8bit(resumed.parameters(), lr=1e-2, weight_decay=0.1)
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    assert resumed_opt.state.keys() == {p for p in resumed.parameters() if p.requires_grad}
    train(resumed, resumed_opt, STEPS)
    # bit for bit: our state_dict holds the 8-bit codes themselves, and the same steps run on the same numbers
    for (name, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name
