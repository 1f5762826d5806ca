"""Which environment values may be shown, and which are hidden behind a digest or masked.

Imported by :mod:`errors` (which everything imports) and :mod:`fingerprint`, so it imports nothing of the
package. Two uses:

* the fingerprint keys on every compiler setting (``TORCHINDUCTOR_*``, ``TRITON_*``, ``TORCH_COMPILE_*``,
  ``TORCHDYNAMO_*``) but writes a value out only for the settings in :data:`SHOWN_VALUES`, and only when
  the value looks harmless (:data:`HARMLESS_VALUE`); any other value becomes ``hidden:<16 hex>``, a slow
  salted digest that changes when the value does. The fingerprint goes into every stored object, the
  report, the terminal and ``$GITHUB_STEP_SUMMARY``; a hidden value reaches none of them.
* :func:`errors.redact` masks the values of the variables that are not known to be harmless
  (:func:`secret_values`), wherever they appear in a message.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Iterator, Mapping, Sequence

# Environment settings that change compiled artifacts or their keys. Paths and logging do not.
ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCH_COMPILE_", "TRITON_", "TORCHDYNAMO_")
# Settings outside those prefixes that change generated code: the CPU vector ISA torch's Inductor picks.
ENV_NAMES = frozenset({"ATEN_CPU_CAPABILITY"})


def keyed(name: str) -> bool:
    """Whether the fingerprint keys on this variable (by name, and by value or its digest)."""
    return (name.startswith(ENV_PREFIXES) or name in ENV_NAMES) and name not in ENV_IGNORED
ENV_IGNORED = frozenset({
    "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TRITON_HOME", "TRITON_DUMP_DIR", "TRITON_OVERRIDE_DIR",
    "TORCHINDUCTOR_COMPILE_THREADS", "TORCH_COMPILE_DEBUG_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE",
    "TORCHINDUCTOR_AUTOGRAD_CACHE", "TORCH_COMPILE_JOB_ID", "TRITON_PRINT_AUTOTUNING",
    "TORCHINDUCTOR_WORKER_START",
})

# A value shown in the fingerprint (and left alone by redact) must match this: flags, numbers, enum names and
# comma-separated lists of them. No ':', '/', '@' or spaces, so no URL, path or sentence.
HARMLESS_VALUE = re.compile(r"[A-Za-z0-9_.,+\-]{0,64}")

# Compiler settings whose values are booleans, numbers or names from a fixed set (torch 2.7-2.13:
# torch/_inductor/config.py, torch/_dynamo/config.py, torch/_functorch/config.py, torch/compiler/config.py;
# triton/knobs.py). Not here, so hidden: free text (TORCH_COMPILE_CACHE_KEY_TAG, *_OVERRIDE_*_CONFIGS,
# TORCH_COMPILE_DYNAMIC_SOURCES), regexes (*_REGEX, CUTLASS allow/deny lists), paths (*_DIR, *_PATH,
# *_OUTPUT, *_LOGPATH), keys (TORCH_COMPILE_STICKY_PGO_*), remote cache endpoints (*_REDIS_*), and every
# name this list does not know.
SHOWN_VALUES = frozenset({
    # Inductor: code generation, fusion, layouts, autotuning
    "TORCHINDUCTOR_ALIGNMENT_ASSERTS", "TORCHINDUCTOR_ANNOTATE_TRAINING", "TORCHINDUCTOR_APPLY_GUMBEL_MAX_TRICK",
    "TORCHINDUCTOR_ASSUME_UNALIGNED_FALLBACK_OUTPUT", "TORCHINDUCTOR_AUTO_CHUNKER",
    "TORCHINDUCTOR_AUTOHEURISTIC_COLLECT", "TORCHINDUCTOR_AUTOHEURISTIC_USE",
    "TORCHINDUCTOR_AUTOTUNE_AT_COMPILE_TIME", "TORCHINDUCTOR_AUTOTUNE_IN_SUBPROC",
    "TORCHINDUCTOR_AUTOTUNE_MULTI_DEVICE", "TORCHINDUCTOR_AUTOTUNE_NUM_CHOICES_DISPLAYED",
    "TORCHINDUCTOR_BATCH_INVARIANT", "TORCHINDUCTOR_BENCHMARK_EPILOGUE_FUSION", "TORCHINDUCTOR_BENCHMARK_FUSION",
    "TORCHINDUCTOR_BENCHMARK_KERNEL", "TORCHINDUCTOR_BUNDLE_TRITON_INTO_FX_GRAPH_CACHE",
    "TORCHINDUCTOR_CACHE_SDPA_CONSTRAINT", "TORCHINDUCTOR_CHUNKER_NUM_CHUNKS",
    "TORCHINDUCTOR_COALESCE_TILING_ANALYSIS", "TORCHINDUCTOR_COLLECTIVE_BENCHMARK_NRUNS",
    "TORCHINDUCTOR_COLLECTIVE_BENCHMARK_TIMEOUT", "TORCHINDUCTOR_COMPILE_WORKER_WAIT_TIMEOUT",
    "TORCHINDUCTOR_COMPREHENSIVE_PADDING", "TORCHINDUCTOR_COOPERATIVE_REDUCTIONS",
    "TORCHINDUCTOR_COORDINATE_DESCENT_CHECK_ALL_DIRECTIONS", "TORCHINDUCTOR_COORDINATE_DESCENT_RADIUS",
    "TORCHINDUCTOR_COORDINATE_DESCENT_TUNING", "TORCHINDUCTOR_CUDAGRAPH_OR_ERROR", "TORCHINDUCTOR_CUDAGRAPHS",
    "TORCHINDUCTOR_CUTLASS_DYNAMIC_CLUSTER_FALLBACK", "TORCHINDUCTOR_CUTLASS_DYNAMIC_CLUSTER_SHAPE",
    "TORCHINDUCTOR_CUTLASS_ENABLED_OPS", "TORCHINDUCTOR_CUTLASS_HASH_WITH_COMPILE_CMD",
    "TORCHINDUCTOR_CUTLASS_INSTANTIATION_LEVEL", "TORCHINDUCTOR_CUTLASS_PRESCREENING",
    "TORCHINDUCTOR_DEBUG_FUSION", "TORCHINDUCTOR_DECOMPOSE_K_THRESHOLD", "TORCHINDUCTOR_DECOMPOSE_SORT_OPS",
    "TORCHINDUCTOR_DEFAULT_AUTOTUNE_REP", "TORCHINDUCTOR_DEFAULT_AUTOTUNE_WARMUP",
    "TORCHINDUCTOR_DELAY_REALIZE_CHEAP_OUTPUTS", "TORCHINDUCTOR_DETERMINISTIC", "TORCHINDUCTOR_DISABLED_PASSES",
    "TORCHINDUCTOR_DISTORT_BENCHMARKING_RESULT", "TORCHINDUCTOR_DISTRIBUTED_MAX_AUTOTUNE_GEMM",
    "TORCHINDUCTOR_DIVISIBLE_BY_16", "TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK", "TORCHINDUCTOR_EMIT_POINTER_RANGE_32",
    "TORCHINDUCTOR_EMULATE_DIVISION_ROUNDING", "TORCHINDUCTOR_EMULATE_PRECISION_CASTS",
    "TORCHINDUCTOR_EMULATE_PRECISION_CASTS_ON_SAVED_TENSORS", "TORCHINDUCTOR_ENABLE_LINEAR_BINARY_FOLDING",
    "TORCHINDUCTOR_ENABLE_PDL", "TORCHINDUCTOR_ENABLED_METRIC_TABLES", "TORCHINDUCTOR_FILE_LOCK_TIMEOUT",
    "TORCHINDUCTOR_FORCE_FILTER_REDUCTION_CONFIGS", "TORCHINDUCTOR_FORCE_LAYOUT_OPT", "TORCHINDUCTOR_FREEZING",
    "TORCHINDUCTOR_FX_WRAPPER", "TORCHINDUCTOR_GRAPH_PARTITION", "TORCHINDUCTOR_INCREMENTAL_AUTOTUNE",
    "TORCHINDUCTOR_INPLACE_PADDING", "TORCHINDUCTOR_KEEP_OUTPUT_STRIDE", "TORCHINDUCTOR_KEEP_STATIC_CUBIN_RAW",
    "TORCHINDUCTOR_LAYOUT_OPTIMIZATION", "TORCHINDUCTOR_LOOP_ORDERING_AFTER_FUSION",
    "TORCHINDUCTOR_LOOP_REINDEXING_AFTER_FUSION", "TORCHINDUCTOR_MAX_AUTOTUNE",
    "TORCHINDUCTOR_MAX_AUTOTUNE_BWD_INPUT_CONV_BACKENDS", "TORCHINDUCTOR_MAX_AUTOTUNE_BWD_WEIGHT_CONV_BACKENDS",
    "TORCHINDUCTOR_MAX_AUTOTUNE_CONV_BACKENDS", "TORCHINDUCTOR_MAX_AUTOTUNE_FLEX_SEARCH_SPACE",
    "TORCHINDUCTOR_MAX_AUTOTUNE_GEMM", "TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS",
    "TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_SEARCH_SPACE", "TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE",
    "TORCHINDUCTOR_MAX_AUTOTUNE_PRUNE_CHOICES_BASED_ON_SHARED_MEM",
    "TORCHINDUCTOR_MAX_AUTOTUNE_REPORT_CHOICES_STATS", "TORCHINDUCTOR_MEMORY_PLANNING",
    "TORCHINDUCTOR_MEMORY_POOL", "TORCHINDUCTOR_MIN_NUM_SPLIT", "TORCHINDUCTOR_MIX_ORDER_REDUCTION",
    "TORCHINDUCTOR_MIX_ORDER_REDUCTION_ALLOW_MULTI_STAGES", "TORCHINDUCTOR_MIX_ORDER_REDUCTION_AUTOTUNE_SPLIT_SIZE",
    "TORCHINDUCTOR_MULTI_KERNEL", "TORCHINDUCTOR_NAN_ASSERTS", "TORCHINDUCTOR_NATIVE_MATMUL",
    "TORCHINDUCTOR_NESTED_REDUCTION", "TORCHINDUCTOR_NUM_DECOMPOSE_K_SPLITS",
    "TORCHINDUCTOR_NVGEMM_MAX_PROFILING_CONFIGS", "TORCHINDUCTOR_NVGEMM_SUPPLEMENT_CONFIGS",
    "TORCHINDUCTOR_ONLINE_SOFTMAX", "TORCHINDUCTOR_OPTIMIZE_SCATTER_UPON_CONST_TENSOR", "TORCHINDUCTOR_ORIGAMI",
    "TORCHINDUCTOR_ORIGAMI_TOPK", "TORCHINDUCTOR_PARTITIONED_SCATTER_ENABLED", "TORCHINDUCTOR_PERMUTE_FUSION",
    "TORCHINDUCTOR_PERSISTENT_REDUCTIONS", "TORCHINDUCTOR_PIPELINE_GEMM_AUTOTUNING",
    "TORCHINDUCTOR_PRECOMPILATION_TIMEOUT_SECONDS", "TORCHINDUCTOR_PROFILE",
    "TORCHINDUCTOR_PROFILE_WITH_DO_BENCH_USING_PROFILING", "TORCHINDUCTOR_PROLOGUE_FUSION",
    "TORCHINDUCTOR_QUIESCE_ASYNC_COMPILE_POOL", "TORCHINDUCTOR_RUN_JIT_POST_COMPILE_HOOK",
    "TORCHINDUCTOR_RUNTIME_TRITON_NAN_ASSERTS", "TORCHINDUCTOR_SAVE_ARGS", "TORCHINDUCTOR_SCALAR_ASSERTS",
    "TORCHINDUCTOR_SHAPE_PADDING", "TORCHINDUCTOR_SIZE_ASSERTS", "TORCHINDUCTOR_SKIP_L1",
    "TORCHINDUCTOR_SPLIT_REDUCTIONS", "TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS",
    "TORCHINDUCTOR_STRICT_STATIC_CUDA_LAUNCHER", "TORCHINDUCTOR_TRITON_DISABLE_DEVICE_DETECTION",
    "TORCHINDUCTOR_TRITON_PROTON_GROUP_BY_SM", "TORCHINDUCTOR_TRITON_PROTON_PER_CTA_OCCUPANCY",
    "TORCHINDUCTOR_TRITON_PROTON_PROFILING", "TORCHINDUCTOR_TRITON_PROTON_SPLIT_INVOCATIONS",
    "TORCHINDUCTOR_UNIQUE_KERNEL_NAMES", "TORCHINDUCTOR_UNIQUE_USER_KERNEL_NAMES",
    "TORCHINDUCTOR_USE_EXPERIMENTAL_BENCHMARKER", "TORCHINDUCTOR_USE_FAST_MATH",
    "TORCHINDUCTOR_USE_FAST_TRITON_LAUNCHER", "TORCHINDUCTOR_USE_LAUNCH_METADATA_SCHEMA",
    "TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER", "TORCHINDUCTOR_USE_TORCH_PROFILER_BENCHMARKER",
    "TORCHINDUCTOR_VEC_ISA_OK", "TORCHINDUCTOR_WARN_MIX_LAYOUT", "TORCHINDUCTOR_WORKER_SUPPRESS_LOGGING",
    "TORCHINDUCTOR_WRITE_ARE_DETERMINISTIC_ALGORITHMS_ENABLED",
    # Inductor's C++ backend (CPU)
    "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "TORCHINDUCTOR_CPP_DYNAMIC_THREADS",
    "TORCHINDUCTOR_CPP_ENABLE_FLOATING_POINT_CONTRACT_FLAG", "TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE",
    "TORCHINDUCTOR_CPP_ENABLE_TILING_HEURISTIC", "TORCHINDUCTOR_CPP_ENABLE_UNSAFE_MATH_OPT_FLAG",
    "TORCHINDUCTOR_CPP_FALLBACK_SCATTER_REDUCE_SUM", "TORCHINDUCTOR_CPP_FORCE_INLINE_KERNEL",
    "TORCHINDUCTOR_CPP_GEMM_CACHE_BLOCKING", "TORCHINDUCTOR_CPP_GEMM_MAX_K_SLICES",
    "TORCHINDUCTOR_CPP_GEMM_THREAD_FACTORS", "TORCHINDUCTOR_CPP_MARCH",
    "TORCHINDUCTOR_CPP_MAX_HORIZONTAL_FUSION_SIZE", "TORCHINDUCTOR_CPP_MIN_CHUNK_SIZE",
    "TORCHINDUCTOR_CPP_NO_REDUNDANT_LOOPS", "TORCHINDUCTOR_CPP_USE_CONSTEXPR_FOR_INT_ARRAY",
    "TORCHINDUCTOR_CPP_USE_DECOMPOSE_TANH", "TORCHINDUCTOR_CPP_WEIGHT_PREPACK", "TORCHINDUCTOR_CPP_WRAPPER",
    "TORCHINDUCTOR_CPP_WRAPPER_BUILD_SEPARATE",
    # caches: on/off switches (their endpoints are not here)
    "TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD", "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE",
    "TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE", "TORCHINDUCTOR_BUNDLED_AUTOTUNE_REMOTE_CACHE",
    "TORCHINDUCTOR_ERROR_ON_CUSTOM_OP_ALIASING", "TORCHINDUCTOR_FORCE_DISABLE_CACHES",
    "TORCHINDUCTOR_FX_GRAPH_CACHE_DEFAULT", "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE",
    "TORCHINDUCTOR_NON_BLOCKING_REMOTE_CACHE_WRITE",
    # Dynamo and torch.compile
    "TORCHDYNAMO_AUTO_FUNCTIONALIZED_V2", "TORCHDYNAMO_CAPTURE_DYNAMIC_OUTPUT_SHAPE_OPS",
    "TORCHDYNAMO_CAPTURE_SCALAR_OUTPUTS", "TORCHDYNAMO_DISABLE", "TORCHDYNAMO_DYNAMIC_SHAPES",
    "TORCHDYNAMO_ENABLE_P2P_COMPILATION", "TORCHDYNAMO_EXTENDED_ADVICE", "TORCHDYNAMO_NO_DATA_DEPENDENT_GRAPH_BREAK",
    "TORCHDYNAMO_PREPARE_FREEZING", "TORCHDYNAMO_PRINT_MISSING", "TORCHDYNAMO_REPRO_AFTER",
    "TORCHDYNAMO_REPRO_FORWARD_ONLY", "TORCHDYNAMO_REPRO_IGNORE_NON_FP", "TORCHDYNAMO_REPRO_LEVEL",
    "TORCHDYNAMO_SUPPRESS_ERRORS", "TORCHDYNAMO_TRANSLATION_NO_BISECT", "TORCHDYNAMO_TRANSLATION_VALIDATION",
    "TORCHDYNAMO_TRANSLATION_VALIDATION_TIMEOUT", "TORCHDYNAMO_VERBOSE",
    "TORCH_COMPILE_BACKEND", "TORCH_COMPILE_CPROFILE", "TORCH_COMPILE_DEBUG", "TORCH_COMPILE_DEBUG_SAVE_REAL",
    "TORCH_COMPILE_DISABLE", "TORCH_COMPILE_DYNAMIC_VALUES", "TORCH_COMPILE_FORCE_DISABLE_CACHES",
    "TORCH_COMPILE_GRAPH_FORMAT", "TORCH_COMPILE_REPLAY_RECORD", "TORCH_COMPILE_USE_LAZY_GRAPH_MODULE",
    # ATen / Inductor's CPU vector ISA
    "ATEN_CPU_CAPABILITY",
    # Triton (triton/knobs.py)
    "TRITON_ALLOW_NON_CONSTEXPR_GLOBALS", "TRITON_ALWAYS_COMPILE", "TRITON_CACHE_AUTOTUNING", "TRITON_DEBUG",
    "TRITON_DEFAULT_FP_FUSION", "TRITON_DISABLE_LINE_INFO", "TRITON_DUMP_PTXAS_LOG", "TRITON_ENABLE_ASAN",
    "TRITON_ENABLE_EXPERIMENTAL_CONSAN", "TRITON_ENABLE_NVTX", "TRITON_F32_DEFAULT", "TRITON_FRONT_END_DEBUGGING",
    "TRITON_HIP_GLOBAL_PREFETCH", "TRITON_HIP_LOCAL_PREFETCH", "TRITON_HIP_USE_ASYNC_COPY",
    "TRITON_HIP_USE_BLOCK_PINGPONG", "TRITON_HIP_USE_IN_THREAD_TRANSPOSE", "TRITON_INTERPRET",
    "TRITON_KERNEL_DUMP", "TRITON_KERNEL_OVERRIDE", "TRITON_MOCK_PTX_VERSION", "TRITON_OVERRIDE_ARCH",
    "TRITON_STORE_BINARY_ONLY",
})

# Variables whose values are not secrets although redact would otherwise mask them: the plugin's own
# settings (not MEGACACHE_ENDPOINT_URL nor MEGACACHE_SIGNING_KEY), AWS's non-credential settings, the
# compiler's cache directories and thread counts (ENV_IGNORED, but for the debug and dump directories, which
# nothing of the plugin's shows), and GitHub's public URLs.
PLAIN_VALUES = (ENV_IGNORED - {"TORCH_COMPILE_DEBUG_DIR", "TRITON_DUMP_DIR", "TRITON_OVERRIDE_DIR"}) | frozenset({
    "MEGACACHE_BUCKET", "MEGACACHE_PREFIX", "MEGACACHE_DIR", "MEGACACHE_MODE", "MEGACACHE_STRICT",
    "MEGACACHE_FILES", "MEGACACHE_REPORT", "MEGACACHE_TIMEOUT", "MEGACACHE_COMPACT_AFTER", "MEGACACHE_SCOPE",
    "MEGACACHE_DEFAULT_SCOPE", "MEGACACHE_DURATIONS", "MEGACACHE_COMPILE_THREADS", "MEGACACHE_PRECOMPILE", "MEGACACHE_CHILDREN",
    "MEGACACHE_UPLOAD_TIMEOUT", "MEGACACHE_REQUIRE_SIGNATURE", "MEGACACHE_EAGER_BACKWARD",
    "MEGACACHE_REUSE_ISA_CHECK",
    "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_CONFIG_FILE",
    "AWS_CA_BUNDLE", "AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE", "AWS_EC2_METADATA_DISABLED",
    "GITHUB_SERVER_URL", "GITHUB_API_URL", "GITHUB_GRAPHQL_URL",
})

# Always masked (their values may be lists: each item is masked too).
SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID", "MEGACACHE_SIGNING_KEY")
# Masked when the value is long enough to be a credential and too long to be a common word.
REDACTED_PREFIXES = (*ENV_PREFIXES, "MEGACACHE_", "AWS_")
SECRET_NAME = re.compile(r"SECRET|TOKEN|PASSWORD|PASSWD|PASSPHRASE|CREDENTIAL|APIKEY|_KEY$|_URL$|_DSN$")
MIN_MASKED = 6
_MIN_ITEM = 8  # items of a list value (SECRET_ENV, e.g. several signing keys), or of any masked value
_MIN_PASSWORD = 4  # the password of a URL inside a masked value
_URL_PASSWORD = re.compile(r"://[^\s/@:]*:([^\s/]*)@")

HIDDEN = re.compile(r"hidden:[0-9a-f]{16}")
_HIDE_SALT = b"pytest-megacache/env-value/v1\0"
_HIDE_ROUNDS = 20_000  # ~10 ms: the digest is stored in the open, so guessing a weak password costs that much


def shown(name: str, value: str) -> bool:
    """Whether the fingerprint may write ``value`` out as it is."""
    return name in SHOWN_VALUES and HARMLESS_VALUE.fullmatch(value) is not None


@functools.lru_cache(maxsize=256)
def hide(name: str, value: str) -> str:
    """``hidden:<16 hex>``: a digest of ``value`` for ``name`` alone (domain-separated, salted, slow)."""
    salt = _HIDE_SALT + name.encode("utf-8", "surrogatepass") + b"\0"
    raw = hashlib.pbkdf2_hmac("sha256", value.encode("utf-8", "surrogatepass"), salt, _HIDE_ROUNDS)
    return f"hidden:{raw.hex()[:16]}"


def fingerprint_value(name: str, value: str) -> str:
    """What the fingerprint records for ``name=value``: the value if :func:`shown`, else :func:`hide`."""
    return value if shown(name, value) else hide(name, value)


def display_value(name: str, value: object) -> str:
    """A stored fingerprint's value, fit for a message: hidden values stay so, and raw values written by older
    versions are shown only if :func:`shown` allows them."""
    if value is None:
        return "unset"
    text = str(value)
    if HIDDEN.fullmatch(text) or shown(name, text):
        return repr(text)
    return hide(name, text)


def env_differences(theirs: Mapping[str, object], here: Mapping[str, object]) -> list[str]:
    """``NAME 'theirs' here 'ours'`` for each compiler variable that differs, no secret included."""
    out = []
    for name in sorted(set(theirs) | set(here)):
        if theirs.get(name) != here.get(name):
            out.append(f"{name} {display_value(name, theirs.get(name))} here {display_value(name, here.get(name))}")
    return out


# torch's repro text copies every variable whose name *contains* one of these (``generate_env_vars_string`` in
# torch/_dynamo/debug_utils.py), not only those with the prefixes above: TORCH_REMOTE_STORE, PYTORCH_..._TOKEN.
REPRO_NAME_PARTS = ("TORCH", "DYNAMO", "INDUCTOR", "TRITON")


def repro_copied(name: str) -> bool:
    """Whether torch's repro text copies this variable (by torch's own name filter)."""
    return any(part in name for part in REPRO_NAME_PARTS)


def masked(name: str, value: str) -> bool:
    """Whether redact masks this variable's value."""
    if name in SECRET_ENV:
        return True
    if name in PLAIN_VALUES:
        return False
    if SECRET_NAME.search(name):
        return True
    return (name.startswith(REDACTED_PREFIXES) or repro_copied(name)) and not shown(name, value)


