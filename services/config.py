"""Validated configuration objects, filled from CLI flags and ``EPD_*`` variables.

Nothing deeper in the code reads the environment: services build these objects once at
start-up (STYLE.md 8).
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any

from services.bus.auth import NatsAuth, take_url_credentials
from services.engine.spec.config import SpeculativeConfig
from services.redis_client import check_redis_url
from services.urls import redact

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def _coerce(raw: str, kind: Any) -> Any:
    text, value = str(kind), raw.strip().lower()
    if text.startswith("tuple"):  # a list option: comma-separated
        return tuple(part.strip() for part in raw.split(",") if part.strip())
    if "bool" in text:
        if value not in _TRUE | _FALSE:
            # A typo must not silently read as False.
            raise ValueError(f"expected one of {sorted(_TRUE | _FALSE)}, got {raw!r}")
        return value in _TRUE
    if ("int" in text or "float" in text) and "None" in text and value in ("", "none", "auto"):
        return None
    if text.startswith("int") or "int |" in text:
        return int(raw)
    if text.startswith("float") or "float |" in text:
        return float(raw)
    return raw


def env_overrides(cls: type, prefix: str = "EPD_", environ=None) -> dict[str, Any]:
    """Values for ``cls``'s fields found as ``EPD_<FIELD>`` in the environment."""
    environ = os.environ if environ is None else environ
    out = {}
    for f in dataclasses.fields(cls):
        key = prefix + f.name.upper()
        if key in environ:
            try:
                out[f.name] = _coerce(environ[key], f.type)
            except ValueError as e:
                raise ValueError(f"{key}: {e}") from e
    return out


class FromEnv:
    """``from_env``: defaults < ``EPD_*`` variables < explicit overrides (CLI flags)."""

    @classmethod
    def from_env(cls, **overrides: Any):
        values = env_overrides(cls)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


