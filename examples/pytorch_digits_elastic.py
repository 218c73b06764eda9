"""Elastic data-parallel training on scikit-learn's bundled 8x8 digits.

Horovod's elastic PyTorch example, sized for CPUs and needing no download. Run it with::

    baguahvdrun --elastic -np 2 python examples/pytorch_digits_elastic.py

If a rank dies, ``baguahvdrun --elastic`` starts the job again and training resumes from the
last ``state.commit()``; with ``--host-discovery-script`` the job also grows or shrinks when
hosts come and go. Changing the import below back to ``import horovod.torch as hvd`` runs it
on Horovod's elastic driver.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import baguahvd.torch as hvd

parser = argparse.ArgumentParser(description="PyTorch elastic digits example",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--batch-size", type=int, default=32, help="input batch size per rank")
parser.add_argument("--epochs", type=int, default=5, help="number of epochs to train")
parser.add_argument("--lr", type=float, default=0.02, help="learning rate for a single rank")
parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
parser.add_argument("--batches-per-commit", type=int, default=10,
                    help="batches between commits of the elastic state")
parser.add_argument("--seed", type=int, default=42, help="random seed")


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
        x = F.relu(self.fc1(x.flatten(1)))
        return F.log_softmax(self.fc2(x), dim=1)


def datasets(seed):
    digits = load_digits()
    images = (torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0 - 0.5) / 0.5
    labels = torch.tensor(digits.target, dtype=torch.int64)
    train_idx, test_idx = train_test_split(
        list(range(len(labels))), test_size=0.2, random_state=seed, stratify=digits.target
    )
    return (torch.utils.data.TensorDataset(images[train_idx], labels[train_idx]),
            torch.utils.data.TensorDataset(images[test_idx], labels[test_idx]))


def scale_learning_rate():
    # Horovod: the global batch grows with the number of ranks, and so does the rate.
    for group in optimizer.param_groups:
        group["lr"] = args.lr * hvd.size()


def train_epoch(state):
    model.train()
    verbose = hvd.rank() == 0
    with tqdm(total=len(train_loader), desc=f"Train Epoch #{state.epoch + 1}",
              disable=not verbose) as progress:
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
            # Horovod: count the batch, so that a restart skips the samples already used.
            train_sampler.record_batch(batch_idx, args.batch_size)
            state.batch += 1
            if state.batch % args.batches_per_commit == 0:
                state.commit()
            progress.set_postfix({"loss": loss.item()})
            progress.update(1)


def evaluate():
    model.eval()
    correct = torch.tensor(0.0)
    with torch.no_grad():
        for data, target in test_loader:
            correct += model(data).argmax(1).eq(target).float().sum()
    # Every rank evaluates the same (synchronised) model on the whole test set.
    return correct.item() / len(test_dataset)


@hvd.elastic.run
def train(state):
    while state.epoch < args.epochs:
        train_epoch(state)
        state.epoch += 1
        state.batch = 0
        train_sampler.set_epoch(state.epoch)
        state.commit()


if __name__ == "__main__":
    args = parser.parse_args()
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    train_dataset, test_dataset = datasets(args.seed)
    # Horovod: ElasticSampler splits what is left of the epoch over the current ranks.
    train_sampler = hvd.elastic.ElasticSampler(train_dataset, shuffle=True, seed=args.seed)
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, sampler=train_sampler)
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=256)

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(),
                                momentum=args.momentum)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    # Horovod: everything a restart must bring back, committed together.
    state = hvd.elastic.TorchState(model, optimizer, train_sampler=train_sampler,
                                   epoch=0, batch=0)
    state.register_reset_callbacks([scale_learning_rate])

    train(state)
    if hvd.rank() == 0:
        print(f"test accuracy: {evaluate():.4f}", flush=True)
