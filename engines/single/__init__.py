"""The single engine: the whole model on this machine, batched by mlx-lm."""
