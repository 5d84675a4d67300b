"""Our optimizers named in a training config: a torchtune-style ``_component_`` dotted path (resolved here with
importlib, and by torchtune's own ``config.instantiate`` where torchtune is installed), and torchtitan's
optimizer container with our class registered under a name.

Neither torchtune nor torchtitan is in the ``test`` extra (docs/integrations.md says why); their tests skip
without them.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import warnings

import pytest
import torch
from tiny_training import assert_resumes_as_closely_as_torch, max_abs_diff, mlp, regression_batch, snapshot

import torchao_optim
from torchao_optim import DTQ8bitTensor

# a config as a YAML loader hands it over: numbers, lists for tuples, a dotted path for the class
OPTIMIZER = {"_component_": "torchao_optim.AdamW8bit", "lr": 2e-3, "weight_decay": 0.01, "betas": [0.9, 0.95]}
SCHEDULER = {"_component_": "torch.optim.lr_scheduler.CosineAnnealingLR", "T_max": 10}
STEPS = 3  # torchtitan: steps before the checkpoint, and as many after it


def instantiate(node: dict, *args, **kwargs):
    """``node["_component_"]`` imported by its dotted path and called with ``args``, then the node's other keys,
    then ``kwargs``: the rule of torchtune's and Hydra's ``instantiate``."""
    module, _, name = node["_component_"].rpartition(".")
    component = getattr(importlib.import_module(module), name)
    return component(*args, **{k: v for k, v in node.items() if k != "_component_"}, **kwargs)


def step_once(model, opt, scheduler):
    x, y = regression_batch(0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    scheduler.step()


def assert_built_from(opt, scheduler, model):
    assert type(opt) is torchao_optim.AdamW8bit
    group = opt.param_groups[0]
    assert group["lr"] == pytest.approx(2e-3 * (1 + math.cos(math.pi / 10)) / 2)  # one step down the cosine
    assert group["weight_decay"] == 0.01 and group["betas"] == (0.9, 0.95)  # the YAML list became a tuple
    assert scheduler.last_epoch == 1
    assert isinstance(opt.state[model[0].weight]["exp_avg"], DTQ8bitTensor)


def test_a_dotted_path_config_builds_our_optimizer():
    model = mlp()
    opt = instantiate(OPTIMIZER, model.parameters())
    scheduler = instantiate(SCHEDULER, opt)
    step_once(model, opt, scheduler)
    assert_built_from(opt, scheduler, model)

    # any format by name, through the general class
    opt = instantiate({"_component_": "torchao_optim.AdamW", "state_format": "4bit", "lr": 1e-3}, model.parameters())
    assert opt.param_groups[0]["state_format"] == "4bit"


def test_a_number_yaml_read_as_text_is_refused_by_value():
    # PyYAML reads "lr: 2e-5" (no dot) as the string "2e-5": the error names it where it is made (torch.optim
    # raises "TypeError: '<=' not supported between instances of 'float' and 'str'")
    with pytest.raises(ValueError, match="2e-5"):
        instantiate(dict(OPTIMIZER, lr="2e-5"), mlp().parameters())


def test_torchtune_config_instantiate():
    config = pytest.importorskip(
        "torchtune.config",
        reason="torchtune is not installed or does not import with the installed torchao",
        exc_type=ImportError,
    )
    OmegaConf = pytest.importorskip("omegaconf").OmegaConf
    cfg = OmegaConf.create({"optimizer": OPTIMIZER, "lr_scheduler": SCHEDULER})
    model = mlp()
    opt = config.instantiate(cfg.optimizer, model.parameters())
    scheduler = config.instantiate(cfg.lr_scheduler, opt)
    step_once(model, opt, scheduler)
    assert_built_from(opt, scheduler, model)


def test_torchtitan_optimizers_container(tmp_path):
    """torchtitan builds optimizers by name in ``OptimizersContainer``; a subclass maps a name to our class, and its
    own ``Config`` makes torchtitan's trainer build it (``config.optimizer.build(model_parts=...)``). Checkpoints
    go through torch.distributed.checkpoint with FQN-keyed state, and resume as exactly as torch's."""
    titan = pytest.importorskip(
        "torchtitan.components.optimizer", reason="torchtitan is not installed", exc_type=ImportError
    )
    if not hasattr(titan, "ParamGroupConfig"):
        pytest.skip("this torchtitan predates OptimizersContainer.Config(param_groups=[ParamGroupConfig(...)])")
    import torch.distributed.checkpoint as dcp

    class Optimizers(titan.OptimizersContainer):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(titan.OptimizersContainer.Config):
            pass

        @staticmethod
        def _resolve_optimizer_factory(name):
            if name == "AdamW8bit":
                return torchao_optim.AdamW8bit
            return titan.OptimizersContainer._resolve_optimizer_factory(name)

    def build(name):
        model = mlp()
        groups = [
            titan.ParamGroupConfig(
                pattern=r"\.bias$", optimizer_name=name, optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.0}
            ),
            titan.ParamGroupConfig(
                pattern=r".*", optimizer_name=name, optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1}
            ),
        ]
        optimizers = Optimizers.Config(param_groups=groups).build(model_parts=[model])
        assert type(optimizers) is Optimizers
        return model, optimizers

    def train(model, optimizers, first_step):
        for step in range(first_step, first_step + STEPS):
            x, y = regression_batch(step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizers.step()
            optimizers.zero_grad()

    def resume_difference(name):
        model, optimizers = build(name)
        train(model, optimizers, 0)
        checkpoint = str(tmp_path / name)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.save({"model": model.state_dict(), "optimizer": optimizers}, checkpoint_id=checkpoint)
            train(model, optimizers, STEPS)
            resumed, resumed_optimizers = build(name)
            state = {"model": resumed.state_dict(), "optimizer": resumed_optimizers}
            dcp.load(state, checkpoint_id=checkpoint)
        resumed.load_state_dict(state["model"])
        train(resumed, resumed_optimizers, STEPS)
        return max_abs_diff(snapshot(resumed), snapshot(model)), resumed_optimizers

    ours, optimizers = resume_difference("AdamW8bit")
    torchs, _ = resume_difference("AdamW")
    assert_resumes_as_closely_as_torch(ours, torchs)
    (opt,) = optimizers.optimizers
    assert type(opt) is torchao_optim.AdamW8bit
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 0.1]
    weight = opt.param_groups[1]["params"][0]  # the 64x128 weight
    assert isinstance(opt.state[weight]["exp_avg"], DTQ8bitTensor) and opt.state[weight]["step"].item() == 2 * STEPS
    flat = optimizers.state_dict()  # FQN-keyed, as torchtitan saves it
    assert isinstance(flat["state.0.weight.exp_avg"], DTQ8bitTensor)
