"""Image files of every awkward kind: converted where they can be, skipped with one warning each (or, with
`strict`, an error naming the file) where they cannot, in image folders, `eval`, `predict` and `inspect`."""

import io
import struct
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import vitkit
from helpers import write_image_folder
from vitkit.cli.parser import main
from vitkit.data.datasets import get_dataset
from vitkit.data.images import MAX_PIXELS, SkippedImageWarning, read_image
from vitkit.errors import ImageError
from vitkit.training.evaluation import evaluate

BAD = ("truncated.jpg", "empty.jpg", "notes.png", "bomb.png")


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def bomb_png(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height pixels, with almost no data: decoding would allocate them all."""
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", zlib.compress(b"\0" * 64))


def write_awkward_images(folder: Path) -> None:
    """One file of each kind the issue lists, good and bad."""
    folder.mkdir(parents=True, exist_ok=True)
    rgb = np.random.default_rng(0).integers(0, 256, (12, 12, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(folder / "good.png")
    buffer = io.BytesIO()
    Image.fromarray(rgb).resize((64, 64)).save(buffer, "JPEG", quality=90)
    (folder / "truncated.jpg").write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    (folder / "empty.jpg").write_bytes(b"")
    (folder / "notes.png").write_text("not an image, whatever the name says\n")
    Image.new("CMYK", (8, 8), (0, 255, 255, 0)).save(folder / "cmyk.jpg")  # pure red in CMYK
    rgba = Image.new("RGBA", (8, 8), (0, 0, 255, 255))
    rgba.putpixel((0, 0), (0, 0, 255, 0))  # one fully transparent pixel
    rgba.save(folder / "rgba.png")
    Image.fromarray(np.array([[0, 32768], [65535, 65535]], dtype=np.uint16)).save(folder / "gray16.png")
    palette = Image.new("P", (4, 4), 1)
    palette.putpalette([0, 0, 0, 10, 200, 30] + [0] * 762)
    palette.save(folder / "palette.png")
    tall = Image.new("RGB", (4, 2), (255, 0, 0))  # 4 wide, 2 high as stored...
    exif = Image.Exif()
    exif[0x0112] = 6  # ...but "rotate 90 degrees clockwise to view": upright it is 2 wide, 4 high
    tall.save(folder / "rotated.jpg", exif=exif)
    (folder / "bomb.png").write_bytes(bomb_png(50_000, 50_000))
    Image.new("RGB", (2, 2), (7, 8, 9)).save(folder / "pixel.png")  # the smallest usable (1 px: `MIN_SIDE`)


@pytest.fixture
def awkward(tmp_path) -> Path:
    write_awkward_images(tmp_path / "images")
    return tmp_path / "images"


def test_convertible_images_are_converted_as_documented(awkward):
    cmyk = read_image(awkward / "cmyk.jpg")
    assert cmyk.shape == (3, 8, 8) and cmyk[0].float().mean() > 200 and cmyk[1:].float().mean() < 60
    rgba = read_image(awkward / "rgba.png")
    assert rgba[:, 0, 0].tolist() == [0, 0, 255] and rgba[:, 1, 1].tolist() == [0, 0, 255]  # alpha dropped
    # ... as torchvision's loader (PIL's convert("RGB")) reads the same file
    assert rgba[:, 0, 0].tolist() == list(Image.open(awkward / "rgba.png").convert("RGB").getpixel((0, 0)))
    gray16 = read_image(awkward / "gray16.png", "L")
    assert gray16[0].tolist() == [[0, 128], [255, 255]]  # scaled from 16 bits, not clipped at 255
    assert read_image(awkward / "palette.png")[:, 0, 0].tolist() == [10, 200, 30]
    rotated = read_image(awkward / "rotated.jpg")
    assert rotated.shape == (3, 4, 2)  # upright, as the EXIF orientation says
    assert read_image(awkward / "pixel.png").flatten().tolist() == [7] * 4 + [8] * 4 + [9] * 4
    assert read_image(awkward / "pixel.png", "L").shape == (1, 2, 2)


def test_palette_transparency_drops_alpha_as_pil_does_without_a_warning_per_file(tmp_path):
    icon = Image.new("P", (4, 4), 1)
    icon.putpalette([0, 0, 0, 10, 200, 30, 250, 40, 90] + [0] * 759)
    icon.putpixel((0, 0), 2)
    icon.save(tmp_path / "icon.png", transparency=bytes([0, 128, 255]))  # per-entry alpha: a tRNS of bytes
    with Image.open(tmp_path / "icon.png") as im:
        assert isinstance(im.info["transparency"], bytes)
        with warnings.catch_warnings(record=True) as pil:
            warnings.simplefilter("always")
            expected = {mode: np.asarray(im.convert(mode)) for mode in ("RGB", "L")}
    assert any("Transparency expressed in bytes" in str(w.message) for w in pil)  # what a folder of them repeated
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rgb, gray = read_image(tmp_path / "icon.png"), read_image(tmp_path / "icon.png", "L")
    assert not caught, [str(w.message) for w in caught]
    assert rgb.permute(1, 2, 0).numpy().tolist() == expected["RGB"].tolist()
    assert gray[0].numpy().tolist() == expected["L"].tolist()


@pytest.mark.parametrize(
    "name, message",
    [
        ("truncated.jpg", r"truncated\.jpg: cannot be decoded \(image file is truncated"),
        ("empty.jpg", r"empty\.jpg: an empty file \(0 bytes\)"),
        ("notes.png", r"notes\.png: not an image PIL can read"),
        ("bomb.png", r"bomb\.png: .*2,?500,?000,?000 pixels.*refused without decoding"),
    ],
)
def test_unusable_images_raise_image_error_naming_the_file(awkward, name, message):
    with pytest.raises(ImageError, match=message):
        read_image(awkward / name)


def test_decompression_bomb_is_refused_before_decoding(awkward, monkeypatch):
    from PIL import ImageFile

    def no_decoding(self):
        raise AssertionError("decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    with pytest.raises(ImageError, match="refused without decoding"):
        read_image(awkward / "bomb.png")
    just_below = int(MAX_PIXELS**0.5)
    (awkward / "big.png").write_bytes(bomb_png(just_below, just_below))
    with pytest.raises(AssertionError, match="decoded"):  # under the limit it would be decoded
        read_image(awkward / "big.png")


def image_folder(root: Path) -> Path:
    """root/train/{a,b} and root/val/{a,b}; class `a` of each split holds every awkward file."""
    for split in ("train", "val"):
        write_awkward_images(root / split / "a")
        write_awkward_images(root / split / "b")
        for bad in BAD:
            (root / split / "b" / bad).unlink()
    return root


def test_image_folder_skips_bad_files_with_one_warning_each_and_counts_them(tmp_path):
    root = image_folder(tmp_path / "folder")
    with pytest.warns(SkippedImageWarning) as caught:
        dataset = get_dataset("imagefolder", "test", data_dir=root)
    assert sorted(Path(str(w.message).split(": ")[0].removeprefix("skipped ")).name for w in caught) == sorted(
        ["empty.jpg", "notes.png", "bomb.png"]
    )  # the header checks; the truncated file is found when decoded
    assert len(dataset) == 2 * 7 + 1  # 7 usable files in each class, and the truncated one of `a`
    model = vitkit.create_model(
        "ViT-Ti/4", image_size=8, hidden_size=8, num_layers=1, mlp_dim=8, num_heads=2, num_classes=2
    )
    with pytest.warns(SkippedImageWarning, match=r"truncated\.jpg") as caught:
        result = evaluate(model, dataset, batch_size=4)
        evaluate(model, dataset, batch_size=4)  # a second pass warns no more
    assert len(caught) == 1
    assert result.count == 14 and len(dataset.skipped) == 4


def test_image_folder_strict_fails_at_the_first_bad_file(tmp_path):
    root = image_folder(tmp_path / "folder")
    with pytest.raises(ImageError, match=r"val/a/(bomb\.png|empty\.jpg|notes\.png)"):
        get_dataset("imagefolder", "test", data_dir=root, strict=True)
    for name in ("bomb.png", "empty.jpg", "notes.png"):
        (root / "val" / "a" / name).unlink()
    dataset = get_dataset("imagefolder", "test", data_dir=root, strict=True)
    with pytest.raises(ImageError, match=r"truncated\.jpg: cannot be decoded"):
        evaluate(vitkit.create_model("ViT-Ti/4", image_size=8, num_layers=1, num_classes=2), dataset)


@pytest.fixture
def tiny_checkpoint(tmp_path) -> Path:
    model = vitkit.create_model(
        "ViT-Ti/4", image_size=8, hidden_size=8, num_layers=1, mlp_dim=8, num_heads=2, num_classes=2
    )
    model.class_names = ["a", "b"]
    vitkit.export(model, tmp_path / "m.safetensors")
    return tmp_path / "m.safetensors"


@pytest.mark.slow
def test_eval_predict_and_inspect_skip_bad_files_and_count_them_or_fail_when_strict(tmp_path, tiny_checkpoint, capsys):
    root = image_folder(tmp_path / "folder")
    checkpoint = str(tiny_checkpoint)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["eval", "--checkpoint", checkpoint, "--data", "imagefolder", "--data-dir", str(root)]) == 0
    out = capsys.readouterr().out
    assert "(14 images)" in out and "4 unreadable image file(s) skipped" in out
    assert sum(issubclass(w.category, SkippedImageWarning) for w in caught) == 4
    assert main(["eval", "--checkpoint", checkpoint, "--data", "imagefolder", "--data-dir", str(root), "--strict"]) == 2
    assert "val/a/" in capsys.readouterr().err

    files = sorted(str(p) for p in (root / "val" / "a").iterdir())
    with pytest.warns(SkippedImageWarning):
        assert main(["predict", "--checkpoint", checkpoint, *files]) == 0
    out = capsys.readouterr().out
    assert out.count("%") == 2 * 7 and "4 unreadable image file(s) skipped" in out  # 7 usable files, top 2
    assert main(["predict", "--checkpoint", checkpoint, "--strict", *files]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bomb.png" in err  # the first bad file, in sorted order

    with pytest.warns(SkippedImageWarning):
        assert main(["inspect", "--checkpoint", checkpoint, "--out", str(tmp_path / "report"), "--image", *files]) == 0
    assert "wrote" in capsys.readouterr().out and (tmp_path / "report" / "report.html").is_file()
    assert (
        main(["inspect", "--checkpoint", checkpoint, "--out", str(tmp_path / "r2"), "--strict", "--image", *files]) == 2
    )


def test_a_dead_dataloader_worker_is_reported_not_waited_on(tmp_path):
    import os
    import signal

    from vitkit.errors import WorkerError
    from vitkit.training.evaluation import batches

    class Killer(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, index):
            os.kill(os.getpid(), signal.SIGKILL)

    with pytest.raises(WorkerError, match=r"a data-loading worker process died .*--workers"):
        list(batches(Killer(), [[0, 1], [2, 3]], workers=1))


@pytest.mark.slow
def test_training_on_an_image_folder_skips_bad_files_and_counts_them_in_the_summary(tmp_path):
    import json

    from vitkit.training.loop import train
    from vitkit.training.recipes import TrainConfig

    root = image_folder(tmp_path / "folder")
    spec = dict(
        data="imagefolder",
        data_dir=str(root),
        image_size=16,
        model="ViT-Ti/8",
        batch_size=4,
        steps=6,
        model_args={"hidden_size": 8, "num_layers": 1, "mlp_dim": 8, "num_heads": 2},
        threads=1,
        out_dir=str(tmp_path / "run"),
    )
    with pytest.warns(SkippedImageWarning):
        result = train(TrainConfig(**spec))
    assert result.step == 6 and result.final.count == 14
    # 4 bad files in each split: 3 found when listed, the truncated one when decoded (6 steps cover each image).
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["skipped_images"] == 8
    with pytest.raises(ImageError, match=r"train/a/(bomb\.png|empty\.jpg|notes\.png)"):
        train(TrainConfig(**{**spec, "strict": True, "out_dir": str(tmp_path / "strict")}))


def test_hidden_files_and_folders_are_neither_classes_nor_images(tmp_path):
    from vitkit.training.evaluation import image_files

    pixels = np.zeros((8, 8, 3), np.uint8)
    for path in ("cat/1.png", "cat/sub/2.png", "dog/3.png", "cat/.ipynb_checkpoints/1-checkpoint.png",
                 ".ipynb_checkpoints/x.png", "__MACOSX/cat/._1.png", ".git/y.png"):  # fmt: skip
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(tmp_path / path)
    (tmp_path / "cat" / "._1.png").write_bytes(b"\x00\x05\x16\x07 macOS AppleDouble")  # no image, a dot first
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing hidden is even read, so no file is skipped as unreadable
        folder = get_dataset("imagefolder", "train", data_dir=tmp_path, val_fraction=0.5)
    assert folder.classes == ["cat", "dog"]
    everything = [p.relative_to(tmp_path).as_posix() for p in image_files([tmp_path])]
    assert everything == ["cat/1.png", "cat/sub/2.png", "dog/3.png"]  # a folder of class folders, whole


def test_a_folder_given_as_an_image_file_is_named_a_folder(tmp_path):
    from vitkit.data.images import read_image

    with pytest.raises(IsADirectoryError, match="a folder, not an image file"):
        read_image(tmp_path)


def test_files_that_are_not_images_are_counted_in_one_line_and_one_pixel_images_are_left_out(tmp_path):
    root = write_image_folder(tmp_path / "folder", per_class=4, classes=("a", "b"))
    for name in ("logo.svg", "notes.txt", "more.svg"):
        (root / "a" / name).write_text("<svg/>")
    Image.new("RGB", (1, 1)).save(root / "b" / "dot.png")
    Image.new("RGB", (1, 40)).save(root / "b" / "line.png")
    with pytest.warns(SkippedImageWarning) as caught:
        dataset = get_dataset("imagefolder", "train", data_dir=root, val_fraction=0)
    messages = [str(w.message) for w in caught]
    assert sum("not images" in m for m in messages) == 1  # one line for the folder, by kind
    assert any(m.endswith("left out 3 files that are not images (.svg 2, .txt 1)") for m in messages)
    assert sum("too small to use" in m for m in messages) == 2 and len(dataset.skipped) == 2
    assert all(p.suffix == ".png" or p.suffix == ".jpg" for p, _ in dataset.samples)
    assert not any(p.name in ("dot.png", "line.png") for p, _ in dataset.samples)
