"""Documents, in input order, from files, URLs and Python objects; and the plan of work units.

This module is the face of :mod:`streampack.inputs`' reading side, kept so that the paths of version 0.1
(``streampack.sources``) and of 0.2 still import. Each name lives in the module of its idea:

- :mod:`~streampack.inputs.records`: :class:`WorkUnit`, :class:`ReadOptions`, the items a record becomes
  (:data:`Item`, :class:`TextStream`), :class:`Documents`, :class:`Position`, and how one record becomes an
  item;
- :mod:`~streampack.inputs.units`: :func:`plan_units`, :func:`plan_python_units`, :func:`read_unit`,
  :func:`records_before`, the dispatch above the formats;
- the formats: :mod:`~streampack.inputs.lines` (JSON Lines, text read one document per line),
  :mod:`~streampack.inputs.text` (a text file as one document), :mod:`~streampack.inputs.parquet`,
  :mod:`~streampack.inputs.python`; and :mod:`~streampack.inputs.compression`, opening and decompressing;
- :mod:`~streampack.inputs.discovery` and :mod:`~streampack.inputs.inputfile` (the input files), re-exported
  here since before the split.

``__all__`` is the old module's. Every other name it imported or defined without an underscore still
imports from here (``name as name``). Code inside streampack imports from the modules above, not from here.
"""

from __future__ import annotations

from streampack._checks import check_int as check_int
from streampack.errors import BadRecordError as BadRecordError
from streampack.errors import InputError as InputError
from streampack.errors import OptionsError as OptionsError
from streampack.inputs import DEFAULT_UNIT_BYTES as DEFAULT_UNIT_BYTES
from streampack.inputs.discovery import Discovery, check_output_outside_inputs, discover_inputs, expand_inputs
from streampack.inputs.inputfile import COMPRESSION_SUFFIXES as COMPRESSION_SUFFIXES
from streampack.inputs.inputfile import Ignored, InputFile
from streampack.inputs.inputfile import describe_error as describe_error
from streampack.inputs.inputfile import looks_like_json_lines as looks_like_json_lines
from streampack.inputs.records import Documents, Item, Position, ReadOptions, TextStream, WorkUnit
from streampack.inputs.records import RecordReader as RecordReader
from streampack.inputs.records import Wanted as Wanted
from streampack.inputs.records import record_reader as record_reader
from streampack.inputs.records import refuse_text_for_sft as refuse_text_for_sft
from streampack.inputs.sft import ChatError as ChatError
from streampack.inputs.sft import ChatTemplate as ChatTemplate
from streampack.inputs.sft import Sft as Sft
from streampack.inputs.sft import check_messages as check_messages
from streampack.inputs.sft import field_segments as field_segments
from streampack.inputs.units import SEQUENCE_UNIT_ROWS as SEQUENCE_UNIT_ROWS
from streampack.inputs.units import plan_python_units, plan_units, read_unit, records_before

__all__ = [  # the old module's: discovery is re-exported
    "Discovery",
    "Documents",
    "Ignored",
    "InputFile",
    "Item",
    "Position",
    "ReadOptions",
    "TextStream",
    "WorkUnit",
    "check_output_outside_inputs",
    "discover_inputs",
    "expand_inputs",
    "plan_python_units",
    "plan_units",
    "read_unit",
    "records_before",
]
