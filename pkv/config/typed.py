"""The validated config as typed, frozen dataclasses: `Config.from_dict(cfg)`.

One source of truth: workflow/schemas/config.schema.yaml holds every key, its type, its
limits and, for a key the config may leave out, its `default:`. This module derives from
it: a field's default is read from the schema (pkv.config.schema.schema_default), never
written here, and tests/test_typed_config.py checks that the fields are exactly the
schema's keys, of its types, with its defaults. The field names are written out (not
made from the schema at import) so that `cfg.measure.max_step` is an AttributeError a
type checker and an editor see; an optional key without a schema default is None when
absent, and means "off" (no column mapping, no overlapped margins).

A view over the dict the pipeline freezes to config.json (whose hash every Parquet file
records; hashes are of that dict, never of this view). A wrong key fails when the config
is loaded, not in the middle of a job: a key the dataclasses do not name is refused, and
so is a missing one, each naming its dotted path. `to_dict()` gives the dict back with
the schema's defaults for keys it left out: the values the run uses.

Values have been validated by the schema before (lists become tuples, so a Config is
immutable and hashable). Imports nothing heavy.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import types
import typing
from dataclasses import dataclass
from functools import cache
from typing import Mapping, Optional

from pkv.config.errors import ConfigError
from pkv.config.schema import schema_default
from pkv.config.stages import external_identity, external_scale, external_title
from pkv.core.families import FAMILIES


@dataclass(frozen=True)
class Shape:
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str
    kv_dtype: str = schema_default("sections.shape", "kv_dtype")


@dataclass(frozen=True)
class Seeds:
    calibration: int
    heldout: tuple[int, ...]
    ablation: int


@dataclass(frozen=True)
class Tolerance:
    max_abs: float
    mean_abs: float


@dataclass(frozen=True)
class Measure:
    holes: float
    max_steps: int
    reference_every: int
    graph: bool


@dataclass(frozen=True)
class TraceSize:
    """A family's SyntheticSpec fields; an absent one takes the schema's default."""

    num_requests: int = schema_default("trace_size", "num_requests")
    decode_min: int = schema_default("trace_size", "decode_min")
    decode_max: int = schema_default("trace_size", "decode_max")
    min_len: int = schema_default("trace_size", "min_len")
    max_len: int = schema_default("trace_size", "max_len")
    mean_arrival_gap: float = schema_default("trace_size", "mean_arrival_gap")
    scale: float = schema_default("trace_size", "scale")

    def given(self) -> dict:
        """SyntheticSpec's keyword arguments: every field, the config's value or the schema's default."""
        return dataclasses.asdict(self)


def _family_size(self, family: str) -> TraceSize:
    if family not in _field_names(Traces):
        raise KeyError(family)
    return getattr(self, family)


# One field per trace family, from the family table (a new family is a row there, not a
# field here): traces.zipf and traces["zipf"] alike.
Traces = dataclasses.make_dataclass("Traces", [(f, TraceSize) for f in FAMILIES], frozen=True,
                                    namespace={"__getitem__": _family_size, "__module__": __name__})


@dataclass(frozen=True)
class Point:
    family: str
    max_active: int


@dataclass(frozen=True)
class Calibration:
    max_steps: int
    split_grid: tuple[int, ...]
    bandwidth_bytes: int
    launch_samples: int


@dataclass(frozen=True)
class Margin:
    max_active: int
    margin: float


@dataclass(frozen=True)
class Policy:
    supported_groups: tuple[int, ...]
    min_context: int
    min_tiles_per_split: int
    margins: tuple[Margin, ...]
    # Optional: the overlapped objective's margins; absent, it promotes by `margins`.
    overlapped_margins: Optional[tuple[Margin, ...]] = None
    # True: the calibration fits that margin instead (pkv.measure.overlapped_margin).
    fit_overlapped_margin: bool = schema_default("sections.policy", "fit_overlapped_margin")

    def __post_init__(self) -> None:
        if self.fit_overlapped_margin and self.overlapped_margins is not None:
            raise ConfigError("give overlapped_margins or fit_overlapped_margin: true, not both")


@dataclass(frozen=True)
class Isolated:
    contexts: tuple[int, ...]
    holes: float
    repeats: int
    engines: tuple[str, ...]


@dataclass(frozen=True)
class SplitSensitivity:
    points: tuple[Point, ...]
    offsets: tuple[int, ...]


@dataclass(frozen=True)
class B4Sweep:
    family: str
    max_active: int
    splits: tuple[int, ...]


@dataclass(frozen=True)
class GqaSweep:
    family: str
    max_active: int
    num_requests: int
    max_steps: int
    groups: tuple[int, ...]
    engines: tuple[str, ...]


@dataclass(frozen=True)
class Ablation:
    family: str
    max_active: int
    engines: tuple[str, ...]


@dataclass(frozen=True)
class KvFp8:
    family: str
    max_active: int
    max_steps: int
    policy: str
    engines: tuple[str, ...]


@dataclass(frozen=True)
class Ablations:
    split_sensitivity: SplitSensitivity
    b4_sweep: B4Sweep
    gqa_sweep: GqaSweep
    raggedness: Ablation
    implementation: Ablation
    kv_fp8: KvFp8


@dataclass(frozen=True)
class MlpProxy:
    family: str
    max_active: int
    width: int
    layers: tuple[int, ...]
    engines: tuple[str, ...]   # the engines measured beside the baselines


