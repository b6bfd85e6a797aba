"""Training: recipes, the defaults fitted to the data, the loop, runs, evaluation, torchrun."""
