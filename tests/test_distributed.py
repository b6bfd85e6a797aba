import json
import os
import pickle
import shutil
import socket
import subprocess
import sys

import pytest
import torch

import vitkit
from helpers import SMALL_ENCODER as TINY
from helpers import assert_same_weights as assert_close
from helpers import run_weights as weights
from helpers import subprocess_env
from vitkit.training.distributed import World, close_world, join_group, load_sharded, save_sharded, wrap_model
from vitkit.training.loop import train
from vitkit.training.optimization import build_optimizer
from vitkit.training.recipes import TrainConfig
from vitkit.training.runs import read_checkpoint

ENV = subprocess_env()
# SGD (Adam turns rounding noise into lr-sized steps, see test_training) and a clip threshold that every step
# hits, so that the gradient norm over shards is part of what is compared. 47 test images in batches of 23: one
# process evaluates 2 batches, the other 1, which a sharded model must make up for with an empty forward.
RECIPE = dict(
    data="shapes",
    data_args={"size": 47, "image_size": 16},
    model="ViT-Ti/8",
    model_args=dict(TINY),
    batch_size=8,
    steps=6,
    eval_every=0,
    eval_batch_size=23,
    log_every=2,
    crop_scale=(0.3, 1.0),
    threads=1,
    optimizer="sgd",
    lr=0.1,
    grad_clip=0.05,
    precision="fp32",  # fp32: the runs are compared at fp32 tolerances
)


def cli_args(out_dir, **overrides) -> list[str]:
    spec = {**RECIPE, **overrides, "out_dir": str(out_dir)}
    args = []
    for name, value in spec.items():
        text = json.dumps(value) if isinstance(value, dict) else value
        args += ["--" + name.replace("_", "-"), *map(str, text if isinstance(text, tuple) else [text])]
    return args


def torchrun(*args: str, nproc: int = 2, timeout: int = 240) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    done = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]


def tiny_model() -> vitkit.VisionTransformer:
    torch.manual_seed(0)
    return vitkit.create_model("ViT-Ti/8", image_size=16, num_classes=6, **TINY)


@pytest.fixture
def one_process_group():
    world = World(0, 1, torch.device("cpu"))
    join_group(world)
    yield world
    close_world(world)


@pytest.mark.slow
def test_fsdp_keeps_weight_decay_groups_and_gathers_bf16_weights_while_reducing_fp32_gradients(one_process_group):
    model, reference = tiny_model(), tiny_model()
    wrap_model(model, one_process_group, "fsdp", "bf16")
    optimizer, plain = build_optimizer(model, TrainConfig()), build_optimizer(reference, TrainConfig())
    names = {id(p): n for n, p in model.named_parameters()}
    plain_names = {id(p): n for n, p in reference.named_parameters()}
    for group, plain_group in zip(optimizer.param_groups, plain.param_groups, strict=True):
        assert [names[id(p)] for p in group["params"]] == [plain_names[id(p)] for p in plain_group["params"]]
        assert group["weight_decay"] == plain_group["weight_decay"]
    decay = TrainConfig().weight_decay
    assert optimizer.param_groups[0]["weight_decay"] == decay and optimizer.param_groups[1]["weight_decay"] == 0.0
    seen = []
    model.blocks[0].mlp.fc1.register_forward_hook(lambda m, i, o: seen.append((m.weight.dtype, o.dtype)))
    model(torch.randn(2, 3, 16, 16)).float().sum().backward()
    assert seen == [(torch.bfloat16, torch.bfloat16)]  # computed in bf16 ...
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())  # kept fp32


@pytest.mark.slow
def test_sharded_checkpoint_round_trips_and_refuses_pickled_objects(tmp_path, one_process_group):
    model = tiny_model()
    wrap_model(model, one_process_group, "fsdp")
    optimizer = build_optimizer(model, TrainConfig())
    model(torch.randn(2, 3, 16, 16)).sum().backward()
    optimizer.step()
    save_sharded(tmp_path / "ck", model, optimizer, {"step": 7})
    assert sorted(p.name for p in (tmp_path / "ck").iterdir())[-1] == "state.json"
    assert not (tmp_path / ".ck.tmp").exists()
    again = tiny_model()
    wrap_model(again, one_process_group, "fsdp")
    optimizer2 = build_optimizer(again, TrainConfig())
    assert load_sharded(tmp_path / "ck", again, optimizer2) == {"step": 7}
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a.full_tensor(), b.full_tensor()), name
    assert optimizer2.state_dict()["param_groups"][0]["weight_decay"] == TrainConfig().weight_decay
    # A .metadata that would run code when unpickled is refused before anything is loaded.
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(os.system))
    with pytest.raises(pickle.UnpicklingError, match="refusing to load posix.system"):
        load_sharded(tmp_path / "ck", again, optimizer2)


