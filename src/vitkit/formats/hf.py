"""Hugging Face ViT directories: `config.json` with `model.safetensors` (possibly sharded) or `pytorch_model.bin`.

`ViTForImageClassification` stores the encoder under `vit.` and the head as `classifier`; a bare `ViTModel` has
no prefix and may have a `pooler` (dense + tanh on the class token), which is the paper's pre-logits layer.
Attention is split into `query`, `key`, `value` Linears; ours is one fused `qkv`. The config's `hidden_act`,
`layer_norm_eps` (1e-12 by default there), `qkv_bias`, `image_size` and `id2label` (our `class_names`) are kept.
"""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path

from safetensors.torch import save_file

from vitkit.data.images import ALPHA
from vitkit.errors import CheckpointError
from vitkit.files import atomic_write, read_safetensors, read_torch
from vitkit.models.config import ViTConfig
from vitkit.models.vit import VisionTransformer

from .common import (
    Rule,
    Tensors,
    export_tensors,
    fused_qkv,
    make_config,
    model_from_rules,
    normalization,
    rename,
    require_learned_posemb,
)

NAME = "hf"
ACTS = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
PREPROCESSOR = "preprocessor_config.json"


def linear(ours: str, theirs: str, bias: bool = True) -> list[Rule]:
    return [rename(f"{ours}.weight", f"{theirs}.weight")] + ([rename(f"{ours}.bias", f"{theirs}.bias")] if bias else [])


def embedding_rules(p: str) -> list[Rule]:
    """Class token, posemb and patch embedding under Hugging Face's names (ViT and Dinov2 alike)."""
    return [
        rename("cls_token", f"{p}embeddings.cls_token"),
        rename("posemb.weight", f"{p}embeddings.position_embeddings"),
        *linear("embedding", f"{p}embeddings.patch_embeddings.projection"),
    ]


def attention_rules(ours: str, theirs: str, qkv_bias: bool) -> list[Rule]:
    """Hugging Face's separate query, key and value and its output dense (ViT and Dinov2 alike) <-> our fused
    `attn.qkv` and `attn.proj` of block `ours`."""
    q, k, v = (f"{theirs}.attention.attention.{n}" for n in ("query", "key", "value"))
    params = ("weight", "bias") if qkv_bias else ("weight",)
    fused = [
        fused_qkv(f"{ours}.attn.qkv.{t}", f"{q}.{t}", f"{k}.{t}", f"{v}.{t}", lambda c: c, lambda c: c) for t in params
    ]
    return fused + linear(f"{ours}.attn.proj", f"{theirs}.attention.output.dense")


def rules_for(config: ViTConfig, p: str) -> list[Rule]:
    """Every tensor of the model under its Hugging Face name; `p` is "vit." in `ViTForImageClassification`, "" in
    a bare `ViTModel`."""
    rules = embedding_rules(p)
    for i in range(config.num_layers):
        ours, theirs = f"blocks.{i}", f"{p}encoder.layer.{i}"
        rules += linear(f"{ours}.norm1", f"{theirs}.layernorm_before")
        rules += attention_rules(ours, theirs, config.qkv_bias)
        rules += linear(f"{ours}.norm2", f"{theirs}.layernorm_after")
        rules += linear(f"{ours}.mlp.fc1", f"{theirs}.intermediate.dense")
        rules += linear(f"{ours}.mlp.fc2", f"{theirs}.output.dense")
    rules += linear("encoder_norm", f"{p}layernorm")
    if config.representation_size:
        rules += linear("pre_logits.0", "pooler.dense")
    if config.num_classes:
        rules += linear("head", "classifier")
    return rules


def read_weights(directory: Path) -> Tensors:
    """The directory's weights: safetensors (one file or shards listed in the index), else a weights-only .bin."""
    if (directory / "model.safetensors").is_file():
        return read_safetensors(directory / "model.safetensors")[0]
    if (directory / "model.safetensors.index.json").is_file():
        index = directory / "model.safetensors.index.json"
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        outside = [s for s in shards if not isinstance(s, str) or Path(s).name != s or s in ("", ".", "..")]
        if outside:
            raise CheckpointError(index, f"shards must be files of the directory itself, not {outside[0]!r}.")
        tensors: Tensors = {}
        for shard in shards:
            part = read_safetensors(directory / shard)[0]
            if set(part) & set(tensors):
                raise CheckpointError(
                    directory / shard, "holds a tensor another shard holds too.", min(set(part) & set(tensors))
                )
            tensors.update(part)
        return tensors
    if (directory / "pytorch_model.bin").is_file():
        return read_torch(directory / "pytorch_model.bin")
    raise FileNotFoundError(f"{directory}: none of {', '.join(WEIGHTS)} found in this Hugging Face directory.")


