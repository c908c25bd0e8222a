"""Mixture configs: a YAML or JSON file (or a dict) that names caches, weights and stages.

Example ``mix.yaml``::

    seq_len: 2048
    layout: windows       # optional: windows (default) | packed | documents (whole documents, padded)
    overlap: 1            # optional, default 0 (windows only)
    seed: 0               # optional
    shuffle: true         # optional: true | false | {block: 4096, window: 32} (a block shuffle)
    block_size: 4096      # optional
    stop: never           # optional: never | first_exhausted
    sources:              # name: cache directory (relative to this file) or URL (s3://bucket/prefix)
      web: caches/web
      code: s3://bucket/code
      math:                 # or a mapping: the cache, and how to read it if it is in object storage
        path: s3://other-bucket/math
        local_dir: /nvme/math-copy   # optional (relative to this file); the local copy of its shards
        max_local_bytes: 2.0e+10     # optional: the bound on that copy
        storage_options: {client_kwargs: {endpoint_url: "http://127.0.0.1:9000"}}  # optional (fsspec)
      fresh:                # a cache whose build is running, followed (streampack.Follow) as it grows
        path: caches/fresh
        follow: true
        first_era: 1024              # optional: era sizes (in samples; in documents for packed/documents)
        largest_era: 65536           # optional
        timeout: 600                 # optional: seconds a batch waits for the build to commit more
    # For every source in object storage that does not set its own (all optional):
    local_dir: /scratch/mix  # one subdirectory per source: /scratch/mix/code, ...
    max_local_bytes: 1.0e+11 # the bound of each source's local copy
    storage_options: {anon: false}
    stages:               # or, for one stage, weights: {web: 0.7, code: 0.3}
      - at: 0
        weights: {web: 0.9, code: 0.1}
      - at: {tokens: 2.0e+10}   # or a position in samples: at: 10000000
        weights: {web: 0.7, code: 0.3}
    exclude:              # optional: what to take out of the run (streampack.loader.Exclusions), a list
      - steps: [[1200, 1250]]   # global steps (both included), or positions: [[start, stop]]
        mode: skip              # skip (default) | mask
      - documents: {web: [17, 4242]}

A source given as a mapping may also hold ``exclude:`` (a mapping or a list of them) naming its own
documents (``documents: [17]``, ``hashes: [...]``). :func:`mixture_exclusions` reads them all, the
config's list first, then each source's in the order of ``sources``; pass them to the loader as
``Loader(load_mixture(path), exclude=mixture_exclusions(path), ...)``, in that order at every resume.

Unknown keys are refused, so a misspelt ``weigths`` never passes silently as "no weights". A source in
object storage is read as :func:`streampack.open` reads one (``local_dir``, ``max_local_bytes``,
``storage_options``); those keys are refused for a local cache. A source with ``follow: true`` is the
committed part of a cache whose build runs, read as :class:`~streampack.loader.follow.Follow` reads it
(its eras shuffled with the config's ``seed``), beside finished ones (see
:mod:`streampack.order.mixture`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

from streampack.errors import MissingDependencyError, OptionsError
from streampack.loader.exclusions import Exclusions
from streampack.loader.follow import FollowOptions, GrowingCache
from streampack.order.blockshuffle import BlockShuffle
from streampack.order.mixture import Mixture
from streampack.reader import Cache
from streampack.reader import open as open_cache
from streampack.store import is_remote

__all__ = ["load_mixture", "mixture_exclusions"]

# How a cache in object storage is read (streampack.open's options), per source or for every source.
_READING = ("local_dir", "max_local_bytes", "storage_options")
_KEYS = {
    "seq_len",
    "layout",
    "overlap",
    "seed",
    "shuffle",
    "block_size",
    "stop",
    "sources",
    "weights",
    "stages",
    "exclude",
    *_READING,
}


def load_mixture(config: str | Path | Mapping[str, Any]) -> Mixture:
    """The :class:`~streampack.order.mixture.Mixture` a config file (``.yaml``, ``.yml``, ``.json``) or
    dict gives.

    Cache paths, and ``local_dir``, are taken relative to the file's directory (to the working directory
    for a dict); a URL (``s3://bucket/prefix``, ``file:///abs/path``) is taken as it is.

    Raises:
        OptionsError: (a ``ValueError``) the file cannot be parsed, a key is unknown or missing, a value
            has the wrong type, or the mixture itself is refused; the message names the file and the key.
        CacheError: a source's cache cannot be opened.
    """
    if isinstance(config, Mapping):
        return _mixture(config, Path.cwd(), "the mixture config")
    path = Path(config)
    return _mixture(_read(path), path.parent, str(path))


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
    if value is None:
        return []
    listed = value if isinstance(value, list) else [value]
    out = []
    for index, item in enumerate(listed):
        if not isinstance(item, Mapping):
            raise OptionsError(
                f"{where}[{index}] is a mapping of documents, hashes, steps, positions, mode, at "
                f"(got {item!r})"
            )
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
    if suffix == ".json":
        try:
            data = orjson.loads(text)
        except orjson.JSONDecodeError as error:
            raise OptionsError(f"{path}: not valid JSON ({error})") from None
    else:
        data = _yaml(text, path)
    if not isinstance(data, Mapping):
        raise OptionsError(
            f"{path}: a mixture config is a mapping with sources and weights (got {type(data).__name__})"
        )
    return data


def _yaml(text: bytes, path: Path) -> Any:
    try:
        import yaml
    except ImportError:  # pragma: no cover - pyyaml is a dependency
        raise MissingDependencyError(
            f"reading {path} needs PyYAML: pip install pyyaml, or write the config as JSON"
        ) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise OptionsError(f"{path}: not valid YAML ({error})") from None


def _mixture(config: Mapping[str, Any], base: Path, where: str) -> Mixture:
    unknown = sorted(set(map(str, config)) - _KEYS)
    if unknown:
        raise OptionsError(f"{where}: unknown keys {unknown}; a mixture config has {sorted(_KEYS)}")
    for key in ("seq_len", "sources"):
        if key not in config:
            raise OptionsError(f"{where}: {key!r} is missing")
    seq_len = _integer(config["seq_len"], f"{where}: seq_len", minimum=1)
    overlap = _integer(config.get("overlap", 0), f"{where}: overlap", minimum=0)
    sources = config["sources"]
    if not isinstance(sources, Mapping) or not sources:
        raise OptionsError(f"{where}: sources is a mapping of name: cache directory or URL (got {sources!r})")
    layout = config.get("layout", "windows")
    if layout not in ("windows", "packed", "documents"):
        raise OptionsError(f"{where}: layout is windows, packed or documents (got {layout!r})")
    if overlap and layout != "windows":
        raise OptionsError(f"{where}: overlap applies to layout: windows only (got layout: {layout})")
    shared = _reading(config, base, where)
    datasets = {}
    for name, location in sources.items():
        if isinstance(location, Mapping) and location.get("follow") is not None:
            datasets[str(name)] = _follow_source(
                str(name), location, shared, base, f"{where}: sources.{name}",
                {"seq_len": seq_len, "overlap": overlap, "layout": layout, "seed": config.get("seed", 0)},
            )  # fmt: skip
            continue
        cache = _open_source(str(name), location, shared, base, f"{where}: sources.{name}")
        datasets[str(name)] = (
            cache.sequences(seq_len, overlap=overlap)
            if layout == "windows"
            else getattr(cache, layout)(seq_len)
        )
    stages = config.get("stages")
    if stages is not None:
        if not isinstance(stages, list):
            raise OptionsError(f"{where}: stages is a list of {{at: ..., weights: {{...}}}} (got {stages!r})")
        stages = [_stage(stage, seq_len, f"{where}: stages[{i}]") for i, stage in enumerate(stages)]
    options = {key: config[key] for key in ("seed", "shuffle", "block_size", "stop") if key in config}
    if isinstance(options.get("shuffle"), Mapping):
        options["shuffle"] = _block_shuffle(options["shuffle"], f"{where}: shuffle")
    try:
        return Mixture(datasets, config.get("weights"), stages=stages, **options)
    except OptionsError as error:
        raise OptionsError(f"{where}: {error}") from None


def _reading(config: Mapping[str, Any], base: Path, where: str) -> dict[str, Any]:
    """The reading options of ``config`` (a whole config's, or one source's), checked; relative
    ``local_dir`` taken from ``base``."""
    options: dict[str, Any] = {}
    if config.get("local_dir") is not None:
        local_dir = config["local_dir"]
        if not isinstance(local_dir, str):
            raise OptionsError(f"{where}: local_dir is a directory (got {local_dir!r})")
        options["local_dir"] = base / local_dir
    if config.get("max_local_bytes") is not None:
        options["max_local_bytes"] = _integer(
            config["max_local_bytes"], f"{where}: max_local_bytes", minimum=1
        )
    if config.get("storage_options") is not None:
        storage = config["storage_options"]
        if not isinstance(storage, Mapping):
            raise OptionsError(
                f"{where}: storage_options is a mapping passed to the fsspec filesystem (got {storage!r})"
            )
        options["storage_options"] = dict(storage)
    return options


def _open_source(name: str, location: object, shared: dict[str, Any], base: Path, where: str) -> Cache:
    """Open the cache of source ``name``: a path or URL, or a mapping with ``path`` and reading options.

    A source in object storage takes the config's reading options where it sets none of its own (the
    config's ``local_dir`` holding one subdirectory per source); a local one takes none.
    """
    own: dict[str, Any] = {}
    if isinstance(location, Mapping):
        unknown = sorted(set(map(str, location)) - {"path", "exclude", *_READING})
        if unknown or "path" not in location:
            problem = f"unknown keys {unknown}" if unknown else "'path' is missing"
            raise OptionsError(f"{where}: {problem}; a source is a path or URL, or has {['path', *_READING]}")
        own = _reading(location, base, where)
        location = location["path"]
    if not isinstance(location, str) or not location:
        raise OptionsError(f"{where} is a cache directory or URL (got {location!r})")
    if not is_remote(location):
        if own:
            raise OptionsError(
                f"{where}: {', '.join(own)} apply to caches in object storage (s3://...), not to the local "
                f"cache {location}"
            )
        return open_cache(location if "://" in location else base / location)
    reading = {**shared, **own}
    if "local_dir" in shared and "local_dir" not in own:
        reading["local_dir"] = shared["local_dir"] / name
    return open_cache(location, **reading)


_FOLLOWING = ("follow", "first_era", "largest_era", "timeout", "poll")


def _follow_source(
    name: str, location: Mapping[str, Any], shared: dict[str, Any], base: Path, where: str,
    samples: Mapping[str, Any],
) -> Any:  # fmt: skip
    """The source ``follow: true`` names: a :class:`~streampack.loader.follow.GrowingCache` of the cache at
    ``path``, whose build may be running, with the config's ``samples`` settings (seq_len, overlap,
    layout, seed) and the source's era and waiting settings."""
    if location["follow"] is not True:
        raise OptionsError(
            f"{where}: follow is true, or left out for a finished cache (got {location['follow']!r})"
        )
    settings = {key: location[key] for key in _FOLLOWING[1:] if key in location}
    for key in ("first_era", "largest_era"):
        if key in settings:
            settings[key] = _integer(settings[key], f"{where}: {key}", minimum=1)
    for key in ("timeout", "poll"):
        value = settings.get(key)
        if key in settings and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise OptionsError(f"{where}: {key} is a number of seconds (got {value!r})")
    path = location.get("path")
    rest = {k: v for k, v in location.items() if k not in _FOLLOWING}
    if not isinstance(path, str) or not path:
        raise OptionsError(f"{where}: 'path' is a cache directory or URL (got {path!r})")
    unknown = sorted(set(map(str, rest)) - {"path", *_READING})
    if unknown:
        raise OptionsError(
            f"{where}: unknown keys {unknown}; a source has {['path', *_READING, *_FOLLOWING]}"
        )
    reading = _reading(rest, base, where)
    if is_remote(path):
        reading = {**shared, **reading}
        if "local_dir" in shared and "local_dir" not in rest:
            reading["local_dir"] = shared["local_dir"] / name
    elif reading:
        raise OptionsError(
            f"{where}: {', '.join(reading)} apply to caches in object storage (s3://...), not to the local "
            f"cache {path}"
        )
    else:
        path = str(path if "://" in path else base / path)
    layout: Any = "sequences" if samples["layout"] == "windows" else samples["layout"]
    try:
        options = FollowOptions(
            seq_len=samples["seq_len"], overlap=samples["overlap"], layout=layout, **settings, **reading
        )
        # In a mixture the source goes on with epochs of its finished cache, as every source does.
        return GrowingCache(path, options, seed=int(samples["seed"]), batch_size=1, drop_last=False)
    except OptionsError as error:
        raise OptionsError(f"{where}: {error}") from None