@dataclass
class EngineConfig(FromEnv):
    """Everything the inference engine needs: model, KV cache, scheduler, backend."""

    # Checkpoint directory (Hugging Face layout) or "demo" for the built-in tiny VLM.
    model: str = "demo"
    # Where the demo checkpoint is generated on first use.
    demo_dir: str = field(default_factory=lambda: os.path.expanduser("~/.cache/epd-serve/demo"))
    # "auto" (fp32 on CPU, bf16 on CUDA), "float32", "bfloat16" or "float16".
    dtype: str = "auto"
    # "auto" (CUDA when present), "cpu" or "cuda[:N]".
    device: str = "auto"
    # "auto" reads safetensors; "dummy" builds the architecture with random weights.
    load_format: str = "auto"
    # Context length; default is the checkpoint's max_position_embeddings.
    max_model_len: int | None = None
    # Tokens per KV block.
    block_size: int = 16
    # Memory budget of the KV pool in MiB (ignored when num_kv_blocks is set).
    kv_cache_memory_mb: int = 512
    # Exact number of KV blocks (tests and benchmarks use it).
    num_kv_blocks: int | None = None
    # Token budget of one engine step (prefill chunks + decode tokens). Default: 8192 on
    # CUDA; 2048 on CPU, where a step's activations then stay in cache (W1 +4 %).
    max_num_batched_tokens: int | None = None
    # Most requests in one step.
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # Decode steps per scheduling round (vLLM's multi-step scheduling) while nothing
    # waits and every running request decodes greedily with nothing else to do per token
    # (no logprobs, penalties or pending min_tokens): the steps run at once, in one native
    # call on the cpu backend, and outputs stream that many tokens at a time. 1: off.
    num_scheduler_steps: int = 1
    # "auto" (Triton on CUDA; on CPU the native kernels when a C compiler can build them,
    # else torch), "cpu", "torch" or "triton".
    attention_backend: str = "auto"
    # Where the native CPU kernels are compiled on first use, and by which C compiler
    # (EPD_KERNEL_CC, else the conventional $CC, else "cc").
    kernel_cache_dir: str = field(
        default_factory=lambda: os.path.expanduser("~/.cache/epd-serve/kernels")
    )
    kernel_cc: str = field(default_factory=lambda: os.environ.get("CC") or "cc")
    # Greedy rows' tokens on the cpu backend through a bfloat16 screen of the LM head
    # (services/kernels/cpu_head.py): the argmax of the fp32 logits, from a bfloat16
    # product in about half the time and exact fp32 dot products for the few entries
    # that can win; the fp32 head's size again in memory (two bfloat16 copies). "auto":
    # where the CPU has bfloat16 dot products (AMX, AVX512_BF16); "on"; "off": the fp32
    # head alone.
    greedy_head_screen: str = "auto"
    # Memory, in MiB, for oneDNN's packed copies of linear weights on the cpu backend
    # (services/kernels/cpu_gemm.py): a product past the native GEMV's 32 rows then reads a
    # weight in oneDNN's own blocked layout instead of re-blocking it on every call (the
    # same bits; 64 x 128 -> 64 +15 %, 2,000-token prompts +9 % on the peers Llama). Made on
    # a weight's first such product while the budget lasts, beside the column-major
    # weights the GEMV reads. 0: none (AMD and other non-Intel CPUs only; MKL serves Intel).
    packed_weights_mb: int = 4096
    # Seed for dummy weights and for requests that bring no seed of their own.
    seed: int = 0
    # Speculative decoding (services/engine/spec/config.py): a SpeculativeConfig, a dict
    # or a JSON string (EPD_SPECULATIVE_CONFIG, --speculative-config); None: off.
    speculative_config: Any = None

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"):
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(
                f"load_format must be auto, safetensors or dummy, got {self.load_format!r}"
            )
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two <= 128, got {self.block_size}")
        if self.kv_cache_memory_mb <= 0:
            raise ValueError("kv_cache_memory_mb must be > 0")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")
        if (self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1) or (
            self.max_num_seqs < 1
        ):
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be >= 1, got {self.num_scheduler_steps}")
        if not _DEVICE.fullmatch(self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.packed_weights_mb < 0:
            raise ValueError(f"packed_weights_mb must be >= 0, got {self.packed_weights_mb}")
        if self.greedy_head_screen not in ("auto", "on", "off"):
            raise ValueError(
                f"greedy_head_screen must be auto, on or off, got {self.greedy_head_screen!r}"
            )
        if self.attention_backend not in ("auto", "cpu", "torch", "triton"):
            raise ValueError(
                "attention_backend must be auto, cpu, torch or triton, "
                f"got {self.attention_backend!r}"
            )

    def step_token_budget(self, device_type: str) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 8192 if device_type == "cuda" else 2048


@dataclass
class ServiceConfig(FromEnv):
    """Where a service finds the bus and Redis, who it is, and how long it waits."""

    nats_url: str = "nats://127.0.0.1:4222"
    redis_url: str = "redis://127.0.0.1:6379/0"
    # Unique per process; defaults to <role>-<random>.
    instance_id: str = ""
    # Gateway gRPC port (0: any free port).
    grpc_port: int = 50051
    host: str = "0.0.0.0"
    # Seconds a whole request may take end to end (the deadline every hop carries).
    request_timeout_s: float = 300.0
    # Seconds without any token from the workers before a request fails as UNAVAILABLE.
    stall_timeout_s: float = 30.0
    # Seconds one bus round trip (encode, prefill admission, KV ack) may take.
    bus_timeout_s: float = 30.0
    # Heartbeat period and the silence after which an instance counts as gone.
    heartbeat_s: float = 1.0
    instance_ttl_s: float = 3.0
    # Embedding-cache entry lifetime in Redis.
    embedding_ttl_s: int = 3600
    # Extra wait before an idle encoder starts a pass, in milliseconds. Images that arrive
    # during a pass always go together in the next one; a fixed wait only adds latency.
    encode_batch_window_ms: float = 0.0
    # Seconds in-flight work may take to finish at shutdown.
    shutdown_grace_s: float = 10.0
    # The process's event loop: "auto" (uvloop when installed, else asyncio's own),
    # "uvloop" or "asyncio" (services/runtime.py's run says why).
    event_loop: str = "auto"
    # Largest payload an instance accepts as a blob (an image sent to an encoder, an
    # embedding sent to prefill), in MiB: what one receive may buffer.
    max_blob_mb: int = 256
    # NATS credentials and TLS (docs/security.md). A user:password or a token goes in
    # nats_url itself (nats://user:pw@host, nats://token@host); these name files.
    # A .creds file (user JWT + nkey seed), for operator/account (decentralised) auth.
    nats_creds: str | None = None
    # A file holding a user nkey seed ("SU..."), for servers that list nkey users.
    nats_nkey_seed: str | None = None
    # PEM CA bundle that signed the NATS server certificate; setting it (or a client
    # certificate) turns TLS on even for nats:// URLs. tls:// URLs alone use system CAs.
    nats_tls_ca: str | None = None
    # PEM client certificate and key for servers that verify clients (mutual TLS).
    nats_tls_cert: str | None = None
    nats_tls_key: str | None = None

    def __repr__(self) -> str:
        # The URLs may carry passwords; a config is printed in logs and tracebacks.
        body = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
        return redact(f"ServiceConfig({body})")

    def nats_auth(self) -> NatsAuth:
        """The NATS credential and TLS files (URL credentials are added by BusConfig)."""
        return NatsAuth(
            creds_file=self.nats_creds or None,
            nkey_seed_file=self.nats_nkey_seed or None,
            tls_ca=self.nats_tls_ca or None,
            tls_cert=self.nats_tls_cert or None,
            tls_key=self.nats_tls_key or None,
        )

    def _check_secrets(self) -> None:
        auth = self.nats_auth()  # raises on a cert without a key, creds and seed both, ...
        missing = auth.missing_files()
        if missing:
            raise ValueError(f"NATS credential / TLS files not found: {missing}")
        take_url_credentials(tuple(self.nats_url.split(",")), auth)  # consistent userinfo
        check_redis_url(self.redis_url)

    def __post_init__(self) -> None:
        self._check_secrets()
        for name in (
            "request_timeout_s",
            "stall_timeout_s",
            "bus_timeout_s",
            "heartbeat_s",
            "instance_ttl_s",
            "shutdown_grace_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        # Port 0 asks the OS for a free port (tests).
        if not 0 <= self.grpc_port < 65536:
            raise ValueError("grpc_port must be in 0..65535")
        if self.max_blob_mb < 1:
            raise ValueError("max_blob_mb must be >= 1")
        if self.event_loop not in ("auto", "uvloop", "asyncio"):
            raise ValueError(f"event_loop must be auto, uvloop or asyncio, got {self.event_loop!r}")
        if self.embedding_ttl_s <= 0 or self.encode_batch_window_ms < 0:
            raise ValueError("embedding_ttl_s must be > 0 and encode_batch_window_ms >= 0")
