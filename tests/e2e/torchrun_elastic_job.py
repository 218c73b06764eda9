"""A job for torchrun's elastic agent: ten steps of SGD, a commit after every second step,
and (on the agent's first attempt, when asked) rank 1 dying after step 5. Each rank saves
its final weights and where each attempt started into ``OUT/rank.<rank>.pt``.

    torchrun ... tests/e2e/torchrun_elastic_job.py OUT [--kill]
"""

from __future__ import annotations

import os
import sys

import torch

import baguahvd.torch as hvd

STEPS = 10
KILL_AFTER = 5

out, kill = sys.argv[1], "--kill" in sys.argv[2:]
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
hvd.init()
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
optimizer = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters()
)
state = hvd.elastic.TorchState(model=model, optimizer=optimizer, step=0)
starts: list[int] = []


@hvd.elastic.run
def train(state: hvd.elastic.TorchState) -> None:
    starts.append(state.step)
    generator = torch.Generator().manual_seed(hvd.rank())
    data = torch.randn(8, 4, generator=generator)
    while state.step < STEPS:
        optimizer.zero_grad()
        model(data * (state.step + 1)).pow(2).mean().backward()
        optimizer.step()
        state.step += 1
        if state.step % 2 == 0:
            state.commit()
        if kill and attempt == 0 and hvd.rank() == 1 and state.step == KILL_AFTER:
            os._exit(1)


train(state)
torch.save(
    {"attempt": attempt, "starts": starts, "size": hvd.size(),
     "weights": {k: v.clone() for k, v in model.state_dict().items()}},
    os.path.join(out, f"rank.{hvd.rank()}.pt"),
)
