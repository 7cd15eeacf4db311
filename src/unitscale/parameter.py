"""u-μP parameter tags: what kind of parameter a tensor is, and how deep its model is.

u-μP (Blake et al., ICLR 2025, arXiv 2407.17465) gives each parameter a learning rate that
depends on its role (hidden weight, bias, norm scale, readout), its fan-in and the depth of
the residual stack it sits in. :class:`Parameter` carries that information on the tensor
itself, so that :mod:`unitscale.optim` can read it from ``model.parameters()``:

* ``mup_type``: ``"weight"`` (a matmul or embedding weight), ``"bias"``, ``"norm"`` (the
  elementwise scale of a normalisation) or ``"output"`` (the readout weight);
* ``mup_scaling_depth``: the number of residual blocks the parameter's block is one of
  (set by :class:`unitscale.DepthModuleList` / :class:`unitscale.DepthSequential`), or None
  for a parameter outside a residual stack.

Design constraints: a :class:`Parameter` *is* an ``nn.Parameter`` (``isinstance`` holds, the
optimisers and ``state_dict`` treat it as one); the tags are plain attributes that survive
``copy.deepcopy``, pickle, ``.to()`` (which keeps the parameter object) and
``load_state_dict`` (which copies into it). :func:`tag_parameter` turns an existing
``nn.Parameter`` into a :class:`Parameter` *in place* (same object), so weights tied
between modules stay tied and an optimiser built earlier still holds them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .errors import UnitScaleError

__all__ = [
    "MUP_TYPES",
    "Parameter",
    "ParameterTagError",
    "has_mup_tags",
    "infer_mup_type",
    "tag_model",
    "tag_module",
    "tag_parameter",
]

#: The values ``mup_type`` may take.
MUP_TYPES = ("weight", "bias", "norm", "output")


class ParameterTagError(UnitScaleError, ValueError):
    """A u-μP tag has a value that is not allowed."""


def _check_tags(mup_type: object, mup_scaling_depth: object) -> None:
    if mup_type not in MUP_TYPES:
        raise ParameterTagError(
            f"unitscale.Parameter: mup_type={mup_type!r} is not one of {MUP_TYPES}"
        )
    if mup_scaling_depth is not None and (
        isinstance(mup_scaling_depth, bool)
        or not isinstance(mup_scaling_depth, int)
        or mup_scaling_depth < 1
    ):
        raise ParameterTagError(
            f"unitscale.Parameter: mup_scaling_depth={mup_scaling_depth!r} must be a positive "
            "int (the number of residual blocks) or None"
        )


#: Optional attribute: the dimension of a weight that is its fan-in, where it is not the
#: last (``0`` for a weight stored ``(in, out)``, as transformers' ``Conv1D`` stores it);
#: :mod:`unitscale.optim` reads it. Kept by deepcopy and pickle like the tags.
FAN_IN_DIM = "fan_in_dim"

#: Optional attribute: the depth rule of the residual stack holding the parameter,
#: ``"depth-mup"`` (the default where unset) or ``"completep"``; set with
#: ``mup_scaling_depth`` by :class:`unitscale.TransformerDecoder` and
#: :func:`unitscale.transforms.unit_scale` (``depth_rule=``), read by :mod:`unitscale.optim`
#: for the depth factor of the learning rate. Kept by deepcopy and pickle like the tags.
DEPTH_RULE = "mup_depth_rule"

#: Optional attribute: True on an embedding's weight (an ``nn.Embedding``'s, set by
#: :func:`tag_module`), a ``"weight"`` that :class:`unitscale.optim.Muon` leaves to AdamW (a
#: lookup table, not a matrix applied to a vector). Kept by deepcopy and pickle like the tags.
EMBEDDING = "mup_embedding"


def _rebuild(
    data: Tensor,
    requires_grad: bool,
    mup_type: str,
    mup_scaling_depth: int | None,
    extra: dict[str, Any] | None = None,
) -> Parameter:
    """Unpickle a :class:`Parameter` (module level, so that pickle can find it)."""
    param = Parameter(data, mup_type, mup_scaling_depth, requires_grad)
    param.__dict__.update(extra or {})
    return param


def _extra(param: Tensor) -> dict[str, Any]:
    return {
        key: param.__dict__[key]
        for key in (FAN_IN_DIM, DEPTH_RULE, EMBEDDING)
        if key in param.__dict__
    }


class Parameter(nn.Parameter):
    """An ``nn.Parameter`` tagged for u-μP: ``mup_type`` and ``mup_scaling_depth``.

    Args:
        data: the tensor.
        mup_type: ``"weight"``, ``"bias"``, ``"norm"`` or ``"output"``.
        mup_scaling_depth: number of residual blocks of the stack holding it, or None.
        requires_grad: as for ``nn.Parameter``.

    Raises:
        ParameterTagError: a tag has a value outside the allowed ones.

    Example:
        >>> import copy, pickle
        >>> p = Parameter(torch.ones(4, 2), "weight", mup_scaling_depth=8)
        >>> isinstance(p, torch.nn.Parameter), p.mup_type, p.mup_scaling_depth
        (True, 'weight', 8)
        >>> q = pickle.loads(pickle.dumps(copy.deepcopy(p)))
        >>> type(q).__name__, q.mup_type, q.mup_scaling_depth
        ('Parameter', 'weight', 8)
    """

    mup_type: str
    mup_scaling_depth: int | None

    def __new__(
        cls,
        data: Tensor | None = None,
        mup_type: str = "weight",
        mup_scaling_depth: int | None = None,
        requires_grad: bool = True,
    ) -> Parameter:
        _check_tags(mup_type, mup_scaling_depth)
        if data is None:
            data = torch.empty(0)
        param = torch.Tensor._make_subclass(cls, data.detach(), requires_grad)
        param.mup_type = mup_type
        param.mup_scaling_depth = mup_scaling_depth
        return param

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass  # everything happens in __new__ (nn.Parameter has no __init__ to call)

    def __deepcopy__(self, memo: dict[int, Any]) -> Parameter:
        if id(self) in memo:
            return memo[id(self)]
        result = Parameter(
            self.data.clone(memory_format=torch.preserve_format),
            self.mup_type,
            self.mup_scaling_depth,
            self.requires_grad,
        )
        result.__dict__.update(_extra(self))
        memo[id(self)] = result
        return result

    def __reduce_ex__(self, proto: Any) -> Any:
        return (
            _rebuild,
            (self.data, self.requires_grad, self.mup_type, self.mup_scaling_depth, _extra(self)),
        )

    def __repr__(self) -> str:  # type: ignore[override]
        depth = f", mup_scaling_depth={self.mup_scaling_depth}" if self.mup_scaling_depth else ""
        return f"unitscale.Parameter(mup_type={self.mup_type!r}{depth}) {self.data!r}"


def has_mup_tags(param: Tensor) -> bool:
    """Whether ``param`` carries u-μP tags (a ``mup_type``; ``mup_scaling_depth`` may be None).

    Example:
        >>> has_mup_tags(Parameter(torch.zeros(3), "bias"))
        True
        >>> has_mup_tags(nn.Parameter(torch.zeros(3)))
        False
    """
    return getattr(param, "mup_type", None) in MUP_TYPES


def tag_parameter(
    param: nn.Parameter, mup_type: str, mup_scaling_depth: int | None = None
) -> Parameter:
    """Tag ``param`` for u-μP in place (the same object becomes a :class:`Parameter`).

    Args:
        param: an ``nn.Parameter`` (or a :class:`Parameter`, whose tags are replaced).
        mup_type: ``"weight"``, ``"bias"``, ``"norm"`` or ``"output"``.
        mup_scaling_depth: number of residual blocks, or None.

    Returns:
        ``param`` itself, now a :class:`Parameter`.

    Raises:
        ParameterTagError: ``param`` is not an ``nn.Parameter`` or a tag is not allowed.

    Example:
        >>> p = nn.Parameter(torch.zeros(3))
        >>> tag_parameter(p, "bias") is p, type(p).__name__, p.mup_type
        (True, 'Parameter', 'bias')
    """
    _check_tags(mup_type, mup_scaling_depth)
    if not isinstance(param, nn.Parameter):
        raise ParameterTagError(
            f"unitscale.parameter.tag_parameter: expected an nn.Parameter, got "
            f"{type(param).__name__}"
        )
    if type(param) is nn.Parameter:
        # Same memory layout (neither class adds slots): the object keeps its identity, so
        # tied weights and existing optimiser references are unaffected.
        param.__class__ = Parameter
    elif not isinstance(param, Parameter):
        raise ParameterTagError(
            f"unitscale.parameter.tag_parameter: cannot tag a {type(param).__name__}; only "
            "plain nn.Parameter objects can be turned into unitscale.Parameter"
        )
    tagged: Parameter = param  # type: ignore[assignment]
    tagged.mup_type = mup_type
    tagged.mup_scaling_depth = mup_scaling_depth
    return tagged


# Normalisation modules whose ``weight`` is an elementwise scale (``mup_type="norm"``).
_NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.LayerNorm,
    nn.RMSNorm,
    nn.GroupNorm,
    nn.modules.batchnorm._NormBase,
)


def infer_mup_type(module: nn.Module, name: str, param: Tensor) -> str:
    """The ``mup_type`` of ``module``'s own parameter ``name``, from the module and name.

    Rule: ``"bias"`` for a parameter named ``bias`` (or ending in ``_bias``); ``"norm"``
    for the other parameters of a normalisation module (``nn.LayerNorm``, ``nn.RMSNorm``,
    group and batch norms, or any class whose name ends in ``Norm``) and for any other
    parameter with fewer than 2 dimensions (an elementwise scale); ``"weight"`` otherwise.
    ``"output"`` is never inferred: the caller knows which weight is the readout.

    Example:
        >>> ln = nn.LayerNorm(4)
        >>> infer_mup_type(ln, "weight", ln.weight), infer_mup_type(ln, "bias", ln.bias)
        ('norm', 'bias')
    """
    if name == "bias" or name.endswith("_bias"):
        return "bias"
    if isinstance(module, _NORM_TYPES) or type(module).__name__.endswith("Norm"):
        return "norm"
    return "norm" if param.dim() < 2 else "weight"


def tag_module(
    module: nn.Module,
    output: Tensor | None = None,
    mup_scaling_depth: int | None = None,
    overwrite: bool = False,
) -> nn.Module:
    """Tag every parameter of ``module`` (in place) with :func:`infer_mup_type`'s type.

    Args:
        module: the module; parameters shared between submodules are tagged once.
        output: the readout weight, tagged ``"output"`` (None: none is).
        mup_scaling_depth: set on every parameter (None: keep a tagged one's, else None).
        overwrite: re-infer the type of parameters that are already tagged.

    Returns:
        ``module``.

    Example:
        >>> mlp = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
        >>> _ = tag_module(mlp, output=mlp[2].weight)
        >>> [p.mup_type for p in mlp.parameters()]
        ['weight', 'bias', 'norm', 'bias', 'output', 'bias']
    """
    for sub in module.modules():
        for name, param in sub.named_parameters(recurse=False):
            if param is output:
                mup_type = "output"
            elif has_mup_tags(param) and not overwrite:
                mup_type = param.mup_type  # type: ignore[attr-defined]
            else:
                mup_type = infer_mup_type(sub, name, param)
            depth = mup_scaling_depth
            if depth is None and has_mup_tags(param):
                depth = param.mup_scaling_depth  # type: ignore[attr-defined]
            tag_parameter(param, mup_type, depth)
            if isinstance(sub, nn.Embedding) and name == "weight" and mup_type == "weight":
                setattr(param, EMBEDDING, True)
    return module


def tag_model(module: nn.Module, output: Tensor | str | None = "find") -> nn.Module:
    """Tag a whole model for u-μP in place, finding its readout and residual stack.

    What :func:`unitscale.transforms.unit_scale` calls on the model it returns (passing the
    readout it made, or None with ``mup=False``). Rules: parameters that already carry tags
    keep them; the readout (``"output"``) is ``output``, or with ``"find"`` the weight of
    ``module.get_output_embeddings()`` when the model has that method (transformers
    models: ``lm_head``; a weight tied to the input embedding is then ``"output"`` too), and
    no weight otherwise (tag it yourself with :func:`tag_parameter`). Tag ``"output"`` only
    a weight applied as u-μP's readout (multiplier ``1/fan_in``); a head applied as a
    unit-scaled linear is a ``"weight"``. Every other parameter
    gets :func:`infer_mup_type`'s type. An ``nn.ModuleList`` of two or more blocks of one
    class (transformers' ``model.layers``, GPT-2's ``h``) is taken as the residual stack:
    its parameters get ``mup_scaling_depth = len(list)`` unless they already have a depth.

    Args:
        module: the model.
        output: the readout weight, None for none, or ``"find"`` (above).

    Returns:
        ``module``.

    Example:
        >>> class Net(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        ...         self.head = nn.Linear(8, 2)
        ...     def get_output_embeddings(self):
        ...         return self.head
        >>> net = tag_model(Net())
        >>> net.blocks[0].weight.mup_scaling_depth, net.head.weight.mup_type
        (3, 'output')
    """
    if isinstance(output, str):
        if output != "find":
            raise ParameterTagError(
                f"unitscale.parameter.tag_model: output={output!r}; pass the readout weight, "
                "None or 'find'"
            )
        output = None
        get_output = getattr(module, "get_output_embeddings", None)
        if callable(get_output):
            weight = getattr(get_output(), "weight", None)
            output = weight if isinstance(weight, nn.Parameter) else None
    tag_module(module, output=output)
    for sub in module.modules():
        if type(sub) is nn.ModuleList and len(sub) > 1 and len({type(block) for block in sub}) == 1:
            for param in sub.parameters():
                if getattr(param, "mup_scaling_depth", None) is None:
                    param.mup_scaling_depth = len(sub)  # type: ignore[attr-defined]
    return module
