"""Backbones, the embedding neck W (M = WᵀW), the embedding model and checkpoint I/O."""
