"""The parametrisations a sweep trains, per model family: their models (the built-in
decoders, ``hf:llama``), their optimisers and the registry :data:`PARAMETRISATION_SPECS`."""

from __future__ import annotations

import math  # noqa: F401 (used by the doctests)
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ... import modules as us
from ... import optim as us_optim
from ..models import GPTConfig, plain_gpt
from ._config import HEAD_SIZE, MODELS, PARAMETRISATIONS, TransferConfig, TransferConfigError

#: ``hf:llama``'s MLP (SwiGLU) intermediate size over its width: 4, the built-in decoder's
#: ratio, rather than Llama's usual ~8/3, so that every width gives an integer size and the
#: fan-ins keep one ratio to the width (8/3 of 32 is not an integer).
LLAMA_MLP_RATIO = 4


def _standard_model(width: int, depth: int, config: TransferConfig) -> nn.Module:
    gpt = GPTConfig(
        hidden_size=width,
        depth=depth,
        heads=width // HEAD_SIZE,
        seq_len=config.seq_len,
        position_embedding=False,
        aligned_labels=True,  # the runner passes Batch.targets
    )
    return plain_gpt(gpt, seed=config.seed)


def _mup_model(width: int, depth: int, config: TransferConfig) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        # the default (Llama-style) block, without rotary embeddings: like the standard model,
        # no positional information of its own
        return us.TransformerDecoder(
            width, depth, width // HEAD_SIZE, 256, rope=False, depth_rule=config.depth_rule
        )


class _CausalLMLoss(nn.Module):
    """A transformers causal LM that returns the mean cross-entropy of its logits against
    already-shifted ``labels`` (the runner passes ``Batch.targets``).

    The loss is computed inside ``forward`` so that :func:`~unitscale.transforms.unit_scale`
    makes it the unit-scaled ``U.cross_entropy`` (as it does for the built-in decoder), and
    ``get_output_embeddings`` hands on the wrapped model's head so that ``unit_scale`` finds
    the readout it makes u-μP's.
    """

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm: Any = lm  # a transformers model: its methods are not nn.Module's

    def get_output_embeddings(self) -> nn.Module:
        head: nn.Module = self.lm.get_output_embeddings()
        return head

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.lm(input_ids=input_ids).logits
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _llama(width: int, depth: int, config: TransferConfig) -> nn.Module:
    """A randomly initialised transformers Llama (no download) seeded by ``config.seed``."""
    try:
        import transformers
    except ModuleNotFoundError as exc:
        raise TransferConfigError(
            "transfer model 'hf:llama' needs the transformers package: pip install 'unitscale[hf]'"
        ) from exc
    options: dict[str, Any] = {
        "vocab_size": 256,
        "hidden_size": width,
        "intermediate_size": LLAMA_MLP_RATIO * width,
        "num_hidden_layers": depth,
        "num_attention_heads": width // HEAD_SIZE,
        "num_key_value_heads": width // HEAD_SIZE,
        "max_position_embeddings": config.seq_len,
        "tie_word_embeddings": False,
        "use_cache": False,
        "attn_implementation": "sdpa",  # a config argument the stubs do not declare
    }
    llama = transformers.LlamaConfig(**options)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        return _CausalLMLoss(transformers.LlamaForCausalLM(llama))


def _llama_mup(width: int, depth: int, config: TransferConfig) -> nn.Module:
    from ...transforms import unit_scale

    # unit_scale's defaults: the paper's residual rule, norms without trainable weights
    return unit_scale(_llama(width, depth, config), depth_rule=config.depth_rule)


def _torch_adamw(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)