@dataclass(frozen=True)
class ExternalColumns:
    """A column mapping (pkv.core.trace_files.columns); time may be NAME:s or NAME:ms."""

    prompt: str
    decode: str
    time: Optional[str] = None


@dataclass(frozen=True)
class External:
    path: str
    step_ms: float
    prompt_scale: float
    max_len: int
    max_requests: int
    max_active: int
    operating_point: Point
    engines: tuple[str, ...]
    # Optional, absent in the committed config (its hash stays): the trace's name and title
    # (pkv.config.stages.external_identity gives the defaults) and a column mapping.
    name: Optional[str] = None
    title: Optional[str] = None
    columns: Optional[ExternalColumns] = None
    time_unit: Optional[str] = None
    stress_scale: Optional[float] = None   # the stress-test replay's prompt scale (pkv.config.stages.EXTERNAL_REPLAYS)

    def identity(self) -> tuple[str, str]:
        """(name, title) of the trace: its files' slug and its table's title."""
        return external_identity({"name": self.name, "title": self.title, "path": self.path})

    def replay(self, stage: str) -> tuple[float | None, str]:
        """(prompt scale, title) of the trace's `stage` replay (pkv.config.stages.EXTERNAL_REPLAYS);
        a scale of None: the config asks for no such replay."""
        section = dataclasses.asdict(self)
        return external_scale(section, stage), external_title(section, stage)


@dataclass(frozen=True)
class NsightCapture:
    family: str
    max_active: int
    max_steps: int
    engines: tuple[str, ...]
    kernel_filter: str
    metrics: tuple[str, ...]


@dataclass(frozen=True)
class ModelStep:
    """The model-level step (pkv measure model-step, pkv.measure.model_plan)."""

    shapes: tuple[str, ...]
    buckets: tuple[int, ...]
    families: tuple[str, ...]
    steps: int
    engines: tuple[str, ...]
    repeats: int
    kv_dtypes: tuple[str, ...]
    # query tokens a row, one pass each: 1 decodes, 2..8 is the speculative step (drafts verified)
    q_lens: tuple[int, ...] = tuple(schema_default("sections.model_step", "q_lens"))


@dataclass(frozen=True)
class FeatureKernels:
    """The kernel sweep's features suite (`pkv bench kernels --suites features`): in `all` where
    the config has this section (pkv.report.spec)."""

    engines: tuple[str, ...]


@dataclass(frozen=True)
class Config:
    """The frozen config (profile resolved, no `smoke:` or `run`)."""

    profile: str
    nsight: bool
    shape: Shape
    seeds: Seeds
    tolerance: Tolerance
    measure: Measure
    baselines: tuple[str, ...]
    traces: Traces
    serving: tuple[Point, ...]
    engine_sets: Mapping[str, tuple[str, ...]]
    calibration: Calibration
    policy: Policy
    isolated: Isolated
    ablations: Ablations
    mlp_proxy: MlpProxy
    external: External
    nsight_capture: NsightCapture
    model_step: ModelStep
    feature_kernels: Optional[FeatureKernels] = None   # absent: the features suite is a named target only

    @classmethod
    def from_dict(cls, cfg: dict, source: str = "config") -> "Config":
        """The typed view of a validated config dict; an unknown or missing key is one
        ConfigError line naming its dotted path."""
        return _build(cls, cfg, source, "")

    @classmethod
    def of(cls, cfg: "Config | dict") -> "Config":
        """`cfg` itself if typed already, else its typed view (functions that take either)."""
        return cfg if isinstance(cfg, Config) else cls.from_dict(cfg)

    def to_dict(self) -> dict:
        """The dict this view was made from, with the schema's defaults for keys it left out
        (lists as lists; an optional key without a default absent when absent)."""
        return _plain(self)


@cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


@cache
def _field_names(cls) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _build(kind, value, source: str, where: str):
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):   # Optional[X]
        return None if value is None else _build(next(a for a in args if a is not type(None)), value, source, where)
    if dataclasses.is_dataclass(kind):
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {where or '(top level)'}: expected a mapping for {kind.__name__}, "
                              f"got {type(value).__name__}")
        hints, fields = _hints(kind), dataclasses.fields(kind)
        names = {f.name for f in fields}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ConfigError(f"{source}: {_at(where, unknown[0])}: unknown key (the typed config "
                              f"{kind.__name__} has {', '.join(sorted(names))})")
        out = {}
        for f in fields:
            if f.name in value:
                out[f.name] = _build(hints[f.name], value[f.name], source, _at(where, f.name))
            elif f.default is dataclasses.MISSING:
                raise ConfigError(f"{source}: {_at(where, f.name)}: missing key")
        try:
            return kind(**out)
        except ConfigError as e:   # a section's own check across its keys (__post_init__)
            raise ConfigError(f"{source}: {where or '(top level)'}: {e}") from None
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{source}: {where}: expected a list, got {type(value).__name__}")
        return tuple(_build(args[0], v, source, f"{where}[{i}]") for i, v in enumerate(value))
    if origin in (collections.abc.Mapping, dict):
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {where}: expected a mapping, got {type(value).__name__}")
        return types.MappingProxyType({k: _build(args[1], v, source, _at(where, k)) for k, v in value.items()})
    return value


def _at(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _plain(value):
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)
                if getattr(value, f.name) is not None or f.default is dataclasses.MISSING}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value
