"""Models for the commands: the built-in pair, Hugging Face configs, and user factories.

``--model`` takes ``builtin`` (the plain GPT and its unit-scaled twin), ``hf:<model_type>``
(a ``transformers`` model built from its config at a small size, random weights, no
download) or ``path/to/file.py:factory`` (a function of no arguments returning a
``torch.nn.Module``). For the last two the unit-scaled twin is
``unitscale.transforms.unit_scale(model)``.

Calling convention of a factory's model: it is called with those of ``input_ids``,
``attention_mask`` and ``labels`` that its ``forward`` accepts by name, or with
``input_ids`` alone, positionally, if it accepts none of them by name. ``input_ids`` is
``(batch, seq)`` int64 bytes; ``labels`` are the next-token targets, already shifted
(``labels[:, t]`` is ``input_ids[:, t + 1]`` of the same text window: ``Batch.targets``,
not the unshifted ``Batch.labels``). The loss is the output if it is a scalar, else its
``loss`` (attribute or key), else the mean cross-entropy of its logits (``(batch, seq,
vocab)``, alone or as the only element of a tuple) against ``labels``. A tuple of several
outputs is refused: which of them is the loss or the logits cannot be told from their
values. Tokens are bytes (0-255), so the model's vocabulary must have at least 256 entries;
a smaller one is refused with that reason. That loss is computed *inside* the module that is
tracked and unit-scaled (:func:`with_loss`): the plain model gets ``F.cross_entropy``, its
twin the unit-scaled ``U.cross_entropy``, exactly as if the model returned its own loss.

Hugging Face models are run with their own objective (:func:`hf_model`): decoder-only
types as causal LMs (``labels=input_ids``; the model shifts), encoder-only types as masked
LMs (15% of positions masked, loss on those only), encoder-decoder types as seq2seq (the
first half of each window is the encoder input, the second half the target).
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data import Batch
from ..experiments.models import GPTConfig
from . import CommandError, OptionError

__all__ = [
    "BYTE_VOCAB",
    "HF_OBJECTIVES",
    "NamedModel",
    "call_model",
    "hf_model",
    "hf_objective",
    "load_factory",
    "objective_batch",
    "quiet_transformers",
    "resolve_models",
    "with_loss",
]

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
    # encoder-decoder configs (T5, BART) size each side separately
    "num_decoder_layers": 2,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 256,
    "decoder_ffn_dim": 256,
}
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len")
_TOKEN_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")
#: Hugging Face objectives: the ``transformers`` auto class and what the batch becomes.
HF_OBJECTIVES: dict[str, str] = {
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "seq2seq": "AutoModelForSeq2SeqLM",
}
#: The fraction of positions a masked LM predicts, and the byte that replaces them (NUL,
#: absent from text; models whose config names a mask token in the vocabulary use it).
MASK_FRACTION = 0.15
MASK_TOKEN = 0
#: The command's tokens are bytes (ids 0-255): a model needs at least this vocabulary.
BYTE_VOCAB = 256


@dataclass
class NamedModel:
    """A model to analyse, with the label shown in tables and reports."""

    name: str
    model: nn.Module
    #: how the batch is given: ``"batch"`` (the Batch's fields the forward accepts) or a
    #: Hugging Face objective, one of :data:`HF_OBJECTIVES`.
    objective: str = "batch"
    signature_of: nn.Module | None = None  # whose forward says which arguments to pass

    @property
    def forward_owner(self) -> nn.Module:
        return self.model if self.signature_of is None else self.signature_of


def _seeded(seed: int, build: Callable[[], nn.Module]) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


@contextlib.contextmanager
def quiet_transformers(enabled: bool = True) -> Iterator[None]:
    """Silence ``transformers``' log messages and warnings (restored on exit).

    The command's progress lines are what the user reads; messages such as ``loss_type=None
    was set in the config but it is unrecognized`` are about transformers' internals and
    would be interleaved with them. Errors still propagate as exceptions. With ``enabled``
    False (a run that uses no transformers model) this does nothing, and in particular does
    not import transformers (about a second).
    """
    if not enabled:
        yield
        return
    try:
        from transformers.utils import logging as hf_logging
    except ModuleNotFoundError:
        yield
        return
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module=r"transformers(\.|$)")
            yield
    finally:
        hf_logging.set_verbosity(level)


def hf_objective(config: Any) -> str:
    """The objective a ``transformers`` config is trained with: a key of :data:`HF_OBJECTIVES`.

    Encoder-decoder configs (T5, BART, ...) are ``"seq2seq"``; types with a masked-LM head
    (BERT, RoBERTa, ...; encoders, though many also register a causal head) ``"masked-lm"``;
    every other type (GPT-2, Llama, ...) ``"causal-lm"``.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    if getattr(config, "is_encoder_decoder", False):
        return "seq2seq"
    if getattr(config, "model_type", None) in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "masked-lm"
    return "causal-lm"