def infer_config(hf: dict, tensors: Tensors, path: Path, overrides: dict) -> ViTConfig:
    """Our config from `config.json`, with the head and pre-logits sizes read from the tensors."""
    if hf.get("model_type") != "vit":
        raise ValueError(f"{path}: model_type={hf.get('model_type')!r}; only Hugging Face 'vit' models are supported.")
    act = hf.get("hidden_act", "gelu")
    if act not in ACTS:
        raise ValueError(f"{path}: hidden_act={act!r} has no vitkit equivalent; supported: {sorted(ACTS)}.")
    if hf.get("pooler_act", "tanh") != "tanh" and "pooler.dense.weight" in tensors:
        raise ValueError(f"{path}: pooler_act={hf['pooler_act']!r}; vitkit's pre-logits layer uses tanh.")
    classifier = tensors.get("classifier.weight")
    pooler = tensors.get("pooler.dense.weight")
    inferred = dict(
        image_size=hf.get("image_size", 224),
        patch_size=hf.get("patch_size", 16),
        in_chans=hf.get("num_channels", 3),
        num_classes=classifier.shape[0] if classifier is not None else 0,
        hidden_size=hf.get("hidden_size", 768),
        num_layers=hf.get("num_hidden_layers", 12),
        num_heads=hf.get("num_attention_heads", 12),
        mlp_dim=hf.get("intermediate_size", 3072),
        representation_size=pooler.shape[0] if pooler is not None and classifier is None else None,
        dropout_rate=float(hf.get("hidden_dropout_prob", 0.0)),
        attention_dropout_rate=float(hf.get("attention_probs_dropout_prob", 0.0)),
        act=ACTS[act],
        layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
        qkv_bias=hf.get("qkv_bias", True),
    )
    return make_config(inferred, overrides, path, tensors)


def class_names_of(hf: dict, num_classes: int) -> list[str] | None:
    """`id2label` in index order, or None when it holds only the default `LABEL_i` names."""
    labels = {int(i): name for i, name in hf.get("id2label", {}).items()}
    if sorted(labels) != list(range(num_classes)) or all(labels[i] == f"LABEL_{i}" for i in labels):
        return None
    return [labels[i] for i in range(num_classes)]


def detect(path: Path) -> bool:
    """A directory, unless its config.json names another model type than ViT (a DINOv2 directory, say) or is
    timm's hub layout (an `architecture` and no `model_type`)."""
    if not path.is_dir():
        return False
    try:
        config = json.loads((path / "config.json").read_text())
        model_type = config.get("model_type", "vit")
    except (OSError, ValueError, AttributeError):
        return True  # no or broken config.json: `load` says what is wrong with the directory
    return model_type == "vit" and not ("architecture" in config and "model_type" not in config)


