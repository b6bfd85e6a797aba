"""Cost of a configuration: parameter count and analytic FLOPs, without allocating any weights."""

from __future__ import annotations

import torch

from .config import ResNetConfig, ViTConfig
from .resnet import BiTConfig


def count_params(config: ViTConfig | BiTConfig) -> int:
    """Number of learned parameters, counted on the meta device (no memory is allocated)."""
    from .architectures import model_from_config

    with torch.device("meta"):
        model = model_from_config(config)
    return sum(p.numel() for p in model.parameters())


def _conv_out(size: int, stride: int) -> int:
    return -(-size // stride)  # SAME padding: ceil(size / stride)


def _stem_macs(config: ResNetConfig, in_chans: int, image_size: tuple[int, int]) -> int:
    """Multiply-adds of the hybrid's ResNet stem convolutions."""
    h, w = (_conv_out(s, 2) for s in image_size)
    width = 64 * config.width_factor
    macs = h * w * 7 * 7 * in_chans * width
    h, w = _conv_out(h, 2), _conv_out(w, 2)  # max-pool
    cin = width
    for i, units in enumerate(config.units):
        width_i = width * 2**i
        for u in range(units):
            stride = 2 if (i > 0 and u == 0) else 1
            oh, ow = _conv_out(h, stride), _conv_out(w, stride)
            macs += h * w * cin * width_i  # conv1 1x1
            macs += oh * ow * 9 * width_i * width_i  # conv2 3x3 with the stride
            macs += oh * ow * width_i * 4 * width_i  # conv3 1x1
            if cin != 4 * width_i or stride != 1:
                macs += oh * ow * cin * 4 * width_i  # conv_proj
            h, w, cin = oh, ow, 4 * width_i
    return macs


def flops(config: ViTConfig | BiTConfig, pooled_only: bool = False) -> int:
    """Forward FLOPs for one image, counting a multiply-add as 2 (matmuls and convolutions only).

    ViT-B/16 at 224 px is 35.1 GFLOP. Norms, softmax and activations are a few percent and are left out,
    as in the usual tables. A BiT ResNet counts its convolutions and its head. `pooled_only`: what `model(x)`
    computes, whose last layer makes the class token's row alone (`VisionTransformer.encode`; ViT-B/16: 32.9).
    """
    if isinstance(config, BiTConfig):
        macs = _stem_macs(config.stem, config.in_chans, config.image_size)
        return 2 * (macs + config.stem.out_channels * config.num_classes)
    d, n, ph, pw = config.hidden_size, config.num_tokens, *config.patch_size
    macs = 0
    cin = config.in_chans
    if config.hybrid:
        macs += _stem_macs(config.hybrid, config.in_chans, config.image_size)
        cin = config.hybrid.out_channels
    macs += config.num_patches * ph * pw * cin * d  # patch embedding

    def layer(rows: int) -> int:  # `rows` tokens ask (queries, then out and MLP); all n give keys and values
        return n * d * 3 * d + 2 * rows * n * d + rows * d * d + 2 * rows * d * config.mlp_dim  # qkv, QK^T & AV, ...

    last = 1 if pooled_only and config.classifier == "token" else n
    macs += (config.num_layers - 1) * layer(n) + layer(last)
    rep = config.representation_size
    if rep:
        macs += d * rep
    macs += (rep or d) * config.num_classes
    return 2 * macs
