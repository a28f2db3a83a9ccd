"""The engine's and every service's settings (services/settings.py declares how a setting
is written; flags, ``EPD_*`` variables and docs/configuration.md come from here).

Nothing deeper in the code reads the environment: services build these objects once at
start-up (STYLE.md 8).
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any

from services.bus.auth import NatsAuth, take_url_credentials
from services.engine.spec.config import SpeculativeConfig
from services.redis_client import check_redis_url
from services.settings import Settings, setting
from services.urls import redact

_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
DTYPES = ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16")


@dataclass
class EngineConfig(Settings):
    """Everything the inference engine needs: model, KV cache, scheduler, backend."""

    model: str = setting(
        "demo",
        doc="Checkpoint directory (Hugging Face layout) or `demo` for the built-in tiny VLM. "
        "`serve gateway` and `up` take `--model` repeated to serve several models on one "
        "fleet (the first is the default; `EPD_MODELS`).",
        flags=("--model",),
    )
    demo_dir: str = setting(
        doc="Where the demo checkpoint is generated on first use.",
        factory=lambda: os.path.expanduser("~/.cache/epd-serve/demo"),
        shown="~/.cache/epd-serve/demo",
    )
    dtype: str = setting(
        "auto",
        doc="Weights and activations: `auto` (float32 on CPU, bfloat16 on CUDA), `float32`, "
        "`bfloat16` or `float16` (`fp32`, `bf16`, `fp16` also read).",
        choices=DTYPES,
    )
    device: str = setting("auto", doc="`auto` (CUDA when present), `cpu` or `cuda[:N]`.")
    quantization: str | None = setting(
        None,
        doc="Quantize the text decoder's linear weights at load (docs/quantization.md): "
        "`int8` (a scale per output channel) or `int4` (a scale and zero point per 128 "
        "inputs); activations stay in `dtype`. Unset: the checkpoint's own weights.",
        choices=("int8", "int4"),
    )
    kv_cache_dtype: str = setting(
        "auto",
        doc="The KV cache's values (docs/quantization.md): `auto` (those of `dtype`), "
        "`int8` or `fp8` (e4m3), each with a scale per token and KV head: about a "
        "quarter of fp32's memory, so four times the tokens in `kv_cache_memory_mb`. "
        "Prefill and decode instances of one fleet must agree. cpu and torch backends.",
        choices=("auto", "int8", "fp8"),
    )
    load_format: str = setting(
        "auto",
        doc="`auto` reads safetensors; `dummy` builds the architecture with random weights.",
        choices=("auto", "safetensors", "dummy"),
    )
    max_model_len: int | None = setting(
        None, doc="Context length; unset: the checkpoint's `max_position_embeddings`.", ge=1
    )
    block_size: int = setting(16, doc="Tokens per KV block.", choices=(1, 2, 4, 8, 16, 32, 64, 128))
    kv_cache_memory_mb: int = setting(
        512,
        doc="Memory budget of the KV block pool, MiB (ignored when `num_kv_blocks` is set).",
        gt=0,
    )
    num_kv_blocks: int | None = setting(
        None, doc="Exact number of KV blocks (tests and benchmarks use it).", ge=1
    )
    max_num_batched_tokens: int | None = setting(
        None,
        doc="Token budget of one engine step (prefill chunks + decode tokens). Unset: 8192 "
        "on CUDA; 2048 on CPU, where a step's activations then stay in cache.",
        ge=1,
    )
    max_num_seqs: int = setting(256, doc="Most requests in one step.", ge=1)
    enable_prefix_caching: bool = setting(
        True, doc="Share the KV blocks of a common prompt prefix between requests."
    )
    enable_chunked_prefill: bool = setting(
        True, doc="Split long prompts over several steps, beside running decodes."
    )
    num_scheduler_steps: int = setting(
        1,
        doc="Decode steps per scheduling round (vLLM's multi-step scheduling) while nothing "
        "waits and every running request decodes greedily with nothing else to do per "
        "token (no logprobs, penalties or pending min_tokens): the steps run at once, in "
        "one native call on the cpu backend, and outputs stream that many tokens at a "
        "time. 1: off.",
        ge=1,
    )
    attention_backend: str = setting(
        "auto",
        doc="`auto` (Triton on CUDA; on CPU the native kernels when a C compiler can build "
        "them, else torch), `cpu`, `torch` or `triton`.",
        choices=("auto", "cpu", "torch", "triton"),
    )
    kernel_cache_dir: str = setting(
        doc="Where the native CPU kernels are compiled on first use.",
        factory=lambda: os.path.expanduser("~/.cache/epd-serve/kernels"),
        shown="~/.cache/epd-serve/kernels",
    )
    kernel_cc: str = setting(
        doc="The C compiler that builds the native CPU kernels.",
        factory=lambda: os.environ.get("CC") or "cc",
        shown="$CC, else cc",
    )
    greedy_head_screen: str = setting(
        "auto",
        doc="Greedy rows' tokens on the cpu backend through a bfloat16 screen of the LM head "
        "(services/kernels/cpu_head.py): the argmax of the fp32 logits, from a bfloat16 "
        "product in about half the time and exact fp32 dot products for the few entries "
        "that can win; the fp32 head's size again in memory. `auto`: where the CPU has "
        "bfloat16 dot products (AMX, AVX512_BF16); `on`; `off`: the fp32 head alone.",
        choices=("auto", "on", "off"),
    )
    packed_weights_mb: int = setting(
        4096,
        doc="Memory, MiB, for oneDNN's packed copies of linear weights on the cpu backend "
        "(services/kernels/cpu_gemm.py): a product past the native GEMV's 32 rows then "
        "reads a weight in oneDNN's own blocked layout instead of re-blocking it on every "
        "call (the same bits). Made on a weight's first such product while the budget "
        "lasts. 0: none (used on AMD and other non-Intel CPUs only; MKL serves Intel).",
        ge=0,
    )
    seed: int = setting(0, doc="Seed for dummy weights and for requests that bring none.")
    speculative_config: Any = setting(
        None,
        doc='Speculative decoding, JSON: `{"method": "ngram", "num_speculative_tokens": 3}` '
        'or `{"method": "eagle3", "model": DIR, "num_speculative_tokens": 3}` '
        "(docs/spec-decode.md). Unset: off.",
    )

    structured_outputs_backend: str = setting(
        "auto",
        doc="Grammar backend of structured outputs (docs/structured-outputs.md): `guidance` "
        "(llguidance, every constraint and tokenizer) or `xgrammar` (where installed: JSON "
        "schemas, regexes, choices and GBNF; llguidance keeps Lark, tool and reasoning "
        "grammars). `auto`: `guidance`.",
        choices=("auto", "guidance", "xgrammar"),
    )

    def normalize(self) -> None:
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)

    def check(self) -> None:
        if not _DEVICE.fullmatch(self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")

    def step_token_budget(self, device_type: str) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 8192 if device_type == "cuda" else 2048


@dataclass
class ServiceConfig(Settings):
    """Where a service finds the bus and Redis, who it is, and how long it waits."""

    nats_url: str = setting(
        "nats://127.0.0.1:4222",
        doc="NATS server(s), comma-separated; may carry `user:password@` or `token@` (never "
        "logged).",
    )
    redis_url: str = setting(
        "redis://127.0.0.1:6379/0",
        doc="Redis for the embedding and semantic caches (`rediss://`, `redis+sentinel://` "
        "and `:password@` accepted, never logged).",
    )
    instance_id: str = setting(
        "", doc="Unique name of this process on the bus; empty: `<role>-<random>`."
    )
    grpc_port: int = setting(50051, doc="Gateway gRPC port (0: any free port).", ge=0, le=65535)
    host: str = setting("0.0.0.0", doc="Address the gateway's servers bind.")
    request_timeout_s: float = setting(
        300.0,
        doc="Seconds a whole request may take end to end (the deadline every hop carries).",
        gt=0,
    )
    stall_timeout_s: float = setting(
        30.0,
        doc="Seconds without any token from the workers before a request fails as UNAVAILABLE.",
        gt=0,
    )
    bus_timeout_s: float = setting(
        30.0, doc="Seconds one bus round trip (encode, prefill admission, KV ack) may take.", gt=0
    )
    heartbeat_s: float = setting(1.0, doc="Heartbeat period, seconds.", gt=0)
    instance_ttl_s: float = setting(
        3.0, doc="Seconds of silence after which an instance counts as gone.", gt=0
    )
    embedding_ttl_s: int = setting(
        3600, doc="Embedding-cache entry lifetime in Redis, seconds.", gt=0
    )
    encode_batch_window_ms: float = setting(
        0.0,
        doc="Extra wait before an idle encoder starts a pass, ms. Images that arrive during a "
        "pass always go together in the next one; a fixed wait only adds latency.",
        ge=0,
    )
    shutdown_grace_s: float = setting(
        10.0, doc="Seconds in-flight work may take to finish at shutdown (SIGTERM, Ctrl-C).", gt=0
    )
    event_loop: str = setting(
        "auto",
        doc="The process's event loop: `auto` (uvloop when installed, else asyncio's own), "
        "`uvloop` or `asyncio` (services/runtime.py says why).",
        choices=("auto", "uvloop", "asyncio"),
    )
    max_blob_mb: int = setting(
        256,
        doc="Largest payload an instance accepts as a blob (an image sent to an encoder, an "
        "embedding sent to prefill), MiB: what one receive may buffer.",
        ge=1,
    )
    nats_creds: str | None = setting(
        None,
        doc="NATS `.creds` file (user JWT + nkey seed), for operator/account auth "
        "(docs/security.md).",
    )
    nats_nkey_seed: str | None = setting(
        None,
        doc="A file holding a NATS user nkey seed (`SU...`), for servers that list nkey users.",
    )
    nats_tls_ca: str | None = setting(
        None,
        doc="PEM CA bundle that signed the NATS server certificate; setting it (or a client "
        "certificate) turns TLS on even for `nats://` URLs. `tls://` URLs alone use "
        "the system CAs.",
    )
    nats_tls_cert: str | None = setting(
        None, doc="PEM client certificate, for servers that verify clients (mutual TLS)."
    )
    nats_tls_key: str | None = setting(None, doc="PEM key of `nats_tls_cert`.")

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

    def check(self) -> None:
        auth = self.nats_auth()  # raises on a cert without a key, creds and seed both, ...
        missing = auth.missing_files()
        if missing:
            raise ValueError(f"NATS credential / TLS files not found: {missing}")
        take_url_credentials(tuple(self.nats_url.split(",")), auth)  # consistent userinfo
        check_redis_url(self.redis_url)