def _block_shuffle(value: Mapping[str, Any], where: str) -> BlockShuffle:
    unknown = sorted(set(map(str, value)) - {"block", "window"})
    if unknown:
        raise OptionsError(f"{where}: unknown keys {unknown}; a block shuffle has 'block' and 'window'")
    try:
        return BlockShuffle(**{key: _integer(v, f"{where}.{key}", minimum=1) for key, v in value.items()})
    except OptionsError as error:
        raise OptionsError(f"{where}: {error}") from None


def _stage(stage: object, seq_len: int, where: str) -> tuple[int, Mapping[str, float]]:
    if not isinstance(stage, Mapping) or set(stage) != {"at", "weights"}:
        raise OptionsError(f"{where} is a mapping with 'at' and 'weights' (got {stage!r})")
    at, weights = stage["at"], stage["weights"]
    if not isinstance(weights, Mapping):
        raise OptionsError(f"{where}.weights is a mapping of source: weight (got {weights!r})")
    if isinstance(at, Mapping):
        if len(at) != 1 or next(iter(at)) not in ("samples", "tokens"):
            raise OptionsError(
                f"{where}.at is a position in samples, or {{samples: N}} or {{tokens: N}} (got {at!r})"
            )
        unit, count = next(iter(at.items()))
        value = _integer(count, f"{where}.at.{unit}", minimum=0)
        return (-(-value // seq_len) if unit == "tokens" else value), weights
    return _integer(at, f"{where}.at", minimum=0), weights


def _integer(value: object, where: str, *, minimum: int) -> int:
    """A whole number, also given as a float (``2.0e+10``) or a string (``"1e9"``, ``"10_000"``)."""
    number: Any = value
    if isinstance(value, str):
        try:
            number = (
                float(value.replace("_", ""))
                if any(c in value for c in ".eE")
                else int(value.replace("_", ""))
            )
        except ValueError:
            number = None
    if isinstance(number, numbers.Integral) and not isinstance(number, bool):
        number = int(number)
    if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number):
        raise OptionsError(f"{where} must be a whole number (got {value!r})")
    if number != int(number) or int(number) < minimum:
        raise OptionsError(f"{where} must be a whole number >= {minimum} (got {value!r})")
    return int(number)
