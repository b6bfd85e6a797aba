import math

import pytest
import torch

from helpers import tiny
from vitkit.cli.commands import _config_and_given
from vitkit.cli.parser import build_parser
from vitkit.training.optimization import (
    build_optimizer,
    layer_depth,
    learning_rate,
    param_groups,
    set_learning_rate,
    set_trainable,
)
from vitkit.training.recipes import FINETUNE_DEFAULTS, TrainConfig


def test_schedule_is_the_official_linear_warmup_then_cosine_or_linear_decay():
    lr = lambda step, kind="cosine": learning_rate(step, 100, 0.1, 10, kind)
    assert math.isclose(lr(1), 0.01) and math.isclose(lr(5), 0.05) and math.isclose(lr(10), 0.1)
    assert math.isclose(lr(55), 0.05) and math.isclose(lr(100), 0.0, abs_tol=1e-12)  # cosine: half-way is half
    assert math.isclose(lr(32.5), 0.1 * 0.5 * (1 + math.cos(math.pi * 0.25)))
    assert math.isclose(lr(55, "linear"), 0.05) and math.isclose(lr(77.5, "linear"), 0.025)
    assert math.isclose(learning_rate(1, 100, 0.1, 0, "cosine"), 0.1 * 0.5 * (1 + math.cos(math.pi / 100)))


def test_weight_decay_applies_to_weight_matrices_only():
    model = tiny(posemb="learn", layer_scale_init=0.1, representation_size=8)
    decayed, plain = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed_names = {names[id(p)] for p in decayed["params"]}
    plain_names = {names[id(p)] for p in plain["params"]}
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert decayed_names == {
        n for n, p in model.named_parameters() if n.endswith("weight") and p.ndim >= 2 and not n.startswith("posemb")
    }
    assert {"embedding.weight", "head.weight", "blocks.0.attn.qkv.weight", "pre_logits.0.weight"} <= decayed_names
    assert {"cls_token", "posemb.weight", "encoder_norm.weight", "blocks.0.ls1.gamma", "head.bias"} <= plain_names
    # and AdamW really decays only those: with zero gradients, only decayed weights shrink
    optimizer = build_optimizer(model, TrainConfig(lr=0.1, weight_decay=0.5))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for n, p in model.named_parameters():
        expected = before[n] * (1 - 0.1 * 0.5) if n in decayed_names else before[n]
        assert torch.allclose(p, expected), n


def test_layer_decay_scales_each_depths_learning_rate_as_beit_and_timm():
    # SGD without momentum moves each parameter by its group's lr times the gradient (ones): the move is the lr
    model = tiny(layer_scale_init=0.1, representation_size=8)  # 2 blocks: depths 0 (embedding) to 3 (head)
    config = TrainConfig(optimizer="sgd", momentum=0.0, weight_decay=0.0, layer_decay=0.5)
    optimizer = build_optimizer(model, config)
    set_learning_rate(optimizer, 0.8)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    expected = {"embedding.weight": 0.1, "cls_token": 0.1, "posemb.weight": 0.1, "blocks.0.attn.qkv.weight": 0.2}
    expected |= {"blocks.1.mlp.fc2.bias": 0.4, "blocks.1.ls1.gamma": 0.4, "encoder_norm.weight": 0.8}
    expected |= {"pre_logits.0.weight": 0.8, "head.bias": 0.8}
    moved = {n: (before[n] - p).mean().item() for n, p in model.named_parameters()}
    for name, lr in expected.items():
        assert math.isclose(moved[name], lr, rel_tol=1e-5), (name, moved[name], lr)
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(moved)  # every parameter, in one group
    assert layer_depth("_fsdp_wrapped_module.blocks.1._checkpoint_wrapped_module.mlp.fc1.weight", 2) == 2
    # weight decay still applies to weight matrices only, in every depth's pair of groups
    decayed = {id(p) for g in param_groups(model, 0.1, 0.5) if g["weight_decay"] for p in g["params"]}
    assert decayed == {id(p) for p in param_groups(model, 0.1)[0]["params"]}
    with pytest.raises(ValueError, match="layer_decay=0 must be in"):
        TrainConfig(layer_decay=0)


