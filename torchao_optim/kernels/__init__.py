"""Hand-written kernels (Triton) used where torch.compile cannot batch a whole group; imported lazily."""
