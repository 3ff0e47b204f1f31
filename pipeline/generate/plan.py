"""Planning the generation job from metadata: every input check, the shards, and what is already done.

    plan = prepare(config)   # lists the input, checks the pair, scans row counts, reads the commit log

The plan never materialises prompts: the input is listed and scanned (`pipeline.source`,
`pipeline.readers`), shards are row ranges made on demand (`plan.shard(i)`), and what is done is one
byte per shard (`pipeline.generate.manifest.OutputState`). The config hash covers the settings that decide
the rows, the input files' identity (path, size, modification time) and the models' identity
(`pipeline.models.model_identity`), so a changed input or model is refused on resume. It writes nothing;
the job takes the lease and writes (`pipeline.generate.job`).

Not here: running anything (`pipeline.generate.job`), the file layout (`pipeline.generate.output`,
`pipeline.generate.manifest`).
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline import fs, models
from pipeline.config import ModelConfig
from pipeline.errors import JobInputError
from pipeline.generate.config import GenerateConfig, generation_settings
from pipeline.generate.lease import check_free
from pipeline.generate.manifest import Manifest, OutputState, check_output_dir, load_state
from pipeline.generate.shards import (
    SHARD_GRANULE,
    ShardLayout,
    ShardTask,
    part_digits,
    shard_layout,
)
from pipeline.hashing import stable_hash, tensor_fingerprint
from pipeline.readers import limit_note, scan_source
from pipeline.redact import redacted
from pipeline.row_columns import SampleCounts
from pipeline.source import Source, list_source, with_shard_size


@dataclass
class JobPlan:
    """Everything decided before any actor starts."""

    config: GenerateConfig
    output: fs.Location
    config_hash: str
    settings: dict[str, Any]
    source: Source
    manifest: Manifest
    manifest_on_disk: bool
    state: OutputState
    lease: Any = field(default=None)  # the job's `Lease` while it runs (set by pipeline.generate.job)
    run_tag: str = field(default_factory=lambda: uuid.uuid4().hex[:8])  # fences this run's part names
    limit_note: str = ""  # "first N of M rows (data.limit)" when data.limit left input rows out
    samples: SampleCounts | None = None  # each row's n, counted by the scan (with data.sampling_params_column)
    model_fingerprints: dict[str, Any] = field(default_factory=dict)  # {role: tensor_fingerprint}: the actors check
    checked_s: float = 0.0  # seconds the config and input check took (the job's first line)
    mlflow_down: str | None = None  # why the job goes on without MLflow (its server did not answer the check)

    @property
    def output_dir(self) -> str:
        return self.output.uri

    @property
    def num_rows(self) -> int:
        return self.manifest.num_rows

    @property
    def num_shards(self) -> int:
        return self.manifest.num_shards

    @property
    def id_kind(self) -> str:
        return self.manifest.id_kind

    @property
    def shard_size(self) -> int:
        """Prompts (input rows) per shard (the source's scan offsets may be coarser: `ShardLayout`)."""
        return self.manifest.shard_size or self.source.shard_size

    @property
    def layout(self) -> ShardLayout:
        """How the output rows (prompts x samples) are cut into shards (`pipeline.generate.shards`)."""
        samples = self.samples_per_prompt
        return ShardLayout(self.num_rows, self.shard_size, samples, self.manifest.samples_per_shard or samples)

    @property
    def samples_per_prompt(self) -> int:
        """Samples per prompt the plan places (`plan_samples`; with rows' own n, the largest the scan found)."""
        return counted_samples(self.samples) if self.samples is not None else plan_samples(self.config)

    @property
    def output_rows(self) -> int:
        """Output rows the job writes: prompts x samples (with rows' own n, the sum of each row's)."""
        return self.samples.output_rows(self.num_rows) if self.samples is not None else self.layout.output_rows

    def shard(self, index: int) -> ShardTask:
        """Shard `index`'s first attempt in this run (fenced when an earlier run listed it)."""
        task = self.layout.task(index)
        return dataclasses.replace(task, run=self.run_tag, fresh=not self.state.listed[index])

    def todo(self) -> np.ndarray:
        """The indices of the shards still to generate, in order."""
        return np.flatnonzero(np.frombuffer(bytes(self.state.done), dtype=np.uint8) == 0)

    @property
    def shards_to_do(self) -> int:
        return self.num_shards - self.state.shards_done

    def refresh(self) -> None:
        """Read the output directory again (the job does, once it holds the lease)."""
        if fs.exists(self.output.child("_manifest.json")):
            self.manifest_on_disk = True
            self.state = load_state(self.output, self.num_shards, self.config.retry_failed)


def plan_samples(config: GenerateConfig) -> int:
    """Samples per prompt a plan without the scan's count places: `spectr.num_samples`, every prompt's n (with
    `data.sampling_params_column`, `prepare` counts each row's n: `SampleCounts`, `counted_samples`).
    `data.max_samples` caps rows' own n only: it never places samples no row asks for."""
    return config.spectr.num_samples


def counted_samples(counts: SampleCounts) -> int:
    """Samples per prompt the plan places when the scan counted rows' own n: the largest n at most
    `data.max_samples` (a row over the cap fails: the scan leaves it out), at least `spectr.num_samples`."""
    return max(counts.default, counts.largest)


def samples_line(plan: JobPlan) -> str:
    """The first line's count: "16 prompts x 4 samples = 64 rows"; rows with their own n: "x 1 to 8 samples"."""
    low = high = plan.samples_per_prompt
    if plan.samples is not None:
        low, high = plan.samples.sample_range(plan.num_rows)
    if high == 1:
        return f"{plan.num_rows} prompts"
    each = f"{high}" if low == high else f"{low} to {high}"
    return f"{plan.num_rows} prompts x {each} samples = {plan.output_rows} rows"


def check_pair(model: ModelConfig) -> Any:
    """The draft/target pair shares a vocabulary and a tokenizer; returns the target's tokenizer."""
    return models.check_pair(model)[2]


def prepare(config: GenerateConfig) -> JobPlan:
    """All input checks, cheapest first. Raises JobInputError; writes nothing."""
    listing = list_source(config.data)
    target_tok = check_pair(config.model)
    models.check_chat_template(target_tok, config.data)

    settings = generation_settings(config)
    settings["inputs"] = listing.identity()
    model_dirs = {role: models.check_model_dir(path, f"model.{role}", config.model.allow_pickle)
                  for role, path in (("target", config.model.target), ("draft", config.model.draft))}
    settings["models"] = {role: models.model_identity(path) for role, path in model_dirs.items()}
    fingerprints = {role: tensor_fingerprint(path) for role, path in model_dirs.items()}
    settings = redacted(settings)  # _manifest.json holds them; a changed password is the same input and models
    config_hash = stable_hash(settings)
    output = fs.resolve(config.output_dir or f"runs/generate-{config_hash[:12]}", "output_dir")
    fs.check_bucket(output, "output_dir")
    check_free(output, config.lease_timeout_s)
    existing = check_output_dir(output, config_hash, settings)

    limit = models.max_new_tokens_limit(config.model) if config.data.max_new_tokens_column else None
    column = config.data.sampling_params_column  # rows' own n: counted on the scan's pass
    counts = None if column is None else SampleCounts(column, config.spectr.num_samples, config.data.max_samples)
    samples = plan_samples(config)
    if existing is not None:  # resume: the shards the manifest records (older manifests: no sample ranges)
        size, per_shard = existing.shard_size or config.shard_size, existing.samples_per_shard or samples
    elif config.shard_size is not None and counts is None:  # output rows per shard: the block of prompts
        size, per_shard = shard_layout(1 << 62, samples, config.shard_size).shard_size, None
    else:  # (with rows' own n the block follows from the scan's count: offsets every granule meanwhile)
        size, per_shard = None, None
    source = scan_source(config.data, listing, size or SHARD_GRANULE, limit, counts)  # the one pass over the metadata
    if counts is not None:
        samples = counted_samples(counts)
        if existing is not None:
            per_shard = existing.samples_per_shard or samples
        config = _placing(config, samples)
    if per_shard is None:  # a new job: the layout by output rows (prompts x samples)
        layout = shard_layout(source.num_rows, samples, config.shard_size)
        if layout.shard_size % source.shard_size == 0:  # else: a small input's shards read their granule
            source = with_shard_size(source, layout.shard_size)
    else:
        layout = ShardLayout(source.num_rows, size or source.shard_size, samples, per_shard)
    shards = layout.num_shards
    if existing is not None:
        _check_same_plan(existing, listing.path, output, source.num_rows, shards, samples)
        _check_same_models(existing, fingerprints, config, output)
    manifest = existing or Manifest(
        config_hash, settings, source.num_rows, shards, part_digits(shards), source.id_kind, layout.shard_size,
        samples_per_shard=layout.samples_per_shard if samples > 1 else None, model_fingerprints=fingerprints,
    )
    if existing is not None:
        state = load_state(output, shards, config.retry_failed)
    else:
        state = OutputState(done=bytearray(shards))
    return JobPlan(config, output, config_hash, settings, source, manifest, existing is not None, state,
                   limit_note=limit_note(config.data, listing, source.num_rows), samples=counts,
                   model_fingerprints=fingerprints)


def _check_same_models(existing: Manifest, fingerprints: dict[str, Any], config: GenerateConfig,
                       output: fs.Location) -> None:
    """Resume: every tensor of the pair is the one the directory was started with (the config hash's identity
    samples large files only)."""
    for role, before in (existing.model_fingerprints or {}).items():
        now = fingerprints.get(role, {})
        changed = sorted(name for name in set(before) | set(now) if before.get(name) != now.get(name))
        if changed:
            raise JobInputError(
                f"model.{role}: the model at {getattr(config.model, role)} changed since {output.uri} was started "
                f"({', '.join(changed[:3])}: tensors differ); restore it to resume, or choose another output_dir"
            )


def _check_same_plan(existing: Manifest, path: str, output: fs.Location, rows: int, shards: int, samples: int) -> None:
    """Resume: the input gives the rows and the plan the shards the directory was started with."""
    if existing.num_rows != rows:
        raise JobInputError(
            f"data.path: {path} now gives {rows} rows, {output.uri} was started with "
            f"{existing.num_rows}; restore the input to resume, or choose another output_dir"
        )
    if existing.num_shards != shards:  # a plan of an older version (rows' own n)
        raise JobInputError(
            f"output_dir: {output.uri} was started with {existing.num_shards} shards, this version plans {shards} "
            f"for the same input and settings ({samples} samples per prompt: each row's n, counted by the scan); "
            f"choose another output_dir"
        )


def _placing(config: GenerateConfig, samples: int) -> GenerateConfig:
    """The config the job runs with when the scan counted rows' own n: `data.max_samples` is the n the plan
    places (the workers fail a row over it), unchanged when the user set it (the hash is taken before)."""
    if config.data.max_samples is not None:
        return config
    return dataclasses.replace(config, data=dataclasses.replace(config.data, max_samples=samples))
