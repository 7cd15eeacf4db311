"""Models for the commands: the built-in pair, Hugging Face configs, and user factories.

``--model`` takes ``builtin`` (the plain GPT and its unit-scaled twin), ``hf:<model_type>``
(a ``transformers`` model built from its config at a small size, random weights, no
download) or ``path/to/file.py:factory`` (a function returning a ``torch.nn.Module``). For
the last two the unit-scaled twin is ``unitscale.transforms.unit_scale(model)``.

Calling convention: a model is called with the keyword arguments of
:class:`unitscale.data.Batch` that its ``forward`` accepts (``input_ids``, ``attention_mask``,
``labels``; only ``input_ids``, positionally, if it accepts none by name). ``labels`` are the
next-token targets, except for Hugging Face models, which shift internally and get
``labels=input_ids``. The loss is the output if it is a scalar, its ``loss`` (attribute or
key), or the cross-entropy of its logits (``(batch, seq, vocab)``) against the targets.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..experiments.data import Batch
from ..experiments.models import GPTConfig
from . import CommandError

__all__ = ["NamedModel", "call_model", "hf_model", "load_factory", "resolve_models"]

#: Sizes given to a Hugging Face config, under every name the common configs use.
HF_SMALL: dict[str, int] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "n_embd": 64,
    "d_model": 64,
    "dim": 64,
    "num_hidden_layers": 2,
    "n_layer": 2,
    "num_layers": 2,
    "n_layers": 2,
    "num_attention_heads": 4,
    "n_head": 4,
    "n_heads": 4,
    "num_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 256,
    "ffn_dim": 256,
    "hidden_dim": 256,
    "d_ff": 256,
    "head_dim": 16,
    "d_kv": 16,
}
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len")
_TOKEN_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")


@dataclass
class NamedModel:
    """A model to analyse, with the label shown in tables and reports."""

    name: str
    model: nn.Module
    hf: bool = False  # Hugging Face convention: unshifted labels
    signature_of: nn.Module | None = None  # whose forward says which arguments to pass

    @property
    def forward_owner(self) -> nn.Module:
        return self.model if self.signature_of is None else self.signature_of


def _seeded(seed: int, build: Callable[[], nn.Module]) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def hf_model(model_type: str, seq_len: int, seed: int) -> nn.Module:
    """A small, randomly initialised ``transformers`` model of ``model_type`` (no download).

    Raises:
        CommandError: for an unknown model type, or one without a causal or masked LM head.
    """
    try:
        import transformers
    except ModuleNotFoundError as exc:
        raise CommandError(
            "--model hf:... needs the transformers package: pip install 'unitscale[hf]'"
        ) from exc
    try:
        config = transformers.AutoConfig.for_model(model_type)
    except (ValueError, KeyError) as exc:
        raise CommandError(
            f"--model hf:{model_type}: unknown Hugging Face model type {model_type!r}; use a "
            "model_type such as gpt2, llama or bert"
        ) from exc
    for key, value in HF_SMALL.items():
        if hasattr(config, key) and isinstance(getattr(config, key), int):
            setattr(config, key, value)
    for key in _POSITION_KEYS:
        if hasattr(config, key):
            setattr(config, key, max(seq_len, 128))
    for i, key in enumerate(_TOKEN_KEYS):
        token = getattr(config, key, None)
        if isinstance(token, int) and token >= HF_SMALL["vocab_size"]:
            setattr(config, key, i)
    if hasattr(config, "use_cache"):
        config.use_cache = False
    last: Exception | None = None
    for auto in ("AutoModelForCausalLM", "AutoModelForMaskedLM"):
        try:
            model = _seeded(seed, partial(getattr(transformers, auto).from_config, config))
        except ValueError as exc:  # this head does not exist for the model type
            last = exc
            continue
        return model
    raise CommandError(
        f"--model hf:{model_type}: no causal or masked language-model head for this model "
        f"type ({str(last).splitlines()[0] if last else 'unknown'})"
    )


def load_factory(spec: str) -> tuple[str, Callable[[], Any]]:
    """Import ``path/to/file.py:factory`` and return ``(label, factory)``.

    Raises:
        CommandError: for a malformed spec, a missing file, an import error or a missing name.
    """
    path_text, sep, name = spec.rpartition(":")
    if not sep or not path_text or not name.isidentifier():
        raise CommandError(
            f"--model {spec!r}: expected 'builtin', 'hf:<model_type>' or 'path/to/file.py:factory'"
        )
    path = Path(path_text)
    if not path.is_file():
        raise CommandError(f"--model {spec!r}: file {path_text!r} does not exist")
    module_name = f"_unitscale_user_{path.stem}_{abs(hash(path.resolve()))}"
    loader_spec = importlib.util.spec_from_file_location(module_name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise CommandError(f"--model {spec!r}: cannot import {path_text!r} as Python")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[module_name] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as exc:
        raise CommandError(
            f"--model {spec!r}: importing {path_text} failed: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}"
        ) from exc
    factory = getattr(module, name, None)
    if not callable(factory):
        raise CommandError(f"--model {spec!r}: {path_text} has no function {name!r}")
    return f"{path.stem}.{name}", factory


def _call_factory(spec: str, factory: Callable[[], Any], seed: int) -> nn.Module:
    try:
        model = _seeded(seed, factory)
    except Exception as exc:
        message = str(exc).splitlines()[0] if str(exc) else ""
        raise CommandError(
            f"--model {spec!r}: the factory failed: {type(exc).__name__}: {message}"
        ) from exc
    if not isinstance(model, nn.Module):
        raise CommandError(
            f"--model {spec!r}: the factory returned {type(model).__name__}, not a torch.nn.Module"
        )
    return model


def _twin(base: NamedModel, seed: int) -> NamedModel:
    from ..errors import UnitScaleError
    from ..transforms import unit_scale

    try:
        twin = _seeded(seed, lambda: unit_scale(base.model))
    except UnitScaleError as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CommandError(f"unit_scale({base.name}) failed: {message}") from exc
    # The twin's forward takes (*args, **kwargs): pass what the original accepts.
    return NamedModel(f"unit_scale({base.name})", twin, base.hf, base.model)


def resolve_models(spec: str, seq_len: int, seed: int) -> list[NamedModel]:
    """The models ``--model spec`` names: the model itself, then its unit-scaled twin.

    Args:
        spec: ``builtin``, ``hf:<model_type>`` or ``path/to/file.py:factory``.
        seq_len: the longest sequence the models must take.
        seed: initialisation seed (the global RNG is left as it was).

    Raises:
        CommandError: when the model or its unit-scaled twin cannot be built (a twin that
            ``unit_scale`` refuses is an error, not a note: the comparison is the point).
    """
    if spec == "builtin":
        from ..experiments.models import plain_gpt, unit_scaled_gpt

        config = GPTConfig(seq_len=max(GPTConfig().seq_len, seq_len))
        return [
            NamedModel("plain", plain_gpt(config, seed)),
            NamedModel("unit-scaled", unit_scaled_gpt(config, seed)),
        ]
    if spec.startswith("hf:"):
        model_type = spec[3:]
        if not model_type:
            raise CommandError("--model hf:<model_type>: give a model type, e.g. hf:gpt2")
        base = NamedModel(model_type, hf_model(model_type, seq_len, seed), hf=True)
    else:
        label, factory = load_factory(spec)
        base = NamedModel(label, _call_factory(spec, factory, seed))
    return [base, _twin(base, seed)]


def _forward_arguments(model: nn.Module, batch: Batch, hf: bool) -> tuple[tuple, dict]:
    values: dict[str, Tensor] = dict(batch)
    if hf:
        values["labels"] = batch.input_ids
    target = model.forward
    try:
        parameters = inspect.signature(target).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins without signatures
        return (batch.input_ids,), {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return (), values
    kwargs = {k: v for k, v in values.items() if k in parameters}
    if not kwargs:
        return (batch.input_ids,), {}
    return (), kwargs


def call_model(entry: NamedModel, model: nn.Module, batch: Batch) -> Tensor:
    """Call ``model`` (``entry.model`` or a tracked copy) on ``batch`` and return a scalar loss.

    Raises:
        CommandError: when the output is neither a loss nor ``(batch, seq, vocab)`` logits.
    """
    args, kwargs = _forward_arguments(entry.forward_owner, batch, entry.hf)
    output = model(*args, **kwargs)
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if loss is None and isinstance(output, (tuple, list)) and output:
        output = output[0]
    if loss is None:
        logits = getattr(output, "logits", output)
        if isinstance(logits, Tensor) and logits.dim() == 0:
            loss = logits
        elif isinstance(logits, Tensor) and logits.shape[:2] == batch.labels.shape:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch.labels.flatten())
        else:
            shape = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
            raise CommandError(
                f"model {entry.name!r} returned {shape}: expected a scalar loss, an output with "
                f"a 'loss', or logits of shape ({batch.labels.shape[0]}, "
                f"{batch.labels.shape[1]}, vocab)"
            )
    if not isinstance(loss, Tensor) or loss.dim() != 0:
        raise CommandError(f"model {entry.name!r}: its loss is not a scalar tensor")
    return loss
