"""One training step of one rank through NCCL, checked against the same step on the CPU.

Run by ``benchmarks/gpu_smoke.sh`` on a machine with a GPU. It sets
BAGUAHVD_NCCL_SINGLE_RANK=1 before ``hvd.init()``, so the job of one rank sends its CUDA
gradients through a one-rank NCCL communicator (creation, warm-up, stream ordering, the
fusion buffer) instead of the identity fast path. Exits non-zero, with one line saying why,
when there is no GPU or when the results differ.
"""

from __future__ import annotations

import os
import sys

import torch


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_smoke_step: no CUDA GPU is visible to torch; this check needs one",
              file=sys.stderr)
        return 2
    os.environ["BAGUAHVD_NCCL_SINGLE_RANK"] = "1"
    import baguahvd.torch as hvd

    hvd.init()
    torch.cuda.set_device(hvd.local_rank())
    torch.manual_seed(0)
    cpu_model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    ).double()
    gpu_model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    ).double().cuda()
    gpu_model.load_state_dict(cpu_model.state_dict())
    inputs = torch.randn(8, 16, dtype=torch.float64)
    targets = torch.randn(8, 4, dtype=torch.float64)

    cpu_optimizer = torch.optim.SGD(cpu_model.parameters(), lr=0.1)
    torch.nn.functional.mse_loss(cpu_model(inputs), targets).backward()
    cpu_optimizer.step()

    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(gpu_model.parameters(), lr=0.1),
        named_parameters=gpu_model.named_parameters(),
    )
    hvd.broadcast_parameters(gpu_model.state_dict(), root_rank=0)
    torch.nn.functional.mse_loss(gpu_model(inputs.cuda()), targets.cuda()).backward()
    optimizer.step()

    reduced = hvd.allreduce(torch.arange(1000, dtype=torch.float32, device="cuda"), op=hvd.Sum)
    if not torch.equal(reduced.cpu(), torch.arange(1000, dtype=torch.float32)):
        print("gpu_smoke_step: a one-rank NCCL allreduce changed its input", file=sys.stderr)
        return 1
    for (name, cpu), gpu in zip(cpu_model.state_dict().items(), gpu_model.state_dict().values()):
        if not torch.allclose(cpu, gpu.cpu(), rtol=1e-12, atol=1e-12):
            error = (cpu - gpu.cpu()).abs().max().item()
            print(f"gpu_smoke_step: {name} differs from the CPU step by {error:g}",
                  file=sys.stderr)
            return 1
    hvd.shutdown()
    print("gpu_smoke_step: one NCCL training step matches the CPU step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
