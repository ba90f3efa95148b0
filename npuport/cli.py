"""The `npuport` command line: thin click commands that parse arguments and call the library."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from npuport import __version__
from npuport.errors import NpuportError


class _Group(click.Group):
    """Prints an NpuportError as one clear line and exits 1, instead of a traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except NpuportError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(1)


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="npuport")
def main() -> None:
    """Convert Qwen3.5 checkpoints to msModelSlim-format W8A8 for Ascend NPUs, validate and package them."""


@main.command("make-tiny")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--arch", type=click.Choice(["dense", "moe"]), default="dense", show_default=True)
@click.option("--layout", type=click.Choice(["multimodal", "text"]), default="multimodal", show_default=True,
              help="multimodal: model.language_model.* plus a small model.visual.*; text: model.*")
@click.option("--mtp-experts", type=click.Choice(["fused", "per-expert"]), default="fused", show_default=True,
              help="How the MoE MTP layer stores its experts.")
@click.option("--size", type=click.Choice(["tiny", "small", "mid"]), default="tiny", show_default=True,
              help="tiny: under 5 MB (tests); small: ~100M parameters; mid: a few GB (benchmarks).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--tie-word-embeddings", is_flag=True, help="Share lm_head with embed_tokens (no lm_head tensor).")
def make_tiny_cmd(out: Path, arch: str, layout: str, mtp_experts: str, size: str, seed: int,
                  tie_word_embeddings: bool) -> None:
    """Write a deterministic Qwen3.5 checkpoint with random weights to OUT (a new folder)."""
    from npuport.tiny_checkpoint import TinySpec, make_tiny

    if out.exists():
        raise NpuportError(f"{out} already exists; choose a new folder")
    spec = TinySpec(arch, layout, mtp_experts, size, seed, tie_word_embeddings)
    make_tiny(out, spec, progress=lambda msg: click.echo(msg, err=True))
    click.echo(f"wrote {arch} {size} Qwen3.5 checkpoint ({layout} layout) to {out}")


if __name__ == "__main__":
    main()
