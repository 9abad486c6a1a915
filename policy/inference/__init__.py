"""Inference backends: one protocol, one request type, one factory, one module per backend."""
