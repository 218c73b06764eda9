"""Parts 3 to 6 of ``benchmarks/gpu_check.py``: the engine's collectives, stream ordering,
DistributedOptimizer and the Bagua algorithms on CUDA tensors, each against a CPU oracle.

Run by the check under ``torchrun --standalone --nproc_per_node=1`` (gloo control plane),
once as it is (a job of one rank takes the identity fast path) and once with
BAGUAHVD_NCCL_SINGLE_RANK=1 (the same collectives through a one-rank NCCL communicator)::

    torchrun --standalone --nproc_per_node=1 benchmarks/gpu_check_engine.py \\
        --part collectives --result out.json

With one rank every reduction is the identity, so the allreduces and reducescatters also
run with pre- and postscale factors: the oracle is ``prescale * postscale * x`` computed in
float64 and rounded once.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from typing import Any

import torch
from gpu_check_common import (
    Recorder,
    WorkerArgs,
    compare,
    finite,
    needs_cuda,
    require,
    run_worker,
    sleep_cycles_per_ms,
    tolerance,
)

import baguahvd.torch as hvd
from baguahvd.torch import algorithms

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SCALES = ((1.0, 1.0), (2.0, 0.5), (0.5, 3.0), (0.1, 1.0))
"""(prescale, postscale) pairs: none, exact powers of two, and one that rounds."""


def ramp(count: int, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
    """Small integers 1..7 on the CPU, exact in every dtype."""
    return ((torch.arange(count) + offset) % 7 + 1).to(dtype)


def scaled(x: torch.Tensor, pre: float, post: float) -> torch.Tensor:
    """The oracle of a one-rank reduction with scale factors: in float64, rounded once."""
    return (x.double() * pre * post).to(x.dtype)


def short(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# -- part 3: collectives -------------------------------------------------------------------


def collectives(rec: Recorder, args: WorkerArgs) -> None:
    """Every collective on ``args.device`` against its CPU oracle, fp32/fp16/bf16."""
    device = args.device
    rec.data["size"] = hvd.size()
    for dtype in DTYPES:
        name = short(dtype)
        for op, op_name in ((hvd.Sum, "sum"), (hvd.Average, "average")):
            for pre, post in SCALES:
                def allreduce(op: int = op, pre: float = pre, post: float = post,
                              dtype: torch.dtype = dtype) -> str:
                    x = ramp(1003, dtype)
                    got = hvd.allreduce(x.to(device), op=op, prescale_factor=pre,
                                        postscale_factor=post)
                    require(got.device == x.to(device).device, f"result on {got.device}")
                    return compare(got, scaled(x, pre, post))

                rec.check(f"allreduce.{name}.{op_name}.pre{pre:g}.post{post:g}", allreduce)

        def in_place(dtype: torch.dtype = dtype) -> str:
            x = ramp(517, dtype).to(device)
            pointer = x.data_ptr()
            out = hvd.allreduce_(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25)
            require(out.data_ptr() == pointer and x.data_ptr() == pointer,
                    "allreduce_ did not reduce in place")
            return compare(x, scaled(ramp(517, dtype), 2.0, 0.25))

        rec.check(f"allreduce_.{name}", in_place)

        def fused(dtype: torch.dtype = dtype) -> str:
            counts = (1, 7, 1000, 3, 65536, 5)
            inputs = [ramp(c, dtype, i) for i, c in enumerate(counts)]
            handles = [hvd.allreduce_async(x.to(device), op=hvd.Average, name=f"fused.{i}",
                                           prescale_factor=0.5, postscale_factor=4.0)
                       for i, x in enumerate(inputs)]
            for x, handle in zip(inputs, handles):
                compare(hvd.synchronize(handle), scaled(x, 0.5, 4.0))
            return f"{len(counts)} asynchronous allreduces in flight together"

        rec.check(f"fused_async.{name}", fused)

        for op, op_name in ((hvd.Sum, "sum"), (hvd.Average, "average")):
            def grouped(op: int = op, dtype: torch.dtype = dtype) -> str:
                inputs = [ramp(c, dtype, i) for i, c in enumerate((3, 1025, 1, 40000))]
                got = hvd.grouped_allreduce([x.to(device) for x in inputs], op=op,
                                            prescale_factor=2.0, postscale_factor=1.5)
                require(len(got) == len(inputs), f"{len(got)} results for {len(inputs)}")
                return "; ".join(compare(g, scaled(x, 2.0, 1.5)) for g, x in zip(got, inputs))

            rec.check(f"grouped_allreduce.{name}.{op_name}", grouped)

        def grouped_in_place(dtype: torch.dtype = dtype) -> str:
            inputs = [ramp(c, dtype, i).to(device) for i, c in enumerate((9, 300))]
            hvd.grouped_allreduce_(inputs, op=hvd.Sum, postscale_factor=3.0)
            return "; ".join(compare(x, scaled(ramp(c, dtype, i), 1.0, 3.0))
                             for i, (x, c) in enumerate(zip(inputs, (9, 300))))

        rec.check(f"grouped_allreduce_.{name}", grouped_in_place)

        def allgather(dtype: torch.dtype = dtype) -> str:
            x = ramp(5 * 6, dtype).reshape(5, 6)
            return compare(hvd.allgather(x.to(device)), x, tol=0)

        rec.check(f"allgather.{name}", allgather)

        def grouped_allgather(dtype: torch.dtype = dtype) -> str:
            inputs = [ramp(4 * 3, dtype).reshape(4, 3), ramp(7, dtype, 2).reshape(7, 1)]
            got = hvd.grouped_allgather([x.to(device) for x in inputs])
            return "; ".join(compare(g, x, tol=0) for g, x in zip(got, inputs))

        rec.check(f"grouped_allgather.{name}", grouped_allgather)

        def alltoall(dtype: torch.dtype = dtype) -> str:
            x = ramp(8 * 2, dtype).reshape(8, 2)
            got, received = hvd.alltoall(x.to(device), splits=[8])
            require(received.tolist() == [8], f"received splits {received.tolist()}")
            return compare(got, x, tol=0)

        rec.check(f"alltoall.{name}", alltoall)

        for op, op_name in ((hvd.Sum, "sum"), (hvd.Average, "average")):
            def reducescatter(op: int = op, dtype: torch.dtype = dtype) -> str:
                x = ramp(7 * 3, dtype).reshape(7, 3)
                got = hvd.reducescatter(x.to(device), op=op, prescale_factor=0.5,
                                        postscale_factor=3.0)
                return compare(got, scaled(x, 0.5, 3.0))

            rec.check(f"reducescatter.{name}.{op_name}", reducescatter)

        def grouped_reducescatter(dtype: torch.dtype = dtype) -> str:
            inputs = [ramp(6, dtype).reshape(3, 2), ramp(10, dtype, 3)]
            got = hvd.grouped_reducescatter([x.to(device) for x in inputs], op=hvd.Sum,
                                            prescale_factor=2.0)
            return "; ".join(compare(g, scaled(x, 2.0, 1.0)) for g, x in zip(got, inputs))

        rec.check(f"grouped_reducescatter.{name}", grouped_reducescatter)

        def broadcast(dtype: torch.dtype = dtype) -> str:
            x = ramp(33, dtype, 4)
            result = compare(hvd.broadcast(x.to(device), root_rank=0), x, tol=0)
            y = x.to(device)
            hvd.broadcast_(y, root_rank=0)
            return f"{result}; in place {compare(y, x, tol=0)}"

        rec.check(f"broadcast.{name}", broadcast)

    for dtype in (torch.float64, torch.int32, torch.int64):
        def other_types(dtype: torch.dtype = dtype) -> str:
            x = ramp(101, dtype)
            got = hvd.allreduce(x.to(device), op=hvd.Average, postscale_factor=1.0)
            summed = hvd.allreduce(x.to(device), op=hvd.Sum)
            return f"average {compare(got, x, tol=0)}; sum {compare(summed, x, tol=0)}"

        rec.check(f"allreduce.{short(dtype)}", other_types)

    def against_cpu_path() -> str:
        # The same calls on a CPU tensor: both paths must give one answer.
        x = torch.randn(4097, generator=torch.Generator().manual_seed(5))
        cpu = hvd.allreduce(x, op=hvd.Average, prescale_factor=0.3, postscale_factor=1.7)
        gpu = hvd.allreduce(x.to(device), op=hvd.Average, prescale_factor=0.3,
                            postscale_factor=1.7)
        return compare(gpu, cpu, tol=tolerance(torch.float32))

    rec.check("allreduce.matches_cpu_path", against_cpu_path)


# -- part 4: stream ordering ----------------------------------------------------------------

DELAY_MS = 200.0
"""How long the producer's stream is held before it writes: far longer than the engine
takes to launch a collective, so a collective that does not wait reads the old value."""


def stream_order(rec: Recorder, args: WorkerArgs) -> None:
    """A producer on a side stream, delayed by ``torch.cuda._sleep``, writes a tensor; a
    collective of it is submitted from that stream. The result must hold what the producer
    wrote, read on the side stream and on the default stream alike."""
    device = args.device
    if device.type != "cuda":
        rec.check("calibrate", lambda: needs_cuda(device))
        return
    cycles: list[float] = []

    def calibrate() -> str:
        cycles.append(sleep_cycles_per_ms(device))
        return f"{cycles[0]:.4g} cycles per ms"

    if not rec.check("calibrate", calibrate):
        return
    delay = int(DELAY_MS * cycles[0])
    side = torch.cuda.Stream(device)

    Op = Callable[[torch.Tensor], list[torch.Tensor]]
    ops: dict[str, Op] = {
        "allreduce": lambda t: [hvd.allreduce(t, op=hvd.Sum)],
        "allreduce_": lambda t: [hvd.allreduce_(t, op=hvd.Sum)],
        "allreduce_async": lambda t: [hvd.synchronize(hvd.allreduce_async(t, op=hvd.Sum))],
        "grouped_allreduce": lambda t: hvd.grouped_allreduce([t, t[: t.numel() // 2]],
                                                             op=hvd.Sum),
        "allgather": lambda t: [hvd.allgather(t)],
        "broadcast_": lambda t: [hvd.broadcast_(t, root_rank=0)],
        "alltoall": lambda t: [hvd.alltoall(t)],
        "reducescatter": lambda t: [hvd.reducescatter(t, op=hvd.Sum)],
    }
    for index, (name, op) in enumerate(ops.items()):
        for reader in ("side", "default"):
            value = float(index * 2 + (reader == "default") + 2)

            def body(op: Op = op, value: float = value, reader: str = reader) -> str:
                tensor = torch.zeros(1 << 20, device=device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    torch.cuda._sleep(delay)
                    tensor.fill_(value)
                    results = op(tensor)
                    if reader == "side":
                        seen = [r.cpu() for r in results]
                if reader == "default":
                    # The documented contract: once the call returned, any stream may read.
                    seen = [r.cpu() for r in results]
                torch.cuda.synchronize(device)
                for got in seen:
                    wrong = int((got != value).sum())
                    require(wrong == 0, (
                        f"{wrong} of {got.numel()} elements read on the {reader} stream are "
                        f"not the producer's {value:g} (min {float(got.min()):g}): the "
                        "collective read its input before the producer wrote it, or returned "
                        "before its result was complete"))
                return f"read on the {reader} stream after a {DELAY_MS:g} ms producer"

            rec.check(f"{name}.read_on_{reader}_stream", body)


# -- part 5: DistributedOptimizer --------------------------------------------------------------


def mlp(dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
        torch.nn.Linear(64, 8),
    ).to(dtype)


def batches(dtype: torch.dtype, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 32, generator=generator, dtype=dtype),
             torch.randn(16, 8, generator=generator, dtype=dtype)) for _ in range(count)]


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
          data: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device,
          passes_per_step: int = 1, round_grads: torch.dtype | None = None) -> list[float]:
    """Trains on ``data``, ``passes_per_step`` backward passes per ``step()``; returns
    the losses. ``round_grads`` rounds the gradients through a dtype first (the oracle of
    a compressed allreduce)."""
    losses = []
    for first in range(0, len(data), passes_per_step):
        optimizer.zero_grad()
        for inputs, targets in data[first:first + passes_per_step]:
            loss = torch.nn.functional.mse_loss(model(inputs.to(device)), targets.to(device))
            loss.backward()
            losses.append(float(loss))
        if round_grads is not None:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.copy_(p.grad.to(round_grads).to(p.grad.dtype))
        optimizer.step()
    return losses


def same_parameters(gpu: torch.nn.Module, cpu: torch.nn.Module, tol: float) -> str:
    details = []
    for (name, expected), got in zip(cpu.state_dict().items(), gpu.state_dict().values()):
        try:
            details.append(compare(got, expected, tol))
        except AssertionError as exc:
            raise type(exc)(f"{name}: {exc}") from None
    return f"{len(details)} tensors, {details[-1] if details else ''}"


def optimizer(rec: Recorder, args: WorkerArgs) -> None:
    """DistributedOptimizer steps on ``args.device`` against plain torch steps on the CPU."""
    device = args.device
    Maker = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
    variants: list[tuple[str, torch.dtype, Maker, dict[str, Any], float]] = [
        ("sgd_momentum.float64", torch.float64,
         lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), {}, 1e-10),
        ("sgd.float32", torch.float32, lambda p: torch.optim.SGD(p, lr=0.1), {}, 1e-5),
        ("adam.float32", torch.float32, lambda p: torch.optim.Adam(p, lr=1e-3), {}, 1e-5),
        ("op_sum.float64", torch.float64, lambda p: torch.optim.SGD(p, lr=0.05),
         {"op": hvd.Sum}, 1e-10),
        ("predivide.float64", torch.float64, lambda p: torch.optim.SGD(p, lr=0.05),
         {"gradient_predivide_factor": 2.0}, 1e-10),
        ("groups_2.float64", torch.float64, lambda p: torch.optim.SGD(p, lr=0.05),
         {"groups": 2}, 1e-10),
        ("backward_passes_per_step_2.float64", torch.float64,
         lambda p: torch.optim.SGD(p, lr=0.05), {"backward_passes_per_step": 2}, 1e-10),
        ("compression_fp16.float32", torch.float32, lambda p: torch.optim.SGD(p, lr=0.1),
         {"compression": hvd.Compression.fp16}, 2e-3),
    ]
    for name, dtype, make, options, tol in variants:
        def body(dtype: torch.dtype = dtype, make: Maker = make,
                 options: dict[str, Any] = options, tol: float = tol) -> str:
            passes = int(options.get("backward_passes_per_step", 1))
            data = batches(dtype, 3 * passes)
            cpu_model = mlp(dtype)
            gpu_model = copy.deepcopy(cpu_model).to(device)
            rounding = torch.float16 if "compression" in options else None
            expected = train(cpu_model, make(list(cpu_model.parameters())), data,
                             torch.device("cpu"), passes, rounding)
            wrapped = hvd.DistributedOptimizer(
                make(list(gpu_model.parameters())),
                named_parameters=gpu_model.named_parameters(), **options,
            )
            hvd.broadcast_parameters(gpu_model.state_dict(), root_rank=0)
            losses = train(gpu_model, wrapped, data, device, passes)
            require(finite(losses), f"losses {losses}")
            compare(torch.tensor(losses, dtype=torch.float64),
                    torch.tensor(expected, dtype=torch.float64), max(tol, 1e-6))
            return f"{len(losses)} backward passes; parameters " + same_parameters(
                gpu_model, cpu_model, tol)

        rec.check(name, body)

    def broadcast_state() -> str:
        model = mlp(torch.float32).to(device)
        base = torch.optim.Adam(model.parameters(), lr=1e-3)
        train(model, base, batches(torch.float32, 1), device)
        before = copy.deepcopy(base.state_dict())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(base, root_rank=0)
        after = base.state_dict()
        for key, state in before["state"].items():
            for field, value in state.items():
                if isinstance(value, torch.Tensor):
                    compare(after["state"][key][field], value.cpu(), tol=0)
        return "Adam state of CUDA parameters unchanged by a broadcast from rank 0"

    rec.check("broadcast_optimizer_state", broadcast_state)


# -- part 6: the Bagua algorithms --------------------------------------------------------------

ALGORITHM_STEPS = 4


def algorithm_optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if name == "qadam":
        # Its warmup ends within the steps, so the compressed stage runs too.
        base: torch.optim.Optimizer = algorithms.QAdamOptimizer(
            model.parameters(), lr=1e-3, warmup_steps=2)
    else:
        base = torch.optim.SGD(model.parameters(), lr=0.1)
    return hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                    algorithm=name)


def bagua_algorithms(rec: Recorder, args: WorkerArgs) -> None:
    """Each registered algorithm trains a few steps on ``args.device``: losses must be
    finite, and the parameters close to the same algorithm's run on the CPU."""
    device = args.device
    names = algorithms.known_algorithms()
    rec.data["algorithms"] = names
    data = batches(torch.float32, ALGORITHM_STEPS)
    for name in names:
        def body(name: str = name) -> str:
            model = mlp(torch.float32).to(device)
            wrapped = algorithm_optimizer(name, model)
            losses = train(model, wrapped, data, device)
            require(finite(losses), f"losses {losses}")
            if device.type == "cpu":
                return f"losses {[round(x, 5) for x in losses]}"
            cpu_model = mlp(torch.float32)
            cpu_losses = train(cpu_model, algorithm_optimizer(name, cpu_model), data,
                               torch.device("cpu"))
            require(finite(cpu_losses), f"CPU losses {cpu_losses}")
            return (f"losses {[round(x, 5) for x in losses]}; parameters vs the CPU run: "
                    + same_parameters(model, cpu_model, 1e-4))

        rec.check(name, body)


PARTS = {
    "collectives": collectives,
    "stream_order": stream_order,
    "optimizer": optimizer,
    "algorithms": bagua_algorithms,
}

if __name__ == "__main__":
    sys.exit(run_worker(PARTS, engine=True))
