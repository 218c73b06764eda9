"""examples/pytorch_digits.py as a LightningModule, trained with ``Trainer(strategy="baguahvd")``.

The same small CNN, data (scikit-learn's bundled 8x8 digits, no download), optimizer and
learning rate as the plain example. Run it with::

    baguahvdrun -np 2 python examples/lightning_digits.py
    python examples/lightning_digits.py --devices 2      # Lightning starts the second rank

Each rank runs this script and builds its own Trainer; Lightning gives each rank its shard of
the data, shows the progress bar and writes checkpoints on rank 0 only. ``--package
pytorch_lightning`` trains with ``import pytorch_lightning as pl`` instead of
``import lightning.pytorch as pl``; the strategy is the same. ``--algorithm NAME``
picks one of Bagua's communication algorithms; with the weight-averaging ones (decentralized,
low_precision_decentralized, async) the strategy averages the ranks' models before each
validation and checkpoint.
"""

import argparse
import importlib
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import baguahvd.lightning  # noqa: F401  (registers strategy="baguahvd" in both packages)

parser = argparse.ArgumentParser(description="PyTorch Lightning digits example",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--batch-size", type=int, default=32, help="input batch size per rank")
parser.add_argument("--test-batch-size", type=int, default=256, help="batch size for testing")
parser.add_argument("--epochs", type=int, default=5, help="number of epochs to train")
parser.add_argument("--lr", type=float, default=0.02, help="SGD learning rate for a single rank")
parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
parser.add_argument("--seed", type=int, default=42, help="random seed")
parser.add_argument("--algorithm", default=None,
                    help="baguahvd communication algorithm (default: Horovod's allreduce)")
parser.add_argument("--checkpoint-dir", default=None,
                    help="save a checkpoint here after every epoch (written by rank 0)")
parser.add_argument("--accelerator", default="cpu", help="Lightning accelerator: cpu or cuda")
parser.add_argument("--devices", type=int, default=1,
                    help="1 under baguahvdrun/mpirun/torchrun; N to let `python` start N ranks")
parser.add_argument("--package", choices=["lightning", "pytorch_lightning"], default="lightning",
                    help="the Lightning package: lightning.pytorch or pytorch_lightning")
parser.add_argument("--no-progress-bar", action="store_true", default=False,
                    help="no progress bar (the per-epoch lines are still printed)")
# Parsed here: the classes below derive from the chosen package's.
args = parser.parse_args(sys.argv[1:] if __name__ == "__main__" else [])
pl = importlib.import_module(
    "lightning.pytorch" if args.package == "lightning" else "pytorch_lightning"
)
strategies = importlib.import_module(
    "baguahvd.lightning.pytorch" if args.package == "lightning"
    else "baguahvd.lightning.pytorch_lightning"
)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(32 * 2 * 2, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = x.flatten(1)
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), dim=1)


class DigitsClassifier(pl.LightningModule):
    def __init__(self, lr, momentum):
        super().__init__()
        self.save_hyperparameters()
        self.net = Net()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        data, target = batch
        output = self(data)
        loss = F.nll_loss(output, target)
        accuracy = output.argmax(1).eq(target).float().mean()
        # sync_dist: the value shown is the mean over the ranks.
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        self.log("train_accuracy", accuracy, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        data, target = batch
        output = self(data)
        self.log("val_loss", F.nll_loss(output, target), sync_dist=True)
        self.log("val_accuracy", output.argmax(1).eq(target).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        # Horovod: scale the learning rate by the number of ranks (the global batch grows).
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr * self.trainer.world_size,
                               momentum=self.hparams.momentum)


class PrintEpochs(pl.Callback):
    """One line per validation on rank 0, as the plain example prints."""

    def on_validation_epoch_end(self, trainer, pl_module):
        if trainer.is_global_zero and trainer.state.fn == "fit" and not trainer.sanity_checking:
            metrics = trainer.callback_metrics
            print(f"Epoch {trainer.current_epoch + 1}: test loss {metrics['val_loss']:.4f}, "
                  f"accuracy {100.0 * metrics['val_accuracy']:.2f}%", flush=True)


def datasets(seed):
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = (images - 0.5) / 0.5
    labels = torch.tensor(digits.target, dtype=torch.int64)
    train_idx, test_idx = train_test_split(
        list(range(len(labels))), test_size=0.2, random_state=seed, stratify=digits.target
    )
    train = torch.utils.data.TensorDataset(images[train_idx], labels[train_idx])
    test = torch.utils.data.TensorDataset(images[test_idx], labels[test_idx])
    return train, test


if __name__ == "__main__":
    # No hvd.init() here: the strategy starts baguahvd once every rank exists (with
    # --devices N, Lightning starts the other ranks when fit begins).
    torch.set_num_threads(1)
    pl.seed_everything(args.seed, verbose=False)

    train_dataset, test_dataset = datasets(args.seed)
    # Plain loaders: the strategy makes Lightning add a DistributedSampler to each.
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size,
                                               shuffle=True)
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size)

    callbacks = [PrintEpochs()]
    if args.checkpoint_dir:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=args.checkpoint_dir, save_top_k=-1,
                                         filename="checkpoint-{epoch}"))
    trainer = pl.Trainer(
        strategy=strategies.BaguaHvdStrategy(algorithm=args.algorithm),  # or "baguahvd"
        accelerator=args.accelerator,
        devices=args.devices,
        max_epochs=args.epochs,
        logger=False,
        callbacks=callbacks,
        enable_checkpointing=bool(args.checkpoint_dir),
        enable_progress_bar=not args.no_progress_bar,
        enable_model_summary=False,
    )
    model = DigitsClassifier(args.lr, args.momentum)
    trainer.fit(model, train_loader, test_loader)
    (results,) = trainer.validate(model, test_loader, verbose=False)

    if trainer.is_global_zero:
        print(f"test accuracy: {results['val_accuracy']:.4f}", flush=True)