def load(path: str | os.PathLike, image_size=None, **overrides) -> VisionTransformer:
    """A Hugging Face ViT directory as a model (`image_size` here only adapts, the native one is in config.json)."""
    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{directory}: no config.json, so this is not a Hugging Face model directory.")
    try:
        hf = json.loads((directory / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{directory / 'config.json'}: not valid JSON ({e}).") from e
    tensors = read_weights(directory)
    config = infer_config(hf, tensors, directory, overrides)
    prefix = "vit." if any(k.startswith("vit.") for k in tensors) else ""
    model = model_from_rules(config, rules_for(config, prefix), tensors, directory, "Hugging Face ViT")
    model.class_names = class_names_of(hf, config.num_classes)
    model.normalization = processor_normalization(directory, config.in_chans)
    return model


def processor_normalization(directory: Path, in_chans: int) -> dict | None:
    """The mean and std of the directory's image processor (`preprocessor_config.json`), where it has one: pixels
    are scaled to [0, 1], then normalised with them (or not at all, with `do_normalize` false)."""
    file = directory / PREPROCESSOR
    if not file.is_file():
        return None
    try:
        processor = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(file, f"not valid JSON ({e}).") from e
    if not isinstance(processor, dict):
        raise CheckpointError(file, "not a JSON object of the image processor's settings.")
    if not processor.get("do_normalize", True):
        return normalization(0.0, 1.0, in_chans, file, "do_normalize")
    return normalization(processor.get("image_mean"), processor.get("image_std"), in_chans, file, "image_mean")


def export(model: VisionTransformer, path: str | os.PathLike) -> None:
    """A directory that `transformers.ViTForImageClassification.from_pretrained` loads (`ViTModel` if headless),
    with the `preprocessor_config.json` that `AutoImageProcessor` and `pipeline("image-classification")` read."""
    config = model.config
    require_learned_posemb(config, NAME)
    unsupported = [
        f"{name}={getattr(config, name)!r}"
        for name, ok in (
            ("classifier", config.classifier == "token"),
            ("hybrid", not config.hybrid),
            ("layer_scale_init", not config.layer_scale_init),
        )
        if not ok
    ]
    if unsupported:
        raise ValueError(
            f"Hugging Face ViT cannot hold {', '.join(unsupported)} (it has a class token, no ResNet stem, "
            "no layer scale): export to 'vitkit' (or 'npz' for gap and hybrid models) instead."
        )
    if config.representation_size and config.num_classes:
        raise ValueError(
            "Hugging Face ViTForImageClassification has no pre-logits layer: drop it with model.reset_head(...) "
            "or export the headless model (num_classes=0), whose pre-logits become ViTModel's pooler."
        )
    tensors = export_tensors(model, rules_for(config, "vit." if config.num_classes else ""), NAME)
    names = model.class_names or [f"LABEL_{i}" for i in range(config.num_classes)]
    square = lambda pair: pair[0] if pair[0] == pair[1] else list(pair)
    hf = {
        "architectures": ["ViTForImageClassification" if config.num_classes else "ViTModel"],
        "model_type": "vit",
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "intermediate_size": config.mlp_dim,
        "hidden_act": {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}[config.act],
        "hidden_dropout_prob": config.dropout_rate,
        "attention_probs_dropout_prob": config.attention_dropout_rate,
        "layer_norm_eps": config.layer_norm_eps,
        "image_size": square(config.image_size),
        "patch_size": square(config.patch_size),
        "num_channels": config.in_chans,
        "qkv_bias": config.qkv_bias,
        "pooler_output_size": config.representation_size or config.hidden_size,
        "pooler_act": "tanh",
        "id2label": {str(i): name for i, name in enumerate(names)},
        "label2id": {name: i for i, name in enumerate(names)},
    }
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write(directory / "model.safetensors", lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    for name, data in (("config.json", hf), (PREPROCESSOR, preprocessor_config(model))):
        atomic_write(directory / name, partial(write_json, data=data))


def write_json(path: str, data: dict) -> None:
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def preprocessor_config(model: VisionTransformer) -> dict:
    """vitkit's evaluation preprocessing in the words of transformers' `ViTImageProcessor`: the whole image
    resized (bilinear) to the model resolution, then x / 127.5 - 1, i.e. (x / 255 - 0.5) / 0.5, to [-1, 1] (or
    normalised with the model's own mean and std).

    `pipeline("image-classification")` reads every image as RGB, so it serves 3-channel models; a 1-channel
    model needs its images converted to grayscale by hand before the processor."""
    config = model.config
    return {
        "image_processor_type": "ViTImageProcessor",
        "do_resize": True,
        "size": {"height": config.image_size[0], "width": config.image_size[1]},
        "resample": 2,  # PIL's BILINEAR
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": (model.normalization or {}).get("mean", [0.5] * config.in_chans),
        "image_std": (model.normalization or {}).get("std", [0.5] * config.in_chans),
        # Transparency: vitkit drops the alpha channel, as the pipeline's `load_image` does (convert("RGB")). The
        # processor's own conversion composites over white instead, so it stays off; `alpha` states the rule.
        "do_convert_rgb": False,
        "alpha": ALPHA,
    }