def sublayer(kind: str, layers: tuple[str, str]) -> set[str]:
    return {f"blocks.{i}.{kind}.{m}.{k}" for i in (0, 1) for m in layers for k in ("weight", "bias")}


def test_adamw_uses_the_fused_kernel_on_plain_tensors_with_the_loops_result():
    # One fused pass over all parameters (0.9 ms a step for the main job's model on a CPU, 4.6 ms for the loop).
    model, reference = tiny(), tiny()
    reference.load_state_dict(model.state_dict())
    start = model.embedding.weight.detach().clone()
    config = TrainConfig(lr=0.01)
    fused = build_optimizer(model, config)
    loop = torch.optim.AdamW(
        param_groups(reference, config.weight_decay), lr=config.lr, betas=config.betas, foreach=False
    )
    assert fused.defaults["fused"] is True and not loop.defaults["fused"]
    x, target = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    for _ in range(3):
        for net, optimizer in ((model, fused), (reference, loop)):
            torch.nn.functional.cross_entropy(net(x), target).backward()
            optimizer.step()
            optimizer.zero_grad()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        if name.endswith("qkv.bias"):  # the key bias's gradient is 0 up to rounding (the softmax ignores it), and
            d = model.config.hidden_size  # Adam scales that noise up to whole steps: the query and value biases
            p, q = torch.cat([p[:d], p[2 * d :]]), torch.cat([q[:d], q[2 * d :]])
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    assert not torch.allclose(model.embedding.weight, start)  # it did learn


@pytest.mark.parametrize(
    "mode, extra",
    [("head", set()), ("attention", sublayer("attn", ("qkv", "proj"))), ("mlp", sublayer("mlp", ("fc1", "fc2")))],
)
def test_partial_finetuning_trains_exactly_the_chosen_parameters(mode, extra):
    expected = {"head.weight", "head.bias"} | extra
    model = tiny()
    assert set(set_trainable(model, mode)) == expected
    assert {n for n, p in model.named_parameters() if p.requires_grad} == expected
    optimizer = build_optimizer(model, TrainConfig(trainable=mode))
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(expected)
    assert len(set_trainable(model, "full")) == len(list(model.parameters()))


def test_frozen_blocks_keep_the_embedding_and_the_lowest_blocks_out_of_backward():
    model = tiny()  # 2 blocks
    learning = set(set_trainable(model, "full", frozen_blocks=1))
    before = ("embedding", "cls_token", "posemb", "blocks.0.")
    assert learning == {n for n, _ in model.named_parameters() if not n.startswith(before)}
    assert "blocks.1.attn.qkv.weight" in learning and "head.weight" in learning
    assert set(set_trainable(model, "mlp", frozen_blocks=1)) == {"head.weight", "head.bias"} | {
        n for n in sublayer("mlp", ("fc1", "fc2")) if n.startswith("blocks.1.")
    }
    set_trainable(model, "full", frozen_blocks=2)
    model(torch.randn(2, model.config.in_chans, *model.config.image_size)).sum().backward()
    assert all(p.grad is None for n, p in model.named_parameters() if n.startswith(("embedding", "blocks.")))
    assert model.head.weight.grad is not None
    with pytest.raises(ValueError, match="frozen_blocks=3: the model has 2 encoder blocks"):
        set_trainable(model, "full", frozen_blocks=3)
    with pytest.raises(ValueError, match="frozen_blocks=-1 must be >= 0"):
        TrainConfig(frozen_blocks=-1)


