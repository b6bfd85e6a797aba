"""timm `VisionTransformer` state dicts (`.safetensors`, or `.pth` / `.bin` read weights-only).

timm's names differ from ours only at the ends (`patch_embed.proj` = `embedding`, `pos_embed` = `posemb.weight`,
`norm` = `encoder_norm`); its blocks (`norm1`, fused `attn.qkv`, `attn.proj`, `norm2`, `mlp.fc1/fc2`, `ls1/ls2`)
are ours. A state dict does not record the number of heads: pass `num_heads=` or get timm's rule,
hidden_size // 64. timm uses exact GELU and LayerNorm eps 1e-6. Files written by `export` also carry the vitkit
config and class names in the safetensors metadata, which timm ignores.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from vitkit.data.images import ALPHA
from vitkit.files import atomic_write, read_safetensors, read_torch
from vitkit.models.config import ViTConfig
from vitkit.models.vit import VisionTransformer

from .common import (
    Rule,
    Tensors,
    export_tensors,
    infer_grid,
    make_config,
    model_from_rules,
    normalization,
    rename,
    require,
    require_learned_posemb,
)

NAME = "timm"
WEIGHTS = "model.safetensors"  # in a hub-layout directory, beside config.json
BIN_WEIGHTS = "pytorch_model.bin"  # what older Hub repositories hold instead (read weights-only)
_RENAMED = (("embedding.", "patch_embed.proj."), ("posemb.weight", "pos_embed"), ("encoder_norm.", "norm."))


def timm_name(key: str) -> str:
    """Our state-dict name -> timm's; blocks and the head are named alike."""
    for ours, theirs in _RENAMED:
        if key.startswith(ours):
            return theirs + key.removeprefix(ours)
    return key


def rules_for(config: ViTConfig) -> list[Rule]:
    """Every tensor of the model under timm's name."""
    with torch.device("meta"):  # only the names are needed: no memory, no initialisation cost
        keys = VisionTransformer(config).state_dict().keys()
    return [rename(key, timm_name(key)) for key in keys]


def infer_config(tensors: Tensors, path: str | os.PathLike, image_size) -> dict:
    """The config fields the tensor shapes determine; the heads by timm's rule (hidden_size // 64)."""
    require(tensors, "patch_embed.proj.weight", path, NAME)
    if "fc_norm.weight" in tensors:
        raise ValueError(
            f"{path}: this timm model applies its final LayerNorm after pooling (fc_norm, global_pool='avg'); "
            "vitkit's classifier='gap' normalises before pooling, so it cannot represent it exactly."
        )
    kernel = tensors["patch_embed.proj.weight"]  # (D, Cin, ph, pw)
    hidden, token = kernel.shape[0], "cls_token" in tensors
    patch = (kernel.shape[2], kernel.shape[3])
    posemb = require(tensors, "pos_embed", path, NAME)  # (1, N, D), class-token row included
    grid = infer_grid(posemb.shape[1] - token, image_size, patch, path)
    return dict(
        image_size=(grid[0] * patch[0], grid[1] * patch[1]),
        patch_size=patch,
        in_chans=kernel.shape[1],
        num_classes=tensors["head.weight"].shape[0] if "head.weight" in tensors else 0,
        hidden_size=hidden,
        num_layers=len({k.split(".")[1] for k in tensors if k.startswith("blocks.")}),
        num_heads=hidden // 64,
        mlp_dim=require(tensors, "blocks.0.mlp.fc1.weight", path, NAME).shape[0],
        classifier="token" if token else "gap",
        layer_scale_init=1e-5 if "blocks.0.ls1.gamma" in tensors else None,
        act="gelu",
        layer_norm_eps=1e-6,
        qkv_bias="blocks.0.attn.qkv.bias" in tensors,
    )


def detect(path: Path) -> bool:
    """A state-dict file: `.safetensors` (not vitkit's, which is asked first) or `.pth` / `.pt` / `.bin`; or a
    directory in timm's hub layout, whose `config.json` names an `architecture`."""
    if path.is_dir():
        return is_hub_dir(path)
    return path.is_file() and path.suffix.lower() in (".safetensors", ".pth", ".pt", ".bin")


def hub_weights(directory: str | os.PathLike) -> Path:
    """The weights of a timm hub-layout directory: `model.safetensors`, or else an older repository's
    `pytorch_model.bin`."""
    for name in (WEIGHTS, BIN_WEIGHTS):
        if (Path(directory) / name).is_file():
            return Path(directory) / name
    raise FileNotFoundError(
        f"{directory}: holds neither {WEIGHTS} nor {BIN_WEIGHTS}; a timm hub directory keeps its weights in one "
        "of them beside config.json."
    )


def is_hub_dir(path: str | os.PathLike) -> bool:
    """A directory in timm's hub layout: `config.json` naming an `architecture`, beside `model.safetensors`."""
    config = Path(path) / "config.json"
    try:
        return config.is_file() and "architecture" in json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False


