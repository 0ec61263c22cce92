"""Frozen dataclass configs, loaded from TOML and overridden by ``--section.field=value``.

Every field carries its own help text (``metadata["help"]``) so the CLI, the README and the
error messages are generated from one place. ``validate`` is run once, on every rank, before any
process group exists; it raises ``ConfigError`` with one line naming the field and valid values.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import typing
from dataclasses import dataclass, field, fields, replace
from typing import Any

from .reliability.errors import UserError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(UserError, ValueError):
    """A user error in the configuration: printed as one line, never as a traceback."""


def _f(default: Any, help: str, **kw: Any) -> Any:
    """A field with its help text; ``ge``/``gt``/``le``/``lt`` state a float's valid range
    (checked by ``validate``, with finiteness, and shown by ``--help``)."""
    return field(default=default, metadata={"help": help, **kw})


_BOUNDS = {"ge": (">=", lambda v, b: v >= b), "gt": (">", lambda v, b: v > b),
           "le": ("<=", lambda v, b: v <= b), "lt": ("<", lambda v, b: v < b)}


def _range_text(f) -> str:
    """'positive', '>= 0', 'between 0 and 1', 'in [0, 1)', ... from a field's bounds."""
    b = {k: f.metadata[k] for k in _BOUNDS if k in f.metadata}
    lo = next(((k, v) for k, v in b.items() if k in ("ge", "gt")), None)
    hi = next(((k, v) for k, v in b.items() if k in ("le", "lt")), None)
    if lo and hi:
        if (lo[0], hi[0]) == ("gt", "lt"):
            return f"between {lo[1]:g} and {hi[1]:g}"
        return f"in {'[' if lo[0] == 'ge' else '('}{lo[1]:g}, {hi[1]:g}{']' if hi[0] == 'le' else ')'}"
    if lo == ("gt", 0):
        return "positive"
    return " and ".join(f"{_BOUNDS[k][0]} {v:g}" for k, v in b.items())


def _check_floats(section, name: str) -> None:
    """Every float field is finite and inside its stated range: a NaN or negative learning
    rate is one line here, not a traceback or a silently diverging run."""
    import math
    for f in fields(section):
        if f.type not in ("float", float):
            continue
        v = getattr(section, f.name)
        bad = not math.isfinite(v) or any(k in f.metadata and not ok(v, f.metadata[k])
                                           for k, (_, ok) in _BOUNDS.items())
        if bad:
            rng = _range_text(f)
            if math.isfinite(v):
                raise ConfigError(f"{name}.{f.name}={v} must be {rng}")
            raise ConfigError(f"{name}.{f.name}={v} must be a finite number" + (f", {rng}" if rng else ""))


@dataclass(frozen=True)
class ModelConfig:
    name: str = _f("llama", "built-in model: llama (byte-level text); on images (the digits): vit "
                            "(vision transformer), resnet (residual CNN with BatchNorm), unet "
                            "(denoiser whose pipeline stages exchange tuples of skip tensors)",
                   choices=("llama", "vit", "resnet", "unet"))
    spec: str = _f("", "your own model: 'package.module:attr', a ModelSpec or a function "
                       "(ModelConfig) -> ModelSpec; overrides model.name")
    n_layers: int = _f(6, "number of transformer blocks")
    d_model: int = _f(256, "hidden size")
    n_heads: int = _f(8, "attention (query) heads")
    n_kv_heads: int = _f(4, "key/value heads (grouped-query attention); must divide n_heads")
    d_ff: int = _f(768, "SwiGLU hidden size")
    vocab_size: int = _f(256, "vocabulary size (256 for the byte-level data)")
    seq_len: int = _f(128, "tokens per sequence")
    tie_embeddings: bool = _f(False, "share the input embedding and the output head")
    rope_theta: float = _f(10000.0, "rotary embedding base", gt=0)
    norm_eps: float = _f(1e-5, "RMSNorm epsilon", gt=0)
    init_std: float = _f(0.02, "std of the normal initialisation", gt=0)
    image_size: int = _f(8, "vit, resnet: image height and width in pixels (digits: 8)")
    patch_size: int = _f(2, "vit: patch height and width; (image_size/patch_size)^2 patches")
    channels: int = _f(1, "vit, resnet: image channels (digits: 1)")
    n_classes: int = _f(10, "vit, resnet: classes of the classifier head")
    base_channels: int = _f(16, "resnet, unet: channels at full resolution (doubled at each halving "
                                "of the resolution)")
    norm_groups: int = _f(4, "unet: GroupNorm groups (tensor parallelism must divide them)")
    init_from: str = _f("", "initialise the weights from this instead of randomly: a Hugging Face Llama folder "
                            "(config.json + safetensors), a `hybridpar import-hf` folder, or a .safetensors/.pt "
                            "file of full tensors under our names; model fields must match it")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass(frozen=True)