def _mup_adamw(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return us_optim.AdamW(model.named_parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)


def _mup_muon(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """:class:`unitscale.optim.Muon` (torch's Muon defaults; AdamW betas 0.9, 0.95 for the
    parameters that are not hidden matrices), no weight decay."""
    return us_optim.Muon(model.named_parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)


@dataclass(frozen=True)
class Parametrisation:
    """One parametrisation a sweep trains: its model, its optimiser and its grid's centre.

    Attributes:
        name: as the tables and the CSV show it (``"standard"`` or ``"u-muP"``).
        build: ``build(width, depth, config)``, the model seeded by ``config.seed``; it takes
            ``model(input_ids, labels=labels)`` and returns the mean cross-entropy.
        optimiser: ``optimiser(model, lr)`` at peak ``lr``.
        model: the model family it belongs to (:attr:`TransferConfig.model`).
        description: the model and optimiser in a few words, for the summary and the figure.
    """

    name: str
    build: Callable[[int, int, TransferConfig], nn.Module]
    optimiser: Callable[[nn.Module, float], torch.optim.Optimizer]
    model: str = "builtin"
    description: str = ""


#: The parametrisations of every model family, each family's in the order they are run and
#: shown. ``builtin`` is the library's own decoder; ``hf:llama`` a transformers Llama (made
#: u-μP by :func:`~unitscale.transforms.unit_scale`).
PARAMETRISATION_SPECS: tuple[Parametrisation, ...] = (
    Parametrisation(
        "standard", _standard_model, _torch_adamw, "builtin",
        "plain PyTorch decoder (GPT-2 init) + torch.optim.AdamW",
    ),
    Parametrisation(
        "u-muP", _mup_model, _mup_adamw, "builtin",
        "unitscale.TransformerDecoder (u-muP default, rope=False) + unitscale.optim.AdamW",
    ),
    Parametrisation(
        "standard", _llama, _torch_adamw, "hf:llama",
        "transformers LlamaForCausalLM (HF init) + torch.optim.AdamW",
    ),
    Parametrisation(
        "u-muP", _llama_mup, _mup_adamw, "hf:llama",
        "unit_scale(LlamaForCausalLM) + unitscale.optim.AdamW",
    ),
)  # fmt: skip


def _spec(name: str, model: str = "builtin") -> Parametrisation:
    for spec in PARAMETRISATION_SPECS:
        if spec.name == name and spec.model == model:
            return spec
    if model not in MODELS:
        raise TransferConfigError(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
    raise TransferConfigError(
        f"unknown parametrisation {name!r}; choose from {', '.join(PARAMETRISATIONS)}"
    )


def build_model(parametrisation: str, width: int, depth: int, config: TransferConfig) -> nn.Module:
    """The decoder of ``parametrisation`` at ``width`` x ``depth`` for ``config.model``,
    seeded by ``config.seed``.

    Every model has ``width / 32`` heads of 32, ``depth`` pre-norm blocks, a final norm, an
    untied readout, a 256-byte vocabulary and no learned position embedding, and takes
    ``model(input_ids, labels=targets)`` (``Batch.targets``, already shifted) and returns the
    mean cross-entropy. The two parametrisations of ``hf:llama`` are the same model (same
    weight shapes); those of ``builtin`` are a plain GPT and the library's decoder:

    - ``builtin``: ``standard`` is :class:`unitscale.models.PlainGPT`
      (``position_embedding=False``: LayerNorms with weight and bias, biased linear layers,
      a 4x GELU MLP, GPT-2's N(0, 0.02) initialisation); ``u-muP`` is the library's decoder
      with its default, Llama-style block (RMSNorm, SwiGLU MLP) and without its rotary
      embeddings, ``unitscale.TransformerDecoder(width, depth, heads, 256, rope=False)`` (so
      that neither model has positional information of its own): the paper's recommended
      scheme (Blake et al., ICLR 2025, arXiv 2407.17465), so no biases and norms without
      trainable parameters. (The sweeps compare each parametrisation with itself across
      sizes; the two blocks differ, as a user's plain GPT and u-μP decoder would.)
    - ``hf:llama``: a randomly initialised ``transformers.LlamaForCausalLM`` (RMSNorm, RoPE,
      SwiGLU MLP of ``4 x width``, no biases; no download); ``standard`` as transformers
      initialises it, ``u-muP`` through :func:`~unitscale.transforms.unit_scale` with its
      defaults (u-μP readout, every parameter tagged, the paper's residual rule, RMSNorm
      weights fixed at 1).

    Example:
        >>> ids = torch.zeros(2, 16, dtype=torch.long)
        >>> [type(build_model(p, 64, 2, TransferConfig())).__name__ for p in PARAMETRISATIONS]
        ['PlainGPT', 'TransformerDecoder']
        >>> build_model("standard", 64, 2, TransferConfig())(ids, labels=ids).shape
        torch.Size([])
    """
    return _spec(parametrisation, config.model).build(width, depth, config)


def build_optimiser(
    parametrisation: str,
    model: nn.Module,
    lr: float,
    family: str = "builtin",
    optimizer: str = "adamw",
) -> torch.optim.Optimizer:
    """AdamW (betas 0.9, 0.95, no weight decay) at peak ``lr``: torch's for ``standard``,
    :class:`unitscale.optim.AdamW` (each parameter ``lr`` times its u-μP rule, the factor in
    its param group's ``"lr_scale"``) for ``u-muP``, for the model family ``family``; with
    ``optimizer="muon"``, u-μP trains with :class:`unitscale.optim.Muon` instead (the
    standard parametrisation keeps torch's AdamW).

    Example:
        >>> m = build_model("u-muP", 64, 2, TransferConfig())
        >>> groups = build_optimiser("u-muP", m, 1.0).param_groups
        >>> rates = sorted({g["lr"] * g["lr_scale"] for g in groups})
        >>> # 1/sqrt(fan_in * depth), fan-ins 192 (SwiGLU's down projection: 8/3 x 64
        >>> # rounded up to a multiple of 64) and 64
        >>> [round(r * math.sqrt(2), 4) for r in rates[:2]]
        [0.0722, 0.125]
    """
    if optimizer == "muon" and parametrisation == "u-muP":
        return _mup_muon(model, lr)
    return _spec(parametrisation, family).optimiser(model, lr)


def describe(parametrisation: str, config: TransferConfig) -> str:
    """The parametrisation's model and optimiser in a few words, with the options of
    ``config`` that change them (``optimizer``, ``depth_rule``), for the summary and figure.

    Example:
        >>> text = describe("u-muP", TransferConfig(optimizer="muon", depth_rule="completep"))
        >>> text.endswith("+ unitscale.optim.Muon"), "rope=False, depth_rule=completep" in text
        (True, True)
    """
    text = _spec(parametrisation, config.model).description
    if parametrisation != "u-muP":
        return text
    if config.depth_rule != "depth-mup":
        rule = f"depth_rule={config.depth_rule}"
        text = (
            text.replace("rope=False)", f"rope=False, {rule})")
            if "rope=False)" in text
            else text.replace(" + ", f" ({rule}) + ", 1)
        )
    if config.optimizer == "muon":
        text = text.replace("unitscale.optim.AdamW", "unitscale.optim.Muon")
    return text
