"""Inputs: files, URLs and Python objects become records in input order, cut into work units.

``discovery`` expands what the user named into files; ``sources`` plans work units and reads each one's
records (JSONL, plain text, Parquet, Python objects; compressed or not); ``sft`` turns fields and chat
messages into text segments with their loss mask. Nothing here knows about tokens.
"""

from __future__ import annotations

#: The default of ``unit_bytes`` (:class:`~streampack.inputs.sources.ReadOptions`, and
#: :class:`~streampack.builder.options.CacheSpec`): about this much input makes one work unit. Here, at
#: the package's root, so that the build's options import it without importing any reader.
DEFAULT_UNIT_BYTES = 64 << 20
