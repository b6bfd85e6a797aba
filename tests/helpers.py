"""Small helpers shared by the tests: `from helpers import tiny, ...` (pyproject.toml puts tests/ on pytest's
sys.path). Fixtures stay in conftest.py."""

import ctypes
import os
from pathlib import Path

import numpy as np
import torch
from PIL import Image

import vitkit
from vitkit.training.recipes import TrainConfig

# The small ViT most tests use: 32 px images cut into a 4x4 grid of 8 px patches, width 32, 2 layers, 4 heads,
# 5 classes, the paper's defaults otherwise. Instant to build and to run on one core.
TINY = dict(image_size=32, patch_size=8, hidden_size=32, num_layers=2, num_heads=4, mlp_dim=64, num_classes=5)


# The training tests' model: ViT-Ti/8 with this encoder (model_args), on 16 px images; a few seconds per run.
SMALL_ENCODER = {"hidden_size": 16, "num_layers": 2, "mlp_dim": 32, "num_heads": 2}
SRC = Path(__file__).resolve().parents[1] / "src"  # PYTHONPATH for the subprocesses (CLI, torchrun) of the tests


def subprocess_env(*paths: Path) -> dict[str, str]:
    """The environment of a test's subprocess (the CLI, torchrun, a benchmark script): this worktree's sources on
    the path (then `paths`), and one OpenMP thread a process."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in (SRC, *paths)), "OMP_NUM_THREADS": "1"}


def run_weights(run_dir) -> dict[str, torch.Tensor]:
    """The final weights of a training run (its model.safetensors)."""
    from safetensors.torch import load_file

    return load_file(str(Path(run_dir) / "model.safetensors"))


def assert_same_weights(a: dict, b: dict, atol: float = 0.0) -> None:
    """Equal tensor for tensor (atol=0: bit for bit)."""
    assert a.keys() == b.keys()
    for k in a:
        if atol == 0.0:
            assert torch.equal(a[k], b[k]), k
        else:
            assert torch.allclose(a[k], b[k], rtol=0, atol=atol), (k, (a[k] - b[k]).abs().max())


def tiny_config(**changes) -> vitkit.ViTConfig:
    """TINY with `changes` applied."""
    return vitkit.ViTConfig(**TINY | changes)


def tiny(**changes) -> vitkit.VisionTransformer:
    """A freshly initialised tiny_config(**changes) model in eval mode (call .train() to train it)."""
    return vitkit.VisionTransformer(tiny_config(**changes)).eval()


def perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """Move every parameter off its initial value, so a skipped or mis-mapped tensor changes the output
    (zero-initialised heads and biases, unit LayerNorm scales would hide it). Returns the model in eval mode."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def shapes_config(out_dir, **overrides) -> TrainConfig:
    """A few-second run on 16-pixel shapes (decoded per sample, through the DataLoader path). One thread: for
    models this small a second thread only waits, and on a busy machine it makes a run many times slower."""
    spec = dict(
        data="shapes",
        data_args={"size": 48, "image_size": 16},
        model="ViT-Ti/8",
        model_args=dict(SMALL_ENCODER),
        batch_size=8,
        steps=10,
        eval_every=0,
        log_every=1,
        crop_scale=(0.3, 1.0),
        out_dir=str(out_dir),
        threads=1,
        precision="fp32",  # not "auto": runs are compared at fp32 tolerances on every machine
    )
    return TrainConfig(**{**spec, **overrides})


def write_image_folder(root, per_class: int = 12, classes=("cat", "dog", "owl")):
    """PNG and JPEG files of varied sizes, each image unique (its pixels encode class and index)."""
    rng = np.random.default_rng(0)
    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (10 + i % 3, 12, 3), dtype=np.uint8)
            pixels[0, 0] = (c, i, 7)
            suffix = ".jpg" if i % 4 == 0 else ".png"
            Image.fromarray(pixels).save(root / name / f"{i:03d}{suffix}")
    return root


def fingerprint(image: torch.Tensor, label: int) -> tuple:
    return (tuple(image.shape), image.numpy().tobytes(), int(label))


class _SignalStack(ctypes.Structure):
    _fields_ = [("ss_sp", ctypes.c_void_p), ("ss_flags", ctypes.c_int), ("ss_size", ctypes.c_size_t)]


def signal_stack_is_mapped() -> bool:
    """Whether this thread's alternate signal stack, if it has one, is still mapped memory. Each `openvino.Core` that
    is not vitkit's one (`openvino_copy.openvino_core`) can leave the thread on a freed one, and a later signal
    (a child process exiting) ends the whole test run with a bare segmentation fault."""
    stack = _SignalStack()
    if ctypes.CDLL(None).sigaltstack(None, ctypes.byref(stack)) != 0 or not stack.ss_sp:
        return True
    with open("/proc/self/maps") as maps:
        spans = [[int(a, 16) for a in line.split()[0].split("-")] for line in maps]
    return any(start <= stack.ss_sp and stack.ss_sp + stack.ss_size <= end for start, end in spans)
