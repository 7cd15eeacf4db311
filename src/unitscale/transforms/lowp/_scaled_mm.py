"""The one call of PyTorch's float8 GEMM (``torch._scaled_mm``) that ``to_fp8`` makes, with
CUDA's rules for it checked on every device.

:func:`scaled_mm_error` holds CUDA's preconditions of ``_scaled_mm`` (torch's
``aten/src/ATen/native/cuda/Blas.cpp``, the cuBLASLt float8 path, and its row-wise CUTLASS
path): float8 operands, not both E5M2; the first operand's inner dimension and both
dimensions of the second multiples of 16; the first operand row-major and the second
column-major; float32 scales, one number each (tensorwise) or ``(M, 1)`` and ``(1, N)``
(rowwise); a float32, bfloat16 or float16 output, bfloat16 for rowwise scales.
:func:`scaled_mm` refuses a call that breaks them on every device, the CPU included (whose
kernel would take it), so that a test run on the CPU fails wherever a GPU would.
:func:`padded_mm` is the call every float8 GEMM of ``to_fp8`` goes through: it lays the
operands out as CUDA wants and pads the inner dimension and the second operand's columns
with zeros to multiples of 16 (exact: zero products; the extra columns are sliced off), as
torchao's ``pad_inner_dim`` does, so that a linear op of any shape converts.

Which devices run float8 GEMMs at all is found by a tiny trial GEMM
(:func:`float8_device_error`); a definite answer is cached per device, a transient failure
(out of memory) is not.

Design constraints: only tensor ops and Python numbers in the GEMM path (no host
synchronisation), so that it runs under ``torch.compile``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ...formats import FormatError

__all__ = [
    "E4M3_DTYPE",
    "E5M2_DTYPE",
    "OUT_DTYPES",
    "check_float8",
    "float8_build_error",
    "float8_compile_error",
    "float8_device_error",
    "padded_mm",
    "scaled_mm",
    "scaled_mm_error",
]

E4M3_DTYPE: Any = getattr(torch, "float8_e4m3fn", None)
E5M2_DTYPE: Any = getattr(torch, "float8_e5m2", None)
#: The output dtypes CUDA's ``_scaled_mm`` writes (float8 outputs aside).
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FALLBACK = "use unitscale.transforms.simulate_fp8, which simulates the same numerics"
_ALIGN = 16


def float8_build_error() -> str | None:
    """What this torch build lacks for float8 GEMMs, or None."""
    missing = []
    if not hasattr(torch, "_scaled_mm") and not hasattr(F, "scaled_mm"):
        missing.append("torch._scaled_mm")
    if E4M3_DTYPE is None or E5M2_DTYPE is None:
        missing.append("the dtypes torch.float8_e4m3fn and torch.float8_e5m2")
    if not missing:
        return None
    return f"torch {torch.__version__} has no {' and no '.join(missing)}"


# (device, rowwise) -> the reason float8 GEMMs fail there (None: they run); definite only.
_TRIALS: dict[tuple[str, bool], str | None] = {}


def _transient(error: BaseException) -> bool:
    """Whether a failed trial may pass later (memory was short), so is not to be cached."""
    oom = getattr(torch, "OutOfMemoryError", None)
    return (oom is not None and isinstance(error, oom)) or "out of memory" in str(error)


def _trial(device: str, rowwise: bool = False) -> str | None:
    """Why a 16 x 16 float8 GEMM fails on ``device`` (with rowwise scales), or None."""
    key = (device, rowwise)
    if key in _TRIALS:
        return _TRIALS[key]
    try:
        a = torch.ones(16, 16, device=device)
        scale = torch.ones((16, 1) if rowwise else (), device=device)
        firsts = (E4M3_DTYPE,) if rowwise else (E4M3_DTYPE, E5M2_DTYPE)
        out = torch.bfloat16 if rowwise else torch.float32
        for first in firsts:
            _call(a.to(first), a.to(E4M3_DTYPE).t(), scale, scale.t(), out, False)
    except Exception as error:  # any failure means: no float8 GEMM here (now)
        kind = "a float8 GEMM with rowwise scales" if rowwise else "a float8 GEMM"
        reason = f"{kind} (torch._scaled_mm) fails on {device}: {error}".split("\n")[0]
        if not _transient(error):
            _TRIALS[key] = reason
        return reason
    _TRIALS[key] = None
    return None


def float8_device_error(device: torch.device | str, rowwise: bool = False) -> str | None:
    """Why float8 GEMMs (with rowwise scales) cannot run on ``device`` (a tiny trial call;
    definite answers cached), or None."""
    build = float8_build_error()
    if build is not None:
        return build
    device = torch.device(device)
    if device.type == "meta":
        return None
    return _trial(str(device), rowwise)


def check_float8(device: torch.device | str, op: str, rowwise: bool = False) -> None:
    """Raise :class:`FormatError` if float8 GEMMs cannot run on ``device``."""
    error = float8_device_error(device, rowwise)
    if error is not None:
        raise FormatError(f"unitscale.transforms.{op}: {error}; {_FALLBACK} on any device")


def _trial_cast(x: Tensor) -> Tensor:
    """The float8 cast of ``to_fp8`` (saturated) and its zero padding, for
    :func:`float8_compile_error`."""
    fmax = torch.finfo(E4M3_DTYPE).max
    return F.pad((x * 2.0).clamp(-fmax, fmax).to(E4M3_DTYPE), (0, 3))


_COMPILE_TRIALS: dict[str, str | None] = {}


def float8_compile_error(device: torch.device | str) -> str | None:
    """Why this torch's Inductor cannot compile ``to_fp8``'s float8 casts on ``device``
    and pads on ``device`` (a tiny compiled trial on the CPU, cached; torch 2.8's C++ code
    generator fails on the padding, ``Vectorized<Float8_e4m3fn>`` having no ``blendv``), or
    None. Other devices: None."""
    device = torch.device(device)
    if device.type != "cpu" or float8_build_error() is not None:
        return None
    if "cpu" not in _COMPILE_TRIALS:
        try:
            compiled = torch.compile(_trial_cast, backend="inductor", dynamic=False)
            compiled(torch.randn(8, 13))
            _COMPILE_TRIALS["cpu"] = None
        except Exception as error:  # any failure: Inductor cannot compile it here
            first = str(error).strip().split("\n")[0][:200]
            _COMPILE_TRIALS["cpu"] = (
                f"torch {torch.__version__}'s Inductor cannot compile a float8 cast and its "
                f"padding on the CPU ({type(error).__name__}: {first})"
            )
    return _COMPILE_TRIALS["cpu"]


def _scale_error(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, out: Any) -> str | None:
    if scale_a.dtype != torch.float32 or scale_b.dtype != torch.float32:
        return f"scales in {scale_a.dtype} and {scale_b.dtype}, not float32"
    if scale_a.numel() == 1 and scale_b.numel() == 1:
        if scale_a.dim() > 0 or scale_b.dim() > 0:
            return "tensorwise scales must be 0-dimensional"
        return None
    rows, cols = (a.shape[0], 1), (1, b.shape[1])
    if tuple(scale_a.shape) != rows or tuple(scale_b.shape) != cols:
        return (
            f"scales of shapes {tuple(scale_a.shape)} and {tuple(scale_b.shape)}: tensorwise "
            f"takes one number each, rowwise {rows} and {cols}"
        )
    if not (scale_a.is_contiguous() and scale_b.is_contiguous()):
        return "rowwise scales must be contiguous"
    if out != torch.bfloat16:
        return f"rowwise scales write bfloat16 only, not {out}"
    return None


def scaled_mm_error(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, out: Any) -> str | None:
    """Why CUDA's ``torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=out)`` would refuse
    these arguments (None: it takes them), whatever device they are on.

    Example:
        >>> a = torch.zeros(32, 24).to(E4M3_DTYPE)  # inner dimension 24
        >>> one = torch.ones(())
        >>> scaled_mm_error(a, torch.zeros(16, 24).to(E4M3_DTYPE).t(), one, one, torch.float32)
        'inner dimension 24 of a (32, 24) @ (24, 16) GEMM is not a multiple of 16'
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        return f"operands of shapes {tuple(a.shape)} and {tuple(b.shape)} do not multiply"
    float8 = (E4M3_DTYPE, E5M2_DTYPE)
    if a.dtype not in float8 or b.dtype not in float8:
        return f"operands in {a.dtype} and {b.dtype}, not float8"
    if a.dtype == b.dtype == E5M2_DTYPE:
        return "both operands in float8_e5m2 (cuBLAS takes at most one)"
    shapes = f"{tuple(a.shape)} @ {tuple(b.shape)} GEMM"
    if a.shape[1] % _ALIGN:
        return f"inner dimension {a.shape[1]} of a {shapes} is not a multiple of {_ALIGN}"
    if b.shape[1] % _ALIGN:
        return f"output columns {b.shape[1]} of a {shapes} are not a multiple of {_ALIGN}"
    if a.stride(1) != 1 and a.shape[1] > 1:
        return f"the first operand of a {shapes} is not row-major (strides {a.stride()})"
    if b.stride(0) != 1 and b.shape[0] > 1:
        return f"the second operand of a {shapes} is not column-major (strides {b.stride()})"
    if out not in OUT_DTYPES:
        return f"output dtype {out}: CUDA's float8 GEMM writes one of {OUT_DTYPES}"
    return _scale_error(a, b, scale_a, scale_b, out)


