"""A test kit for code that reads streampack caches: caches written straight from numpy arrays
(``caches``) and a TCP proxy that throttles or resets a connection (``linkproxy``), for object-storage
tests. Nothing here is a build path.
"""