@pytest.mark.slow
def test_fsdp_run_matches_ddp_and_resumes_exactly_with_the_same_or_another_process_count(tmp_path):
    torchrun("-m", "vitkit", "train", *cli_args(tmp_path / "ddp", strategy="ddp"))
    torchrun("-m", "vitkit", "train", *cli_args(tmp_path / "fsdp", strategy="fsdp"))
    assert_close(weights(tmp_path / "ddp"), weights(tmp_path / "fsdp"), atol=1e-5)
    assert (tmp_path / "fsdp" / "checkpoint" / "state.json").is_file()
    assert not (tmp_path / "fsdp" / "checkpoint.pt").exists() and (tmp_path / "ddp" / "checkpoint.pt").is_file()
    # Stop after 3 of 6 steps, then resume with 2 processes and (from a copy) with 1.
    script = tmp_path / "stop.py"
    config = TrainConfig(**RECIPE, strategy="fsdp", out_dir=str(tmp_path / "split"))
    script.write_text(
        "import json, vitkit\n"
        f"vitkit.train(vitkit.TrainConfig.from_dict(json.loads({json.dumps(json.dumps(config.to_dict()))})), "
        "stop_after=3)\n"
    )
    torchrun(str(script))
    assert read_checkpoint(tmp_path / "split")["step"] == 3
    shutil.copytree(tmp_path / "split", tmp_path / "split-one")
    torchrun("-m", "vitkit", "train", "--resume", str(tmp_path / "split"))
    whole = weights(tmp_path / "fsdp")
    for name, tensor in weights(tmp_path / "split").items():
        assert torch.equal(tensor, whole[name]), name  # exact: same shards, same reductions
    resumed = train(resume=tmp_path / "split-one")  # 2 processes -> 1: DCP reshards the model and the optimiser
    assert resumed.step == 6
    assert_close(weights(tmp_path / "split-one"), whole, atol=1e-5)


@pytest.mark.slow
def test_fsdp_run_saved_by_one_process_resumes_with_two(tmp_path):
    config = TrainConfig(**RECIPE, strategy="fsdp")
    train(config.replace(out_dir=str(tmp_path / "whole")))
    assert train(config.replace(out_dir=str(tmp_path / "split")), stop_after=3).step == 3
    torchrun("-m", "vitkit", "train", "--resume", str(tmp_path / "split"))  # 1 process -> 2: DCP reshards
    assert read_checkpoint(tmp_path / "split")["step"] == 6
    # Within 1e-5, not exact: two processes reduce the gradients in another order than one.
    assert_close(weights(tmp_path / "split"), weights(tmp_path / "whole"), atol=1e-5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_torchrun_nodes_with_a_c10d_rendezvous_train_as_one(tmp_path):
    port = free_port()
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc_per_node=1",
                f"--node_rank={i}",
                "--rdzv_backend=c10d",
                f"--rdzv_endpoint=127.0.0.1:{port}",
                "--rdzv_id=vitkit-test",
                "-m",
                "vitkit",
                "train",
                *cli_args(tmp_path / "two-nodes"),
            ],
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    for node in nodes:
        _, err = node.communicate(timeout=240)
        assert node.returncode == 0, err[-3000:]
    assert json.loads((tmp_path / "two-nodes" / "config.json").read_text())["world_size"] == 2
    # Two nodes of one process = one process with the whole batch (the global batches do not depend on the split).
    train(TrainConfig(**RECIPE, out_dir=str(tmp_path / "one")))
    assert_close(weights(tmp_path / "two-nodes"), weights(tmp_path / "one"), atol=1e-5)


@pytest.mark.slow
def test_fsdp_in_one_process_with_gradient_checkpointing_trains_as_the_plain_model(tmp_path):
    # Recomputing each sharded block in backward (its weights gathered again) changes nothing but the memory.
    train(TrainConfig(**RECIPE, out_dir=str(tmp_path / "plain")))
    sharded = train(TrainConfig(**RECIPE, strategy="fsdp", grad_checkpointing=True, out_dir=str(tmp_path / "fsdp")))
    assert sharded.step == 6 and (tmp_path / "fsdp" / "checkpoint" / "state.json").is_file()
    assert_close(weights(tmp_path / "plain"), weights(tmp_path / "fsdp"), atol=1e-5)