def secret_values(env: Mapping[str, str]) -> Iterator[tuple[str, str]]:
    """``(name, text)`` for each piece of a masked variable that may appear in a message: the whole value, its
    comma- or space-separated items, and the password of a URL in it."""
    for name, value in env.items():
        if not value or not masked(name, value):
            continue
        if len(value) >= MIN_MASKED:
            yield name, value
        for item in re.split(r"[\s,]+", value):
            if len(item) >= _MIN_ITEM and item != value:
                yield name, item
        for password in _URL_PASSWORD.findall(value):
            if len(password) >= _MIN_PASSWORD:
                yield name, password


# torch writes a repro script into every compiled FX graph it caches (CompiledFxGraph.runnable_graph_str, from
# torch._dynamo.debug_utils.generate_env_vars_string): one line per variable whose name contains TORCH, DYNAMO,
# INDUCTOR or TRITON, value included (with ' turned into "). That graph is the mega-cache's inductor artifact.
_REPRO_ENV_LINE = re.compile(rb"os\.environ\['([A-Za-z_][A-Za-z0-9_]*)'\] = '([^']*)'")


def scrub_torch_artifact(data: bytes) -> bytes:
    """``data`` with the value of each variable in torch's repro lines (``os.environ['NAME'] = '...'``) overwritten by
    as many ``*`` bytes, unless the fingerprint would show it (:func:`shown`): same length, so a pickle (whose
    strings are length-prefixed) still loads. Other bytes are left alone; ``data`` itself is returned when there is
    nothing to scrub. Applied to every entry the plugin stores (torch's artifacts, the files of child processes'
    FX graphs and AOTAutograd entries, Triton's files, dynamic-shape profiles)."""
    if b"os.environ['" not in data:
        return data

    def scrub(match: re.Match[bytes]) -> bytes:
        name, value = match[1].decode("ascii"), match[2].decode("utf-8", "replace")
        if shown(name, value):  # only what the fingerprint itself would show stays: paths and unknown names do not
            return match[0]
        start, end = match.start(2) - match.start(0), match.end(2) - match.start(0)
        return match[0][:start] + b"*" * (end - start) + match[0][end:]

    return _REPRO_ENV_LINE.sub(scrub, data)


