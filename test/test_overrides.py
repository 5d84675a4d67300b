"""Per-parameter overrides: by parameter, module type and name pattern; bitsandbytes' StableEmbedding override."""

import sys
import types

import pytest
import torch

import torchao_optim
from torchao_optim import DTQ8bitTensor, overrides, quantize_optimizer_state


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(128, 64)
        self.proj = torch.nn.Linear(64, 128)
        self.norm = torch.nn.LayerNorm(128)
        self.head = torch.nn.Linear(128, 64, bias=False)


def names(group):
    return [n for n, _ in group["params"]]


def test_by_name_module_type_and_parameter():
    model = Model()
    groups = overrides(
        model,
        {
            "*embed*": "none",
            torch.nn.LayerNorm: {"state_format": "none", "weight_decay": 0.0},
            model.head.weight: "test_cubic8" if "test_cubic8" in torchao_optim.list_state_formats() else "dtq8",
            "head.*": "never reached: a parameter key comes first",
        },
    )
    assert [names(g) for g in groups] == [
        ["proj.weight", "proj.bias"],
        ["embed_tokens.weight"],
        ["norm.weight", "norm.bias"],
        ["head.weight"],
    ]
    assert set(groups[0]) == {"params"}
    assert groups[1]["state_format"] == "none"
    assert groups[2] == dict(groups[2], state_format="none", weight_decay=0.0)


def test_first_matching_rule_wins_and_defaults():
    model = Model()
    groups = overrides(model, {"proj.*": {"lr": 0.1}, torch.nn.Linear: "none"}, defaults={"weight_decay": 0.0})
    assert [names(g) for g in groups] == [
        ["embed_tokens.weight", "norm.weight", "norm.bias"],
        ["proj.weight", "proj.bias"],
        ["head.weight"],
    ]
    assert groups[0]["weight_decay"] == 0.0 and groups[1]["lr"] == 0.1 and groups[2]["state_format"] == "none"


def test_bad_rules_are_named():
    with pytest.raises(ValueError, match="override key 3"):
        overrides(Model(), {3: "none"})
    with pytest.raises(ValueError, match="override for '\\*embed\\*'"):
        overrides(Model(), {"*embed*": 32})


def test_one_line_keeps_an_embedding_in_fp32_state():
    """The issue's acceptance line, for our optimizer and for a stock one through quantize_optimizer_state."""
    for make in (
        lambda g: torchao_optim.AdamW8bit(g, compile=False, fused=False),
        lambda g: quantize_optimizer_state(torch.optim.AdamW(g)),
    ):
        model = Model()
        opt = make(overrides(model, {"*embed*": "none"}))
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        assert type(opt.state[model.embed_tokens.weight]["exp_avg"]) is torch.Tensor
        assert type(opt.state[model.proj.weight]["exp_avg"]) is DTQ8bitTensor
        assert opt.param_groups[1]["param_names"] == ["embed_tokens.weight"]


def test_bitsandbytes_stable_embedding_override(monkeypatch):
    """bitsandbytes is not installed here: a stand-in GlobalOptimManager with its two registries (module overrides
    as StableEmbedding registers them, and id-keyed ones) is honoured; an explicit rule still wins."""
    model = Model()

    class GlobalOptimManager:
        instance = None

        @classmethod
        def get_instance(cls):
            if cls.instance is None:
                cls.instance = types.SimpleNamespace(module_weight_config_triple=[], pid2config={})
            return cls.instance

    manager = GlobalOptimManager.get_instance()
    manager.module_weight_config_triple.append((model.embed_tokens, "weight", {"optim_bits": 32}))
    manager.pid2config[id(model.head.weight)] = {"min_8bit_size": 100, "lr": 0.5}
    bnb = types.ModuleType("bitsandbytes")
    bnb.optim = types.ModuleType("bitsandbytes.optim")
    bnb.optim.GlobalOptimManager = GlobalOptimManager
    monkeypatch.setitem(sys.modules, "bitsandbytes", bnb)
    monkeypatch.setitem(sys.modules, "bitsandbytes.optim", bnb.optim)
    groups = overrides(model)
    assert [names(g) for g in groups][1:] == [["embed_tokens.weight"], ["head.weight"]]
    assert groups[1]["state_format"] == "none"
    assert groups[2] == dict(groups[2], min_quant_size=100, lr=0.5)
    assert names(overrides(model, bitsandbytes=False)[0]) == [n for n, _ in model.named_parameters()]
    assert overrides(model, {"embed*": "dtq8"})[1]["state_format"] == "dtq8"


def test_without_bitsandbytes_nothing_changes(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import fails
    assert len(overrides(Model())) == 1