def _small_config(config: Any, seq_len: int) -> None:
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
    if getattr(config, "is_encoder_decoder", False):
        # Labels are shifted right into the decoder input from this token (T5: the pad).
        start = getattr(config, "decoder_start_token_id", None)
        if not isinstance(start, int):
            pad = getattr(config, "pad_token_id", None)
            config.decoder_start_token_id = pad if isinstance(pad, int) else 0
    if hf_objective(config) == "masked-lm" and hasattr(config, "is_decoder"):
        config.is_decoder = False  # an encoder: bidirectional attention, no decoder warnings


def hf_model(model_type: str, seq_len: int, seed: int) -> nn.Module:
    """A small, randomly initialised ``transformers`` model of ``model_type`` (no download).

    The head is that of the family's objective (:func:`hf_objective`): a causal LM, a masked
    LM or a seq2seq LM.

    Raises:
        CommandError: for an unknown model type, or one without a head for its objective.
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
        raise OptionError(
            f"--model hf:{model_type}: unknown Hugging Face model type {model_type!r}; use a "
            "model_type such as gpt2, llama, bert or t5"
        ) from exc
    _small_config(config, seq_len)
    objective = hf_objective(config)
    auto = getattr(transformers, HF_OBJECTIVES[objective])
    try:
        return _seeded(seed, partial(auto.from_config, config))
    except ValueError as exc:  # no head of this kind for the model type
        raise OptionError(
            f"--model hf:{model_type}: {model_type} is a {objective} model type but has no "
            f"{objective} head in transformers; supported: decoder-only (causal LM, e.g. gpt2, "
            "llama), encoder-only (masked LM, e.g. bert, roberta), encoder-decoder (seq2seq, "
            "e.g. t5, bart)"
        ) from exc


def load_factory(spec: str) -> tuple[str, Callable[[], Any]]:
    """Import ``path/to/file.py:factory`` and return ``(label, factory)``.

    Raises:
        OptionError: for a malformed spec, a missing file or a missing name.
        CommandError: when importing the file fails.
    """
    path_text, sep, name = spec.rpartition(":")
    if not sep or not path_text or not name.isidentifier():
        raise OptionError(
            f"--model {spec!r}: expected 'builtin', 'hf:<model_type>' or 'path/to/file.py:factory'"
        )
    path = Path(path_text)
    if not path.is_file():
        raise OptionError(f"--model {spec!r}: file {path_text!r} does not exist")
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
        raise OptionError(f"--model {spec!r}: {path_text} has no function {name!r}")
    return f"{path.stem}.{name}", factory


def _batch_arguments(forward: Callable[..., Any]) -> tuple[str, ...] | None:
    """The Batch fields ``forward`` takes by name; None: ``input_ids`` alone, positionally."""
    try:
        parameters = inspect.signature(forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins without signatures
        return None
    fields = ("input_ids", "attention_mask", "labels")
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return fields
    named = tuple(f for f in fields if f in parameters)
    return named or None


def _loss_of(output: Any, labels: Tensor | None, name: str) -> Tensor:
    """The scalar loss in ``output``; the cross-entropy of its logits when ``labels`` is given."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if loss is None and isinstance(output, (tuple, list)):
        if len(output) != 1:
            raise CommandError(_tuple_message(name, output))
        output = output[0]
    if loss is None:
        logits = getattr(output, "logits", output)
        if isinstance(logits, Tensor) and logits.dim() == 0:
            loss = logits
        elif (
            labels is not None
            and isinstance(logits, Tensor)
            and logits.dim() == 3
            and logits.shape[:2] == labels.shape
        ):
            if logits.shape[-1] < BYTE_VOCAB:
                raise CommandError(
                    _vocab_message(name, f"its logits cover {logits.shape[-1]} tokens")
                )
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        else:
            shape = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
            expected = "a scalar loss or an output with a 'loss'"
            if labels is not None:
                expected += f", or logits of shape ({labels.shape[0]}, {labels.shape[1]}, vocab)"
            raise CommandError(f"model {name!r} returned {shape}: expected {expected}")
    if not isinstance(loss, Tensor) or loss.dim() != 0:
        raise CommandError(f"model {name!r}: its loss is not a scalar tensor")
    return loss


