"""CachedDataset: reading time of the second epoch as a ratio of the first.

The dataset's decode is deliberately slow (a 3x3 blur applied 20 times to a 3x64x64 image
rebuilt from its index), as decoding and augmenting real images is. The first epoch decodes
and fills the cache; the second reads from it. One process, one torch thread.

    python benchmarks/cached_dataset.py [--samples 400] [--redis]
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import tempfile
import time

import torch

from baguahvd.contrib import CachedDataset


class SlowDecode(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n
        self.kernel = torch.full((3, 1, 3, 3), 1 / 9)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        image = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(i))
        for _ in range(20):
            image = torch.nn.functional.conv2d(image, self.kernel, padding=1, groups=3)
        return image[0], i % 10


def _epoch(dataset: torch.utils.data.Dataset) -> float:
    start = time.perf_counter()
    for i in range(len(dataset)):  # type: ignore[arg-type]
        dataset[i]
    return time.perf_counter() - start


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--redis", action="store_true", help="also time a redis-server cache")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    plain = SlowDecode(args.samples)
    rows.append(("no cache", _epoch(plain), _epoch(plain)))
    folder = tempfile.mkdtemp()
    lmdb_cached = CachedDataset(SlowDecode(args.samples), path=folder, dataset_name="bench")
    rows.append(("lmdb", _epoch(lmdb_cached), _epoch(lmdb_cached)))
    server = None
    if args.redis and shutil.which("redis-server"):
        port = _free_port()
        server = subprocess.Popen(["redis-server", "--port", str(port), "--save", "",
                                   "--appendonly", "no"], stdout=subprocess.DEVNULL)
        time.sleep(0.5)
        redis_cached = CachedDataset(SlowDecode(args.samples), backend="redis",
                                     dataset_name="bench", host="127.0.0.1", port=port)
        rows.append(("redis", _epoch(redis_cached), _epoch(redis_cached)))
    print(f"{args.samples} samples, slow decode")
    print(f"{'cache':<10}{'epoch 1 (s)':>14}{'epoch 2 (s)':>14}{'epoch 2 / epoch 1':>20}")
    for name, first, second in rows:
        print(f"{name:<10}{first:>14.3f}{second:>14.3f}{second / first:>20.3f}")
    if server is not None:
        server.terminate()
        server.wait()
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
