"""The BiT-style ResNet baseline: built from the hybrid's blocks, trained and saved like a ViT, costed exactly."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import vitkit
from vitkit.models.resnet import BiTConfig, ResNetClassifier, decode_bit


def test_bit_r26_has_the_resnet26_layout_and_a_zero_head():
    model = vitkit.create_model("BiT-R26", num_classes=10, image_size=32)
    assert isinstance(model, ResNetClassifier) and model.config.units == (2, 2, 2, 2)
    assert model.config.name == "BiT-R26" and decode_bit("BiT-R50x2").width_factor == 2
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == 1 + 3 * 8 + 4  # root, 3 per unit, a projection at the start of each stage
    assert model(torch.randn(2, 3, 32, 32)).abs().max() == 0  # zero-initialised head


def test_flops_and_params_match_torch_counters():
    config = BiTConfig(units=(1, 2), image_size=(28, 36), in_chans=1, num_classes=7)
    model = ResNetClassifier(config)
    with FlopCounterMode(display=False) as counter:
        model(torch.randn(1, 1, 28, 36))
    assert vitkit.flops(config) == counter.get_total_flops()
    assert vitkit.count_params(config) == sum(p.numel() for p in model.parameters())


def test_unknown_depth_names_the_known_ones():
    with pytest.raises(ValueError, match="BiT-R26"):
        vitkit.create_model("BiT-R27")


def test_export_and_load_checkpoint_round_trip(tmp_path):
    model = vitkit.create_model("BiT-R26", units=(1,), num_classes=3, image_size=16)
    torch.nn.init.normal_(model.head.weight)
    model.class_names = ["a", "b", "c"]
    vitkit.export(model, tmp_path / "bit.safetensors")
    loaded = vitkit.load_checkpoint(tmp_path / "bit.safetensors", image_size=24, num_classes=5)
    assert isinstance(loaded, ResNetClassifier) and loaded.config.image_size == (24, 24)
    assert loaded.config.num_classes == 5 and loaded.head.weight.abs().sum() == 0  # a new head for the new task
    same = vitkit.load_checkpoint(tmp_path / "bit.safetensors").eval()
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(same(x), model.eval()(x))
    with pytest.raises(ValueError, match="format='vitkit'"):
        vitkit.export(model, tmp_path / "bit.npz", format="npz")


@pytest.mark.slow
def test_vitkit_train_trains_and_resumes_the_resnet(tmp_path):
    from vitkit.training.loop import train

    config = vitkit.TrainConfig(
        data="shapes",
        data_args={"size": 32, "image_size": 16},
        model="BiT-R26",
        model_args={"units": [1]},
        batch_size=8,
        steps=4,
        eval_every=0,
        log_every=1,
        out_dir=str(tmp_path / "run"),
        threads=1,
    )
    stopped = train(config, stop_after=2)
    assert stopped.interrupted and stopped.step == 2
    done = train(resume=tmp_path / "run")
    assert not done.interrupted and done.step == 4 and done.final is not None
    model = vitkit.load_checkpoint(tmp_path / "run" / "model.safetensors")
    assert isinstance(model, ResNetClassifier) and model.class_names == vitkit.data.datasets.ShapesDataset.classes
