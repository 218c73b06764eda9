"""Data-parallel training of a small CNN on scikit-learn's bundled 8x8 digits.

Horovod's PyTorch MNIST example, sized for CPUs and needing no download. Run it with::

    baguahvdrun -np 2 python examples/pytorch_digits.py

Changing the import below back to ``import horovod.torch as hvd`` runs it on Horovod.

``--algorithm NAME`` (baguahvd only) picks one of Bagua's communication algorithms. With
decentralized and asynchronous ones (decentralized, low_precision_decentralized, async) the
ranks' models differ, so the model evaluated is their average (Bagua: evaluate per rank or
average explicitly); async averaging is aborted around each evaluation and checkpoint, as
Bagua requires. qadam trains with Adam (a QAdamOptimizer, see --qadam-warmup-steps).
"""

import argparse
import copy
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data
import torch.utils.data.distributed
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import baguahvd.torch as hvd

parser = argparse.ArgumentParser(description="PyTorch digits example",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--batch-size", type=int, default=32, help="input batch size per rank")
parser.add_argument("--test-batch-size", type=int, default=256, help="batch size for testing")
parser.add_argument("--epochs", type=int, default=5, help="number of epochs to train")
parser.add_argument("--optimizer", choices=["sgd", "adam"], default=None,
                    help="optimizer (default: adam with --algorithm qadam, else sgd)")
parser.add_argument("--lr", type=float, default=None,
                    help="learning rate for a single rank (default: 0.02 for SGD, 0.001 for Adam)")
parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
parser.add_argument("--seed", type=int, default=42, help="random seed")
parser.add_argument("--log-interval", type=int, default=10,
                    help="batches between loss logs (0: no per-batch logs)")
parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                    help="use fp16 compression during allreduce")
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0,
                    help="apply gradient predivide factor in optimizer")
parser.add_argument("--checkpoint-dir", default=None,
                    help="save a checkpoint here after every epoch and resume from the latest")
parser.add_argument("--algorithm", default=None,
                    help="baguahvd communication algorithm (baguahvd only; default: allreduce)")
parser.add_argument("--qadam-warmup-steps", type=int, default=100,
                    help="with --algorithm qadam: Adam steps before the compressed stage")
parser.add_argument("--no-cuda", action="store_true", default=False,
                    help="disables CUDA training")


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


class Metric:
    """Running average of a value over batches, averaged over ranks each time."""

    def __init__(self, name):
        self.name = name
        self.sum = torch.tensor(0.0)
        self.n = torch.tensor(0.0)

    def update(self, val):
        self.sum += hvd.allreduce(val.detach().cpu(), name=self.name)
        self.n += 1

    @property
    def avg(self):
        return self.sum / self.n


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


# Algorithms after which every rank holds a model of its own.
MODEL_AVERAGING = ("decentralized", "low_precision_decentralized", "async")


def checkpoint_path(epoch):
    return os.path.join(args.checkpoint_dir, f"checkpoint-{epoch}.pt")


def pause_averaging():
    # Bagua's async algorithm must be aborted before evaluating or saving the model.
    if args.algorithm == "async" and optimizer.algorithm_impl is not None:
        optimizer.algorithm_impl.abort()


def resume_averaging():
    if args.algorithm == "async" and optimizer.algorithm_impl is not None:
        optimizer.algorithm_impl.resume()


def train(epoch):
    resume_averaging()
    model.train()
    # Horovod: set epoch to sampler for shuffling.
    train_sampler.set_epoch(epoch)
    train_loss = Metric("train_loss")
    train_accuracy = Metric("train_accuracy")
    with tqdm(total=len(train_loader), desc=f"Train Epoch #{epoch + 1}",
              disable=not verbose) as progress:
        for batch_idx, (data, target) in enumerate(train_loader):
            if args.cuda:
                data, target = data.cuda(), target.cuda()
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            loss.backward()
            optimizer.step()
            train_loss.update(loss)
            train_accuracy.update(output.argmax(1).eq(target).float().mean())
            progress.set_postfix({"loss": train_loss.avg.item(),
                                  "accuracy": 100.0 * train_accuracy.avg.item()})
            progress.update(1)
            if verbose and args.log_interval and batch_idx % args.log_interval == 0:
                progress.write(
                    f"Train Epoch: {epoch + 1} [{batch_idx * len(data)}/{len(train_sampler)}"
                    f" ({100.0 * batch_idx / len(train_loader):.0f}%)]\tLoss: {loss.item():.6f}"
                )


def metric_average(val, name):
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return avg_tensor.item()


