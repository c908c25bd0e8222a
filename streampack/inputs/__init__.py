"""Inputs: files, URLs and Python objects become records in input order, cut into work units.

``discovery`` expands what the user named into files; ``records`` holds the work unit, the read options and
what one record becomes; ``units`` plans the units and reads each one with the reader of its format:
``lines`` (JSON Lines, and text one document per line), ``text`` (a text file as one document), ``parquet``
and ``python`` (Python objects), over ``compression`` (opening and decompressing), each yielding a unit's
records in ``parts`` that are parsed only when asked (by the build, on its encoder threads); ``sft`` turns
fields and chat messages into text segments with their loss mask. Nothing here knows about tokens.
"""

from __future__ import annotations

#: The default of ``unit_bytes`` (:class:`~streampack.inputs.records.ReadOptions`, and
#: :class:`~streampack.builder.options.CacheSpec`): about this much input makes one work unit. Here, at
#: the package's root, so that the build's options import it without importing any reader.
DEFAULT_UNIT_BYTES = 64 << 20
