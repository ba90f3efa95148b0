"""npuport: Qwen3.5 BF16 -> msModelSlim-format W8A8 for Ascend NPUs; convert, validate, package."""

__version__ = "0.1.0"