def _call(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, out: Any, fast: bool) -> Tensor:
    """``torch._scaled_mm``, or ``F.scaled_mm`` where a release has only that."""
    if hasattr(torch, "_scaled_mm"):
        return torch._scaled_mm(
            a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out, use_fast_accum=fast
        )
    kinds = getattr(F, "ScalingType")  # noqa: B009 (torch 2.13 and later only)
    kind = kinds.TensorWise if scale_a.numel() == 1 else kinds.RowWise
    result: Tensor = getattr(F, "scaled_mm")(  # noqa: B009
        a, b, scale_a, kind, scale_b, kind, output_dtype=out, use_fast_accum=fast
    )
    return result


def scaled_mm(
    a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, out: Any, fast_accum: bool = False
) -> Tensor:
    """``(a @ b) * scale_a * scale_b`` as ``torch._scaled_mm``, refused with
    :class:`FormatError` wherever CUDA would refuse it (:func:`scaled_mm_error`), on every
    device. ``fast_accum``: cuBLAS's fast float8 accumulation (CUDA only; ignored elsewhere).
    """
    error = scaled_mm_error(a, b, scale_a, scale_b, out)
    if error is not None:
        raise FormatError(
            f"unitscale.transforms.to_fp8: torch._scaled_mm on CUDA refuses this GEMM: {error}; "
            "call padded_mm, which pads and lays out the operands as CUDA wants"
        )
    return _call(a, b, scale_a, scale_b, out, fast_accum)


