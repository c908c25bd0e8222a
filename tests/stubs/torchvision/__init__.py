"""A stand-in for ``torchvision``, put on ``sys.path`` by the MDS tests only.

``mosaicml-streaming`` 0.13.0 imports ``torchvision`` at import time (for its vision datasets, which the
token tests never use), and installing the real one would replace the CPU torch with a CUDA build. This
module gives the two names that import asks for and nothing else.
"""

from __future__ import annotations

import sys
import types
from typing import Any


class VisionDataset:
    """The base class ``streaming.vision.base`` subclasses; never instantiated by the token tests."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("the torchvision stub of the MDS tests has no vision datasets")


def to_tensor(pic: Any) -> Any:
    """Named by ``streaming.vision.base``; never called by the token tests."""
    raise NotImplementedError("the torchvision stub of the MDS tests has no transforms")


datasets = types.ModuleType("torchvision.datasets")
datasets.VisionDataset = VisionDataset  # type: ignore[attr-defined]
datasets.CIFAR10 = VisionDataset  # type: ignore[attr-defined]
transforms = types.ModuleType("torchvision.transforms")
functional = types.ModuleType("torchvision.transforms.functional")
functional.to_tensor = to_tensor  # type: ignore[attr-defined]
transforms.functional = functional  # type: ignore[attr-defined]
sys.modules.update(
    {
        "torchvision.datasets": datasets,
        "torchvision.transforms": transforms,
        "torchvision.transforms.functional": functional,
    }
)
