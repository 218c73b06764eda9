"""``python tests/support/lightning_self_launch.py OUT_DIR``: a Trainer with
``strategy="baguahvd"`` and ``devices=2`` started without a launcher, so Lightning starts the
second rank itself; each rank writes what it trained and how baguahvd joined the ranks to
``OUT_DIR/rank<r>.pt``. Run by tests/e2e/test_lightning_launch.py."""

from __future__ import annotations

import pathlib
import sys

import lightning.pytorch as pl
import torch
import torch.utils.data

import baguahvd.lightning  # noqa: F401  (registers strategy="baguahvd")
import baguahvd.torch as hvd
from tests.support.lightning_models import BATCH, Classifier, dataset, flat

DEVICES = 2


def main(out: pathlib.Path) -> None:
    model = Classifier()
    trainer = pl.Trainer(
        strategy="baguahvd", accelerator="cpu", devices=DEVICES, max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0,
    )
    trainer.fit(model, torch.utils.data.DataLoader(dataset(), batch_size=BATCH, shuffle=True))
    torch.save(
        {
            "weights": flat(model),
            "gathered": hvd.allgather(flat(model).unsqueeze(0)),
            "rank": hvd.rank(),
            "size": hvd.size(),
            "global_rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "gloo": hvd.gloo_enabled(),
        },
        out / f"rank{hvd.rank()}.pt",
    )


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
