"""The model family: configs, the ViT, the hybrid stem, the ResNet baseline, names, FLOPs."""
