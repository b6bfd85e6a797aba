"""Hugging Face `Dinov2Model` directories (DINOv2, Oquab et al. 2023): a ViT with LayerScale and a class token.

The blocks are named as in Hugging Face ViT except `norm1` / `norm2`, `mlp.fc1` / `mlp.fc2` and LayerScale's
`layer_scale1.lambda1` / `layer_scale2.lambda1` (our `ls1.gamma` / `ls2.gamma`). The position embedding is stored
for the pre-training grid (37x37 patches at 518 px) and interpolated on every forward pass to the input's grid
(bicubic, `align_corners=False`, no antialiasing); we interpolate it the same way once, at load time, to the
requested `image_size`, so the model then matches Dinov2Model at that size exactly.

Left out: `embeddings.mask_token`, which only replaces masked patches during self-supervised pre-training.
Refused with the reason: SwiGLU MLPs (`use_swiglu_ffn`, the giant model) and register tokens
(`Dinov2WithRegisters`), for which vitkit's encoder has no place: it holds exactly one prefix token.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from vitkit.models.config import ViTConfig
from vitkit.models.vit import VisionTransformer

from .common import Rule, Tensors, interpolated_posemb, make_config, model_from_rules, rename
from .hf import attention_rules, embedding_rules, linear, processor_normalization, read_weights

NAME = "dinov2"
WRITES = False  # load-only: `export` refuses


def detect(path: str | os.PathLike) -> bool:
    """A directory whose config.json says `model_type` dinov2 (or dinov2_with_registers, to refuse it clearly)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        return json.loads(config.read_text()).get("model_type", "").startswith("dinov2")
    except (json.JSONDecodeError, AttributeError):
        return False


def rules_for(config: ViTConfig) -> list[Rule]:
    """Every tensor of the model under its Dinov2Model name (the posemb is interpolated before the rules apply)."""
    rules = embedding_rules("")
    for i in range(config.num_layers):
        ours, theirs = f"blocks.{i}", f"encoder.layer.{i}"
        rules += linear(f"{ours}.norm1", f"{theirs}.norm1")
        rules += attention_rules(ours, theirs, config.qkv_bias)
        rules += [rename(f"{ours}.ls1.gamma", f"{theirs}.layer_scale1.lambda1")]
        rules += linear(f"{ours}.norm2", f"{theirs}.norm2")
        rules += linear(f"{ours}.mlp.fc1", f"{theirs}.mlp.fc1")
        rules += linear(f"{ours}.mlp.fc2", f"{theirs}.mlp.fc2")
        rules += [rename(f"{ours}.ls2.gamma", f"{theirs}.layer_scale2.lambda1")]
    return rules + linear("encoder_norm", "layernorm")


def infer_config(hf: dict, tensors: Tensors, path: Path, image_size, overrides: dict) -> ViTConfig:
    """Our config from config.json; unsupported variants are refused with the reason."""
    if hf.get("model_type") == "dinov2_with_registers" or hf.get("num_register_tokens"):
        raise ValueError(
            f"{path}: a DINOv2 with {hf.get('num_register_tokens')} register tokens. vitkit's encoder holds one prefix "
            "token (the class token) and its posemb, pooling and inspection assume so; registers would need a second "
            "kind of prefix token in the model, so this checkpoint is refused rather than loaded approximately."
        )
    if hf.get("use_swiglu_ffn"):
        raise ValueError(f"{path}: use_swiglu_ffn=True (SwiGLU MLP): vitkit's MLP is the paper's GELU MLP.")
    if hf.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"{path}: hidden_act={hf['hidden_act']!r}; only 'gelu' is supported for DINOv2.")
    hidden = hf.get("hidden_size", 768)
    patch = hf.get("patch_size", 14)
    inferred = dict(
        image_size=image_size or hf.get("image_size", 518),
        patch_size=patch,
        in_chans=hf.get("num_channels", 3),
        num_classes=0,
        hidden_size=hidden,
        num_layers=hf.get("num_hidden_layers", 12),
        num_heads=hf.get("num_attention_heads", 12),
        mlp_dim=int(hidden * hf.get("mlp_ratio", 4)),
        layer_scale_init=float(hf.get("layerscale_value", 1.0)),
        act="gelu",
        layer_norm_eps=hf.get("layer_norm_eps", 1e-6),
        qkv_bias=hf.get("qkv_bias", True),
    )
    return make_config(inferred, overrides, path, tensors)


def load(path: str | os.PathLike, image_size=None, **overrides) -> VisionTransformer:
    """A `Dinov2Model` directory as a headless model at `image_size` (default: config.json's), posemb
    interpolated as DINOv2 does."""
    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{directory}: no config.json, so this is not a Hugging Face model directory.")
    hf = json.loads((directory / "config.json").read_text())
    if hf.get("model_type") == "dinov2_with_registers" or hf.get("num_register_tokens"):
        infer_config(hf, {}, directory, image_size, overrides)  # refuses with the reason, before reading weights
    tensors: Tensors = read_weights(directory)
    config = infer_config(hf, tensors, directory, image_size, overrides)
    if any(k.startswith("dinov2.") for k in tensors):
        raise ValueError(
            f"{directory}: a Dinov2ForImageClassification, whose head reads the class token next to the mean patch "
            "token (2 x hidden_size inputs); vitkit's head reads one pooled vector. Save its `.dinov2` backbone "
            "(a Dinov2Model) and load that."
        )
    tensors.pop("embeddings.mask_token", None)  # masked-image pre-training only
    key = "embeddings.position_embeddings"
    if key in tensors:
        tensors[key] = interpolated_posemb(tensors[key], 1, config.grid_size)
    model = model_from_rules(config, rules_for(config), tensors, directory, "Hugging Face Dinov2Model")
    model.normalization = processor_normalization(directory, config.in_chans)  # ImageNet's, as DINOv2 is trained
    return model


def export(model: VisionTransformer, path: str | os.PathLike) -> None:
    raise ValueError("dinov2 is a load-only format in vitkit: export to 'vitkit', 'hf', 'timm' or 'npz' instead.")
