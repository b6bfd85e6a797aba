"""Datasets: images read safely, folders, shards, the survey of a dataset, augmentation."""
