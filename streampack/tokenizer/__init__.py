"""Tokenizers: text becomes ids, exactly as the tokenizer's own library gives them.

``backends`` holds the tokenizer protocol, its backends (the built-in ``bytes``, Hugging Face
``tokenizer.json``, tiktoken ranks) and the engines that compute their ids (the reference libraries and
the fast engine, used only where it is proven exact); ``pieces`` cuts long texts where the cut cannot
change the ids; ``tiktoken_json`` describes tiktoken ranks as a ``tokenizer.json``.
"""

from streampack.tokenizer.backends import Tokenizer, load_tokenizer

__all__ = ["Tokenizer", "load_tokenizer"]
