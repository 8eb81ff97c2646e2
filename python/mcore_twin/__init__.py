"""mcore-twin's Python side: capture Megatron-Core layers as golden files (mcore_twin.capture) and
the live property tests that run the real Megatron-Core against the twins (mcore_twin.live)."""

__version__ = "0.1.0"
