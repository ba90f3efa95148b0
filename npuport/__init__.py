"""npuport: Qwen3.5 BF16 -> msModelSlim-format W8A8 for Ascend NPUs; convert, validate, package.
Here: the CLI and the demo (they may import anything), and the helpers every package shares (errors, devices,
JSON files, checksums, a folder's tokenizer and chat template read as the runtime reads them), which import only
each other."""

__version__ = "0.1.0"
