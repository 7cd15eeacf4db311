"""Side measurement for ``unitscale transfer --model hf:llama``: where is u-μP's optimum when
Llama's RMSNorm weights are frozen (the paper's norms without trainable parameters)?

``unit_scale`` keeps a transformers Llama's RMSNorm weights trainable (tagged ``"norm"``),
which the paper's recommended scheme does not; with them, the committed run's optimum sits
below the default learning rate 0.5. This trains the committed run's u-μP side (same data,
schedule, seed and grid points) with every ``"norm"`` parameter set ``requires_grad=False``
after ``unit_scale`` and prints the final held-out loss per width and learning rate. Nothing
is written: the numbers are quoted in ``docs/guide/umup.rst``.

Run: ``python benchmarks/transfer_llama_frozen_norms.py [--widths 32,64,256] [--steps -1,0,1]``
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch
from torch import nn

from unitscale.experiments import transfer


def frozen_norms(width: int, depth: int, config: transfer.TransferConfig) -> nn.Module:
    """The committed run's u-μP Llama (``unit_scale`` of it) with its norm weights frozen."""
    model = transfer._llama_mup(width, depth, config)
    for parameter in model.parameters():
        if getattr(parameter, "mup_type", None) == "norm":
            parameter.requires_grad_(False)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="32,64,256", help="comma-separated widths")
    parser.add_argument("--steps", default="-1,0,1", help="grid steps k (lr = 0.5 x 2^k)")
    args = parser.parse_args()
    config = transfer.default_config(model="hf:llama")
    data = transfer._train_data(config)
    heldout = transfer._eval_data(config, "heldout")
    train_eval = transfer._eval_data(config, "train")
    torch.set_num_threads(config.threads)
    # train_one builds through the registry (in the transfer package's _models, where it is
    # read): its hf:llama u-muP entry gets the frozen norms.
    transfer._models.PARAMETRISATION_SPECS = tuple(
        replace(s, build=frozen_norms) if (s.name, s.model) == ("u-muP", "hf:llama") else s
        for s in transfer._models.PARAMETRISATION_SPECS
    )
    for width in (int(w) for w in args.widths.split(",")):
        for k in (int(s) for s in args.steps.split(",")):
            run = transfer.train_one("u-muP", width, 2, k, config, data, heldout, train_eval)
            print(f"width {width} lr {run.lr:g}: held-out {run.final_heldout_loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
