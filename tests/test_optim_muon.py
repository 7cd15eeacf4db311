"""unitscale.optim.Muon (torch's Muon for hidden matrices, u-μP AdamW for the rest) and
unitscale.optim.effective_rates."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import unitscale as us
from unitscale.errors import UnitScaleError
from unitscale.optim import (
    SGD,
    Adam,
    AdamW,
    Muon,
    effective_rates,
    lr_scale_func_adam,
    lr_scale_func_muon,
    scaled_parameters,
)

needs_muon = pytest.mark.skipif(
    not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon is torch 2.9+"
)


def _decoder(width: int = 64, depth: int = 2, **kwargs: object) -> us.TransformerDecoder:
    torch.manual_seed(0)
    return us.TransformerDecoder(width, depth, width // 32, 32, rope=False, **kwargs)  # type: ignore[arg-type]


def _loss(model: nn.Module, seed: int = 1) -> torch.Tensor:
    ids = torch.randint(0, 32, (4, 17), generator=torch.Generator().manual_seed(seed))
    return model(ids[:, :-1], ids[:, 1:])


@needs_muon
def test_hidden_matrices_go_to_muon_the_rest_to_adamw() -> None:
    model = _decoder()
    opt = Muon(model.named_parameters(), lr=0.5)
    table = effective_rates(opt)
    by_name = dict(zip(table.name, table.algorithm, strict=True))
    assert by_name["embedding.weight"] == "Adam"  # a lookup table, not a matrix
    assert by_name["readout.weight"] == "Adam"
    hidden = [n for n in by_name if n.startswith("layers.")]
    assert hidden and all(by_name[n] == "Muon" for n in hidden)
    # the rates: lr * sqrt(fan_out) / sqrt(depth) for Muon, u-muP's Adam rule for the rest
    for name, param in model.named_parameters():
        row = table[table.name == name].iloc[0]
        rule = lr_scale_func_muon if name.startswith("layers.") else lr_scale_func_adam
        assert row.lr == pytest.approx(0.5 * rule(param), rel=1e-12), name
    qkv = table[table.name == "layers.0.attn.qkv.weight"].iloc[0]
    assert qkv.lr == pytest.approx(0.5 * math.sqrt(192) / math.sqrt(2))


@needs_muon
def test_a_step_is_torchs_muon_and_unitscales_adamw_at_their_rates() -> None:
    model = _decoder()
    reference = _decoder()
    reference.load_state_dict(model.state_dict())
    opt = Muon(model.named_parameters(), lr=0.3, weight_decay=0.1)
    hidden = [p for n, p in reference.named_parameters() if n.startswith("layers.")]
    others = [p for n, p in reference.named_parameters() if not n.startswith("layers.")]
    muons = [
        # torch's Muon at u-muP's rate: lr * sqrt(fan_out) / sqrt(depth), decay independent
        torch.optim.Muon(  # type: ignore[attr-defined]
            [p],
            lr=0.3 * lr_scale_func_muon(p) / math.sqrt(max(1.0, p.shape[0] / p.shape[1])),
            weight_decay=0.1
            / (0.3 * lr_scale_func_muon(p) / math.sqrt(max(1.0, p.shape[0] / p.shape[1]))),
        )
        for p in hidden
    ]
    adamw = AdamW(others, lr=0.3, weight_decay=0.1)
    for _ in range(2):
        for m, o in ((model, [opt]), (reference, [*muons, adamw])):
            _loss(m).backward()
            for each in o:
                each.step()
                each.zero_grad()
    for (name, got), want in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(got, want), name


@needs_muon
def test_schedulers_and_state_dict_reach_both_parts() -> None:
    model = _decoder()
    opt = Muon(model.named_parameters(), lr=0.4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _loss(model).backward()
    opt.step()
    sched.step()
    assert {g["lr"] for g in opt.param_groups} == {0.2}
    assert {g["algorithm"] for g in opt.param_groups} == {"muon", "adamw"}
    state = copy.deepcopy(opt.state_dict())  # torch's state_dict holds the live tensors
    twin = _decoder()
    twin.load_state_dict(model.state_dict())
    again = Muon(twin.named_parameters(), lr=0.4)
    again.load_state_dict(state)
    for m, o in ((model, opt), (twin, again)):
        o.zero_grad()
        _loss(m, seed=2).backward()
        o.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


def test_an_old_torch_gets_an_error_naming_the_release(monkeypatch: pytest.MonkeyPatch) -> None:
    import unitscale.optim._muon as muon_module

    monkeypatch.delattr(torch.optim, "Muon", raising=False)
    monkeypatch.setattr(muon_module, "_scaled_muon_class", [])
    with pytest.raises(UnitScaleError, match=r"torch 2\.9 added"):
        Muon(_decoder().parameters(), lr=0.1)


def _output_change(width: int, optimiser: str, lr: float = 0.05) -> dict[str, float]:
    """One step at ``width``: rms of ``ΔW x / sqrt(fan_in)`` (the change of each hidden layer
    of the second block, on the step's own inputs) over ``lr``."""
    torch.manual_seed(0)
    model = us.TransformerDecoder(width, depth=2, heads=width // 32, vocab_size=256, rope=False)
    if optimiser == "muon":
        opt: torch.optim.Optimizer = Muon(model.named_parameters(), lr=lr)
    else:  # the control: torch's Muon at one rate for every width (its own adjustment)
        hidden = [p for n, p in model.named_parameters() if n.startswith("layers.")]
        opt = torch.optim.Muon(hidden, lr=lr, weight_decay=0.0)  # type: ignore[attr-defined]
    inputs: dict[str, torch.Tensor] = {}
    linears = {n: m for n, m in model.named_modules() if n.startswith("layers.1.")}
    linears = {n: m for n, m in linears.items() if isinstance(m, us.Linear)}
    hooks = [
        m.register_forward_pre_hook(lambda _, a, n=n: inputs.__setitem__(n, a[0].detach()))
        for n, m in linears.items()
    ]
    before = {n: m.weight.detach().clone() for n, m in linears.items()}
    ids = torch.randint(0, 256, (8, 33), generator=torch.Generator().manual_seed(1))
    model(ids[:, :-1], ids[:, 1:]).backward()
    opt.step()
    for hook in hooks:
        hook.remove()
    out = {}
    for name, module in linears.items():
        delta = module.weight.detach() - before[name]
        change = inputs[name] @ delta.T / math.sqrt(module.weight.shape[1])
        out[name] = change.square().mean().sqrt().item() / lr
    return out


@needs_muon
def test_coordinate_check_update_sizes_do_not_depend_on_width() -> None:
    # ||ΔW x|| / output scale after one step, per hidden layer, widths 64-512: u-muP's Muon
    # rate keeps it within 1.5x across widths (measured: at most 1.21x, mlp.down 0.51-0.61
    # of lr); torch's Muon at one rate shrinks it like 1/sqrt(width) (about 2.8x).
    widths = [64, 128, 256, 512]
    for optimiser, within in (("muon", True), ("torch", False)):
        changes = [_output_change(w, optimiser) for w in widths]
        for name in changes[0]:
            sizes = [c[name] for c in changes]
            ratio = max(sizes) / min(sizes)
            assert (ratio < 1.5) is within, (optimiser, name, sizes)
    sizes = [v for c in (_output_change(w, "muon") for w in (64, 512)) for v in c.values()]
    assert all(0.25 < s < 2.0 for s in sizes), sizes  # entries of size about lr


def test_effective_rates_for_every_optimiser_unitscale_builds() -> None:
    model = _decoder(depth=4)
    named = list(model.named_parameters())
    for cls, algorithm in ((Adam, "Adam"), (AdamW, "Adam"), (SGD, "SGD")):
        table = effective_rates(cls(named, lr=0.25, weight_decay=0.1)).set_index("name")
        assert sorted(table.index) == sorted(n for n, _ in named)  # in the groups' order
        assert set(table.algorithm) == {algorithm}
        for name, param in named:
            row = table.loc[name]
            assert row.lr == pytest.approx(0.25 * lr_scale_func_adam(param))
            assert row.tag == param.mup_type  # type: ignore[attr-defined]
            assert row.decay_per_step == pytest.approx(0.1)  # independent decay
    qkv = effective_rates(AdamW(named, lr=0.25)).set_index("name").loc["layers.0.attn.qkv.weight"]
    assert qkv["rule"] == "weight: lr * 1/sqrt(fan_in=64) * 1/sqrt(depth=4) (Adam)"
    # bare parameters: names from the model; groups from scaled_parameters in another optimiser
    table = effective_rates(AdamW(model.parameters(), lr=0.25), model)
    assert sorted(table.name) == sorted(n for n, _ in named)
    groups = scaled_parameters(model.parameters(), lr_scale_func_adam, lr=0.25)
    table = effective_rates(torch.optim.Adagrad(groups), model)
    assert sorted(table.lr) == pytest.approx(sorted(0.25 * lr_scale_func_adam(p) for _, p in named))
    assert table.base_lr.isna().all()


def test_effective_rates_show_an_untagged_parameter() -> None:
    model = nn.Sequential(us.Linear(8, 8), nn.Linear(8, 2))
    table = effective_rates(AdamW(model.parameters(), lr=0.1, allow_untagged=True), model)
    untagged = table[table.tag.isna()]
    assert list(untagged.name) == ["1.weight", "1.bias"]
    assert set(untagged.lr) == {0.1}
    assert untagged.rule.str.startswith("untagged").all()


@needs_muon
def test_an_added_group_is_split_by_the_same_rule() -> None:
    opt = Muon(_decoder().named_parameters(), lr=0.5)
    extra = us.Linear(64, 128)
    opt.add_param_group({"params": [("extra.weight", extra.weight), ("extra.bias", extra.bias)]})
    table = effective_rates(opt).set_index("name")
    assert table.loc["extra.weight", "algorithm"] == "Muon"
    assert table.loc["extra.weight", "lr"] == pytest.approx(0.5 * math.sqrt(128))
    assert table.loc["extra.bias", "algorithm"] == "Adam"
    assert table.loc["extra.bias", "lr"] == pytest.approx(0.5)
    extra(torch.randn(4, 64)).sum().backward()
    before = extra.weight.detach().clone()
    opt.step()
    assert not torch.equal(extra.weight, before)