def model_to_evaluate():
    """The model, or with a decentralized or asynchronous algorithm the ranks' average."""
    if args.algorithm not in MODEL_AVERAGING:
        return model
    averaged = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in averaged.named_parameters():
            p.copy_(hvd.allreduce(p, name=f"average.{name}"))
    return averaged


def test():
    net = model_to_evaluate()
    net.eval()
    test_loss = 0.0
    test_accuracy = 0.0
    with torch.no_grad():
        for data, target in test_loader:
            if args.cuda:
                data, target = data.cuda(), target.cuda()
            output = net(data)
            # sum up batch loss
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            # get the index of the max log-probability
            test_accuracy += output.argmax(1).eq(target).float().sum().item()

    # Horovod: use test_sampler to determine the number of examples in this rank's shard.
    test_loss /= len(test_sampler)
    test_accuracy /= len(test_sampler)

    # Horovod: average metric values across ranks.
    test_loss = metric_average(test_loss, "avg_loss")
    test_accuracy = metric_average(test_accuracy, "avg_accuracy")
    return test_loss, test_accuracy


def save_checkpoint(epoch):
    if hvd.rank() == 0 and args.checkpoint_dir:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        torch.save(state, checkpoint_path(epoch + 1))


if __name__ == "__main__":
    args = parser.parse_args()
    args.cuda = not args.no_cuda and torch.cuda.is_available() and hvd.cuda_built()

    # Horovod: initialize library.
    hvd.init()
    torch.manual_seed(args.seed)

    if args.cuda:
        # Horovod: pin GPU to local rank.
        torch.cuda.set_device(hvd.local_rank())
        torch.cuda.manual_seed(args.seed)

    # Horovod: limit # of CPU threads to be used per worker.
    torch.set_num_threads(1)

    # Horovod: print logs on the first worker.
    verbose = hvd.rank() == 0

    train_dataset, test_dataset = datasets(args.seed)
    # Horovod: use DistributedSampler to partition the data among ranks.
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank(), seed=args.seed)
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, sampler=train_sampler)
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    test_loader = torch.utils.data.DataLoader(
        test_dataset, batch_size=args.test_batch_size, sampler=test_sampler)

    model = Net()
    if args.cuda:
        model.cuda()

    # Horovod: scale learning rate by the number of ranks (the global batch grows with it).
    if args.optimizer is None:
        args.optimizer = "adam" if args.algorithm == "qadam" else "sgd"
    if args.lr is None:
        args.lr = 0.001 if args.optimizer == "adam" else 0.02
    if args.algorithm == "qadam":
        # Adam whose second moment freezes after the warmup (baguahvd only).
        from baguahvd.algorithms import QAdamOptimizer

        if args.optimizer != "adam":
            parser.error("--algorithm qadam trains with Adam (--optimizer adam)")
        optimizer = QAdamOptimizer(model.parameters(), lr=args.lr * hvd.size(),
                                   warmup_steps=args.qadam_warmup_steps)
    elif args.optimizer == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * hvd.size())
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(),
                                    momentum=args.momentum)

    # Horovod: (optional) compression algorithm.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    # Horovod: wrap optimizer with DistributedOptimizer.
    extra = {} if args.algorithm is None else {"algorithm": args.algorithm}
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=compression,
        gradient_predivide_factor=args.gradient_predivide_factor,
        **extra,
    )

    # Horovod: the latest checkpoint is found on rank 0, which broadcasts the epoch.
    resume_from_epoch = 0
    if hvd.rank() == 0 and args.checkpoint_dir:
        for try_epoch in range(args.epochs, 0, -1):
            if os.path.exists(checkpoint_path(try_epoch)):
                resume_from_epoch = try_epoch
                break
    resume_from_epoch = hvd.broadcast_object(resume_from_epoch, root_rank=0,
                                             name="resume_from_epoch")

    # Horovod: restore on rank 0, which then broadcasts weights and state to the others.
    if resume_from_epoch > 0 and hvd.rank() == 0:
        checkpoint = torch.load(checkpoint_path(resume_from_epoch))
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
    if resume_from_epoch > 0 and verbose:
        print(f"resuming from epoch {resume_from_epoch}", flush=True)

    # Horovod: broadcast parameters & optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    test_accuracy = None
    for epoch in range(resume_from_epoch, args.epochs):
        train(epoch)
        pause_averaging()
        test_loss, test_accuracy = test()
        if verbose:
            print(f"Epoch {epoch + 1}: test loss {test_loss:.4f}, "
                  f"accuracy {100.0 * test_accuracy:.2f}%", flush=True)
        save_checkpoint(epoch)
    if test_accuracy is None:  # the checkpoints already covered every epoch
        test_loss, test_accuracy = test()

    if verbose:
        print(f"test accuracy: {test_accuracy:.4f}", flush=True)
