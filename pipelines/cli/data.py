"""`mdc data ...`: write the generated and the packaged datasets as shards."""

from __future__ import annotations

from typing import Optional

import typer

from mdc.data.emoji import MissingPackages, write_emoji_dataset
from mdc.data.img2dataset import damage_folder, generated_rows, write_img2dataset_folder
from mdc.data.shapes import write_shapes_dataset
from mdc.data.tuxpaint import write_tuxpaint_dataset
from pipelines.infra.console import console, user_errors

data_app = typer.Typer(no_args_is_help=True, help="Write datasets as shards (local path or s3://).")


@data_app.command("shapes")
def data_shapes(
    out: str = typer.Option(..., help="output folder or s3://bucket/prefix"),
    num: int = typer.Option(2000, min=1),
    seed: int = 0,
    format: str = typer.Option("webdataset", help="webdataset | parquet"),
    endpoint_url: Optional[str] = None,
):
    """The generated compositional shapes dataset (train/, val/, compositionality files)."""

    manifest = write_shapes_dataset(out, num=num, seed=seed, format=format, endpoint_url=endpoint_url)
    console.print(manifest)


@data_app.command("tuxpaint")
def data_tuxpaint(
    out: str = typer.Option(..., help="output folder or s3://bucket/prefix"),
    format: str = typer.Option("webdataset", help="webdataset | parquet"),
    endpoint_url: Optional[str] = None,
):
    """Debian's tuxpaint-stamps-default (real images with English captions) as shards."""

    manifest = write_tuxpaint_dataset(out, format=format, endpoint_url=endpoint_url)
    console.print(manifest)


@data_app.command("emoji")
def data_emoji(
    out: str = typer.Option(..., help="output folder or s3://bucket/prefix"),
    image_size: int = typer.Option(32, min=8, help="side of the rendered images, pixels"),
    seed: int = typer.Option(0, help="salt of the split by base emoji"),
    val_fraction: float = typer.Option(0.1, min=0.0, max=0.5),
    test_fraction: float = typer.Option(0.1, min=0.0, max=0.5),
    format: str = typer.Option("webdataset", help="webdataset | parquet"),
    endpoint_url: Optional[str] = None,
):
    """Noto Color Emoji captioned with their CLDR names (Debian's fonts-noto-color-emoji, unicode-data):
    train/val/test split by base emoji, group and subgroup probe labels, real swap pairs."""

    with user_errors(MissingPackages, ValueError):
        manifest = write_emoji_dataset(
            out, image_size, seed, val_fraction, test_fraction, format, endpoint_url=endpoint_url
        )
    counts = {name: split["num_samples"] for name, split in manifest["splits"].items()}
    pairs = {k: manifest["compositionality"][k] for k in ("gender_pairs", "skin_tone_pairs")}
    console.print({"splits": counts, "bases": manifest["num_bases"], "pairs": pairs, "skipped": manifest["skipped"]})


@data_app.command("img2dataset")
def data_img2dataset(
    out: str = typer.Option(..., help="output folder (local)"),
    format: str = typer.Option("webdataset", help="img2dataset's --output_format: webdataset | parquet"),
    num: int = typer.Option(200, min=1),
    samples_per_shard: int = typer.Option(50, min=1),
    image_size: int = typer.Option(64, min=8, help="shorter side of the JPEGs"),
    damaged: bool = typer.Option(False, help="also break it as real downloads break"),
):
    """A folder laid out exactly as img2dataset writes it (side files, failed rows), from generated images."""

    with user_errors(ValueError):
        stats = write_img2dataset_folder(generated_rows(num, image_size), out, format, samples_per_shard)
    console.print({k: stats[k] for k in ("count", "successes", "failed_to_download", "failed_to_resize")})
    if damaged:
        console.print({"damaged": damage_folder(out, format)})
