"""Layers shared by every model: each parameter carries its own `weight_loader`."""
