"""Step time and bytes sent per step of every communication algorithm, in one run.

Run under MPI (two ranks)::

    mpirun -np 2 python benchmarks/algorithms.py                       # one machine
    benchmarks/emulated_cluster.sh --rate 1gbit --rate 100mbit -- \\
        python benchmarks/algorithms.py --warmup 2 --steps 3           # 2 emulated hosts

Methodology and measured results: benchmarks/README.md.

Every algorithm trains the same MLP (1024-2048-2048-1024-10, 8.4 M fp32 parameters, 33.6 MB
= 32.1 MiB of gradients) with Adam on a fixed synthetic batch, through
``hvd.DistributedOptimizer``: Horovod's default path (``algorithm=None``), ``op=hvd.Adasum``,
PyTorch's own ``DistributedDataParallel`` over gloo (the ``ddp`` row: the same model and Adam,
gradients bucketed and allreduced by gloo during backward), and each Bagua algorithm under its
registered name with Bagua's defaults (``hierarchical=True``
where Bagua has it; with one rank per host that is the same traffic as flat). ``qadam`` wraps a
``QAdamOptimizer`` whose warmup ends inside the benchmark's warmup, so the timed steps are the
compressed stage; ``async`` keeps its default ``sync_interval_ms=500`` and is timed for at
least ``--async-seconds`` so that several averaging rounds fall in the window. On one machine
``--flat`` (the default there) adds ``hierarchical=False`` variants, because on one host the
hierarchical variants reduce in full precision inside the node and compress nothing.

Reported per algorithm:

- step time: each rank's median over its timed steps (forward, backward, ``step()``), the
  slowest rank's median in the table. The algorithms run in ``--repeats`` rounds (every
  other round in reverse order), each round with a fresh model, optimizer and warmup, and the
  median pools the timed steps of all rounds: load from other processes that comes and goes
  during the run then falls on every algorithm alike;
- ratios: gradient_allreduce's step time / this step time (>1 = faster), and the same against
  Horovod's default path;
- bytes/step, algorithmic: what the collectives this algorithm issued send per rank, by the
  textbook formulas (allreduce 2(n-1)/n x bytes, alltoall the rows sent to other ranks,
  allgather (n-1)/n x output, broadcast (n-1) x bytes at the root), counted by wrapping
  ``baguahvd.backends.mpi.MPICommunicator``; engine negotiation and protocol headers excluded;
- bytes/step, measured (only when ``EMU_NET_IF`` names the rank's network interface, as on
  the emulated cluster): the interface's ``tx_bytes`` counter over the timed steps, i.e. what
  really went on the wire, headers and negotiation included.

``python benchmarks/algorithms.py report RESULT.json ... --markdown OUT.md --png OUT.png``
renders the saved results (``--json-dir``) as a markdown table and a plot (needs matplotlib).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

MODEL_DIMS = (1024, 2048, 2048, 1024, 10)
DEFAULT_ALGORITHMS = (
    "local", "horovod", "horovod@mpi", "horovod@gloo", "ddp", "gradient_allreduce",
    "gradient_allreduce@mpi", "bytegrad", "bytegrad@mpi", "decentralized",
    "low_precision_decentralized", "async", "qadam", "adasum", "auto",
)
DATA_PLANES = ("mpi", "gloo")
"""``<row>@mpi`` / ``<row>@gloo``: that row with BAGUAHVD_CPU_BACKEND forced (the row
without a suffix runs baguahvd's default, ``auto``)."""
try:  # optional reference: real Horovod, when installed
    import horovod.torch as real_horovod  # type: ignore[import-not-found]
except Exception:  # noqa: BLE001 - any import failure means "not available"
    real_horovod = None

FOREIGN = ("local", "ddp", "horovod_real")
"""Rows that run without baguahvd: it is shut down meanwhile, so that its engine thread's
idle cycles do not share the cores and the link with them."""

HIERARCHICAL = ("bytegrad", "decentralized", "low_precision_decentralized", "qadam")
"""Algorithms whose Bagua default is hierarchical=True."""


# -- byte accounting ----------------------------------------------------------------------


class ByteCounter:
    """Bytes this rank's collectives send, by the formulas of the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sent = 0.0

    def add(self, nbytes: float) -> None:
        with self._lock:
            self.sent += nbytes


COUNTER = ByteCounter()


def install_byte_counter() -> None:
    """Wraps the collectives of baguahvd's MPI and gloo communicators (engine and async
    loop)."""
    import torch

    from baguahvd.backends import gloo as gloo_backend
    from baguahvd.backends import mpi as backend

    classes = (backend.MPICommunicator, gloo_backend.GlooCommunicator)

    def wire_bytes(t: torch.Tensor) -> int:
        # float16/bfloat16 reductions travel as float32 (see the backend's docstring).
        item = 4 if t.dtype in (torch.float16, torch.bfloat16) else t.element_size()
        return t.numel() * item

    def allreduce(self: Any, tensor_in: Any, tensor_out: Any, *_: Any) -> float:
        return 2 * (self.size - 1) / self.size * wire_bytes(tensor_out)

    def allgather(self: Any, tensor_in: Any, tensor_out: Any, counts: Sequence[int]) -> float:
        return (self.size - 1) / self.size * sum(counts) * tensor_out.element_size()

    def broadcast(self: Any, tensor: Any, root: int) -> float:
        return (self.size - 1) * tensor.numel() * tensor.element_size() if self.rank == root else 0

    def alltoall(self: Any, tensor_in: Any, send_counts: Sequence[int], *_: Any) -> float:
        item = tensor_in.element_size()
        return sum(c for j, c in enumerate(send_counts) if j != self.rank) * item

    def reduce_scatter(self: Any, tensor_in: Any, *_: Any) -> float:
        return (self.size - 1) / self.size * wire_bytes(tensor_in)

    def sendrecv(self: Any, tensor_out: Any, *_: Any) -> float:
        return tensor_out.numel() * tensor_out.element_size()

    formulas: dict[str, Callable[..., float]] = {
        "allreduce": allreduce, "allreduce_scaled": allreduce, "iallreduce": allreduce,
        "allgather": allgather,
        "broadcast": broadcast, "alltoall": alltoall, "reduce_scatter": reduce_scatter,
        "sendrecv": sendrecv,
    }
    for cls in classes:
        for name, formula in formulas.items():
            if cls is gloo_backend.GlooCommunicator and name == "reduce_scatter":
                continue  # an allreduce underneath, counted there
            original = getattr(cls, name)

            def wrapped(self: Any, *args: Any, _original: Any = original,
                        _formula: Callable[..., float] = formula, **kwargs: Any) -> Any:
                COUNTER.add(_formula(self, *args, **kwargs))
                return _original(self, *args, **kwargs)

            setattr(cls, name, wrapped)


def tx_bytes() -> int | None:
    """The tx byte counter of $EMU_NET_IF in this rank's network namespace, if set."""
    interface = os.environ.get("EMU_NET_IF")
    if not interface:
        return None
    with open(f"/sys/class/net/{interface}/statistics/tx_bytes") as f:
        return int(f.read())


