"""The build: a corpus becomes a token cache, in bounded memory, resumably and byte-identically.

``coordinator`` holds :func:`build` (plan, check, run, record: ``planning``, ``directory``, ``running``);
``options`` the cache's identity (``CacheSpec``) and the run's settings (``RunOptions``); ``pipeline`` the
work units' read → encode → write loop (``tasks``, ``commits``, ``blocks``, ``framing``, ``writerthread``);
``writer``
the shard writer and its commits; ``executors`` the process pool and Ray; ``publish`` the upload of
finished units to object storage; ``progress`` (the bar) and ``timings`` what the user sees.
"""