def test_train_config_reads_yaml_and_json_and_command_line_overrides_them(tmp_path):
    (tmp_path / "c.yaml").write_text("lr: 0.002\nepochs: 3\ncrop_scale: [0.5, 1.0]\nmodel_args: {hidden_size: 32}\n")
    (tmp_path / "c.json").write_text('{"batch_size": 64, "schedule": "cosine"}')
    assert TrainConfig.from_file(tmp_path / "c.yaml").crop_scale == (0.5, 1.0)
    assert TrainConfig.from_file(tmp_path / "c.json").schedule == "cosine"  # not the default
    args = build_parser().parse_args(
        ["train", "--config", str(tmp_path / "c.yaml"), "--epochs", "5", "--flip", "false",
         "--model-args", "hidden_size=48,num_heads=4", "--betas", "0.9", "0.95"]
    )  # fmt: skip
    config, _ = _config_and_given(args, {})
    assert (config.lr, config.epochs, config.flip, config.betas) == (0.002, 5.0, False, (0.9, 0.95))
    assert config.model_args == {"hidden_size": 48, "num_heads": 4}
    finetune, _ = _config_and_given(
        build_parser().parse_args(["finetune", "--checkpoint", "m.safetensors", "--lr", "0.03"]), FINETUNE_DEFAULTS
    )
    assert (finetune.optimizer, finetune.weight_decay, finetune.lr, finetune.model_args) == ("sgd", 0.0, 0.03, {})
    assert finetune.trainable == "full"
    # a --config file sets its own fields over the preset, not every field back to train's defaults
    args = build_parser().parse_args(["finetune", "--checkpoint", "m", "--config", str(tmp_path / "c.json")])
    finetune, _ = _config_and_given(args, FINETUNE_DEFAULTS)
    assert (finetune.optimizer, finetune.steps, finetune.batch_size, finetune.schedule) == ("sgd", 500, 64, "cosine")
    # the fields typed or in the file count as given whatever their values (the transfer's recipe keeps them)
    args = build_parser().parse_args(["train", "--config", str(tmp_path / "c.json"), "--label-smoothing", "0.1"])
    assert _config_and_given(args, {})[1] == {"batch_size", "schedule", "label_smoothing"}


def test_finetune_runs_the_papers_500_steps_unless_epochs_or_steps_are_given():
    def finetune(*options: str) -> TrainConfig:
        args = build_parser().parse_args(["finetune", "--checkpoint", "m.safetensors", *options])
        return _config_and_given(args, FINETUNE_DEFAULTS)[0]

    assert (finetune().steps, finetune("--epochs", "10").steps, finetune("--epochs", "10").epochs) == (500, None, 10)
    assert finetune("--steps", "80").steps == 80 and finetune("--steps", "80", "--epochs", "2").steps == 80
    assert "by default for 500 steps: the paper's length for its smallest datasets" in " ".join(
        build_parser()._subparsers._group_actions[0].choices["finetune"].format_help().split()
    )
    for flag in ("--trainable", "--train"):  # --train: the option's older spelling, still accepted
        args = build_parser().parse_args(["finetune", "--checkpoint", "m.safetensors", flag, "head"])
        assert _config_and_given(args, FINETUNE_DEFAULTS)[0].trainable == "head"


def test_train_config_errors_name_the_bad_value():
    with pytest.raises(ValueError, match="optimizer='lamb'"):
        TrainConfig(optimizer="lamb")
    with pytest.raises(ValueError, match="trainable='all' is unknown: choose one of full, head, attention, mlp"):
        TrainConfig(trainable="all")
    with pytest.raises(ValueError, match="batch_size=100 must be a positive multiple of accumulation_steps=3"):
        TrainConfig(batch_size=100, accumulation_steps=3)
    with pytest.raises(ValueError, match=r"unknown TrainConfig field\(s\) 'learning_rate'; valid fields: data, "):
        TrainConfig.from_dict({"learning_rate": 1.0})
    with pytest.raises(ValueError, match=r"'weight_decy' \(did you mean 'weight_decay'\?\)"):
        TrainConfig().replace(weight_decy=0.1)


def test_the_main_job_trains_on_all_its_training_images_and_other_runs_hold_val_out():
    from vitkit.training.recipes import MAIN_JOB_DATA_ARGS, main_job_data

    # `vitkit train` with no arguments: the final run of a recipe chosen on val, as the paper's final runs
    assert main_job_data(TrainConfig()).data_args == MAIN_JOB_DATA_ARGS == {"val_fraction": 0.0}
    assert main_job_data(TrainConfig(lr=1e-3)).data_args == MAIN_JOB_DATA_ARGS  # the same data, another recipe
    # another dataset, or data_args given (the recipe re-checked on val): as given
    for config in (TrainConfig(data="cifar10"), TrainConfig(data_args={"val_fraction": 0.1})):
        assert main_job_data(config) == config