class ParallelConfig:
    dp: int = _f(2, "data-parallel degree (model replicas)")
    tp: int = _f(1, "tensor-parallel degree (Megatron column/row split)")
    pp: int = _f(1, "pipeline-parallel degree (stages)")
    cp: int = _f(1, "context-parallel degree: each sequence split over cp ranks (long sequences)")
    cp_attention: str = _f("ring", "attention across the cp group: K/V passed around a ring (never "
                                   "holds the full K/V) or all-gathered once",
                           choices=("ring", "allgather"))
    microbatches: int = _f(1, "micro-batches per optimizer step on each dp replica")
    schedule: str = _f("1f1b", "pipeline schedule", choices=("gpipe", "1f1b", "interleaved"))
    virtual_stages: int = _f(1, "model chunks per pipeline rank (interleaved 1F1B; >1 needs schedule=interleaved)")
    sequence_parallel: bool = _f(False, "Megatron-SP: norms and residuals sharded along the sequence inside tp")
    zero1: bool = _f(False, "ZeRO-1: shard AdamW state over dp (reduce-scatter grads, all-gather params)")
    recompute: str = _f("none", "activation recomputation", choices=("none", "selective", "full"))
    grad_reduce_dtype: str = _f("fp32", "dtype of the dp gradient reduction", choices=("fp32", "bf16"))
    order: str = _f("tp-dp-pp", "rank order, innermost axis first (tp innermost = closest ranks)")
    pp_split: str = _f("", "blocks per stage, e.g. '2,2,1,1', or 'auto': the split whose slowest "
                           "stage is predicted fastest (stem and head included); empty = by count, "
                           "or auto when the blocks' costs differ (a CNN's stages)")
    bucket_mb: float = _f(0.0, "data-parallel gradient bucket size in MiB; 0 = auto: an eighth of the "
                               "stage's gradients, between 1 and 25 MiB (up to 100 MiB beyond 8 replicas), "
                               "so the first all-reduces start while backward still runs", ge=0)

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp


