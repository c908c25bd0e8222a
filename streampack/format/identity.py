"""The identity of a build: what a resumed build must share with the cache it continues
(:func:`build_identity`), and what tells a follower a cache is still the same build's (:func:`build_digest`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from streampack.format.manifest import Manifest, inputs_json


def build_identity(manifest: Manifest) -> dict[str, Any]:
    """What a resumed build must share with the cache, one setting per key (the tokenizer by its hash: it
    may be named by another path). Computed from the sections' JSON, so a key a later version added is
    compared too; settings older caches lack read as what such a build did."""
    tokenizer = {k: v for k, v in manifest.tokenizer.to_json().items() if k != "spec"}
    settings = {k: v for k, v in manifest.settings.to_json().items() if k != "tokenizer"}
    for key, value in _LATER_SETTINGS.items():
        settings.setdefault(key, value)
    for key, value in _LEFT_OUT_AT_DEFAULT.items():
        if settings.get(key, value) == value:
            settings.pop(key, None)
    # The policies as resolved (the tokenizer's own EOS or BOS may come from a tokenizer_config.json, which
    # the tokenizer's hash does not cover), keyed apart from the settings of the same name.
    policies = {"eos_policy": manifest.eos.to_json(), "bos_policy": manifest.bos.to_json()}
    return {"tokenizer": tokenizer, "dtype": manifest.dtype, **policies, **settings}


# Settings added after caches were first written, with the value that those caches were built with.
_LATER_SETTINGS: dict[str, Any] = {"bos": False, "bos_id": None, "fields": None, "chat": None}
# Settings added later still, left out of the identity while they hold these defaults: the identity and
# digest of every cache built without them stay what they were.
_LEFT_OUT_AT_DEFAULT: dict[str, Any] = {"chat_turns": "all", "chat_reasoning": "train"}


def build_digest(manifest: Manifest) -> str:
    """What identifies a build's output, the same while it runs, once complete and after a resume: its
    :func:`build_identity`, inputs and work units."""
    fields = {
        "identity": build_identity(manifest),
        "inputs": inputs_json(manifest.inputs),
        "units": manifest.units,
        "loss_mask": manifest.loss_mask,
    }
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
