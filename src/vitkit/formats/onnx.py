"""ONNX graphs: vitkit's own exports (`export`), read back exactly, and ViT graphs from elsewhere (timm, Hugging
Face, DINOv2-style backbones), read with the `onnx` package, with their linear head where they have one.

`export` writes the model through PyTorch's own exporter with a dynamic batch axis, and records in the model's
metadata (`metadata_props`) what a runtime needs beside the graph: the config, the class names and the
preprocessing (`METADATA` lists the keys). A graph with that metadata is loaded by its weights' names; any other
graph by its structure (`onnx_parse.parse`).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import torch

from vitkit.data.images import ALPHA
from vitkit.errors import CheckpointError
from vitkit.files import atomic_write
from vitkit.models.vit import VisionTransformer

from .common import interpolated_posemb, make_config, model_from_rules, normalization, rename
from .onnx_graph import initializer_array, load_external_data
from .onnx_parse import parse

NAME = "onnx"


def detect(path: str | os.PathLike) -> bool:
    return Path(path).suffix.lower() == ".onnx" and Path(path).is_file()


def load(path: str | os.PathLike, image_size=None, **overrides) -> VisionTransformer:
    """The model `export` wrote (its recorded config, head and class names); or the ViT of another ONNX graph,
    with its linear head where it has one (else headless: `num_classes=0`), at `image_size` (default: the
    graph's)."""
    try:
        import onnx
    except ImportError as e:
        raise ImportError("reading ONNX graphs needs the onnx package: pip install onnx (or vitkit[onnx])") from e
    try:
        model = onnx.load(str(path), load_external_data=False)  # read below, after checking each reference
    except Exception as e:  # noqa: BLE001 - protobuf raises its own DecodeError
        raise ValueError(f"{path}: not a readable ONNX file ({type(e).__name__}: {e}).") from e
    load_external_data(model, path)
    metadata = {p.key: p.value for p in model.metadata_props}
    if "vitkit_config" in metadata:
        return _load_export(model, metadata, path, overrides)
    p = parse(model, path)
    hidden = p.tensors["embedding.weight"].shape[0]
    table = p.tensors["posemb.weight"]
    prefix = int(p.classifier == "token")
    side = math.isqrt(table.shape[1] - prefix)
    size = image_size or p.image_size or (side * p.patch[0], side * p.patch[1])
    inferred = dict(
        image_size=size,
        patch_size=p.patch,
        in_chans=p.tensors["embedding.weight"].shape[1],
        num_classes=p.num_classes,
        classifier=p.classifier,
        representation_size=p.representation_size,
        hidden_size=hidden,
        num_layers=p.layers,
        num_heads=p.heads,
        mlp_dim=p.tensors["blocks.0.mlp.fc1.weight"].shape[0],
        layer_scale_init=1.0 if p.layer_scale else None,
        act=p.act,
        layer_norm_eps=p.eps,
    )
    config = make_config(inferred, overrides, path, p.tensors)
    if p.resize is not None:  # resample as the graph does on every forward pass
        mode = {"cubic": "bicubic", "linear": "bilinear"}.get(p.resize["mode"])
        supported = p.resize["coordinates"] in ("half_pixel", "pytorch_half_pixel")
        if mode is None or not supported or (mode == "bicubic" and p.resize["cubic_coeff_a"] != -0.75):
            raise ValueError(f"{path}: the graph resamples its posemb with an unsupported Resize {p.resize}.")
        table = interpolated_posemb(table, prefix, config.grid_size, mode, p.resize["antialias"])
    elif side * side == table.shape[1] - prefix and (side, side) != config.grid_size:
        config, wanted = config.replace(image_size=(side * p.patch[0], side * p.patch[1])), config.image_size
        vit = model_from_rules(config, [rename(k, k) for k in p.tensors], p.tensors, path, NAME)
        vit.set_image_size(wanted)
        return vit
    p.tensors["posemb.weight"] = table
    return model_from_rules(config, [rename(k, k) for k in p.tensors], p.tensors, path, NAME)


def _load_export(model, metadata: dict[str, str], path, overrides: dict) -> VisionTransformer:
    """The model of a graph `export` wrote: the recorded config, each weight from the initializer of its name."""
    try:
        recorded = json.loads(metadata["vitkit_config"])
        class_names = json.loads(metadata["class_names"]) if "class_names" in metadata else None
        trained_on = json.loads(metadata["trained_on"]) if "trained_on" in metadata else None
    except ValueError as e:
        raise CheckpointError(path, f"its recorded config or class names are not valid JSON ({e}).",
                              "vitkit_config") from e  # fmt: skip
    held = {t.name: torch.from_numpy(np.array(initializer_array(t, path))) for t in model.graph.initializer}
    config = make_config(recorded, overrides, path, held)
    with torch.device("meta"):
        names = set(VisionTransformer(config).state_dict())
    # The graph's other initializers are its constants (a sincos posemb table, shapes): computed, not weights.
    tensors = {name: t for name, t in held.items() if name in names}
    vit = model_from_rules(config, [rename(k, k) for k in sorted(names)], tensors, path, NAME)
    vit.class_names, vit.trained_on = class_names, trained_on
    if "mean" in metadata or "std" in metadata:
        try:
            mean, std = (json.loads(metadata[k]) if k in metadata else None for k in ("mean", "std"))
        except ValueError as e:
            raise CheckpointError(path, f"its recorded mean or std is not valid JSON ({e}).", "mean") from e
        vit.normalization = normalization(mean, std, config.in_chans, path, "mean")
    return vit


# ----------------------------------------------------------------------------------------------------------
# Writing.
# ----------------------------------------------------------------------------------------------------------

# The opset the dynamo exporter writes natively (no version conversion): Gelu and LayerNormalization stay single
# operators, which the runtimes map to their fused kernels.
OPSET = 20
# A protobuf message holds at most 2 GiB, and the weights are kept inside the file (one file, written atomically).
MAX_BYTES = 2**31 - 2**24
# What `export` records in the model's `metadata_props` (each value a string; JSON where it is not text).
METADATA = {
    "vitkit_config": "the ViTConfig (JSON), from which vitkit rebuilds the model",
    "class_names": "the class names, in the order of the logits (JSON list; absent when the model has none)",
    "image_size": "[height, width] the graph takes (JSON)",
    "color_mode": "RGB, or L (grayscale) for a one-channel model",
    "alpha": "transparency: drop (the alpha channel is dropped and the colour stored under each pixel kept, as PIL's "
    'convert("RGB") does)',
    "resize": "how each whole image is brought to image_size: bilinear, antialiased, no crop",
    "rescale_factor": "pixel values 0..255 are multiplied by it first (1/255)",
    "mean": "then the per-channel mean is subtracted (JSON list)",
    "std": "and the result divided by the per-channel std (JSON list): inputs in [-1, 1] unless the model's checkpoint "
    "was normalised otherwise (`model.normalization`)",
    "trained_on": "what the model was trained on (JSON; absent when unknown)",
}


def preprocessing(model: VisionTransformer) -> dict[str, str]:
    """vitkit's evaluation preprocessing (`data.to_input`: bilinear resize, x / 127.5 - 1, or the checkpoint's own
    mean and std) in metadata terms."""
    config = model.config
    norm = model.normalization or {"mean": [0.5] * config.in_chans, "std": [0.5] * config.in_chans}
    return {
        "image_size": json.dumps(list(config.image_size)),
        "color_mode": "L" if config.in_chans == 1 else "RGB",
        "alpha": ALPHA,
        "resize": "bilinear, antialiased, no crop",
        "rescale_factor": repr(1 / 255),
        "mean": json.dumps(norm["mean"]),
        "std": json.dumps(norm["std"]),
    }


def exportable(model: VisionTransformer) -> None:
    """A ValueError naming what keeps `model` from export: a `vitkit.optimize` copy (packed or bf16 weights, which
    the exporter would write as opaque operators or in another precision) or one too large for one ONNX file."""
    with torch.device("meta"):
        plain = VisionTransformer(model.config)
    foreign = sorted({type(m).__name__ for m in model.modules()} - {type(m).__name__ for m in plain.modules()})
    if foreign:
        raise ValueError(
            f"the model holds {', '.join(foreign)} modules, which a plain VisionTransformer does not (a "
            "vitkit.optimize copy?): export the model as loaded; ONNX runtimes make their own fast copy."
        )
    dtypes = sorted({str(t.dtype) for t in model.state_dict().values()} - {"torch.float32"})
    if dtypes:
        raise ValueError(f"the model holds {', '.join(dtypes)} weights: export it in fp32 (model.float()); ONNX "
                         "runtimes pick their own precision at load.")  # fmt: skip
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    if size > MAX_BYTES:
        raise ValueError(
            f"the model's weights take {size / 2**30:.2f} GiB, more than the 2 GiB one ONNX file can hold: export "
            "it in vitkit's format (safetensors) instead."
        )


def export(model: VisionTransformer, path: str | os.PathLike) -> None:
    """An ONNX graph (opset `OPSET`) of `model`: input `images` (batch, C, H, W), already preprocessed, output
    `logits` (`features` for a headless model), the batch axis dynamic; every weight an initializer under its
    state-dict name; the config, class names and preprocessing in `metadata_props` (`METADATA`). Needs the onnx
    and onnxscript packages."""
    try:
        import onnx  # noqa: F401 - the exporter needs both; say so before it fails deep inside
        import onnxscript  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "ONNX export needs the onnx and onnxscript packages: pip install onnx onnxscript (or vitkit[onnx])"
        ) from e
    if Path(path).suffix.lower() != ".onnx":  # the suffix is how `detect` (and every runtime's user) knows it
        raise ValueError(f"{path}: ONNX export writes one .onnx file; name it *.onnx.")
    exportable(model)
    config = model.config
    x = torch.zeros(2, config.in_chans, *config.image_size, device=next(model.parameters()).device)
    was_training = model.training
    model.eval()
    try:
        # The dynamo exporter: the TorchScript one is deprecated and bakes traced Python branches in with warnings.
        # optimize=False keeps each weight under its state-dict name (folding a transpose renames it; runtimes fold
        # at load, and ran the graph as fast either way).
        program = torch.onnx.export(
            model, (x,), None, dynamo=True, optimize=False, opset_version=OPSET, verbose=False,
            input_names=["images"], output_names=["logits" if config.num_classes else "features"],
            dynamic_shapes={"x": {0: torch.export.Dim("batch")}},
        )  # fmt: skip
    finally:
        model.train(was_training)
    if program is None:  # what the TorchScript exporter returns; dynamo=True returns the program
        raise RuntimeError("torch.onnx.export returned no ONNX program")
    graph = program.model_proto
    graph.doc_string = f"vitkit VisionTransformer, {config.num_layers} layers, D={config.hidden_size}"
    metadata = {"vitkit_config": json.dumps(config.to_dict()), **preprocessing(model)}
    if model.class_names is not None:
        metadata["class_names"] = json.dumps(list(model.class_names))
    if model.trained_on:
        metadata["trained_on"] = json.dumps(model.trained_on)
    del graph.metadata_props[:]
    for key, value in metadata.items():
        graph.metadata_props.add(key=key, value=value)
    data = graph.SerializeToString()
    atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))
