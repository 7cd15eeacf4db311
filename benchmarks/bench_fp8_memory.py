"""Memory the linear ops keep for the backward: to_fp8 against FP32 and simulate_fp8.

The built-in decoder (:class:`unitscale.TransformerDecoder`, u-μP) runs one forward with
``torch.autograd.graph.saved_tensors_hooks`` recording every tensor autograd saves for the
backward, in three forms: as it is (FP32), ``simulate_fp8`` (rounded operands, FP32
matmuls) and ``to_fp8`` (float8 GEMMs). A saved tensor belongs to a linear op when it is
saved while a linear op runs: ``unitscale.functional.linear``/``linear_readout`` or the
float8 GEMM of ``to_fp8`` is on the Python stack. Bytes are
counted once per distinct storage (the same tensor saved twice is held once); those of
parameters (held anyway) are reported apart. Measured, not estimated: nothing is inferred
from shapes.

Each run is appended to ``benchmarks/results/fp8_memory.json`` with the date and load.

Run: ``python benchmarks/bench_fp8_memory.py [--hidden 256] [--depth 2] [--batch 8]
[--seq 128]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from _history import append_run, machine_state
from torch import Tensor, nn

import unitscale
from unitscale.transforms import simulate_fp8, to_fp8

RESULTS = Path(__file__).parent / "results" / "fp8_memory.json"

# The frames that mark a linear op: the unit-scaled linears (the decoder's own ops, also what
# simulate_fp8 calls with rounded operands) and everything in to_fp8's float8 GEMM file.
_MATMUL_FILE = str(Path(unitscale.__file__).parent / "functional" / "_matmul.py")
_LINEAR_FUNCTIONS = {"linear", "linear_readout", "_linear", "_apply_factors"}
_FP8_FILE = str(Path(unitscale.__file__).parent / "transforms" / "_fp8_gemm.py")


def _in_linear_op() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_filename == _FP8_FILE or (
            code.co_filename == _MATMUL_FILE and code.co_name in _LINEAR_FUNCTIONS
        ):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def saved_bytes(model: nn.Module, ids: Tensor, parameters: set[int]) -> dict[str, Any]:
    """Bytes saved for the backward in one forward of ``model``: all, and by linear ops."""
    seen: dict[tuple[int, bool], tuple[int, bool, str]] = {}

    def pack(tensor: Tensor) -> Tensor:
        key = (tensor.untyped_storage().data_ptr(), _in_linear_op())
        nbytes = tensor.untyped_storage().nbytes()
        is_parameter = tensor.untyped_storage().data_ptr() in parameters
        seen[key] = (nbytes, is_parameter, str(tensor.dtype).replace("torch.", ""))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, ids)
    loss.backward()
    linear = [v for (_, in_linear), v in seen.items() if in_linear]
    dtypes: dict[str, int] = {}
    for nbytes, is_parameter, dtype in linear:
        if not is_parameter:
            dtypes[dtype] = dtypes.get(dtype, 0) + nbytes
    return {
        "all_ops_bytes": sum(v[0] for v in seen.values() if not v[1]),
        "linear_ops_bytes": sum(v[0] for v in linear if not v[1]),
        "linear_ops_parameter_bytes": sum(v[0] for v in linear if v[1]),
        "linear_ops_bytes_by_dtype": dtypes,
    }


def measure(hidden: int, depth: int, batch: int, seq: int, vocab: int) -> dict[str, Any]:
    torch.manual_seed(0)
    base = unitscale.TransformerDecoder(hidden, depth=depth, heads=4, vocab_size=vocab)
    ids = torch.randint(0, vocab, (batch, seq))
    forms = {"fp32": base, "simulate_fp8": simulate_fp8(base), "to_fp8": to_fp8(base)}
    result: dict[str, Any] = {}
    for name, model in forms.items():
        parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
        model(ids, ids)  # the first call captures; measure the second
        result[name] = saved_bytes(model, ids, parameters)
    fp32 = result["fp32"]["linear_ops_bytes"]
    for name in forms:
        result[name]["linear_ops_vs_fp32"] = round(result[name]["linear_ops_bytes"] / fp32, 3)
    print(result, flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    state = machine_state()
    result = measure(args.hidden, args.depth, args.batch, args.seq, args.vocab)
    append_run(
        args.output,
        {
            **state,
            "device": "cpu",
            "model": {
                "family": "TransformerDecoder (u-muP)",
                "hidden_size": args.hidden,
                "depth": args.depth,
                "heads": 4,
                "vocab_size": args.vocab,
                "batch_size": args.batch,
                "seq_len": args.seq,
            },
            "results": result,
        },
    )


if __name__ == "__main__":
    main()