def _vocab_message(name: str, found: str) -> str:
    return (
        f"model {name!r}: {found}; the command feeds byte tokens 0-255 (input_ids and "
        f"labels), so the model needs a vocabulary of at least {BYTE_VOCAB}"
    )


def with_loss(model: nn.Module, name: str) -> nn.Module:
    """Make a factory's ``model`` return its loss, computed inside its own ``forward``.

    The model's class is replaced by a subclass (same name, parameters and ``state_dict``
    keys) whose ``forward(input_ids, attention_mask=None, labels=None)`` calls the original
    with the arguments it accepts (the module docstring's convention) and returns the loss:
    the output if it is one, else the cross-entropy of its logits against ``labels``.
    Because the loss is part of the module, :func:`~unitscale.transforms.unit_scale` turns its
    ``F.cross_entropy`` into the unit-scaled ``U.cross_entropy``, as it does for a model that
    computes its own loss; a loss computed outside would leave every gradient of the twin a
    factor ``~sqrt(vocab) * batch * seq`` too small. Only the command's own model (built by
    the factory for this run) is changed.
    """
    original = type(model)
    accepted = _batch_arguments(model.forward)

    def forward(
        self: nn.Module,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
    ) -> Tensor:
        values = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
        if accepted is None:
            output = original.forward(self, input_ids)
        else:
            output = original.forward(self, **{k: values[k] for k in accepted})
        return _loss_of(output, labels, name)

    namespace = {
        "forward": forward,
        "__module__": original.__module__,
        "__qualname__": original.__qualname__,
        "__doc__": original.__doc__,
    }
    model.__class__ = type(original.__name__, (original,), namespace)
    return model


def _check_byte_model(model: nn.Module, name: str) -> None:
    """Refuse, before any capture, a model the command cannot feed or read.

    One eager forward of two tokens, the smallest and the largest byte, in eval mode (no
    batch-norm statistics move), without gradients and with the RNG state put back: a
    vocabulary under 256 (an IndexError, or logits that cover fewer tokens) or an output of
    several elements is refused here, with its reason, rather than from inside a captured
    forward (TorchDynamo keeps a frame that raised in its cache, which would change how
    later captures of the same code go). Other failures are left to the real step, which
    reports them with their context.

    Raises:
        CommandError: for a vocabulary under 256 or an ambiguous tuple output.
    """
    ids = torch.tensor([[0, BYTE_VOCAB - 1]])
    values = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    accepted = _batch_arguments(model.forward)
    training = model.training
    model.eval()
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        try:
            if accepted is None:
                output = model(ids)
            else:
                output = model(**{k: values[k] for k in accepted})
        except IndexError as exc:
            message = str(exc).splitlines()[0] if str(exc) else "IndexError"
            raise CommandError(_vocab_message(name, f"IndexError: {message}")) from exc
        except Exception:  # the step itself reports it, with its context
            return
        finally:
            model.train(training)
    if getattr(output, "loss", None) is not None:
        return
    if isinstance(output, (tuple, list)):
        if len(output) != 1:
            raise CommandError(_tuple_message(name, output))
        output = output[0]
    logits = getattr(output, "logits", output)
    if isinstance(logits, Tensor) and logits.dim() == 3 and logits.shape[-1] < BYTE_VOCAB:
        raise CommandError(_vocab_message(name, f"its logits cover {logits.shape[-1]} tokens"))


def _tuple_message(name: str, output: tuple[Any, ...] | list[Any]) -> str:
    return (
        f"model {name!r} returned a {type(output).__name__} of {len(output)}: the command "
        "cannot tell which is the loss or the logits; return the loss (a scalar), an output "
        "with .loss, or the (batch, seq, vocab) logits alone"
    )


def _call_factory(spec: str, label: str, factory: Callable[[], Any], seed: int) -> nn.Module:
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
    _check_byte_model(model, label)
    return with_loss(model, label)


