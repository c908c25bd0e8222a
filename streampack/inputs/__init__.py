"""Inputs: files, URLs and Python objects become records in input order, cut into work units.

``discovery`` expands what the user named into files; ``units`` plans the units and reads each with the
reader of its format (``lines``, ``text``, ``parquet``, ``python``); ``sft`` turns fields and chat messages
into segments with their loss mask. Nothing here knows about tokens.
"""

from __future__ import annotations

#: About this much input makes one work unit (here, so that the build's options import no reader).
DEFAULT_UNIT_BYTES = 64 << 20
