"""Tar shards (the WebDataset layout) against Parquet shards for the same JPEGs, measured side by side.

Writes 2,000 JPEGs of `shapes` (160 px, quality 90) as 4 shards of each format, then times (best of 3) writing,
streaming every sample's bytes, and streaming + decoding them (`vitkit.data.images.read_image(name, data=...)`) on
this process's one thread. Tar is read with Python's tarfile in stream mode, as WebDataset reads it. Usage:
`python benchmarks/shard_formats.py [--images 2000]`.
"""

from __future__ import annotations

import argparse
import io
import os
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from PIL import Image

from vitkit.data.datasets import ShapesDataset
from vitkit.data.images import read_image
from vitkit.speed.benchmark import record_header, write_record

SHARDS = 4


def jpegs(n: int) -> list[tuple[bytes, int]]:
    dataset = ShapesDataset(size=n, image_size=160)
    out = []
    for i in range(n):
        image, label = dataset[i]
        buffer = io.BytesIO()
        Image.fromarray(image.permute(1, 2, 0).numpy()).save(buffer, "JPEG", quality=90)
        out.append((buffer.getvalue(), label))
    return out


def write_tar(folder: str, samples) -> None:
    for s, part in enumerate(np.array_split(np.arange(len(samples)), SHARDS)):
        with tarfile.open(f"{folder}/{s}.tar", "w") as tar:
            for i in part:
                data, label = samples[i]
                for name, payload in ((f"{i:08d}.cls", str(label).encode()), (f"{i:08d}.jpg", data)):
                    info = tarfile.TarInfo(name)
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))


def read_tar(folder: str, decode: bool) -> int:
    n = 0
    for s in range(SHARDS):
        with tarfile.open(f"{folder}/{s}.tar", "r|") as tar:
            for member in tar:
                data = tar.extractfile(member).read()
                if member.name.endswith(".jpg"):
                    n += 1
                    if decode:
                        read_image("sample", data=data)
    return n


def write_parquet(folder: str, samples) -> None:
    for s, part in enumerate(np.array_split(np.arange(len(samples)), SHARDS)):
        table = pa.table(
            {
                "image": pa.array([samples[i][0] for i in part], pa.binary()),
                "label": pa.array([samples[i][1] for i in part], pa.int64()),
            }
        )
        pq.write_table(table, f"{folder}/{s}.parquet", row_group_size=100, compression="none")


def read_parquet(folder: str, decode: bool) -> int:
    n = 0
    for s in range(SHARDS):
        for batch in pq.ParquetFile(f"{folder}/{s}.parquet").iter_batches(batch_size=100, columns=["image", "label"]):
            for data in batch.column("image").to_pylist():
                n += 1
                if decode:
                    read_image("sample", data=data)
    return n


def three_times(fn, *args) -> list[float]:
    """Seconds of three calls; the best is reported."""
    times = []
    for _ in range(3):
        tick = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - tick)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument(
        "--out", type=Path, help="write a JSON record of the results (benchmarks/results/shard-formats-MACHINE.json)"
    )
    args = parser.parse_args()
    n, rows = args.images, []
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cores; pyarrow {pa.__version__}")  # fmt: skip
    samples = jpegs(n)
    print(f"{n} JPEGs of {np.mean([len(d) for d, _ in samples]):.0f} bytes on average, {SHARDS} shards")
    print(f"{'format':<10}{'write img/s':>12}{'bytes/img':>10}{'read img/s':>11}{'read+decode img/s':>18}")
    formats = (("tar", write_tar, read_tar, ".tar"), ("parquet", write_parquet, read_parquet, ".parquet"))
    for name, write, read, suffix in formats:
        with tempfile.TemporaryDirectory() as folder:
            rounds = {"write": three_times(write, folder, samples)}
            size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(suffix))
            assert read(folder, False) == n
            rounds["stream"], rounds["decode"] = three_times(read, folder, False), three_times(read, folder, True)
            w, r, d = (min(rounds[k]) for k in ("write", "stream", "decode"))
            print(f"{name:<10}{n / w:>12.0f}{size / n:>10.0f}{n / r:>11.0f}{n / d:>18.0f}")
            rows.append(
                {
                    "format": name,
                    "write_images_per_s": n / w,
                    "bytes_per_image": size / n,
                    "stream_images_per_s": n / r,
                    "decode_images_per_s": n / d,
                    "rounds_s": rounds,
                }
            )
    if args.out:
        settings = {"images": n, "shards": SHARDS, "pyarrow": pa.__version__, "load_average": os.getloadavg()[0]}
        write_record(args.out, {**record_header("shard-formats"), "settings": settings, "rows": rows})


if __name__ == "__main__":
    main()
