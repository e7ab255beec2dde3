"""The parallel modes: the strategy table, one entry per mode, and the wrappers they put around a model."""
