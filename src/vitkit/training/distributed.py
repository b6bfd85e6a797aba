"""torchrun support: one process per device, gloo on CPU and NCCL on GPU, only rank 0 writes.

`torchrun --nproc_per_node=N -m vitkit train ...` sets RANK, WORLD_SIZE and LOCAL_RANK; without them the run
is a single process and nothing here needs a process group.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from vitkit.files import fsync


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


def launched_rank() -> int:
    """This process's rank as torchrun set it (0 without torchrun), known before the process group is joined."""
    return int(os.environ["RANK"]) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else 0


def init_world(device: str = "auto") -> World:
    """Join the torchrun process group when launched by torchrun; a world of one otherwise."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    base = resolve_device(device)
    if size == 1:
        return World(0, 1, base)
    rank, local_rank = launched_rank(), int(os.environ.get("LOCAL_RANK", "0"))
    if base.type == "cuda":
        base = torch.device("cuda", local_rank)
        torch.cuda.set_device(base)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if base.type == "cuda" else "gloo")
    return World(rank, size, base)


def close_world(world: World) -> None:
    """Leave the process group: torchrun's, or the group of one that FSDP joined for a single process."""
    if dist.is_initialized():
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


# --- Sharding the model: DDP replicas or FSDP2 shards -----------------------------------------------------------

STRATEGIES = ("ddp", "fsdp")


def join_group(world: World) -> None:
    """A process group even for a world of one, so that FSDP can run (and resume) in a single process."""
    if not dist.is_initialized():
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)


def wrap_model(model: nn.Module, world: World, strategy: str, precision: str = "fp32") -> nn.Module:
    """The module that the training step calls: `model` itself (one process, DDP not needed),
    DistributedDataParallel around it, or `model` sharded in place with FSDP2.

    FSDP2 shards every encoder block, then the root (embedding, posemb, class token, norm, head), over all
    processes; with precision "bf16" parameters are gathered and used in bf16 while gradients are reduced and
    the optimiser steps in fp32. Build the optimiser after this call: FSDP replaces the parameters by DTensor
    shards (same names, so weight-decay groups are unchanged).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is unknown: choose one of {', '.join(STRATEGIES)}.")
    if strategy == "ddp":
        if world.size == 1:
            return model
        return DistributedDataParallel(model, device_ids=[world.device.index] if world.device.type == "cuda" else None)
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise ValueError(
            f"strategy='fsdp' shards a Vision Transformer block by block; a {type(model).__name__} has no encoder "
            "blocks: train it with --strategy ddp (the baselines are small enough to replicate)."
        )
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    join_group(world)
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if precision == "bf16"
        else MixedPrecisionPolicy()
    )
    for block in blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def is_sharded(model: nn.Module) -> bool:
    """True for a model sharded by FSDP2 (its parameters are DTensor shards). Cheap: FSDP is only imported (a few
    seconds) by `wrap_model` when it shards a model."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def gradient_sync(net: nn.Module, sync: bool):
    """A context in which backward reduces gradients over processes only when `sync` (the last micro-batch of
    an accumulated step): DDP's `no_sync`, FSDP2's `set_requires_gradient_sync`."""
    net = getattr(net, "_orig_mod", net)  # under torch.compile (--compile): the module it compiled
    if isinstance(net, DistributedDataParallel) and not sync:
        return net.no_sync()
    if is_sharded(net):
        cast(Any, net).set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The whole model's state dict on CPU, on the main process (None elsewhere); every process must call this
    for a sharded model, whose parameters are then gathered."""
    if not is_sharded(model):
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return cast(dict[str, torch.Tensor], state) if dist.get_rank() == 0 else None


# --- Sharded checkpoints (torch.distributed.checkpoint) ---------------------------------------------------------

STATE_JSON = "state.json"


def save_sharded(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Save a sharded model and its optimiser with torch.distributed.checkpoint into the directory `path`, every
    process writing its own shards, and the non-tensor `state` (JSON) beside them. Written to a temporary
    directory that replaces `path` only when complete, so an interrupted save leaves the previous one intact.
    Every process must call this."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    groups = optim_state.pop("param_groups")
    # Tensors only: DCP pickles anything else and would unpickle it again with weights_only=False.
    tensors = {"model": model_state, "optim": optim_state["state"]}
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(tmp)))
    if dist.get_rank() == 0:
        (tmp / STATE_JSON).write_text(json.dumps({**state, "param_groups": groups}, indent=1) + "\n")
        fsync(tmp / STATE_JSON)  # DCP fsyncs its own files
        fsync(tmp)
        old = path.with_name(f".{path.name}.old")
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        fsync(path.parent)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def read_sharded_state(path: str | os.PathLike) -> dict:
    """The JSON state saved beside a sharded checkpoint (config, step, RNG, ...), read on any process."""
    file = Path(path) / STATE_JSON
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no sharded checkpoint here (written by `vitkit train --strategy fsdp`).")
    return json.loads(file.read_text())


def load_sharded(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Load a checkpoint written by `save_sharded` into a sharded model and its optimiser, whatever the number of
    processes that wrote it (DCP reshards); returns its JSON state. Every process must call this."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    state = read_sharded_state(path)
    _read_metadata(path)  # refuse a crafted checkpoint here, with its own error, before DCP reads it
    model_state, optim_state = get_state_dict(model, optimizer)
    tensors: dict[str, Any] = {"model": model_state, "optim": optim_state["state"]}
    dcp.load(tensors, storage_reader=_safe_reader(path))
    groups = state.pop("param_groups")
    set_state_dict(
        model,
        optimizer,
        model_state_dict=tensors["model"],
        optim_state_dict={"state": tensors["optim"], "param_groups": groups},
    )
    return state


def _dcp_globals() -> set[tuple[str, str]]:
    from torch.distributed.checkpoint import metadata

    names = {(metadata.__name__, n) for n in dir(metadata) if isinstance(getattr(metadata, n), type)}
    dtypes = {("torch", n) for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)}
    return (
        names
        | dtypes
        | {
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
            ("torch", "Size"),
            ("torch.serialization", "_get_layout"),
            ("pathlib", "PosixPath"),
            ("pathlib", "WindowsPath"),
            ("collections", "OrderedDict"),
        }
    )


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata` is a pickle: rebuild only DCP's own metadata classes, sizes and dtypes from it."""

    def find_class(self, module: str, name: str):
        if (module, name) not in _dcp_globals():
            raise pickle.UnpicklingError(
                f"refusing to load {module}.{name} from a checkpoint's .metadata: only DCP metadata is expected."
            )
        return super().find_class(module, name)


def _read_metadata(path: str | os.PathLike):
    """A DCP checkpoint's metadata, unpickled with DCP's own classes only; a checkpoint holding pickled objects
    (which DCP would load with weights_only=False) is refused."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    with open(Path(path) / ".metadata", "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    pickled = [k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]
    if pickled:
        raise ValueError(
            f"{path}: holds pickled objects {pickled[:3]}; vitkit's sharded checkpoints keep tensors only (the rest "
            "is in state.json), so this one is not loaded."
        )
    return metadata


def _safe_reader(path: str | os.PathLike):
    """A DCP reader for `path` that reads the metadata with `_read_metadata` (built here: torch.distributed.checkpoint
    takes seconds to import)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            metadata = _read_metadata(self.path)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(str(path))
