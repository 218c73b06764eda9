"""Step time of a synchronous job on variable-length sequences: LoadBalancingDistributedSampler
against torch's DistributedSampler.

    python benchmarks/load_balanced_sampler.py                 # 4 ranks, 2048 sequences
    python benchmarks/load_balanced_sampler.py --ranks 8 --batch 16

A tiny LSTM (input 32, hidden 128, one layer) trains on sequences whose lengths follow a
log-normal distribution (median about 40, a long tail up to ``--max-len``); each rank's
batch is padded to its longest sequence. The ranks are simulated in this one process: every
step, each rank's forward and backward runs in turn and is timed alone, and the step costs
the slowest rank's time, since a synchronous data-parallel step waits for the slowest rank
(communication is left out: it is the same for every sampler). One epoch per sampler,
after a warm-up, in ``--rounds`` interleaved rounds (the table shows the median epoch
time); every sampler sees the same model and the same sequences.

Columns: epoch time (sum over steps of the slowest rank), the same as a ratio of
DistributedSampler's, the mean over steps of slowest/fastest rank time, and the padded
tokens the slowest rank processes per step (a machine-independent proxy).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn
from torch.utils.data import DistributedSampler

from baguahvd.contrib import LoadBalancingDistributedSampler


def lengths(n: int, max_len: int) -> list[int]:
    g = torch.Generator().manual_seed(0)
    raw = torch.exp(torch.randn(n, generator=g) * 0.8 + 3.7).long() + 1
    return raw.clamp(max=max_len).tolist()


def rank_lists(name: str, n: int, costs: list[int], ranks: int) -> list[list[int]]:
    dataset = range(n)
    if name == "DistributedSampler":
        return [list(DistributedSampler(dataset, ranks, r, seed=0)) for r in range(ranks)]
    level = float(name.split("=")[1].rstrip(")"))
    return [
        list(
            LoadBalancingDistributedSampler(
                dataset, None, ranks, r, random_level=level, complexities=costs
            )
        )
        for r in range(ranks)
    ]


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(32, 128, batch_first=True)
        self.head = nn.Linear(128, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, -1]).sum()


def run_step(model: Model, batch_lengths: list[int]) -> float:
    x = torch.randn(len(batch_lengths), max(batch_lengths), 32)
    start = time.perf_counter()
    model.zero_grad()
    model(x).backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=400)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Model()
    costs = lengths(args.samples, args.max_len)
    for _ in range(5):
        run_step(model, [64] * args.batch)
    names = ["DistributedSampler", "LoadBalancing(random_level=0)",
             "LoadBalancing(random_level=0.1)"]
    print(f"{args.ranks} simulated ranks, batch {args.batch} per rank, {args.samples} "
          f"sequences (median length {statistics.median(costs):.0f}, max {max(costs)}), "
          f"torch {torch.__version__}, {args.threads} thread(s)")
    print("| sampler | epoch time (s) | vs DistributedSampler | slowest/fastest rank per "
          "step | padded tokens of the slowest rank per step |")
    print("|---|---:|---:|---:|---:|")
    results: dict[str, tuple[list[float], list[float], list[float]]] = {
        name: ([], [], []) for name in names
    }
    for _ in range(args.rounds):  # interleaved, so that load from elsewhere hits all alike
        for name in names:
            totals, spreads, tokens = results[name]
            lists = rank_lists(name, args.samples, costs, args.ranks)
            total = 0.0
            for s in range(len(lists[0]) // args.batch):
                times = []
                padded = []
                for rank_list in lists:
                    batch = [costs[i] for i in rank_list[s * args.batch : (s + 1) * args.batch]]
                    times.append(run_step(model, batch))
                    padded.append(max(batch) * len(batch))
                total += max(times)
                spreads.append(max(times) / min(times))
                tokens.append(max(padded))
            totals.append(total)
    base = statistics.median(results[names[0]][0])
    for name in names:
        totals, spreads, tokens = results[name]
        total = statistics.median(totals)
        print(f"| {name} | {total:.2f} | {total / base:.2f} | "
              f"{statistics.mean(spreads):.2f} | {statistics.mean(tokens):.0f} |")


if __name__ == "__main__":
    main()
