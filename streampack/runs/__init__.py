"""The tools used around a training run, above the loader and below the command line.

* :mod:`~streampack.runs.provenance`: which documents (and input records) a step trained on, ``which``.
* :mod:`~streampack.runs.audit`: every sample a run consumed, recomputed from its state's history, and
  which were served twice or skipped; :mod:`~streampack.runs.coverage` is its arithmetic and
  :mod:`~streampack.runs.auditexclusions` the run's exclusions re-applied leg by leg.
* :mod:`~streampack.runs.mixconfig`: a mixture read from a YAML or JSON config, ``load_mixture``.

Each module is imported on its own: importing this package loads none of them.
"""
