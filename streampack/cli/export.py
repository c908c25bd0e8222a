"""``streampack export``: write a cache in another ecosystem's token format (:mod:`streampack.interop`)."""

from __future__ import annotations

from typing import Any

import click

from streampack.cli.sources import declared, source_options
from streampack.interop import FORMATS
from streampack.interop import convert as convert_source
from streampack.interop import export as export_cache


@click.command()
@click.argument("cache_dir")
@click.option("--to", type=click.Choice(list(FORMATS)), help="The format to write (required).")
@click.option(
    "--out",
    "dest",
    required=True,
    help="Destination: a directory (megatron: a path prefix), or an fsspec URL.",
)
@click.option("--overwrite", is_flag=True, help="Replace what is at --out once the new export is complete.")
@click.option(
    "--seq-len", type=int, help="hf, mds: one sample of this many tokens a row (default: a document)."
)
@click.option("--packed", is_flag=True, help="hf: whole documents packed into the --seq-len samples.")
@click.option("--val", type=float, help="nanogpt: hold out this fraction of the documents into val.bin.")
@click.option("--split-seed", type=int, help="nanogpt: which documents --val holds out.")
@click.option(
    "--out-dtype", help="megatron: optimal (default), cache, uint16 or int32; nanogpt: uint16 or cache."
)
@click.option("--shard-tokens", type=int, help="llmc: tokens a shard holds (default 10^8, at most 2^31 - 1).")
@click.option(
    "--hf-files", type=click.Choice(["parquet", "arrow", "both"]), help="hf: which files (parquet)."
)
@click.option(
    "--drop-loss-mask", is_flag=True, help="Export an SFT cache's tokens to a format without masks."
)
@click.option(
    "--durable",
    is_flag=True,
    help="fsync every file before the move into place: a machine crash, not only a killed export, then "
    "leaves no destination a reader takes as whole.",
)
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@source_options(loose=True)
def export(
    cache_dir: str,
    to: str | None,
    dest: str,
    overwrite: bool,
    seq_len: int | None,
    packed: bool,
    val: float | None,
    split_seed: int | None,
    out_dtype: str | None,
    shard_tokens: int | None,
    hf_files: str | None,
    drop_loss_mask: bool,
    durable: bool,
    no_progress: bool,
    **source: Any,
) -> None:
    """Write the cache in CACHE_DIR in another ecosystem's token format, atomically.

    Formats: megatron (DEST.bin + DEST.idx), llmc (llm.c / modded-nanogpt shards), nanogpt (train.bin),
    datatrove (.ds files), olmo (OLMo-core numpy files), hf (Parquet / save_to_disk), mds (MosaicML),
    streampack (a native cache, as `convert` writes). CACHE_DIR may hold another format's files too (see
    `convert`): --format, --dtype and the other source options describe them.
    """
    from streampack.reader import open as open_cache

    if to is None:  # a script from when --format and --dtype named what export writes
        if source["source_format"] is None:
            raise click.UsageError("Missing option '--to': the format to write.")
        click.echo("warning: export --format FORMAT is deprecated; use --to FORMAT", err=True)
        to, source["source_format"] = source["source_format"], None
        if source["source_dtype"] is not None:
            click.echo("warning: export --dtype is deprecated; use --out-dtype", err=True)
            out_dtype, source["source_dtype"] = source["source_dtype"], None

    given: dict[str, Any] = {
        "seq_len": seq_len,
        "packed": packed or None,
        "val": int(val) if val is not None and val >= 1 and float(val).is_integer() else val,
        "split_seed": split_seed,
        "dtype": out_dtype,
        "shard_tokens": shard_tokens,
        "files": hf_files,
        "drop_loss_mask": drop_loss_mask or None,
    }
    options = {key: value for key, value in given.items() if value is not None}
    with open_cache(cache_dir, **declared(source)) as opened:
        done = export_cache(
            opened,
            to,
            dest,
            overwrite=overwrite,
            progress=False if no_progress else None,
            durable=durable,
            **options,
        )
    click.echo(
        f"exported {done.rows:,} {'rows' if seq_len else 'documents'}, {done.num_tokens:,} tokens as "
        f"{to} to {dest} ({len(done.files)} files)"
    )


@click.command()
@click.argument("source")
@click.option("--out", required=True, help="The cache directory to create (or an fsspec URL).")
@click.option("--overwrite", is_flag=True, help="Replace what is at --out once the new cache is complete.")
@click.option(
    "--shard-tokens", type=int, help="Tokens a shard holds at most (default 2^28), cut between documents."
)
@click.option("--durable", is_flag=True, help="fsync every file before the move into place.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@source_options()
def convert(
    source: str,
    out: str,
    overwrite: bool,
    shard_tokens: int | None,
    durable: bool,
    no_progress: bool,
    **given: Any,
) -> None:
    """Make a streampack cache of another format's token files at SOURCE (the tokens copied by the kernel).

    SOURCE: a Megatron prefix (x for x.bin + x.idx), a folder of llm.c, datatrove (.ds), OLMo (.npy) or
    MDS shards, or a nanoGPT train.bin. The new cache has a manifest with every file's checksum
    (`streampack verify` checks them) and keeps what the source declares (EOS, BOS, loss masks) and what
    --eos-id, --bos-id, --tokenizer say.
    """
    done = convert_source(
        source,
        out,
        overwrite=overwrite,
        progress=False if no_progress else None,
        durable=durable,
        shard_tokens=shard_tokens,
        **declared(given),
    )
    click.echo(f"converted {done.rows:,} documents, {done.num_tokens:,} tokens from {source} into {out}")