def _twin(base: NamedModel, seed: int) -> NamedModel:
    from ..errors import UnitScaleError
    from ..transforms import unit_scale

    try:
        twin = _seeded(seed, lambda: unit_scale(base.model))
    except UnitScaleError as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CommandError(f"unit_scale({base.name}) failed: {message}") from exc
    # The twin's forward takes (*args, **kwargs): pass what the original accepts.
    return NamedModel(f"unit_scale({base.name})", twin, base.objective, base.model)


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

        # labels already shifted, as the command passes them to every "batch" model
        config = GPTConfig(seq_len=max(GPTConfig().seq_len, seq_len), aligned_labels=True)
        return [
            NamedModel("plain", plain_gpt(config, seed)),
            NamedModel("unit-scaled", unit_scaled_gpt(config, seed)),
        ]
    if spec.startswith("hf:"):
        model_type = spec[3:]
        if not model_type:
            raise OptionError("--model hf:<model_type>: give a model type, e.g. hf:gpt2")
        model = hf_model(model_type, seq_len, seed)
        base = NamedModel(model_type, model, hf_objective(model.config))
    else:
        label, factory = load_factory(spec)
        base = NamedModel(label, _call_factory(spec, label, factory, seed))
    return [base, _twin(base, seed)]


def objective_batch(objective: str, batch: Batch, config: Any = None) -> dict[str, Tensor]:
    """The keyword arguments a Hugging Face ``objective`` gets from ``batch``.

    ``causal-lm``: the batch with ``labels=input_ids`` (the model shifts). ``masked-lm``:
    :data:`MASK_FRACTION` of the positions (a fixed draw) replaced by the mask token, the
    labels those positions' bytes and -100 elsewhere. ``seq2seq``: the window's first half
    as the encoder input, its second half as the labels (the model builds the decoder input
    by shifting them right).

    Raises:
        CommandError: when the batch is too short for the objective.
    """
    ids, mask = batch.input_ids, batch.attention_mask
    if objective == "causal-lm":
        return {"input_ids": ids, "attention_mask": mask, "labels": ids}
    if objective == "masked-lm":
        generator = torch.Generator().manual_seed(0)
        masked = torch.rand(ids.shape, generator=generator) < MASK_FRACTION
        masked[:, 0] |= ~masked.any(dim=1)  # at least one prediction per sequence
        token = getattr(config, "mask_token_id", None)
        if not isinstance(token, int) or not 0 <= token < HF_SMALL["vocab_size"]:
            token = MASK_TOKEN
        labels = torch.where(masked, ids, torch.full_like(ids, -100))
        return {"input_ids": ids.masked_fill(masked, token), "attention_mask": mask,
                "labels": labels}  # fmt: skip
    if objective == "seq2seq":
        half = ids.shape[1] // 2
        if half < 1:
            raise OptionError("--seq-len must be at least 2 for an encoder-decoder model")
        return {
            "input_ids": ids[:, :half].contiguous(),
            "attention_mask": mask[:, :half].contiguous(),
            "labels": ids[:, half:].contiguous(),
        }
    raise CommandError(f"unknown objective {objective!r}; expected one of {list(HF_OBJECTIVES)}")


def call_model(entry: NamedModel, model: nn.Module, batch: Batch) -> Tensor:
    """Call ``model`` (``entry.model`` or a tracked copy) on ``batch`` and return a scalar loss.

    Raises:
        CommandError: when the output is not a loss (a factory's model: nor logits of
            shape ``(batch, seq, vocab)``), or the model's vocabulary is under 256 bytes.
    """
    owner = entry.forward_owner
    if entry.objective == "batch":
        # The command's convention (module docstring): labels already shifted.
        values: dict[str, Tensor] = {
            "input_ids": batch.input_ids,
            "attention_mask": batch.attention_mask,
            "labels": batch.targets,
        }
    else:
        values = objective_batch(entry.objective, batch, getattr(owner, "config", None))
    accepted = _batch_arguments(owner.forward)
    try:
        if accepted is None:
            output = model(values["input_ids"])
        else:
            output = model(**{k: v for k, v in values.items() if k in accepted})
    except IndexError as exc:  # an embedding or a loss given a byte beyond its vocabulary
        message = str(exc).splitlines()[0] if str(exc) else "IndexError"
        raise CommandError(_vocab_message(entry.name, f"IndexError: {message}")) from exc
    return _loss_of(output, None, entry.name)
