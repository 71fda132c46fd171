"""harness: an instrumented serving harness for real-time autoregressive video world models."""
__version__ = "0.1.0"
