"""Part 9 of ``benchmarks/gpu_check.py`` (optional): two ranks on one GPU, and collectives
that must end at their deadline instead of hanging.

Two ranks share the one GPU through ``torchrun --standalone --nproc_per_node=2``. NCCL
refuses two ranks of one communicator on one device of one host, so each rank names a host
of its own (``NCCL_HOSTID``, set here from the rank before CuPy loads NCCL), and NCCL talks
over its socket transport on the loopback interface (the check sets NCCL_P2P_DISABLE=1,
NCCL_SHM_DISABLE=1 and NCCL_SOCKET_IFNAME=lo). Parts:

* ``two_ranks``: allreduce (Sum, Average, grouped), allgather and broadcast of CUDA tensors
  across both ranks, against values computed from the rank;
* ``two_rank_algorithms``: every Bagua algorithm trains on both ranks, each rank on data of
  its own; the parameters must match the same algorithm's run on CPU tensors (gloo) of the
  same two ranks (async model averaging, whose rounds depend on timing: finite losses);
* ``skipped_collective``: rank 1 skips a collective rank 0 runs (and goes on to another);
  the engine's stall inspector must end both at HOROVOD_STALL_SHUTDOWN_TIME_SECONDS with
  ``StallError`` (a skipped collective is never agreed, so it never reaches NCCL);
* ``device_stall``: both ranks submit the collective, but rank 1's input is still being
  produced on a stream held by ``torch.cuda._sleep`` well past BAGUAHVD_NCCL_TIMEOUT_SECONDS;
  rank 0 waits inside NCCL and must get ``NCCLTimeoutError`` at the deadline. Rank 1's
  collective is stuck behind its producer: it times out too, or, when rank 0's report comes
  first, gets ``PeerFailureError`` naming rank 0's ``NCCLTimeoutError`` (both end the job);
* ``one_rank_deadline`` (one rank, BAGUAHVD_NCCL_SINGLE_RANK=1): the same held stream under
  a one-rank NCCL communicator, which must time out the same way, and before the held
  producer ends (aborting the communicator waits for the device; the error must not). A
  warm-up collective creates the communicator first: creating it waits for the device too,
  so a communicator created behind the held stream would time out in ncclCommInitRank.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

# Before anything loads NCCL: a host of its own per rank (see the module docstring).
if "NCCL_HOSTID" in os.environ and os.environ.get("LOCAL_RANK"):
    os.environ["NCCL_HOSTID"] = f"{os.environ['NCCL_HOSTID']}-{os.environ['LOCAL_RANK']}"

import torch  # noqa: E402
from gpu_check_common import (  # noqa: E402
    Recorder,
    SkipCheck,
    WorkerArgs,
    compare,
    describe,
    finite,
    needs_cuda,
    require,
    run_worker,
    sleep_cycles_per_ms,
)
from gpu_check_engine import (  # noqa: E402
    ALGORITHM_STEPS,
    algorithm_optimizer,
    batches,
    mlp,
    same_parameters,
    train,
)

import baguahvd.torch as hvd  # noqa: E402
from baguahvd.torch import algorithms  # noqa: E402

SLACK_S = 15.0
"""How much later than its deadline a stalled collective may end and still pass (the
engine polls, aborting NCCL takes a moment, and two processes share one GPU)."""


def ramp(rank: int, count: int, device: torch.device) -> torch.Tensor:
    return ((torch.arange(count) + 3 * rank) % 7 + 1).float().to(device)


def two_ranks(rec: Recorder, args: WorkerArgs) -> None:
    device, rank, size = args.device, hvd.rank(), hvd.size()
    rec.data["nccl_hostid"] = os.environ.get("NCCL_HOSTID")

    def world() -> str:
        require(size == 2, f"{size} ranks; this part needs two")
        return f"rank {rank} of {size} on {device}"

    if not rec.check("two_ranks", world):
        return
    everyone = torch.stack([ramp(r, 1001, torch.device("cpu")) for r in range(size)])

    def allreduce() -> str:
        summed = hvd.allreduce(ramp(rank, 1001, device), op=hvd.Sum, name="two.sum")
        averaged = hvd.allreduce(ramp(rank, 1001, device), op=hvd.Average, name="two.avg",
                                 postscale_factor=2.0)
        return (f"sum {compare(summed, everyone.sum(0))}; average "
                f"{compare(averaged, everyone.sum(0) / size * 2.0)}")

    rec.check("allreduce", allreduce)

    def grouped() -> str:
        counts = (1, 7, 100_000)
        got = hvd.grouped_allreduce([ramp(rank, c, device) for c in counts], op=hvd.Sum,
                                    name="two.grouped")
        return "; ".join(
            compare(g, torch.stack([ramp(r, c, torch.device("cpu")) for r in range(size)]).sum(0))
            for g, c in zip(got, counts)
        )

    rec.check("grouped_allreduce", grouped)

    def fused() -> str:
        # Submitted together, so the engine fuses them into few NCCL calls.
        counts = [1 + 997 * i for i in range(24)]
        handles = [hvd.allreduce_async(ramp(rank + i, c, device), op=hvd.Sum,
                                       name=f"two.fused.{i}") for i, c in enumerate(counts)]
        for i, (c, handle) in enumerate(zip(counts, handles)):
            expected = torch.stack([ramp(r + i, c, torch.device("cpu"))
                                    for r in range(size)]).sum(0)
            compare(hvd.synchronize(handle), expected)
        return f"{len(counts)} asynchronous allreduces"

    rec.check("fused_async", fused)

    def half() -> str:
        got = hvd.allreduce(ramp(rank, 64, device).half(), op=hvd.Sum, name="two.half")
        return compare(got, everyone[:, :64].sum(0).half())

    rec.check("allreduce.float16", half)

    def allgather() -> str:
        got = hvd.allgather(ramp(rank, 3 * (rank + 1), device).reshape(rank + 1, 3),
                            name="two.allgather")
        expected = torch.cat([ramp(r, 3 * (r + 1), torch.device("cpu")).reshape(r + 1, 3)
                              for r in range(size)])
        return compare(got, expected, tol=0)

    rec.check("allgather", allgather)

    def broadcast() -> str:
        got = hvd.broadcast(ramp(rank, 17, device), root_rank=1, name="two.broadcast")
        return compare(got, ramp(1, 17, torch.device("cpu")), tol=0)

    rec.check("broadcast", broadcast)


def two_rank_algorithms(rec: Recorder, args: WorkerArgs) -> None:
    device, rank = args.device, hvd.rank()
    if not rec.check("two_ranks", lambda: require(hvd.size() == 2, "this part needs two ranks")
                     or f"rank {rank} of 2 on {device}"):
        return
    # Each rank its own inputs, so that what the ranks exchange matters.
    data = [(inputs * (1 + rank), targets) for inputs, targets in
            batches(torch.float32, ALGORITHM_STEPS)]
    names = algorithms.known_algorithms()
    rec.data["algorithms"] = names

    def run(name: str, on: torch.device) -> tuple[torch.nn.Module, list[float]]:
        model = mlp(torch.float32).to(on)
        wrapped = algorithm_optimizer(name, model)
        losses = train(model, wrapped, data, on)
        impl = wrapped.algorithm_impl  # type: ignore[attr-defined]
        if hasattr(impl, "abort"):  # async model averaging: stop its thread
            impl.abort()
        require(finite(losses), f"losses on {on}: {losses}")
        return model, losses

    for name in names:
        def body(name: str = name) -> str:
            model, losses = run(name, device)
            shown = f"losses {[round(x, 5) for x in losses]}"
            if name == "async" or device.type == "cpu":
                return shown
            cpu_model, _ = run(name, torch.device("cpu"))
            return f"{shown}; parameters vs the CPU run: " + \
                same_parameters(model, cpu_model, 1e-4)

        rec.check(name, body)


def _expect_error(rec: Recorder, name: str, call: Callable[[], object], expected: str,
                  deadline_s: float, started: float, from_peer: bool = False) -> None:
    """Records the check ``name``: ``call()`` must raise ``expected`` (a class name) within
    ``deadline_s`` + :data:`SLACK_S` of ``started``; with ``from_peer``, a PeerFailureError
    whose message names ``expected`` (a peer's report of it) passes too."""

    def body() -> str:
        try:
            result = call()
        except Exception as exc:  # noqa: BLE001 - which one is the point of the check
            took = time.monotonic() - started
            rec.data[f"{name}.error"] = describe(exc)
            rec.data[f"{name}.seconds"] = round(took, 2)
            names = [cls.__name__ for cls in type(exc).__mro__]
            reported = from_peer and "PeerFailureError" in names and expected in str(exc)
            require(expected in names or reported,
                    f"ended after {took:.1f} s with {describe(exc)}, not {expected}")
            require(took <= deadline_s + SLACK_S,
                    f"{expected} came after {took:.1f} s; the deadline was {deadline_s:g} s")
            what = f"{type(exc).__name__} ({expected} on a peer)" if reported else \
                type(exc).__name__
            return f"{what} after {took:.1f} s (deadline {deadline_s:g} s)"
        took = time.monotonic() - started
        raise AssertionError(f"no error: the collective returned after {took:.1f} s "
                             f"({str(result)[:200]})")

    rec.check(name, body)


def _setting(name: str) -> float:
    value = os.environ.get(name)
    if value is None:
        raise SkipCheck(f"{name} is not set; the check sets it")
    return float(value)


def skipped_collective(rec: Recorder, args: WorkerArgs) -> None:
    device, rank = args.device, hvd.rank()
    if not rec.check("warm_up", lambda: compare(
            hvd.allreduce(torch.ones(4, device=device), op=hvd.Sum, name="skip.warm_up"),
            torch.full((4,), float(hvd.size())))):
        return
    deadline = _setting("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS")
    started = time.monotonic()
    # Rank 1 skips "skip.stalled" and goes on to the next collective, as a rank on another
    # code path would: neither collective is ever agreed.
    name = "skip.stalled" if rank == 0 else "skip.next"
    _expect_error(rec, name,
                  lambda: hvd.allreduce(torch.ones(4, device=device), name=name),
                  "StallError", deadline, started)


def _held_stream_collective(rec: Recorder, args: WorkerArgs, hold: bool, check: str,
                            from_peer: bool = False) -> None:
    """Submits an allreduce whose input is produced on a stream that ``torch.cuda._sleep``
    holds for three times the NCCL timeout (when ``hold``); expects NCCLTimeoutError (or,
    with ``from_peer``, a peer's report of one)."""
    device = args.device
    if device.type != "cuda":
        rec.check(check, lambda: needs_cuda(device))
        return
    timeout = _setting("BAGUAHVD_NCCL_TIMEOUT_SECONDS")
    cycles = sleep_cycles_per_ms(device)
    rec.data["hold_s"] = 3 * timeout if hold else 0.0
    side = torch.cuda.Stream(device)
    tensor = torch.zeros(1024, device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    started = time.monotonic()
    with torch.cuda.stream(side):
        if hold:
            torch.cuda._sleep(int(3 * timeout * 1e3 * cycles))
        tensor.fill_(1.0)
        _expect_error(rec, check, lambda: hvd.allreduce(tensor, op=hvd.Sum, name="held"),
                      "NCCLTimeoutError", timeout, started, from_peer=from_peer)


def _warm_up(rec: Recorder, args: WorkerArgs) -> bool:
    """A first collective, which creates the NCCL communicator before anything holds the
    device."""
    return rec.check("warm_up", lambda: compare(
        hvd.allreduce(torch.ones(4, device=args.device), op=hvd.Sum, name="held.warm_up"),
        torch.full((4,), float(hvd.size()))))


def device_stall(rec: Recorder, args: WorkerArgs) -> None:
    if _warm_up(rec, args):
        held = hvd.rank() == 1
        _held_stream_collective(rec, args, hold=held, check="held_collective", from_peer=held)


def one_rank_deadline(rec: Recorder, args: WorkerArgs) -> None:
    def one_rank() -> str:
        require(hvd.size() == 1, f"{hvd.size()} ranks; this part needs one")
        require(os.environ.get("BAGUAHVD_NCCL_SINGLE_RANK") == "1",
                "needs BAGUAHVD_NCCL_SINGLE_RANK=1 (the check sets it)")
        return "one rank through a one-rank NCCL communicator"

    if rec.check("setup", one_rank) and _warm_up(rec, args):
        _held_stream_collective(rec, args, hold=True, check="held_collective")

        def before_the_producer_ends() -> str:
            took, hold = rec.data.get("held_collective.seconds"), rec.data.get("hold_s")
            if took is None or not hold:
                raise SkipCheck("no held collective ended with an error")
            # The abort waits for the device; the error must not wait for the abort.
            require(took < hold, f"the error came after {took} s, when the {hold} s "
                                 "producer had ended: it waited for the NCCL abort")
            return f"the error came after {took} s, the producer runs {hold} s"

        rec.check("error_before_the_producer_ends", before_the_producer_ends)


PARTS = {
    "two_ranks": two_ranks,
    "two_rank_algorithms": two_rank_algorithms,
    "skipped_collective": skipped_collective,
    "device_stall": device_stall,
    "one_rank_deadline": one_rank_deadline,
}

if __name__ == "__main__":
    sys.exit(run_worker(PARTS, engine=True))
