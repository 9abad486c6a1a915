"""The JAX library of rlpipe: the policy model, losses, checkpoints, inference backends and the RolloutManager.

Imports point one way: `steps` (programs) -> `policy` (this package, JAX) -> `pipeline` (JAX-free run-root
logic) -> `schemas` (declared records and tables).
"""
