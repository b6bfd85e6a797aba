"""The Vision Transformer of Dosovitskiy et al. (ICLR 2021), read top to bottom as equations (1)-(4):

    z_0  = [x_class; x_p^1 E; ...; x_p^N E] + E_pos          (1)  patch embedding, class token, posemb
    z'_l = MSA(LN(z_{l-1})) + z_{l-1}                         (2)  attention block, pre-LN, residual
    z_l  = MLP(LN(z'_l)) + z'_l                               (3)  MLP block, pre-LN, residual
    y    = LN(z_L^0)                                          (4)  final LN, class token (or mean) -> head

The module is organised in that order: position embeddings, MLP, attention, encoder block, the model.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .config import ViTConfig
from .hybrid import ResNetStem

# ----------------------------------------------------------------------------------------------------------
# Position embeddings (E_pos of eq. 1, and the paper's Appendix D.4 ablations). Each kind is a module that
# adds itself to the token sequence (B, N, D), may return a per-layer attention bias, and can be resampled
# to a new patch grid.
# ----------------------------------------------------------------------------------------------------------


def resample_grid(grid: torch.Tensor, new_size: tuple[int, int], mode: str = "bilinear") -> torch.Tensor:
    """Resample a (..., h, w, D) grid of embeddings to (..., H, W, D).

    "bilinear" uses aligned corners, which is `scipy.ndimage.zoom(order=1)` as in the official
    `interpolate_posembed`; "bicubic" is timm's choice (half-pixel centres, antialiased when shrinking).
    """
    if mode not in ("bilinear", "bicubic"):
        raise ValueError(f"mode={mode!r} is unknown: use 'bilinear' (official) or 'bicubic'.")
    if tuple(grid.shape[-3:-1]) == tuple(new_size):
        return grid
    lead, (h, w, d) = grid.shape[:-3], grid.shape[-3:]
    x = grid.reshape(-1, h, w, d).permute(0, 3, 1, 2).float()
    if mode == "bilinear":
        x = F.interpolate(x, size=new_size, mode="bilinear", align_corners=True)
    else:
        x = F.interpolate(x, size=new_size, mode="bicubic", align_corners=False, antialias=True)
    return x.permute(0, 2, 3, 1).reshape(*lead, *new_size, d).to(grid.dtype)


def posemb_sincos_2d(grid: tuple[int, int], dim: int, temperature: float = 10_000.0) -> torch.Tensor:
    """Fixed 2D sine-cosine embedding (MoCo v3 / big_vision): (gh * gw, D), a quarter of D per sin/cos of y/x."""
    y, x = torch.meshgrid(torch.arange(grid[0]), torch.arange(grid[1]), indexing="ij")
    omega = 1.0 / temperature ** (torch.arange(dim // 4) / (dim // 4 - 1 if dim > 4 else 1))
    y = y.flatten()[:, None] * omega[None, :]
    x = x.flatten()[:, None] * omega[None, :]
    return torch.cat([x.sin(), x.cos(), y.sin(), y.cos()], dim=1).float()


class LearnedPosemb(nn.Module):
    """The paper's default: one learned D-vector per position, the class token's row included (1, N, D)."""

    def __init__(self, grid: tuple[int, int], dim: int, num_prefix: int):
        super().__init__()
        self.num_prefix = num_prefix
        self.weight = nn.Parameter(torch.zeros(1, num_prefix + grid[0] * grid[1], dim))
        self.grid = grid

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.weight

    def attention_bias(self) -> None:
        return None

    def resample(self, grid: tuple[int, int], mode: str) -> None:
        prefix, patches = self.weight.data[:, : self.num_prefix], self.weight.data[:, self.num_prefix :]
        patches = resample_grid(patches.reshape(1, *self.grid, -1), grid, mode).reshape(1, grid[0] * grid[1], -1)
        self.weight = nn.Parameter(torch.cat([prefix, patches], dim=1))
        self.grid = grid


class Learned2dPosemb(nn.Module):
    """Paper's 2D ablation: learned row (Y) and column (X) embeddings of D/2 each, concatenated per patch."""

    def __init__(self, grid: tuple[int, int], dim: int, num_prefix: int):
        super().__init__()
        self.num_prefix = num_prefix
        self.row = nn.Parameter(torch.zeros(grid[0], dim // 2))
        self.col = nn.Parameter(torch.zeros(grid[1], dim // 2))

    def embedding(self) -> torch.Tensor:
        """(gh * gw, D): row embedding of the patch's row next to column embedding of its column."""
        gh, gw = self.row.shape[0], self.col.shape[0]
        grid = torch.cat([self.row[:, None].expand(gh, gw, -1), self.col[None, :].expand(gh, gw, -1)], dim=-1)
        return grid.reshape(gh * gw, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[:, : self.num_prefix], x[:, self.num_prefix :] + self.embedding()], dim=1)

    def attention_bias(self) -> None:
        return None

    def resample(self, grid: tuple[int, int], mode: str) -> None:
        self.row = nn.Parameter(resample_grid(self.row.data[:, None], (grid[0], 1), mode)[:, 0])
        self.col = nn.Parameter(resample_grid(self.col.data[None], (1, grid[1]), mode)[0])


class SinCos2dPosemb(nn.Module):
    """Fixed 2D sine-cosine embedding added to the patch tokens; nothing to learn, nothing saved."""

    def __init__(self, grid: tuple[int, int], dim: int, num_prefix: int):
        super().__init__()
        self.num_prefix, self.dim = num_prefix, dim
        self.table: torch.Tensor
        self.register_buffer("table", posemb_sincos_2d(grid, dim), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[:, : self.num_prefix], x[:, self.num_prefix :] + self.table.to(x.dtype)], dim=1)

    def attention_bias(self) -> None:
        return None

    def resample(self, grid: tuple[int, int], mode: str) -> None:
        self.table = posemb_sincos_2d(grid, self.dim).to(self.table.device)


class RelativePosemb(nn.Module):
    """Paper's relative ablation: a learned attention-logit bias per layer, head and 2D offset (dy, dx).

    Pairs that involve the class token share one extra learned bias. Adds nothing to the tokens.
    """

    def __init__(self, grid: tuple[int, int], num_layers: int, num_heads: int, num_prefix: int):
        super().__init__()
        self.num_prefix, self.grid = num_prefix, grid
        self.table = nn.Parameter(torch.zeros(num_layers, num_heads, 2 * grid[0] - 1, 2 * grid[1] - 1))
        self.prefix_bias = nn.Parameter(torch.zeros(num_layers, num_heads)) if num_prefix else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def attention_bias(self) -> torch.Tensor:
        """(layers, heads, N, N): bias[l, h, q, k] = table[l, h, dy(q, k), dx(q, k)]."""
        gh, gw = self.grid
        ys, xs = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
        dy = (ys.flatten()[:, None] - ys.flatten()[None, :]) + gh - 1  # (P, P)
        dx = (xs.flatten()[:, None] - xs.flatten()[None, :]) + gw - 1
        patches = self.table[:, :, dy.to(self.table.device), dx.to(self.table.device)]  # (L, H, P, P)
        if self.prefix_bias is None:
            return patches
        n = self.num_prefix + gh * gw
        bias = self.prefix_bias[:, :, None, None].expand(*patches.shape[:2], n, n).clone()
        bias[..., self.num_prefix :, self.num_prefix :] = patches
        return bias

    def resample(self, grid: tuple[int, int], mode: str) -> None:
        size = (2 * grid[0] - 1, 2 * grid[1] - 1)
        self.table = nn.Parameter(resample_grid(self.table.data[..., None], size, mode)[..., 0])
        self.grid = grid


class NoPosemb(nn.Module):
    """Paper's "no positional information" ablation: the tokens are a bag of patches."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def attention_bias(self) -> None:
        return None

    def resample(self, grid: tuple[int, int], mode: str) -> None:
        pass


Posemb = LearnedPosemb | Learned2dPosemb | SinCos2dPosemb | RelativePosemb | NoPosemb


def build_posemb(config: ViTConfig) -> Posemb:
    prefix = int(config.classifier == "token")
    grid, dim = config.grid_size, config.hidden_size
    if config.posemb == "learn":
        return LearnedPosemb(grid, dim, prefix)
    if config.posemb == "learn2d":
        return Learned2dPosemb(grid, dim, prefix)
    if config.posemb == "sincos2d":
        return SinCos2dPosemb(grid, dim, prefix)
    if config.posemb == "relative":
        return RelativePosemb(grid, config.num_layers, config.num_heads, prefix)
    return NoPosemb()


# ----------------------------------------------------------------------------------------------------------
# MLP and multi-head self-attention (the two sub-layers of eqs. 2 and 3): stock layers. `vitkit.speed.kernels.install`
# swaps in subclasses with the same parameters that run the fastest kernels for the machine.
# ----------------------------------------------------------------------------------------------------------


class MlpBlock(nn.Module):
    """Two linear layers with a GELU between them (Sec. 3.1), dropout after each as in the official code."""

    def __init__(self, dim: int, mlp_dim: int, act: str, dropout: float):
        super().__init__()
        self.fc1 = nn.Linear(dim, mlp_dim)
        self.act = nn.GELU(approximate="tanh" if act == "gelu_tanh" else "none")
        self.fc2 = nn.Linear(mlp_dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


class Attention(nn.Module):
    """Multi-head self-attention with fused q, k, v projections (Appendix A).

    `F.scaled_dot_product_attention` (fused); when the attention probabilities are asked for, the same computation
    is written out with an explicit softmax (`attend_explicit`) and the probabilities returned.
    """

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool, attention_dropout: float):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.attention_dropout = attention_dropout

    def forward(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, need_weights: bool = False, queries: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, N, D) -> (B, N, D), and the attention probabilities when `need_weights`. `queries`: only the first
        `queries` tokens attend (the others still serve as keys and values), giving (B, queries, D)."""
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # (B, H, N, d)
        q = q[:, :, :queries]  # (B, H, queries, d); all N when None
        p_drop = self.attention_dropout if self.training else 0.0
        if bias is not None:
            bias = bias[..., :queries, :].to(q.dtype)
        if need_weights:  # softmax(q k^T / sqrt(d) + bias) v written out, keeping the probabilities
            y, probs = attend_explicit(q, k, v, bias, p_drop)
        else:
            y, probs = self.attend(q, k, v, bias, p_drop), None
        return self.proj(y.transpose(1, 2).reshape(b, q.shape[2], d)), probs

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, dropout_p: float
    ) -> torch.Tensor:
        """softmax(q k^T / sqrt(d) + bias) v over (B, H, N, d), by PyTorch's fused kernel."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p)


def head_scale(q: torch.Tensor) -> float:
    """1/sqrt(d) for queries (..., d), as a number: in a traced graph a constant, where `q.shape[-1] ** -0.5` would be
    computed from the traced shape on every call."""
    return float(q.shape[-1]) ** -0.5


def attend_explicit(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, dropout_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention written out, and its probabilities (B, H, N, N): the two matmuls in q's dtype (or autocast's), the
    softmax in fp32."""
    logits = (q * head_scale(q)) @ k.transpose(-2, -1)  # (B, H, N, N)
    if bias is not None:
        logits = logits + bias
    probs = logits.float().softmax(dim=-1).to(v.dtype)
    return (F.dropout(probs, dropout_p) @ v if dropout_p else probs @ v), probs


class LayerScale(nn.Module):
    """Per-channel learned scale of a residual branch (CaiT); off unless `layer_scale_init` is set."""

    def __init__(self, dim: int, init: float):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), float(init)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class DropPath(nn.Module):
    """Stochastic depth: drop a residual branch for a whole sample, rescaling the survivors."""

    def __init__(self, rate: float):
        super().__init__()
        self.rate = rate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rate == 0.0 or not self.training:
            return x
        keep = x.new_empty(x.shape[0], *([1] * (x.ndim - 1))).bernoulli_(1.0 - self.rate)
        return x * keep / (1.0 - self.rate)


