"""A minGPT-shaped project: the trainer and the model in a package, the script beside it."""
