"""Warnings located at the user's calling line."""

from __future__ import annotations

import os
import sys
import warnings

import torch

__all__ = ["warn_user"]


def warn_user(message: str) -> None:
    """Warn with the user's calling line as location (outside torch and unitscale)."""

    skip = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    warnings.warn(message, UserWarning, stacklevel=level + 1)
