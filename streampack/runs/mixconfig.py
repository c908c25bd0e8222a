"""Mixture configs: a YAML or JSON file (or a dict) that names caches, weights and stages.

:func:`load_mixture` makes the :class:`~streampack.order.mixture.Mixture`, :func:`mixture_exclusions` the
exclusions it lists. Every key is described in docs/guide/mixtures.md ("Config files").
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import orjson
import yaml
from msgspec import Meta, Struct

from streampack.errors import OptionsError, read_json
from streampack.follow import FollowOptions, GrowingCache
from streampack.loader.exclusions import Exclusions
from streampack.loader.state import Count, Positive
from streampack.order.blockshuffle import BlockShuffle
from streampack.order.mixture import Mixture
from streampack.reader import open as open_cache
from streampack.store import is_remote

__all__ = ["CONFIG_KEYS", "is_config", "load_mixture", "mixture_exclusions"]

_FIX = "see streampack mix --help for what a mixture config holds"
_READING = ("local_dir", "max_local_bytes", "storage_options")
_FOLLOWING = ("first_era", "largest_era", "timeout", "poll")


class _Reading(Struct, forbid_unknown_fields=True, kw_only=True):
    """How caches in object storage are read (:func:`streampack.open`'s options)."""

    local_dir: str | None = None
    max_local_bytes: Positive | None = None
    storage_options: dict[str, Any] | None = None


class _Source(_Reading):
    """A source given as a mapping: its cache, how to read it, and how to follow a build that runs."""

    path: Annotated[str, Meta(min_length=1)]
    exclude: Any = None  # read by mixture_exclusions
    follow: Literal[True] | None = None
    first_era: Positive | None = None
    largest_era: Positive | None = None
    timeout: float | None = None
    poll: float | None = None

    def __post_init__(self) -> None:
        following = [key for key in _FOLLOWING if getattr(self, key) is not None]
        reading = [key for key in _READING if getattr(self, key) is not None]
        if following and not self.follow:
            raise ValueError(f"{', '.join(following)} apply to a source with follow: true only")
        if self.follow and self.exclude is not None:
            raise ValueError("exclude applies to a finished cache, not to one followed")
        if reading and not is_remote(self.path):
            raise ValueError(
                f"{', '.join(reading)} apply to caches in object storage (s3://...), not to the local cache "
                f"{self.path}"
            )


class _At(Struct, forbid_unknown_fields=True):
    """Where a stage starts, given in samples or in tokens."""

    samples: Count | None = None
    tokens: Count | None = None

    def __post_init__(self) -> None:
        if (self.samples is None) == (self.tokens is None):
            raise ValueError("a stage is at a position in samples, or {samples: N} or {tokens: N}")


class _Stage(Struct, forbid_unknown_fields=True):
    at: Count | _At
    weights: dict[str, float]


class _BlockShuffle(Struct, forbid_unknown_fields=True):
    block: Positive = BlockShuffle.block
    window: Positive = BlockShuffle.window


class _Config(_Reading):
    """A mixture config; its sources are read one by one (:class:`_Source`), so messages name them."""

    seq_len: Positive
    sources: Annotated[dict[str, Any], Meta(min_length=1)]
    layout: Literal["windows", "packed", "documents"] = "windows"
    overlap: Count = 0
    seed: int | None = None
    shuffle: bool | _BlockShuffle | None = None
    block_size: int | None = None
    stop: Literal["never", "first_exhausted"] | None = None
    weights: dict[str, float] | None = None
    stages: list[_Stage] | None = None
    exclude: Any = None  # read by mixture_exclusions


#: The keys a mixture config may hold (``streampack mix --help`` describes each); any other is refused.
CONFIG_KEYS: tuple[str, ...] = _Config.__struct_fields__


def load_mixture(config: str | Path | Mapping[str, Any]) -> Mixture:
    """The :class:`~streampack.order.mixture.Mixture` a config file (``.yaml``, ``.yml``, ``.json``) or
    dict gives.

    Cache paths, and ``local_dir``, are taken relative to the file's directory (to the working directory
    for a dict); a URL (``s3://bucket/prefix``, ``file:///abs/path``) is taken as it is.

    Raises:
        OptionsError: (a ``ValueError``) the file cannot be parsed, a key is unknown or missing, a value
            has the wrong type, or the mixture itself is refused; the message names the file and the
            JSON path of the key.
        CacheError: a source's cache cannot be opened.
    """
    if isinstance(config, Mapping):
        return _mixture(config, Path.cwd(), "the mixture config")
    path = Path(config)
    return _mixture(_read(path), path.parent, str(path))


def is_config(data: str | Path) -> bool:
    """Whether ``data`` names a mixture config file (YAML or JSON), not a cache or token files."""
    return Path(data).suffix in {".yaml", ".yml", ".json"} and Path(data).is_file()


def mixture_exclusions(config: str | Path | Mapping[str, Any]) -> list[Exclusions]:
    """The exclusions a mixture config names (its ``exclude:`` list, then each source's), in that order.

    Raises:
        OptionsError: ``exclude:`` is not a mapping or a list of them, or one of them is not an
            :class:`~streampack.loader.exclusions.Exclusions`; the message names the file and the key.
    """
    where = "the mixture config" if isinstance(config, Mapping) else str(config)
    data = config if isinstance(config, Mapping) else _read(Path(config))
    found = _exclusions(data.get("exclude"), None, f"{where}: exclude")
    sources = data.get("sources")
    for name, location in sources.items() if isinstance(sources, Mapping) else ():
        if isinstance(location, Mapping):
            found += _exclusions(location.get("exclude"), str(name), f"{where}: sources.{name}.exclude")
    return found


def _exclusions(value: object, source: str | None, where: str) -> list[Exclusions]:
    out = []
    for index, item in enumerate([] if value is None else value if isinstance(value, list) else [value]):
        try:
            out.append(Exclusions.from_config(item, source=source))
        except OptionsError as error:
            raise OptionsError(f"{where}[{index}]: {error}") from None
    return out


def _read(path: Path) -> Mapping[str, Any]:
    suffix = path.suffix.lower()
    if suffix not in (".json", ".yaml", ".yml"):
        raise OptionsError(
            f"{path}: a mixture config is a .yaml, .yml or .json file (got {suffix or 'no suffix'!r})"
        )
    try:
        text = path.read_bytes()
    except OSError as error:
        raise OptionsError(f"cannot read the mixture config {path}: {error.strerror}") from None
    try:
        data = orjson.loads(text) if suffix == ".json" else yaml.safe_load(text)
    except (orjson.JSONDecodeError, yaml.YAMLError) as error:
        raise OptionsError(f"{path}: not valid {'JSON' if suffix == '.json' else 'YAML'} ({error})") from None
    if not isinstance(data, Mapping):
        raise OptionsError(
            f"{path}: a mixture config is a mapping with sources and weights (got {type(data).__name__})"
        )
    return data


def _mixture(raw: Mapping[str, Any], base: Path, where: str) -> Mixture:
    config = read_json(raw, _Config, OptionsError, where, _FIX, strict=False)
    if config.overlap and config.layout != "windows":
        raise OptionsError(
            f"{where}: overlap applies to layout: windows only (got layout: {config.layout}) - at `$.overlap`"
        )
    shared = _reading(config, base)
    datasets = {}
    for name, raw_source in config.sources.items():
        given = {"path": raw_source} if isinstance(raw_source, str) else raw_source
        source = read_json(given, _Source, OptionsError, where, _FIX, at=f"$.sources.{name}", strict=False)
        path, reading = _location(name, source, shared, base)
        if source.follow:
            datasets[name] = _following(source, path, reading, config, f"{where}: sources.{name}")
            continue
        cache = open_cache(path, **reading)
        datasets[name] = (
            cache.sequences(config.seq_len, overlap=config.overlap)
            if config.layout == "windows"
            else getattr(cache, config.layout)(config.seq_len)
        )
    stages = None
    if config.stages is not None:
        stages = [(_samples(stage.at, config.seq_len), stage.weights) for stage in config.stages]
    block = config.shuffle
    shuffle = BlockShuffle(block.block, block.window) if isinstance(block, _BlockShuffle) else block
    options = {"seed": config.seed, "shuffle": shuffle, "block_size": config.block_size, "stop": config.stop}
    try:
        chosen: dict[str, Any] = {key: value for key, value in options.items() if value is not None}
        return Mixture(datasets, config.weights, stages=stages, **chosen)
    except OptionsError as error:
        raise OptionsError(f"{where}: {error}") from None


def _samples(at: int | _At, seq_len: int) -> int:
    """A stage's start in samples: ``{tokens: N}`` is the first sample that reaches token ``N``."""
    if isinstance(at, int):
        return at
    return at.samples if at.samples is not None else -(-(at.tokens or 0) // seq_len)


def _reading(options: _Reading, base: Path) -> dict[str, Any]:
    """The reading options ``options`` sets; a relative ``local_dir`` taken from ``base``."""
    reading = {key: getattr(options, key) for key in _READING if getattr(options, key) is not None}
    if "local_dir" in reading:
        reading["local_dir"] = base / reading["local_dir"]
    return reading


def _location(name: str, source: _Source, shared: dict[str, Any], base: Path) -> tuple[str, dict[str, Any]]:
    """The cache of source ``name`` and its reading options.

    A cache in object storage takes the config's options where it sets none of its own, the config's
    ``local_dir`` holding one subdirectory per source; a local one, relative to ``base``, takes none.
    """
    if not is_remote(source.path):
        return str(source.path if "://" in source.path else base / source.path), {}
    own = _reading(source, base)
    reading = {**shared, **own}
    if "local_dir" in shared and "local_dir" not in own:
        reading["local_dir"] = shared["local_dir"] / name
    return source.path, reading


def _following(source: _Source, path: str, reading: dict[str, Any], config: _Config, where: str) -> Any:
    """The :class:`~streampack.follow.GrowingCache` a ``follow: true`` source names, read with the
    config's seq_len, overlap, layout and seed."""
    settings = {key: getattr(source, key) for key in _FOLLOWING if getattr(source, key) is not None}
    layout: Any = "sequences" if config.layout == "windows" else config.layout
    try:
        options = FollowOptions(
            seq_len=config.seq_len, overlap=config.overlap, layout=layout, **settings, **reading
        )
        # In a mixture the source goes on with epochs of its finished cache, as every source does.
        return GrowingCache(path, options, seed=config.seed or 0, batch_size=1, drop_last=False)
    except OptionsError as error:
        raise OptionsError(f"{where}: {error}") from None
