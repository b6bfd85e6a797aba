"""Seeing inside a model: the paper's analysis figures as functions (`figures`), their faithfulness (`attribution`),
translation (`translation`), the HTML report, and the paper's findings as experiments. `vitkit.analysis.<name>`
is the figures' public API, and the faithfulness score of any map."""

from .attribution import Faithfulness, faithfulness, perturbation_curves
from .figures import (
    AttentionMaps,
    EmbeddingFilters,
    Localisation,
    Occlusion,
    Rollout,
    attention_maps,
    attention_rollout,
    embedding_filters,
    has_no_head,
    localisation,
    mean_attention_distance,
    occlusion_sensitivity,
    occlusion_windows,
    patch_distances,
    posemb_similarity,
)

__all__ = [
    "EmbeddingFilters",
    "AttentionMaps",
    "Rollout",
    "Occlusion",
    "Localisation",
    "embedding_filters",
    "posemb_similarity",
    "patch_distances",
    "mean_attention_distance",
    "attention_maps",
    "attention_rollout",
    "occlusion_windows",
    "occlusion_sensitivity",
    "has_no_head",
    "localisation",
    "Faithfulness",
    "faithfulness",
    "perturbation_curves",
]
