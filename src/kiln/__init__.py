"""kiln: make XLA compilation a one-time cost for JAX programs."""

__version__ = "0.1.0"
