"""The recording pass: statistics of every float tensor and gradient of a captured graph.

``_pass`` holds :class:`TrackScalesPass`; ``_graph`` what the pass reads off a graph;
``_tensors`` how it hooks and aliases the user's tensors.
"""

from ._pass import TrackScalesPass

__all__ = ["TrackScalesPass"]