def load(path: str | os.PathLike, image_size=None, **overrides) -> VisionTransformer:
    """A timm state dict (or a hub-layout directory) as a model; the config comes from the tensor shapes (or
    vitkit's metadata, if present)."""
    pretrained_cfg: dict = {}
    if Path(path).is_dir():
        pretrained_cfg = json.loads((Path(path) / "config.json").read_text()).get("pretrained_cfg") or {}
        path = hub_weights(path)
    if Path(path).suffix == ".safetensors":
        tensors, metadata = read_safetensors(path)
    else:
        tensors, metadata = read_torch(path), {}
    if "vitkit_config" in metadata:
        inferred = json.loads(metadata["vitkit_config"])
    else:
        inferred = infer_config(tensors, path, image_size)
        if "num_heads" not in overrides and inferred["hidden_size"] % 64:
            raise ValueError(
                f"{path}: a timm state dict does not record the number of heads and hidden_size="
                f"{inferred['hidden_size']} is not a multiple of 64 (timm's usual head width): pass num_heads=."
            )
    config = make_config(inferred, overrides, path, tensors)
    model = model_from_rules(config, rules_for(config), tensors, path, NAME)
    if "class_names" in metadata:
        model.class_names = json.loads(metadata["class_names"])
    # The input's mean and std: as vitkit recorded them, or the hub directory's (ImageNet's, say).
    norm = json.loads(metadata["normalization"]) if "normalization" in metadata else pretrained_cfg
    if isinstance(norm, dict):
        model.normalization = normalization(norm.get("mean"), norm.get("std"), config.in_chans, path, "normalization")
    return model


def model_args(config: ViTConfig) -> dict:
    """The arguments of timm's `VisionTransformer` that build this model's layout."""
    square = lambda pair: pair[0] if pair[0] == pair[1] else list(pair)
    args = dict(
        img_size=square(config.image_size),
        patch_size=square(config.patch_size),
        in_chans=config.in_chans,
        num_classes=config.num_classes,
        embed_dim=config.hidden_size,
        depth=config.num_layers,
        num_heads=config.num_heads,
        mlp_ratio=config.mlp_dim / config.hidden_size,
        qkv_bias=config.qkv_bias,
    )
    if config.classifier == "gap":
        args.update(class_token=False, global_pool="avg", fc_norm=False)
    if config.layer_scale_init:
        args["init_values"] = config.layer_scale_init
    if config.act == "gelu_tanh":
        args["act_layer"] = "gelu_tanh"
    return args


def hub_config(model: VisionTransformer) -> dict:
    """timm's hub `config.json`: an `architecture` it knows, `model_args` that reshape it into this model, and
    the `pretrained_cfg` of vitkit's evaluation preprocessing (bilinear resize of the whole image to [-1, 1], or
    with the model's own mean and std), from which `timm.data.create_transform(**resolve_data_config({},
    model=m))` builds the same transform."""
    c = model.config
    size = {192: "tiny", 384: "small", 768: "base", 1024: "large", 1280: "huge"}.get(c.hidden_size, "base")
    pretrained_cfg = {
        "input_size": [c.in_chans, *c.image_size],
        "fixed_input_size": True,
        "interpolation": "bilinear",
        "crop_pct": 1.0,
        "crop_mode": "squash",  # the whole image, resized to input_size (aspect ratio not kept), as vitkit does
        "mean": (model.normalization or {}).get("mean", [0.5] * c.in_chans),
        "std": (model.normalization or {}).get("std", [0.5] * c.in_chans),
        "num_classes": c.num_classes,
        "pool_size": None,
        "first_conv": "patch_embed.proj",
        "classifier": "head",
    }
    if model.class_names is not None:
        pretrained_cfg["label_names"] = list(model.class_names)
    return {
        "architecture": f"vit_{size}_patch16_224",  # any ViT name serves: model_args set every dimension
        "num_classes": c.num_classes,
        "num_features": c.hidden_size,
        "global_pool": "token" if c.classifier == "token" else "avg",
        "model_args": model_args(c),
        "pretrained_cfg": pretrained_cfg,
        # Transparency: the alpha channel dropped, as timm's own image loaders do (convert("RGB")); stated beside
        # `pretrained_cfg`, which timm reads into a dataclass that takes no key it does not know.
        "alpha": ALPHA,
    }


def export(model: VisionTransformer, path: str | os.PathLike) -> None:
    """A safetensors state dict that timm's `VisionTransformer` with the matching arguments (`model_args`)
    loads strictly; a `path` without a suffix becomes a directory in timm's hub layout, `model.safetensors`
    with a `config.json` from which `timm.create_model("local-dir:PATH", pretrained=True)` builds the model.

    Matching arguments: `img_size`, `patch_size`, `embed_dim`, `depth`, `num_heads`, `mlp_ratio`, `qkv_bias`,
    `num_classes`, `class_token=False, global_pool='avg', fc_norm=False` for gap models, `init_values` with layer
    scale, and a tanh `act_layer` for gelu_tanh models. timm has no pre-logits layer.
    """
    require_learned_posemb(model.config, NAME)
    if model.config.hybrid:
        raise ValueError(f"hybrid={model.config.hybrid}: timm's hybrid layout differs; export to 'npz' or 'vitkit'.")
    if model.config.representation_size:
        raise ValueError("timm's VisionTransformer has no pre-logits layer: drop it with model.reset_head(...) first.")
    tensors: Tensors = export_tensors(model, rules_for(model.config), NAME)
    metadata = {"format": "pt", "vitkit_config": json.dumps(model.config.to_dict())}
    if model.class_names is not None:
        metadata["class_names"] = json.dumps(list(model.class_names))
    if model.normalization:
        metadata["normalization"] = json.dumps(model.normalization)
    if Path(path).suffix not in ("", ".safetensors"):
        raise ValueError(
            f"{path}: timm export writes safetensors; name the file *.safetensors, or give a path "
            "without a suffix for timm's hub directory (model.safetensors + config.json)."
        )
    if Path(path).suffix:
        atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata))
        return
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write(directory / WEIGHTS, lambda tmp: save_file(tensors, tmp, metadata))
    text = json.dumps(hub_config(model), indent=2) + "\n"
    atomic_write(directory / "config.json", lambda tmp: Path(tmp).write_text(text))
