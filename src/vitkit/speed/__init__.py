"""The speed wing: machine facts, kernels installed by swapping layers, optimize's backends, benchmarks."""