class EncoderBlock(nn.Module):
    """One Transformer layer: eq. (2) then eq. (3)."""

    def __init__(self, config: ViTConfig, drop_path: float):
        super().__init__()
        dim, eps = config.hidden_size, config.layer_norm_eps
        scale = (lambda: LayerScale(dim, config.layer_scale_init)) if config.layer_scale_init else nn.Identity
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attn = Attention(dim, config.num_heads, config.qkv_bias, config.attention_dropout_rate)
        self.ls1, self.drop_path1 = scale(), DropPath(drop_path)
        self.drop = nn.Dropout(config.dropout_rate)
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = MlpBlock(dim, config.mlp_dim, config.act, config.dropout_rate)
        self.ls2, self.drop_path2 = scale(), DropPath(drop_path)

    def forward(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, need_weights: bool = False, queries: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`queries`: compute the outputs of the first `queries` tokens only (B, queries, D); None: all."""
        y, probs = self.attn(self.norm1(x), bias, need_weights, queries)
        x = x[:, :queries] + self.drop_path1(self.ls1(self.drop(y)))  # z' = MSA(LN(z)) + z   (2)
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))  # z = MLP(LN(z')) + z'    (3)
        return x, probs


# ----------------------------------------------------------------------------------------------------------
# The model.
# ----------------------------------------------------------------------------------------------------------


def check_images(x: torch.Tensor, config: ViTConfig) -> None:
    """Refuse (ValueError) a batch of images that is not (B, C, H, W) with the model's channels and size, naming
    the fix."""
    c, (h, w) = config.in_chans, config.image_size
    expected = f"expected (B, {c}, {h}, {w})"
    if x.ndim != 4:
        one = " (one image: add the batch axis, x[None])" if x.ndim == 3 else ""
        raise ValueError(f"input of shape {tuple(x.shape)} is not a batch of images: {expected}{one}.")
    if x.shape[1] != c:
        kind, mode = {1: ("grayscale", "L"), 3: ("RGB", "RGB")}.get(c, (f"{c}-channel", None))
        pil = f" (PIL: image.convert({mode!r}))" if mode else ""
        raise ValueError(
            f"input of shape {tuple(x.shape)} has {x.shape[1]} channel{'' if x.shape[1] == 1 else 's'}, and the "
            f"model takes {kind} images: {expected}. Convert the images{pil} before they are made tensors."
        )
    if tuple(x.shape[-2:]) != (h, w):
        raise ValueError(
            f"input of shape {tuple(x.shape)} does not match the model: {expected}. Resize the images, or call "
            "model.set_image_size(...) to resample the position embedding."
        )


class VisionTransformer(nn.Module):
    """ViT: `model(x)` maps images (B, C, H, W) to logits (B, num_classes).

    Named intermediates come from `forward_intermediates`, with no hooks and no second code path.
    """

    def __init__(self, config: ViTConfig):
        super().__init__()
        self.config = config
        self.class_names: list[str] | None = None
        self.trained_on: dict | None = None  # what it was trained on (`data.survey.describe`), saved by vitkit
        # Its input's mean and std where a checkpoint says they are not the official 0.5 (`data.to_input`).
        self.normalization: dict | None = None
        dim = config.hidden_size
        # Hybrid: the patches are taken from a ResNet feature map instead of the image (Sec. 3.1).
        self.stem = ResNetStem(config.hybrid, config.in_chans) if config.hybrid else None
        cin = self.stem.out_channels if self.stem else config.in_chans
        self.embedding = nn.Conv2d(cin, dim, config.patch_size, stride=config.patch_size)  # E of eq. (1)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim)) if config.classifier == "token" else None
        self.posemb: Posemb = build_posemb(config)
        self.dropout = nn.Dropout(config.dropout_rate)
        rates = [config.drop_path_rate * i / max(config.num_layers - 1, 1) for i in range(config.num_layers)]
        self.blocks = nn.ModuleList(EncoderBlock(config, rate) for rate in rates)
        self.encoder_norm = nn.LayerNorm(dim, eps=config.layer_norm_eps)
        rep = config.representation_size
        self.pre_logits = nn.Sequential(nn.Linear(dim, rep), nn.Tanh()) if rep else nn.Identity()
        self.head = nn.Linear(rep or dim, config.num_classes) if config.num_classes else nn.Identity()
        self.grad_checkpointing = False
        self.init_weights()

    # --- eq. (1) -------------------------------------------------------------------------------------------
    def embed(self, x: torch.Tensor, out: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Images (B, C, H, W) -> z_0 (B, N, D): patch embedding, class token, position embedding, dropout."""
        check_images(x, self.config)
        x = x.to(self.encoder_norm.weight.dtype)  # images in the model's dtype: a bf16 model takes fp32 images
        if self.stem is not None:
            x, stem_out = self.stem.forward_intermediates(x)
            if out is not None:
                out.update({f"stem/{k}": v for k, v in stem_out.items()})
        x = self.patch_embed(x)  # (B, gh*gw, D), row-major patches
        if out is not None:
            out["embedding"] = x.unflatten(1, self.config.grid_size)  # (B, gh, gw, D); the input size was checked
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1).to(x.dtype), x], dim=1)  # (B, N+1, D)
        x = self.dropout(self.posemb(x))
        return self.drop_patches(x) if self.training and self.config.patch_dropout else x

    def drop_patches(self, x: torch.Tensor) -> torch.Tensor:
        """Patch dropout (Liu et al., 2022): each image keeps a random `1 - patch_dropout` of its patch tokens, and
        its class token. After the position embedding, so that a kept token still says where it was. Each step
        computes fewer tokens, and the model learns to classify from part of the image; evaluation keeps all."""
        prefix = 0 if self.cls_token is None else 1
        n = x.shape[1] - prefix
        keep = max(1, int(n * (1.0 - self.config.patch_dropout)))
        kept = torch.rand(x.shape[0], n, device=x.device).argsort(dim=1)[:, :keep] + prefix  # (B, keep)
        patches = x.gather(1, kept.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        return torch.cat([x[:, :prefix], patches], dim=1)  # (B, prefix + keep, D)

    def patch_embed(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> x_p E (B, gh*gw, D): every P x P patch projected by E, a convolution whose stride is its
        kernel size, the patches in row-major order."""
        return self.embedding(x).flatten(2).transpose(1, 2)

    # --- eqs. (2), (3), and the LN of (4) ------------------------------------------------------------------
    def encode(
        self,
        x: torch.Tensor,
        out: dict[str, list[torch.Tensor]] | None = None,
        need_weights: bool = False,
        pooled_only: bool = False,
    ) -> torch.Tensor:
        """z_0 -> LN(z_L) (B, N, D); records each layer's tokens (and attention) into `out` when given.

        `pooled_only` with a class token: the last layer computes the class token's row alone, z_L^0 of eq. (4),
        (B, 1, D). Its other rows reach nothing the head reads; skipping them leaves the logits as they are and
        saves most of a layer."""
        biases = self.posemb.attention_bias()
        last = len(self.blocks) - 1 if pooled_only and self.cls_token is not None else None
        for i, block in enumerate(self.blocks):
            bias = None if biases is None else biases[i]
            queries = 1 if i == last else None
            if self.grad_checkpointing and self.training and torch.is_grad_enabled() and not need_weights:
                x, probs = checkpoint(block, x, bias, False, queries, use_reentrant=False)
            else:
                x, probs = block(x, bias, need_weights, queries)
            if out is not None:
                out["tokens"].append(x)
                if need_weights:
                    out["attention"].append(probs)
        return self.encoder_norm(x)

    # --- eq. (4) and the head ------------------------------------------------------------------------------
    def pool(self, encoded: torch.Tensor) -> torch.Tensor:
        """y: the class token's output, or the mean of all tokens for `classifier="gap"`."""
        return encoded[:, 0] if self.cls_token is not None else encoded.mean(dim=1)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Encoder output after the final LayerNorm, (B, N, D)."""
        return self.encode(self.embed(x))

    def forward_head(self, encoded: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        y = self.pre_logits(self.pool(encoded))
        return y if pre_logits else self.head(y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.encode(self.embed(x), pooled_only=True))

    def forward_intermediates(self, x: torch.Tensor, attention: bool = False) -> dict:
        """Every named intermediate of one forward pass.

        Keys: `embedding` (B, gh, gw, D) patch embedding; `stem/...` for hybrids; `tokens`, a list of each
        layer's output (B, N, D); `attention`, a list of (B, heads, N, N) probabilities when `attention=True`
        (computed with an explicit softmax, otherwise the fused kernel runs); `encoded` after the final LN;
        `pre_logits` (the pooled representation fed to the head) and `logits`.
        """
        out: dict = {"tokens": [], "attention": []}
        out["encoded"] = self.encode(self.embed(x, out), out, need_weights=attention)
        out["pre_logits"] = self.forward_head(out["encoded"], pre_logits=True)
        out["logits"] = self.head(out["pre_logits"])
        return out

    # --- fine-tuning helpers -------------------------------------------------------------------------------
    def set_image_size(self, image_size: int | tuple[int, int], mode: str = "bilinear") -> None:
        """Change the input resolution, resampling the position embedding in 2D (official: bilinear)."""
        config = self.config.replace(image_size=image_size)
        self.posemb.resample(config.grid_size, mode)
        self.config = config

    def reset_head(self, num_classes: int, keep_pre_logits: bool = False) -> None:
        """A new zero-initialised head for `num_classes` (0: none). As in the paper's fine-tuning set-up the
        pre-logits layer is removed unless `keep_pre_logits`."""
        rep = self.config.representation_size if keep_pre_logits else None
        if not keep_pre_logits:
            self.pre_logits = nn.Identity()
        ref = self.encoder_norm.weight
        self.config = self.config.replace(num_classes=num_classes, representation_size=rep)
        self.head = nn.Identity()
        if num_classes:
            self.head = nn.Linear(rep or self.config.hidden_size, num_classes, device=ref.device, dtype=ref.dtype)
            nn.init.zeros_(self.head.weight)
            nn.init.zeros_(self.head.bias)
        self.class_names = None

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block in the backward pass instead of storing its activations (saves memory)."""
        self.grad_checkpointing = enable

    # --- initialisation ------------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self) -> None:
        """`init="jax"`: the official scheme; `init="trunc_normal"`: truncated normal, std 0.02, everywhere."""
        jax = self.config.init == "jax"
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                if not jax:
                    nn.init.trunc_normal_(m.weight, std=0.02)
                elif name.endswith("attn.qkv"):  # xavier as for three separate D x D projections
                    bound = math.sqrt(6.0 / (m.in_features + m.out_features // 3))
                    nn.init.uniform_(m.weight, -bound, bound)
                elif name.endswith("pre_logits.0"):
                    nn.init.trunc_normal_(m.weight, std=math.sqrt(1.0 / m.in_features))
                else:
                    nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
                    if jax and ".mlp." in f".{name}.":
                        nn.init.normal_(m.bias, std=1e-6)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        fan_in = self.embedding.in_channels * self.embedding.kernel_size[0] * self.embedding.kernel_size[1]
        nn.init.trunc_normal_(self.embedding.weight, std=math.sqrt(1.0 / fan_in) if jax else 0.02)
        if self.embedding.bias is not None:
            nn.init.zeros_(self.embedding.bias)
        if self.stem is not None:
            self.stem.init_weights()
        for p in self.posemb.parameters():
            nn.init.normal_(p, std=0.02) if jax else nn.init.trunc_normal_(p, std=0.02)
        if isinstance(self.posemb, RelativePosemb):
            for p in self.posemb.parameters():
                nn.init.zeros_(p)  # start as plain content attention
        if self.cls_token is not None:
            nn.init.zeros_(self.cls_token) if jax else nn.init.trunc_normal_(self.cls_token, std=0.02)
        if jax and isinstance(self.head, nn.Linear):
            nn.init.zeros_(self.head.weight)
            nn.init.zeros_(self.head.bias)
