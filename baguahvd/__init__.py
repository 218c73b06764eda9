"""baguahvd: Horovod's PyTorch API on an engine of its own, with Bagua's algorithms."""

__version__ = "0.1.0"