@dataclass(frozen=True)
class TrainConfig:
    steps: int = _f(250, "optimizer steps")
    global_batch: int = _f(32, "sequences per optimizer step, over all dp replicas")
    lr: float = _f(3e-3, "peak learning rate", gt=0)
    min_lr_ratio: float = _f(0.1, "final learning rate as a fraction of lr (cosine decay)", ge=0, le=1)
    warmup_steps: int = _f(20, "linear warmup steps")
    weight_decay: float = _f(0.1, "AdamW weight decay (matrices only)", ge=0)
    beta1: float = _f(0.9, "AdamW beta1", ge=0, lt=1)
    beta2: float = _f(0.95, "AdamW beta2", ge=0, lt=1)
    eps: float = _f(1e-8, "AdamW epsilon", gt=0)
    grad_clip: float = _f(1.0, "clip the global gradient norm to this; 0 disables", ge=0)
    seed: int = _f(0, "seed of initialisation and data order (layout-independent)")
    eval_every: int = _f(50, "validation every N steps; 0 disables")
    eval_batches: int = _f(4, "validation batches (of global_batch sequences)")
    metrics: str = _f("", "rank 0 writes one JSON line per step here")
    device: str = _f("auto", "cpu, cuda or auto", choices=("auto", "cpu", "cuda"))
    precision: str = _f("auto", "compute dtype (fp32 master weights always); fp16 uses dynamic loss "
                                "scaling; auto = bf16 on GPUs, fp32 on CPUs",
                        choices=("auto", "fp32", "bf16", "fp16"))
    threads_per_rank: int = _f(0, "torch threads per rank; 0 = cores / local ranks")
    bind_cores: bool = _f(True, "on a CPU, bind each local rank to its own share of the cores "
                                "(ranks beyond the cores take one each, in turn): a rank the OS "
                                "moves between cores loses its caches; false if other jobs "
                                "share this machine's cores")
    compile: bool = _f(False, "torch.compile each unit of the model (inductor: fused elementwise "
                              "kernels, fewer launches); the first steps compile (slower); on a CPU "
                              "needs a C++ compiler")
    progress: bool = _f(True, "show a progress bar on rank 0")
    summary: bool = _f(True, "print what the run trains (model, layout, data, start state) on rank 0")
    tensorboard: str = _f("", "rank 0 writes TensorBoard event files to this folder "
                              "(pip install 'hybridpar[tensorboard]')")
    peak_tflops: float = _f(0.0, "peak TFLOP/s of one device, for MFU in the TensorBoard logs; 0 = not logged", ge=0)
    trace: str = _f("", "write every rank's events (forward/backward per micro-batch, collectives, idle) "
                        "to this Chrome trace JSON (Perfetto) and a PNG timeline next to it "
                        "(pip install 'hybridpar[plot]')")


@dataclass(frozen=True)
class DataConfig:
    path: str = _f("", "text file or folder; empty = the Python standard library's sources")
    val_fraction: float = _f(0.05, "tail fraction of the tokens (or images) held out for validation", gt=0, lt=1)
    tokenizer: str = _f("", "text models: 'byte', or a tokenizer.json (or a folder holding one); empty = the "
                            "model.init_from folder's tokenizer.json if it has one, else byte")
    text_field: str = _f("text", "JSONL documents: the field holding the text")
    format: str = _f("auto", "JSONL: auto (lines with prompt+response or messages are instruction data, "
                             "the loss masked on prompts), text, or sft", choices=("auto", "text", "sft"))
    token_dtype: str = _f("uint16", ".bin token files: the id dtype", choices=("uint16", "uint32"))
    images: str = _f("digits", "image models: scikit-learn's bundled 8x8 digits, or synthetic images of "
                               "model.image_size (any resolution, for memory and speed measurements)",
                     choices=("digits", "synthetic"))
    n_images: int = _f(4096, "data.images=synthetic: how many images")