def _pad(x: Tensor, rows: int, cols: int) -> Tensor:
    """``x`` with zero rows and columns appended up to ``(rows, cols)``."""
    if tuple(x.shape) == (rows, cols):
        return x
    return F.pad(x, (0, cols - x.shape[1], 0, rows - x.shape[0]))


def _up(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


def padded_mm(
    a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, out: Any, fast_accum: bool = False
) -> Tensor:
    """:func:`scaled_mm` of float8 ``a (M, K)`` and ``b (K, N)`` in any layout and shape:
    ``a`` row-major, ``b`` column-major, ``K`` and ``N`` padded with zeros to multiples of 16
    (rowwise ``scale_b`` with ones), the result sliced back to ``(M, N)``. Exact: the padded
    products are zeros and the padded columns are dropped.

    Example:
        >>> a, b = torch.ones(3, 5).to(E4M3_DTYPE), torch.ones(5, 7).to(E4M3_DTYPE)
        >>> out = padded_mm(a, b, torch.ones(()), torch.ones(()), torch.float32)
        >>> out.shape, out[0, 0].item()
        (torch.Size([3, 7]), 5.0)
    """
    k, n = a.shape[1], b.shape[1]
    k_pad, n_pad = _up(k), _up(n)
    a = _pad(a, a.shape[0], k_pad)
    if a.stride(1) != 1:
        a = a.contiguous()
    b = _pad(b, k_pad, n_pad)
    if b.stride(0) != 1:
        b = b.t().contiguous().t()
    if scale_b.numel() > 1 and n_pad != n:
        scale_b = F.pad(scale_b, (0, n_pad - n), value=1.0)
    result = scaled_mm(a, b, scale_a, scale_b, out, fast_accum)
    return result if n_pad == n else result[:, :n]
