"""Other ecosystems' token files read as a :class:`~streampack.reader.Cache`, where they lie.

``opening`` holds :func:`~streampack.reader.foreign.opening.open_foreign` (and ``open_remote``, for files
in object storage), the ``ForeignShards`` such a cache reads through and the registry of formats
(``READERS``); one module per format (``megatron``, ``llmc``, ``nanogpt``, ``datatrove``, ``olmo``,
``mds``) holds its layout and its reader. They share ``files`` (where the files are read from, and what a
reader checks of them), ``identity`` (what identifies the files, which formats record no checksum of) and
``scanning`` (finding the documents of a stream without an index).
"""
