# One image for every epd-serve service (encoder, prefill, decode, cache, gateway).
# NATS and Redis run from their official images (docker-compose.yml).
#
#   docker build -t epd-serve:local .                              # CPU torch (default)
#   docker build -t epd-serve:cuda --build-arg TORCH_VARIANT=cuda .  # CUDA torch + Triton
#
# Layers: OS packages -> torch -> the other dependencies (read from pyproject.toml) ->
# the source. A source change rebuilds only the last, small layer.

# The dependency list alone (the core and the router's `pii` extra; not `local`: compose
# runs NATS and Redis from their own images): other pyproject.toml edits leave the
# dependency layer below cached, since COPY --from compares the list's content.
FROM python:3.11-slim AS requirements
COPY pyproject.toml /
RUN python -c "import tomllib; p = tomllib.load(open('/pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['pii']))" > /requirements.txt

FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 EPD_DEMO_DIR=/models/demo

# A C compiler: the CPU backend builds its native kernels on first use (without one,
# the slower torch backend serves).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# torch first, pinned. cpu: the CPU build from PyTorch's CPU index (~0.7 GB installed;
# PyPI's Linux wheel is the CUDA build, ~2.5 GB more). cuda: PyPI's wheel (CUDA 12) plus
# Triton for the GPU kernels. TORCH_INDEX_URL overrides the index of either (a mirror,
# or e.g. https://download.pytorch.org/whl/cu128 for another CUDA version). A wheel of the
# other kind (a local find-links copy sorts first: 2.13.0+cpu > 2.13.0) fails the build.
ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX_URL=""
RUN set -eu; \
    case "$TORCH_VARIANT" in \
      cpu)  spec="torch==${TORCH_VERSION}+cpu"; extra=""; \
            index="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}" ;; \
      cuda) spec="torch==${TORCH_VERSION}"; extra="triton>=3.1"; \
            index="${TORCH_INDEX_URL:-https://pypi.org/simple}" ;; \
      *)    echo "TORCH_VARIANT must be cpu or cuda, got '$TORCH_VARIANT'" >&2; exit 2 ;; \
    esac; \
    pip install --index-url "$index" --extra-index-url https://pypi.org/simple "$spec" $extra; \
    python -c "import sys, torch; cuda = torch.version.cuda; print('torch', torch.__version__, 'cuda', cuda); \
sys.exit((cuda is None) != ('$TORCH_VARIANT' == 'cpu'))"

# The other dependencies: editing the source keeps this layer.
COPY --from=requirements /requirements.txt /tmp/requirements.txt
RUN pip install -r /tmp/requirements.txt "setuptools>=68" wheel && rm /tmp/requirements.txt

WORKDIR /app
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY launch ./launch
COPY services ./services
COPY gateway ./gateway
COPY encoder_svc ./encoder_svc
COPY prefill_svc ./prefill_svc
COPY decode_svc ./decode_svc
COPY cache_svc ./cache_svc
# --no-deps --no-build-isolation: everything it needs is installed above (no network).
RUN pip install --no-deps --no-build-isolation . && rm -rf build *.egg-info

# Not root. /models is the models volume (the demo checkpoint is generated there on
# first use; mount other checkpoints under it); kernels compile into ~/.cache.
RUN useradd --create-home --uid 1000 epd && mkdir -p /models && chown epd:epd /models
USER epd
WORKDIR /home/epd

EXPOSE 8000 50051
ENTRYPOINT ["epd"]
CMD ["serve", "all"]