# -- one algorithm --------------------------------------------------------------------------


def build_model() -> Any:
    import torch

    torch.manual_seed(0)  # the same weights on every rank
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(MODEL_DIMS, MODEL_DIMS[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(MODEL_DIMS) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def split_spec(spec: str) -> tuple[str, str, str]:
    """``name[:flat][@plane]`` -> (name, variant, data plane or "")."""
    rest, _, plane = spec.partition("@")
    name, _, variant = rest.partition(":")
    return name, variant, plane


def describe(spec: str, qadam_warmup: int, optimizer: str = "sgd") -> str:
    text = _describe(spec, qadam_warmup, optimizer)
    plane = split_spec(spec)[2]
    if plane:
        text += f"; BAGUAHVD_CPU_BACKEND={plane}"
    return text


def _describe(spec: str, qadam_warmup: int, optimizer: str) -> str:
    name, variant, _ = split_spec(spec)
    opt = "SGD (momentum 0.9)" if optimizer == "sgd" else "Adam"
    if name == "local":
        return f"plain {opt}, no DistributedOptimizer: compute only, no communication"
    if name == "horovod":
        return "DistributedOptimizer(opt) (Horovod's allreduce path, algorithm=None)"
    if name == "horovod_real":
        return "horovod.torch.DistributedOptimizer(opt) (Horovod itself)"
    if name == "ddp":
        return f"torch.nn.parallel.DistributedDataParallel over gloo (PyTorch's own), {opt}"
    if name == "adasum":
        return "DistributedOptimizer(opt, op=hvd.Adasum)"
    if name == "qadam":
        hier = "hierarchical=False" if variant == "flat" else "hierarchical=True"
        return f"QAdamAlgorithm({hier}) around QAdamOptimizer(warmup_steps={qadam_warmup})"
    if variant == "flat":
        return f'{name} with hierarchical=False'
    if name in HIERARCHICAL:
        return f'algorithm="{name}" (Bagua defaults: hierarchical=True)'
    if name == "async":
        return 'algorithm="async" (sync_interval_ms=500, warmup_steps=0)'
    if name == "auto":
        return 'algorithm="auto" (measures the link, picks among the synchronous ones)'
    return f'algorithm="{name}"'


def make_optimizer(spec: str, model: Any, hvd: Any, args: argparse.Namespace) -> Any:
    import torch

    from baguahvd import algorithms as alg

    name, variant, _ = split_spec(spec)
    flat = variant == "flat"
    named = list(model.named_parameters())
    if name == "qadam":
        qadam = alg.QAdamOptimizer(model.parameters(), lr=args.lr,
                                   warmup_steps=args.qadam_warmup)
        return hvd.DistributedOptimizer(qadam, named_parameters=named,
                                        algorithm=alg.QAdamAlgorithm(hierarchical=not flat))
    base: torch.optim.Optimizer
    if args.optimizer == "sgd":
        base = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    else:
        base = torch.optim.Adam(model.parameters(), lr=args.lr)
    if name in ("local", "ddp"):
        return base
    if name == "horovod":
        return hvd.DistributedOptimizer(base, named_parameters=named, algorithm=None)
    if name == "horovod_real":
        real_horovod.init()
        return real_horovod.DistributedOptimizer(base, named_parameters=named)
    if name == "adasum":
        return hvd.DistributedOptimizer(base, named_parameters=named, op=hvd.Adasum)
    if flat:
        objects = {
            "bytegrad": lambda: alg.ByteGradAlgorithm(hierarchical=False),
            "decentralized": lambda: alg.DecentralizedAlgorithm(hierarchical=False),
            "low_precision_decentralized":
                lambda: alg.LowPrecisionDecentralizedAlgorithm(hierarchical=False),
            "gradient_allreduce": lambda: alg.GradientAllReduceAlgorithm(hierarchical=False),
        }
        return hvd.DistributedOptimizer(base, named_parameters=named, algorithm=objects[name]())
    return hvd.DistributedOptimizer(base, named_parameters=named, algorithm=name)


def run_one(spec: str, hvd: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Warmup, timed steps; this rank's step times and byte counts."""
    import torch

    name = split_spec(spec)[0]
    model = build_model()
    if name == "ddp":
        # PyTorch's own data parallelism: gradient buckets allreduced by gloo during backward.
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = make_optimizer(spec, model, hvd, args)
    from mpi4py import MPI

    generator = torch.Generator().manual_seed(1 + MPI.COMM_WORLD.Get_rank())
    data = torch.randn(args.batch_size, MODEL_DIMS[0], generator=generator)
    target = torch.randint(0, MODEL_DIMS[-1], (args.batch_size,), generator=generator)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> float:
        start = time.perf_counter()
        opt.zero_grad()
        loss_fn(model(data), target).backward()
        opt.step()
        return time.perf_counter() - start

    for _ in range(args.warmup):
        step()
    impl = getattr(opt, "algorithm_impl", None)
    rounds0 = getattr(impl, "rounds", None)
    tx0, counted0 = tx_bytes(), COUNTER.sent
    window0, cpu0 = time.perf_counter(), time.process_time()
    times: list[float] = []
    is_async = name == "async"
    while len(times) < args.steps or (
        is_async and time.perf_counter() - window0 < args.async_seconds
    ):
        times.append(step())
    window = time.perf_counter() - window0
    cpu = time.process_time() - cpu0
    tx1, counted1 = tx_bytes(), COUNTER.sent
    rounds = None if rounds0 is None else getattr(impl, "rounds", 0) - rounds0
    choice = getattr(impl, "choice", None)
    steps = len(times)
    if is_async and impl is not None:
        impl.abort()  # collective: every rank stops averaging before the next algorithm
    close = getattr(opt, "close", None)
    if close is not None:
        close()
    return {
        "times": times,
        "steps": steps,
        "window_s": window,
        "cpu_per_step": cpu / steps,
        # gloo's traffic passes none of baguahvd's backends: the interface counters only.
        "counted_per_step": None if name == "ddp" else (counted1 - counted0) / steps,
        "tx_per_step": None if tx0 is None or tx1 is None else (tx1 - tx0) / steps,
        "async_rounds": rounds,
        "chosen": None if choice is None else choice.name,
        "data_plane": None if name in FOREIGN else data_plane(),
    }


def data_plane() -> str:
    """What baguahvd's CPU collectives run on now: ``mpi`` or ``gloo``."""
    from baguahvd.runtime.runtime import runtime

    transport = runtime.transport
    return "mpi" if transport is None or transport.value == "mpi" else "gloo"


def plane_label(row: dict[str, Any]) -> str:
    """What a result row's CPU collectives ran on, for the tables."""
    name = split_spec(row["algorithm"])[0]
    if name == "ddp":
        return "gloo"
    if name == "horovod_real":
        return "Horovod's MPI"
    if name == "local":
        return "none"
    return row.get("data_plane") or "mpi"


def use_data_plane(hvd: Any, plane: str) -> None:
    """Restarts baguahvd with BAGUAHVD_CPU_BACKEND=``plane`` (``""``: the default) when it
    runs with another setting (collective: every rank calls it for the same row)."""
    wanted = plane or "auto"
    if os.environ.get("BAGUAHVD_CPU_BACKEND", "auto") == wanted and hvd.is_initialized():
        return
    if hvd.is_initialized():
        hvd.shutdown()
    os.environ["BAGUAHVD_CPU_BACKEND"] = wanted
    hvd.init()


# -- driver ---------------------------------------------------------------------------------


def human_bytes(value: float | None) -> str:
    if value is None:
        return "–"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(value) < 1000 or unit == "GB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{value:.0f} B"
        value /= 1000
    return f"{value:.1f} GB"


def markdown_table(result: dict[str, Any]) -> str:
    measured = any(row["tx_per_step"] is not None for row in result["rows"])
    header = ["algorithm", "CPU data plane", "step time (s)", "speed-up vs gradient_allreduce",
              "speed-up vs Horovod path", "CPU s/step/rank", "bytes/step/rank (algorithmic)"]
    if measured:
        header.append("bytes/step/rank (measured tx)")
    header.append("timed steps")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in result["rows"]:
        name = f"`{row['algorithm']}`"
        if row.get("chosen"):
            name += f" (chose {', '.join(row['chosen'])})"
        cells = [
            name,
            plane_label(row),
            f"{row['step_s']:.3f}",
            f"{row['speedup_vs_allreduce']:.2f}x" if row["speedup_vs_allreduce"] else "–",
            f"{row['speedup_vs_horovod']:.2f}x" if row["speedup_vs_horovod"] else "–",
            f"{row['cpu_per_step']:.2f}",
            human_bytes(row["counted_per_step"]),
        ]
        if measured:
            cells.append(human_bytes(row["tx_per_step"]))
        steps = str(row["steps"])
        if row.get("async_rounds") is not None:
            steps += f" ({row['async_rounds']} averaging rounds)"
        cells.append(steps)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


SYNCHRONOUS = ("gradient_allreduce", "bytegrad")
"""What ``auto`` chooses among with SGD (qadam too with Adam): its target's reference."""


def target_lines(result: dict[str, Any]) -> list[str]:
    """Whether the step-time targets hold in ``result`` (emulated runs only)."""
    if not result.get("link"):
        return []
    floor = result.get("ring_floor_s")
    rows = {row["algorithm"]: row for row in result["rows"]}
    lines = []

    def step(name: str) -> float | None:
        row = rows.get(name)
        return None if row is None else float(row["step_s"])

    def verdict(ok: bool) -> str:
        return "met" if ok else "not met"

    default, ddp = step("horovod"), step("ddp")
    if default is not None and ddp is not None:
        lines.append(f"- default path (`horovod`) <= DDP: {default:.3f} s against "
                     f"{ddp:.3f} s = {default / ddp:.2f}x, {verdict(default <= ddp)}")
    real = step("horovod_real")
    if default is not None:
        if real is None:
            lines.append("- default path <= 0.8x Horovod: Horovod is not installed here")
        else:
            lines.append(f"- default path <= 0.8x Horovod: {default / real:.2f}x, "
                         f"{verdict(default <= 0.8 * real)}")
    auto = step("auto")
    best = [(step(name), name) for name in SYNCHRONOUS if step(name) is not None]
    if auto is not None and best:
        fastest, name = min(best)  # type: ignore[type-var]
        assert fastest is not None
        lines.append(f"- `auto` within 1.1x of the best synchronous algorithm (`{name}`, "
                     f"{fastest:.3f} s): {auto:.3f} s = {auto / fastest:.2f}x, chose "
                     f"{', '.join(rows['auto'].get('chosen') or ['?'])}, "
                     f"{verdict(auto <= 1.1 * fastest)}")
    bytegrad = step("bytegrad")
    if bytegrad is not None and ddp is not None:
        lines.append(f"- `bytegrad` >= 3x faster than DDP (set for 100 Mbit/s): "
                     f"{ddp / bytegrad:.2f}x, {verdict(ddp / bytegrad >= 3)}")
    allreduce = step("gradient_allreduce")
    if allreduce is not None and floor:
        line = (f"- `gradient_allreduce` against the ring allreduce floor ({floor:.2f} s): "
                f"{allreduce / floor:.2f}x the floor")
        local = step("local")
        if local is not None:
            line += (f" (minus the `local` compute-only step: "
                     f"{(allreduce - local) / floor:.2f}x)")
        lines.append(line)
    return lines


def summarize(spec: str, rounds: list[list[dict[str, Any]]],
              args: argparse.Namespace) -> dict[str, Any]:
    """One table row from every round's results of every rank (``rounds[round][rank]``)."""
    ranks = range(len(rounds[0]))
    times = [[t for r in rounds for t in r[k]["times"]] for k in ranks]
    steps = [sum(r[k]["steps"] for r in rounds) for k in ranks]

    def per_step(key: str, k: int) -> float | None:
        values = [r[k][key] * r[k]["steps"] for r in rounds if r[k][key] is not None]
        return sum(values) / steps[k] if len(values) == len(rounds) else None

    medians = [statistics.median(t) for t in times]
    tx = [per_step("tx_per_step", k) for k in ranks]
    async_rounds = [r[0]["async_rounds"] for r in rounds]
    return {
        "algorithm": spec,
        "description": describe(spec, args.qadam_warmup, args.optimizer),
        "data_plane": rounds[0][0].get("data_plane", "mpi"),
        "chosen": sorted({r[0]["chosen"] for r in rounds if r[0].get("chosen")}) or None,
        "step_s": max(medians),
        "rank_medians_s": medians,
        "steps": min(steps),
        "counted_per_step": None if split_spec(spec)[0] == "ddp" else statistics.fmean(
            per_step("counted_per_step", k) or 0.0 for k in ranks),
        "cpu_per_step": statistics.fmean(per_step("cpu_per_step", k) or 0.0 for k in ranks),
        "tx_per_step": None if None in tx else statistics.fmean(
            x for x in tx if x is not None),
        "async_rounds": None if None in async_rounds else sum(
            x for x in async_rounds if x is not None),
    }


def bench(args: argparse.Namespace) -> None:
    import torch
    from mpi4py import MPI

    import baguahvd.torch as hvd

    torch.set_num_threads(args.threads)
    install_byte_counter()
    # Rows without an @plane suffix run with what the caller set (baguahvd's default: auto).
    default_plane = os.environ.get("BAGUAHVD_CPU_BACKEND", "")
    hvd.init()
    comm = MPI.COMM_WORLD
    rank, size = hvd.rank(), hvd.size()
    hosts = comm.allgather(socket.gethostname())
    one_host = len(set(hosts)) == 1
    specs = list(args.algorithms)
    if real_horovod is not None and "horovod" in specs and "horovod_real" not in specs:
        specs.insert(specs.index("horovod") + 1, "horovod_real")
    flat = args.flat if args.flat is not None else one_host
    if flat:
        specs += [f"{name}:flat" for name in HIERARCHICAL if name in args.algorithms]
    link = os.environ.get("EMU_LINK_RATE")
    per_flow = os.environ.get("EMU_PER_FLOW") == "1"
    setting = f"emulated cluster, links {link}" if link else (
        "one machine" if one_host else f"{len(set(hosts))} hosts")
    if link and per_flow:
        setting = f"emulated cluster, {link} per TCP connection"
    params = sum(p.numel() for p in build_model().parameters())
    if rank == 0:
        print(f"{setting}: {size} ranks on hosts {', '.join(sorted(set(hosts)))}; MLP "
              f"{'-'.join(map(str, MODEL_DIMS))}, {params / 1e6:.2f} M params = "
              f"{params * 4 / 1e6:.1f} MB of fp32 gradients; batch {args.batch_size}; "
              f"warmup {args.warmup}, timed steps {args.steps}, rounds {args.repeats}",
              flush=True)

    if "ddp" in specs:
        from gloo import start_gloo

        start_gloo(comm)

    load_before = os.getloadavg()
    # Rounds over all algorithms (every other round in reverse order), so that a change of
    # the machine's load during the run falls on every algorithm alike.
    per_spec: dict[str, list[list[dict[str, Any]]]] = {spec: [] for spec in specs}
    for round_index in range(args.repeats):
        order = specs if round_index % 2 == 0 else specs[::-1]
        for spec in order:
            comm.Barrier()
            name = split_spec(spec)[0]
            if name in FOREIGN:
                if hvd.is_initialized():
                    hvd.shutdown()
            else:
                use_data_plane(hvd, split_spec(spec)[2] or default_plane)
            mine = run_one(spec, hvd, args)
            if name == "horovod_real":
                real_horovod.shutdown()
            gc.collect()  # the previous model, optimizer state and buffers
            everyone = comm.gather(mine, root=0)
            if rank == 0:
                assert everyone is not None
                per_spec[spec].append(everyone)
                step_s = max(statistics.median(r["times"]) for r in everyone)
                print(f"  round {round_index + 1}: {spec:<34} {step_s:8.3f} s/step", flush=True)
    rows = [summarize(spec, per_spec[spec], args) for spec in specs] if rank == 0 else []

    if rank != 0:
        return
    for row in rows:
        print(f"  {row['algorithm']:<34} {row['step_s']:8.3f} s/step  "
              f"{human_bytes(row['counted_per_step']):>10} algorithmic  "
              f"{human_bytes(row['tx_per_step']):>10} measured", flush=True)
    by_name = {row["algorithm"]: row for row in rows}
    for row in rows:
        for key, ref in (("speedup_vs_allreduce", "gradient_allreduce"),
                         ("speedup_vs_horovod", "horovod")):
            row[key] = by_name[ref]["step_s"] / row["step_s"] if ref in by_name else None
    result = {
        "setting": setting,
        "link": link,
        "ranks": size,
        "hosts": sorted(set(hosts)),
        "params": params,
        "gradient_bytes": params * 4,
        "batch_size": args.batch_size,
        "warmup": args.warmup,
        "steps": args.steps,
        "repeats": args.repeats,
        "qadam_warmup": args.qadam_warmup,
        "async_seconds": args.async_seconds,
        "threads": args.threads,
        "cores": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "rows": rows,
    }
    print()
    print(f"### {setting}\n")
    print(markdown_table(result))
    print(f"\nload average (1 min) of the machine: {load_before[0]:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after, on {os.cpu_count()} cores")
    if link and link != "unshaped":
        floor = 2 * (size - 1) / size * params * 4 * 8 / parse_rate(link)
        result["ring_floor_s"] = floor
        print(f"\nring allreduce floor at {link}: {floor:.2f} s "
              f"(2(n-1)/n x {params * 4 / 1e6:.1f} MB at the link rate)")
    print("\n".join(target_lines(result)))
    if args.json_dir:
        os.makedirs(args.json_dir, exist_ok=True)
        label = link or ("one_machine" if one_host else "cluster")
        if link and per_flow:
            label += "_per_flow"
        path = os.path.join(args.json_dir, f"algorithms_{label}.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"\nsaved {path}")


def parse_rate(text: str) -> float:
    """bits/s of a tc rate such as 100mbit or 1gbit."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    lowered = text.lower()
    if lowered == "unshaped":
        return math.inf
    for suffix, factor in units.items():
        if lowered.endswith(suffix):
            return float(lowered[: -len(suffix)]) * factor
    raise ValueError(f"not a tc rate: {text!r}")


# -- report ---------------------------------------------------------------------------------


def report(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(prog="algorithms.py report")
    parser.add_argument("results", nargs="+", help="JSON files written with --json-dir")
    parser.add_argument("--markdown", help="write the tables here")
    parser.add_argument("--png", help="write the step time vs bandwidth plot here (one panel "
                                      "per directory of result files)")
    args = parser.parse_args(argv)
    loaded = [(path, json.load(open(path))) for path in args.results]
    loaded.sort(key=lambda item: (os.path.dirname(item[0]), -parse_rate(item[1]["link"])
                                  if item[1].get("link") else float("-inf")))
    parts = []
    emulated = [result for _, result in loaded if result.get("link")]
    if len(emulated) > 1:
        parts += ["### Step time per setting (s; slowest rank's median)\n",
                  summary_table(emulated), ""]
    for _, result in loaded:
        parts.append(f"### {result['setting']}\n")
        parts.append(markdown_table(result))
        load = result.get("load_average_before")
        if load:
            parts.append(f"\n{result['ranks']} ranks, {result['cores']} cores; load average "
                         f"of the machine {load[0]:.1f} before the run, "
                         f"{result['load_average_after'][0]:.1f} after.")
        targets = target_lines(result)
        if targets:
            at_100 = parse_rate(result["link"]) == 100e6 if result.get("link") else False
            parts.append("\nTargets:\n" if at_100 else
                         "\nTargets (bytegrad's is set for 100 Mbit/s):\n")
            parts.extend(targets)
        parts.append("")
    text = "\n".join(parts)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    if args.png:
        groups: dict[str, list[dict[str, Any]]] = {}
        for path, result in loaded:
            if result.get("link"):
                groups.setdefault(os.path.dirname(os.path.abspath(path)), []).append(result)
        plot(groups, args.png)


def summary_table(results: list[dict[str, Any]]) -> str:
    """One row per system, one column per emulated setting (fastest link first)."""
    results = sorted(results, key=lambda r: -parse_rate(r["link"]))
    names = list(dict.fromkeys(row["algorithm"] for r in results for row in r["rows"]))
    header = ["system", *(r["link"] for r in results)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name in names:
        cells = [f"`{name}`"]
        for r in results:
            row = next((x for x in r["rows"] if x["algorithm"] == name), None)
            if row is None:
                cells.append("–")
                continue
            cell = f"{row['step_s']:.3f}"
            plane = plane_label(row)
            cell += f" ({plane}"
            if row.get("chosen"):
                cell += f", chose {', '.join(row['chosen'])}"
            cells.append(cell + ")")
        lines.append("| " + " | ".join(cells) + " |")
    loads = [x for r in results for x in (r["load_average_before"][0],
                                            r["load_average_after"][0])]
    lines.append(f"\nIn brackets: the CPU data plane. Load average of the machine "
                 f"{min(loads):.1f}-{max(loads):.1f} on {results[0]['cores']} cores.")
    return "\n".join(lines)


def plot(groups: dict[str, list[dict[str, Any]]], path: str) -> None:
    """One panel per group (directory) of emulated results: step time vs link rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups) + 2.5, 5.2),
                             sharey=True, squeeze=False)
    markers = "os^vD<>px*h"
    first: dict[str, Any] = {}
    for ax, (directory, results) in zip(axes[0], groups.items()):
        results = sorted(results, key=lambda r: parse_rate(r["link"]))
        first = results[0]
        # "unshaped" (veth at memory speed) is drawn one decade right of the fastest rate.
        shaped = [parse_rate(r["link"]) / 1e6 for r in results if r["link"] != "unshaped"]
        rates = [parse_rate(r["link"]) / 1e6 if r["link"] != "unshaped"
                 else 10 * max(shaped or [1000.0]) for r in results]
        names = [row["algorithm"] for row in first["rows"]]
        for i, name in enumerate(names):
            ys = []
            for r in results:
                row = next((x for x in r["rows"] if x["algorithm"] == name), None)
                ys.append(row["step_s"] if row else float("nan"))
            label = "local (compute only)" if name == "local" else name
            style = "--" if name == "local" else ":" if "@" in name else "-"
            ax.plot(rates, ys, marker=markers[i % len(markers)], label=label, linestyle=style)
        floors = [float(r.get("ring_floor_s") or "nan") for r in results]
        if any(f == f for f in floors):
            ax.plot(rates, floors, color="black", linestyle=":", label="ring allreduce floor")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(rates)
        ax.set_xticklabels([
            "unshaped" if r["link"] == "unshaped" else
            f"{x:g} Mbit/s" if x < 1000 else f"{x / 1000:g} Gbit/s"
            for x, r in zip(rates, results)])
        ax.minorticks_off()
        loads = [x for r in results for x in (r["load_average_before"][0],
                                                r["load_average_after"][0])]
        ax.set_title(f"{os.path.basename(directory)}: load average "
                     f"{min(loads):.1f}-{max(loads):.1f} on {first['cores']} cores",
                     fontsize=10)
        ax.set_xlabel("link bandwidth (tc tbf; 2 emulated hosts, 1 rank each)")
        ax.grid(True, which="both", alpha=0.3)
    ymin, ymax = axes[0][0].get_ylim()
    ticks = [t for t in (0.1, 0.2, 0.3, 0.5, 1, 2, 3, 5, 10, 20, 30) if ymin <= t <= ymax]
    axes[0][0].set_yticks(ticks)
    axes[0][0].set_yticklabels([f"{t:g}" for t in ticks])
    axes[0][0].set_ylabel("step time (s; median, slowest rank)")
    axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(f"Step time per algorithm: MLP with {first['gradient_bytes'] / 1e6:.1f} MB "
                 f"of fp32 gradients, batch {first['batch_size']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"saved {path}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "report":
        report(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithms", nargs="+", default=list(DEFAULT_ALGORITHMS),
                        help="local (no communication), horovod (algorithm=None), adasum, "
                             "ddp (torch DistributedDataParallel over gloo), "
                             "horovod_real (Horovod itself, added when importable) or "
                             "registered algorithm names (name:flat for hierarchical=False)")
    parser.add_argument("--flat", dest="flat", action="store_true", default=None,
                        help="add hierarchical=False variants (default: on one host only)")
    parser.add_argument("--no-flat", dest="flat", action="store_false")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per algorithm")
    parser.add_argument("--steps", type=int, default=10,
                        help="timed steps per algorithm and round")
    parser.add_argument("--repeats", type=int, default=2,
                        help="rounds over all algorithms; each algorithm's step time is the "
                             "median of its timed steps of every round")
    parser.add_argument("--async-seconds", type=float, default=8.0,
                        help="async: keep timing steps (per round) until this much time has "
                             "passed, so that averaging rounds fall in the window")
    parser.add_argument("--qadam-warmup", type=int, default=None,
                        help="QAdamOptimizer warmup_steps (default: --warmup - 1)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd",
                        help="sgd: SGD with momentum 0.9; adam: Adam (qadam always runs "
                             "QAdamOptimizer)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--json-dir", default=None, help="save the results here as JSON")
    args = parser.parse_args()
    if args.repeats < 1 or args.steps < 1:
        parser.error("--repeats and --steps must be >= 1")
    if args.warmup < 2:
        parser.error("--warmup must be >= 2 (qadam's warmup has to end before timing)")
    if args.qadam_warmup is None:
        args.qadam_warmup = args.warmup - 1
    if not 1 <= args.qadam_warmup < args.warmup:
        parser.error("--qadam-warmup must be >= 1 and < --warmup")
    bench(args)


if __name__ == "__main__":
    main()
