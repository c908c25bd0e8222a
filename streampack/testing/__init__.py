"""A test kit for code that reads streampack caches: caches written straight from numpy arrays
(``caches``), and a TCP proxy that throttles or resets a connection (``linkproxy``).
"""

from streampack.testing.caches import rewrite_as_version_1, write_cache, write_random_cache

__all__ = ["rewrite_as_version_1", "write_cache", "write_random_cache"]