@dataclass(frozen=True)
class ReliabilityConfig:
    deadline_s: float = _f(300.0, "watchdog: a rank whose current operation (collective, send/recv, forward, "
                                  "backward) lasts longer than this stops the job, naming the rank(s) that "
                                  "stopped participating; 0 disables", ge=0)
    dump_dir: str = _f("", "watchdog report and per-rank stack dumps; empty = <tmp>/hybridpar-dumps/<run id>")
    nan_policy: str = _f("stop", "non-finite loss or gradient norm: stop naming the step and rank, or skip "
                                 "the update (parameters unchanged); under fp16 the loss scaler decides",
                         choices=("stop", "skip"))
    max_consecutive_skips: int = _f(5, "nan_policy=skip: stop after this many non-finite steps in a row")
    straggler_every: int = _f(10, "every N steps gather each rank's mean busy time per step (time not waiting "
                                  "in communication) into the metrics ('rank_busy_s'); 0 disables")
    straggler_threshold: float = _f(1.5, "name a rank whose busy time exceeds this multiple of the median of "
                                         "its pipeline stage's ranks (metrics 'straggler'); 0 disables naming", gt=1)


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str = _f("", "checkpoint folder (step_NNNNNN/ checkpoints and a `latest` pointer); empty: no "
                      "checkpoints. Any layout can load them; a restarted torchrun worker resumes from it")
    every: int = _f(0, "save every N steps; with dir set a checkpoint is also saved at the last step and on "
                       "SIGTERM (all ranks save together, then exit 0)")
    keep: int = _f(3, "keep the newest K checkpoints in dir; 0 keeps all")
    resume: bool = _f(False, "continue from dir's latest checkpoint (hybridpar train --resume); an error "
                             "if there is none, unless fresh_if_none")
    fresh_if_none: bool = _f(False, "with resume: start a new run, saying so, when dir holds no checkpoint "
                                    "(hybridpar train --resume=auto)")
    load: str = _f("", "start from this checkpoint (a step_NNNNNN folder, or a dir: its latest), in any "
                       "layout: weights, optimizer state, step; checkpoint.dir's latest wins when resuming")


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reliability: ReliabilityConfig = field(default_factory=ReliabilityConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_SECTION_TYPES = {"model": ModelConfig, "parallel": ParallelConfig, "train": TrainConfig,
                  "data": DataConfig,
                  "reliability": ReliabilityConfig,
                  "checkpoint": CheckpointConfig}


def _suggest(name: str, options: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def _coerce(section: str, f: dataclasses.Field, value: Any, *, from_text: bool) -> Any:
    """Convert ``value`` to the field's type; TOML values must already have the right type."""
    where = f"{section}.{f.name}"
    typ = {"int": int, "float": float, "bool": bool, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]
    if from_text and isinstance(value, str):
        if typ is bool:
            low = value.lower()
            if low not in ("true", "false", "1", "0", "yes", "no"):
                raise ConfigError(f"{where}={value!r} is not a boolean; use true or false")
            value = low in ("true", "1", "yes")
        elif typ is not str:
            try:
                value = typ(value)
            except ValueError:
                raise ConfigError(f"{where}={value!r} is not {'an integer' if typ is int else 'a number'}") from None
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ConfigError(f"{where} must be {typ.__name__}, got {type(value).__name__} {value!r}")
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{where}={value!r} is not valid; choose one of {', '.join(choices)}")
    return value


def apply_updates(cfg: Config, updates: dict[str, dict[str, Any]], *, from_text: bool) -> Config:
    """Return ``cfg`` with ``{section: {field: value}}`` applied, rejecting unknown keys."""
    new_sections = {}
    for section, values in updates.items():
        if section not in _SECTION_TYPES:
            raise ConfigError(f"unknown config section '{section}'{_suggest(section, _SECTION_TYPES)}"
                              f" (sections: {', '.join(_SECTION_TYPES)})")
        if not isinstance(values, dict):
            raise ConfigError(f"config section '{section}' must be a table, got {values!r}")
        by_name = {f.name: f for f in fields(_SECTION_TYPES[section])}
        changes = {}
        for key, value in values.items():
            if key not in by_name:
                raise ConfigError(f"unknown config key '{section}.{key}'"
                                  f"{_suggest(key, by_name)}")
            changes[key] = _coerce(section, by_name[key], value, from_text=from_text)
        new_sections[section] = replace(getattr(cfg, section), **changes)
    return replace(cfg, **new_sections)


def load_toml(path: str) -> dict:
    import os
    import stat
    try:
        mode = os.stat(path).st_mode
    except OSError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        raise ConfigError(f"config file {path} is not a regular file (a pipe or device?); "
                          f"pass a .toml file")  # reading a FIFO would block forever
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
        if raw.startswith(b"\xef\xbb\xbf"):
            raise ConfigError(f"config file {path} starts with a UTF-8 byte-order mark, which TOML "
                              f"does not allow; save it as UTF-8 without BOM")
        return tomllib.loads(raw.decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a folder; pass a .toml file") from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None


def parse_overrides(items: typing.Sequence[str]) -> dict[str, dict[str, str]]:
    """``["--model.n_layers=6", "train.lr=1e-3"]`` -> ``{"model": {"n_layers": "6"}, ...}``."""
    out: dict[str, dict[str, str]] = {}
    for item in items:
        body = item[2:] if item.startswith("--") else item
        key, eq, value = body.partition("=")
        section, dot, name = key.partition(".")
        if not eq or not dot or not name:
            raise ConfigError(f"cannot parse override '{item}'; write --section.field=value, "
                              f"e.g. --model.n_layers=6")
        out.setdefault(section.replace("-", "_"), {})[name.replace("-", "_")] = value
    return out


def load_config(path: str | None = None, overrides: typing.Sequence[str] = (),
                base: Config | None = None) -> Config:
    cfg = base or Config()
    if path:
        cfg = apply_updates(cfg, load_toml(path), from_text=False)
    return apply_updates(cfg, parse_overrides(overrides), from_text=True)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def pp_split(n_layers: int, pp: int, spec: str = "") -> list[int]:
    """Layers per stage; balanced splits give the extra layers to the earliest stages."""
    if spec:
        return [int(x) for x in spec.split(",")]
    base, extra = divmod(n_layers, pp)
    return [base + (1 if s < extra else 0) for s in range(pp)]


def bucket_bytes(grad_bytes: int, bucket_mb: float, dp: int = 1) -> int:
    """Gradient bucket size for a stage holding ``grad_bytes`` of gradients, reduced over ``dp``
    replicas: ``bucket_mb`` MiB, or (0, auto) an eighth of them clamped to [1 MiB, cap]. One
    25 MiB bucket for a 20 MiB stage would start its all-reduce only after the last backward,
    exposing all of it (measured: 2-5% of a dp=2 step here); eight buckets overlap all but the
    last with backward. The cap is 25 MiB (DDP's) up to 8 replicas and grows with dp beyond
    them, to 100 MiB at dp >= 32: a ring all-reduce pays 2(dp-1) latencies per bucket, which
    larger buckets amortise across nodes (Megatron's buckets are ~40M elements)."""
    if bucket_mb > 0:
        return int(bucket_mb * 2**20)
    cap = 25 * 2**20 * min(4, max(1, dp // 8))
    return int(min(cap, max(2**20, -(-grad_bytes // 8))))


def precision_of(t: "TrainConfig", device) -> str:
    """The compute dtype a run uses on ``device``: ``auto`` is bf16 autocast on a GPU (IEEE fp32
    matmuls run an order of magnitude slower there) and fp32 on a CPU (where bf16 matmuls are
    emulated and slower)."""
    if t.precision != "auto":
        return t.precision
    return "bf16" if getattr(device, "type", str(device)) == "cuda" else "fp32"


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Raise ConfigError naming the first problem; call before creating any process group."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    for section in (m, p, t):
        for f in fields(section):
            v = getattr(section, f.name)
            if f.type in ("int", int) and not isinstance(v, bool) and v < 0:
                raise ConfigError(f"{_sec(section)}.{f.name}={v} must not be negative")
    for name, section in (("model", m), ("parallel", p), ("train", t), ("data", cfg.data),
                          ("reliability", cfg.reliability)):
        _check_floats(section, name)
    if t.eval_every and t.eval_batches < 1:
        raise ConfigError(f"train.eval_batches={t.eval_batches} must be at least 1 when "
                          f"train.eval_every={t.eval_every} (0 disables evaluation)")
    positive = [("model", m, "n_layers"), ("model", m, "d_model"), ("model", m, "n_heads"),
                ("model", m, "n_kv_heads"), ("model", m, "d_ff"), ("model", m, "vocab_size"),
                ("model", m, "seq_len"), ("parallel", p, "dp"), ("parallel", p, "cp"), ("parallel", p, "tp"),
                ("parallel", p, "pp"), ("parallel", p, "microbatches"), ("train", t, "steps"),
                ("train", t, "global_batch"), ("model", m, "image_size"), ("model", m, "channels"),
                ("model", m, "n_classes"), ("data", cfg.data, "n_images")]
    for sec, obj, name in positive:
        if getattr(obj, name) < 1:
            raise ConfigError(f"{sec}.{name}={getattr(obj, name)} must be at least 1")
    if m.d_model % m.n_heads:
        raise ConfigError(f"model.n_heads={m.n_heads} must divide model.d_model={m.d_model}; "
                          f"valid n_heads: {', '.join(map(str, _divisors(m.d_model)))}")
    if m.spec:
        pass  # a user's model: its spec is checked when it is loaded (before any process starts)
    elif m.name == "vit":
        _validate_vit(m, p)
    elif m.name in ("resnet", "unet"):
        _validate_cnn(m, p)
    else:
        _validate_llama(m, p)
    if not m.spec and m.name != "unet" and p.pp > m.n_layers:
        raise ConfigError(f"parallel.pp={p.pp} exceeds model.n_layers={m.n_layers}; "
                          f"each stage needs at least one layer (pp <= {m.n_layers})")
    _validate_rest(cfg, world_size)


def _validate_vit(m: ModelConfig, p: ParallelConfig) -> None:
    if m.image_size % m.patch_size:
        raise ConfigError(f"model.patch_size={m.patch_size} must divide model.image_size="
                          f"{m.image_size}; valid: {', '.join(map(str, _divisors(m.image_size)))}")
    for name, size in (("n_heads", m.n_heads), ("d_ff", m.d_ff)):
        if size % p.tp:
            valid = [d for d in _divisors(m.n_heads) if m.d_ff % d == 0]
            raise ConfigError(f"parallel.tp={p.tp} must divide model.{name}={size}; "
                              f"valid tp: {', '.join(map(str, valid))}")
    if p.sequence_parallel and p.tp > 1:
        raise ConfigError(f"parallel.sequence_parallel is not supported for model.name=vit: its "
                          f"patch embedding and class-token head are not split over tp, so the "
                          f"token stream would stay whole on every rank (the gradients counted "
                          f"tp={p.tp} times); turn sequence parallelism off")


def _validate_cnn(m: ModelConfig, p: ParallelConfig) -> None:
    if m.base_channels < 1 or m.base_channels % p.tp:
        raise ConfigError(f"parallel.tp={p.tp} must divide model.base_channels={m.base_channels} "
                          f"(tensor parallelism splits every block's channels); valid tp: "
                          f"{', '.join(map(str, _divisors(max(m.base_channels, 1))))}")
    if m.name == "unet":
        if m.image_size % 4:
            raise ConfigError(f"model.image_size={m.image_size}: the unet halves it twice, so it "
                              f"must be a multiple of 4")
        if m.norm_groups < 1 or m.base_channels % m.norm_groups or m.norm_groups % p.tp:
            raise ConfigError(f"model.norm_groups={m.norm_groups} must divide model.base_channels="
                              f"{m.base_channels} and be divisible by parallel.tp={p.tp} (each tp "
                              f"rank normalises whole groups)")
    if p.sequence_parallel and p.tp > 1:
        raise ConfigError(f"parallel.sequence_parallel splits activations along dim 1, the channels "
                          f"of a CNN; turn it off for model.name={m.name}")


def _validate_llama(m: ModelConfig, p: ParallelConfig) -> None:
    if m.head_dim % 2:
        raise ConfigError(f"head_dim = d_model/n_heads = {m.head_dim} must be even for rotary embeddings")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads}; "
                          f"valid n_kv_heads: {', '.join(map(str, _divisors(m.n_heads)))}")
    for name, size in (("n_heads", m.n_heads), ("n_kv_heads", m.n_kv_heads), ("d_ff", m.d_ff),
                       ("vocab_size", m.vocab_size)):
        if size % p.tp:
            valid = [d for d in _divisors(m.n_kv_heads) if m.n_heads % d == 0 and m.d_ff % d == 0
                     and m.vocab_size % d == 0]
            raise ConfigError(f"parallel.tp={p.tp} must divide model.{name}={size}; "
                              f"valid tp: {', '.join(map(str, valid))}")


def _validate_rest(cfg: Config, world_size: int | None) -> None:
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if p.pp_split and p.pp_split != "auto":
        try:
            split = pp_split(m.n_layers, p.pp, p.pp_split)
        except ValueError:
            raise ConfigError(f"parallel.pp_split={p.pp_split!r} must be comma-separated integers") from None
        if len(split) != p.pp or sum(split) != m.n_layers or min(split) < 1:
            raise ConfigError(f"parallel.pp_split={p.pp_split!r} must list pp={p.pp} positive "
                              f"layer counts summing to n_layers={m.n_layers}")
    if p.virtual_stages < 1:
        raise ConfigError(f"parallel.virtual_stages={p.virtual_stages} must be at least 1")
    if (p.schedule == "interleaved") != (p.virtual_stages > 1):
        raise ConfigError("parallel.schedule=interleaved and parallel.virtual_stages>1 go together; "
                          f"got schedule={p.schedule}, virtual_stages={p.virtual_stages}")
    if p.virtual_stages > 1:
        if p.pp < 2:
            raise ConfigError("parallel.schedule=interleaved needs parallel.pp >= 2")
        if p.pp * p.virtual_stages > m.n_layers:
            raise ConfigError(f"pp*virtual_stages = {p.pp}*{p.virtual_stages} exceeds model.n_layers="
                              f"{m.n_layers}; each model chunk needs at least one layer")
        if p.microbatches % p.pp:
            raise ConfigError(f"parallel.microbatches={p.microbatches} must be a multiple of pp={p.pp} "
                              f"for the interleaved schedule")
        if p.pp_split:
            raise ConfigError("parallel.pp_split is not supported with virtual_stages > 1")
    if p.sequence_parallel and m.name == "llama" and not m.spec and m.seq_len % p.tp:
        raise ConfigError(f"parallel.sequence_parallel needs tp={p.tp} to divide model.seq_len={m.seq_len}")
    axes = p.order.split("-")
    if sorted(axes) not in (["dp", "pp", "tp"], ["cp", "dp", "pp", "tp"]):
        raise ConfigError(f"parallel.order={p.order!r} must name dp, tp and pp once each (and cp, "
                          f"or cp goes right after tp), innermost first, e.g. 'tp-dp-pp' or "
                          f"'tp-cp-dp-pp'")
    if p.cp > 1:
        _validate_cp(m, p)
    per_step = p.dp * p.microbatches
    if t.global_batch % per_step:
        raise ConfigError(
            f"train.global_batch={t.global_batch} must be divisible by dp*microbatches="
            f"{p.dp}*{p.microbatches}={per_step}; e.g. train.global_batch="
            f"{max(per_step, (t.global_batch // per_step) * per_step)}")
    if p.bucket_mb < 0:
        raise ConfigError(f"parallel.bucket_mb={p.bucket_mb} must be positive (or 0 for auto)")
    c = cfg.checkpoint
    for name in ("every", "keep"):
        if getattr(c, name) < 0:
            raise ConfigError(f"checkpoint.{name}={getattr(c, name)} must not be negative")
    if (c.every or c.resume) and not c.dir:
        raise ConfigError("checkpoint.every/checkpoint.resume need checkpoint.dir: the folder to save to "
                          "and resume from")
    r = cfg.reliability
    if not r.deadline_s >= 0:
        raise ConfigError(f"reliability.deadline_s={r.deadline_s} must be >= 0 (0 disables the watchdog)")
    if r.max_consecutive_skips < 1:
        raise ConfigError(f"reliability.max_consecutive_skips={r.max_consecutive_skips} must be at least 1")
    if not (r.straggler_threshold == 0 or r.straggler_threshold > 1):
        raise ConfigError(f"reliability.straggler_threshold={r.straggler_threshold} must be > 1 (0 disables)")
    import importlib.util
    for name, value, package, use, extra in (
            ("tensorboard", t.tensorboard, "tensorboard", "needs the tensorboard package", "tensorboard"),
            ("trace", t.trace, "matplotlib", "draws a PNG timeline with matplotlib", "plot")):
        if value and importlib.util.find_spec(package) is None:
            raise ConfigError(f"train.{name}={value!r} {use}: pip install 'hybridpar[{extra}]'")
    if t.compile:
        import shutil
        if not any(shutil.which(c) for c in (os.environ.get("CXX", ""), "c++", "g++", "clang++") if c):
            raise ConfigError("train.compile=true needs a C++ compiler for torch.compile's inductor "
                              "(none of $CXX, c++, g++, clang++ is on PATH): install one "
                              "(e.g. apt install g++) or leave train.compile off")
    if world_size is not None and world_size != p.world_size:
        names, sizes = ("dp*cp*tp*pp", f"{p.dp}*{p.cp}*{p.tp}*{p.pp}") if p.cp > 1 else \
            ("dp*tp*pp", f"{p.dp}*{p.tp}*{p.pp}")
        raise ConfigError(
            f"the launcher started {world_size} processes but {names} = {sizes} = "
            f"{p.world_size}; start {p.world_size} processes (torchrun --nproc-per-node) or change "
            f"--{names.replace('*', '/--')} so their product is {world_size}")


def _validate_cp(m: ModelConfig, p: ParallelConfig) -> None:
    """Context parallelism splits each sequence into 2*cp chunks (zigzag: rank r holds chunks r
    and 2cp-1-r, equal causal work), and sequence parallelism splits a rank's share over tp."""
    if m.spec:
        return  # a user's model: its spec says whether it supports cp (checked when loaded)
    if m.name == "vit":
        return  # its tokens are padded to a multiple of cp; sequence parallelism is refused
    if m.name != "llama":
        raise ConfigError(f"parallel.cp={p.cp}: context parallelism splits token sequences for "
                          f"models built on the library's attention (llama, vit); "
                          f"model.name={m.name} has no context-parallel support, use cp=1")
    if m.seq_len % (2 * p.cp):
        raise ConfigError(f"parallel.cp={p.cp} cuts each sequence into 2*cp = {2 * p.cp} equal "
                          f"chunks: model.seq_len={m.seq_len} must be a multiple of {2 * p.cp}")
    if p.sequence_parallel and p.tp > 1 and (m.seq_len // p.cp) % p.tp:
        raise ConfigError(f"parallel.sequence_parallel splits each cp rank's {m.seq_len // p.cp} "
                          f"tokens over tp={p.tp}, which must divide them")


def _sec(obj: Any) -> str:
    return {v: k for k, v in _SECTION_TYPES.items()}[type(obj)]


def describe_fields() -> str:
    """Markdown-ish list of every field with its default and help, for --help and the README."""
    lines = []
    for section, typ in _SECTION_TYPES.items():
        for f in fields(typ):
            rng = _range_text(f)
            lines.append(f"  --{section}.{f.name}={f.default!r}  {f.metadata['help']}"
                         + (f" (valid: {rng})" if rng else ""))
    return "\n".join(lines)
