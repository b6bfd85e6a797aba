"""torchrun support: one process per device, gloo on CPU and NCCL on GPU, only rank 0 writes.

`torchrun --nproc_per_node=N -m vitkit train ...` sets RANK, WORLD_SIZE and LOCAL_RANK; without them the run
is a single process and nothing here needs a process group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    """Where this process sits: its rank among `size` processes, and its device."""

    rank: int
    size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(name: str) -> torch.device:
    """'auto' (CUDA when available, else CPU), 'cpu', 'cuda' or 'cuda:N'."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but CUDA is not available here: use device='cpu' or 'auto'.")
    return device


def init_world(device: str = "auto") -> World:
    """Join the torchrun process group when launched by torchrun; a world of one otherwise."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    base = resolve_device(device)
    if size == 1:
        return World(0, 1, base)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if base.type == "cuda":
        base = torch.device("cuda", local_rank)
        torch.cuda.set_device(base)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if base.type == "cuda" else "gloo")
    return World(rank, size, base)


def close_world(world: World) -> None:
    if world.size > 1 and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(tensor: torch.Tensor, world: World) -> torch.Tensor:
    """Sum a tensor over all processes (in place; a no-op for a world of one)."""
    if world.size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_gather_tensors(tensor: torch.Tensor, world: World) -> list[torch.Tensor]:
    """Every process's copy of an equally shaped tensor, in rank order."""
    if world.size == 1:
        return [tensor]
    parts = [torch.empty_like(tensor) for _ in range(world.size)]
    dist.all_gather(parts, tensor.contiguous())
    return parts


def any_process(flag: bool, world: World) -> bool:
    """True on every process when `flag` is true on at least one (e.g. a stop request seen by rank 0)."""
    if world.size == 1:
        return flag
    value = torch.tensor([float(flag)], device=world.device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def barrier(world: World) -> None:
    if world.size > 1:
        dist.barrier()
