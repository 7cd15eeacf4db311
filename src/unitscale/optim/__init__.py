"""u-μP optimisers: torch's Adam, AdamW and SGD with per-parameter learning rates from tags.

u-μP (Blake et al., ICLR 2025) sets each parameter's learning rate to ``lr * scale(p)``, with
``scale`` a rule of the parameter's u-μP tags (:mod:`unitscale.parameter`): its
``mup_type``, its fan-in and ``mup_scaling_depth``. With those rules the *change* of every
activation in one step does not depend on the model's width or depth, so the best ``lr``
found on a small model is the best one for a large model.

Fan-in: for a weight, ``prod(shape[1:])``: an ``nn.Linear`` weight's ``in_features``, a
convolution's ``in_channels/groups * kernel``, and an embedding's ``embedding_dim`` (for an
embedding this is the width it writes, which gives u-μP's embedding rule, see
:func:`lr_scale_func_adam`). A weight stored ``(in, out)`` (transformers' ``Conv1D``) says
so with the attribute ``fan_in_dim = 0``, which :func:`unitscale.transforms.unit_scale` sets.

How it works: :class:`Adam`, :class:`AdamW` and :class:`SGD` are torch's classes with the
same positional arguments and defaults (bound against torch's own signature). The parameters
are put into torch parameter groups, one per distinct rule factor: each group's ``"lr"`` is
the *base* learning rate, its ``"lr_scale"`` the factor, and ``step()`` runs torch's step with
``lr * lr_scale``. So a learning-rate scheduler, or a hand-written ``group["lr"] = ...``,
sets the base rate and every parameter keeps its ratio to it. The optimiser state and
``state_dict`` are torch's (``foreach``/``fused`` included).

Weight decay, ``independent_weight_decay=True`` (default), is the reference's *independent*
decay (Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer training
instabilities", section 3.2.2): each group's ``weight_decay`` is divided by that group's
learning rate at construction, ``lr_0 * lr_scale``, so a decoupled step
(``p -= lr_t * lr_scale * (weight_decay / (lr_0 * lr_scale)) * p``) shrinks every parameter by

    ``weight_decay * lr_t / lr_0`` per step,

``weight_decay`` times the schedule's factor, whatever ``lr`` and the parameter's u-μP factor:
changing the learning rate, the width or the depth does not change the decay. ``lr_0`` is
kept in each group as ``"decay_lr"`` (the base rate when the group was made, times
``lr_scale``); ``group["weight_decay"]`` shows the value given, ``step()`` passes torch
``weight_decay / decay_lr``. ``independent_weight_decay=False``: torch's coefficient on the
parameter's own rate (a shrink of ``lr_t * lr_scale * weight_decay``). ``weight_decay``
defaults to 0 in every class (the reference's default; torch's AdamW has 0.01).

Design constraints: drop-in for ``torch.optim``'s classes (same positional arguments and
defaults, ``state_dict`` and schedulers work); a parameter without tags is an error naming
it unless ``allow_untagged=True`` (then it gets ``lr`` unscaled).
"""

from ._groups import scaled_parameters
from ._muon import Muon
from ._optimizers import SGD, Adam, AdamW
from ._rates import effective_rates
from ._rules import (
    UntaggedParameterError,
    lr_scale_func_adam,
    lr_scale_func_muon,
    lr_scale_func_sgd,
)

__all__ = [  # noqa: RUF022 (grouped by kind)
    # optimisers
    "Adam",
    "AdamW",
    "SGD",
    "Muon",
    # what each parameter gets
    "effective_rates",
    # building blocks for any other optimiser
    "scaled_parameters",
    "lr_scale_func_adam",
    "lr_scale_func_sgd",
    "lr_scale_func_muon",
    # errors
    "UntaggedParameterError",
]

# The public names live in private modules; they are documented, pickled and shown as
# unitscale.optim's (as before the module became a package).
for _name in __all__:
    globals()[_name].__module__ = __name__
del _name
