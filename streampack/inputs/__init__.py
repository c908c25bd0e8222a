"""Inputs: files, URLs and Python objects become records in input order, cut into work units.

``discovery`` expands what the user named into files; ``sources`` plans work units and reads each one's
records (JSONL, plain text, Parquet, Python objects; compressed or not); ``sft`` turns fields and chat
messages into text segments with their loss mask. Nothing here knows about tokens.
"""
