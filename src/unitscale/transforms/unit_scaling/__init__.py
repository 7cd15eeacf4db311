"""Automatic unit scaling (u-μP by default) of a captured model: ``unit_scale``.

Modules: the transform and its graph pass (``_transform``); what it recognises in a graph
(``_graph``: residual adds, norms, readouts); the initialisation of the copy's weights
(``_initialise``); the ``replace`` argument (``_replace``); the report of what became of
each op (``_summary``); in-place ops rewritten out of place (``_inplace``), frozen norms
(``_norms``), the residual rule (``_residual_tau``) and user functions kept whole
(``_user_ops``).
"""

from ._replace import UnknownOpError
from ._summary import UnitScaleSummary, unit_scale_summary
from ._transform import ResidualTau, unit_scale

__all__ = ["ResidualTau", "UnitScaleSummary", "UnknownOpError", "unit_scale", "unit_scale_summary"]
