"""The build: a corpus becomes a token cache, in bounded memory, resumably and byte-identically.

``coordinator`` holds :func:`build`; ``options`` the cache's identity and the run's settings; ``pipeline``
the work units' read -> encode -> write loop; ``executors`` the process pool and Ray; ``publish`` the
output directory and the upload to object storage.
"""
