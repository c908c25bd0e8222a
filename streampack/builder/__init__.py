"""The build: a corpus becomes a token cache, in bounded memory, resumably and byte-identically.

``coordinator`` holds :func:`build` (plan, check, run, record); ``options`` the cache's identity
(``CacheSpec``) and the run's settings (``RunOptions``); ``pipeline`` one work unit's read → encode → write
loop; ``writer`` the shard writer and its commits; ``executors`` the process pool and Ray; ``publish`` the
upload of finished units to object storage; ``progress`` and ``stagetimes`` what the user sees.
"""