def stored_secret(data: bytes, pieces: Sequence[tuple[str, bytes]]) -> str | None:
    """The name of the first variable whose value (a :func:`secret_values` piece, encoded) ``data`` still holds
    once scrubbed: such an entry is not stored at all."""
    for name, piece in pieces:
        if piece in data:
            return name
    return None


# The credentials a stored entry is searched for, byte for byte, after the scrub: the values of variables that are
# secret by name (SECRET_ENV, SECRET_NAME) and the passwords of URLs, at least this long. Other masked values reach
# torch's artifacts only through its repro lines, which the scrub blanks; a plain word or a path held by a
# torch-named variable elsewhere in an artifact is a coincidence (a source path, "testing"), not a leak.
MIN_STORED_SECRET = 8


def _credential(name: str) -> bool:
    return name in SECRET_ENV or (name not in PLAIN_VALUES and SECRET_NAME.search(name) is not None)


def stored_pieces(env: Mapping[str, str]) -> list[tuple[str, bytes]]:
    """The credentials of ``env`` (:func:`secret_values` of the variables secret by name, and URL passwords) as the
    bytes a stored entry could hold them in (UTF-8, and UTF-16 for pickled text)."""
    out: dict[bytes, str] = {}
    for name, text in secret_values(env):
        password = text in _URL_PASSWORD.findall(env.get(name, ""))
        if len(text) < MIN_STORED_SECRET or not (_credential(name) or password):
            continue
        for encoded in (text.encode("utf-8", "surrogatepass"), text.encode("utf-16-le", "surrogatepass")):
            out.setdefault(encoded, name)
    return sorted(((name, piece) for piece, name in out.items()), key=lambda item: -len(item[1]))
