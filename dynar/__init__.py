"""dynar: train convolutional networks on CPU clusters."""
__version__ = "0.1.0"
