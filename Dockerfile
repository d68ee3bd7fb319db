# dspark on Ray's own GPU image (the Ray version the KubeRay manifests pin, Python 3.12).
#   docker build -t dspark:0.1.0 .      (the image k8s/ names; tests/test_k8s.py checks that they agree)
# Runs as Ray's non-root user "ray" (uid 1000, group users/100: the manifests' runAsUser and fsGroup).
ARG RAY_VERSION=2.60.0
FROM rayproject/ray:${RAY_VERSION}-py312-gpu

LABEL org.opencontainers.image.title="dspark" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.description="DSpark speculative decoding served on Ray"

USER ray
WORKDIR /home/ray/dspark

# FlashInfer compiles its kernels with nvcc on first use (minutes) and caches them under
# $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer: a directory the ray user owns; mount a volume there to keep the
# compiled kernels across pods. The build fails here if the base image has no nvcc.
ENV FLASHINFER_WORKSPACE_BASE=/home/ray/flashinfer-cache
RUN mkdir -p "$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer" && nvcc --version

COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users configs ./configs
COPY --chown=ray:users runtime ./runtime
COPY --chown=ray:users cluster ./cluster
RUN python -m pip install --no-cache-dir ".[gpu]" && python -c "import configs, runtime, cluster.cli"

# 8000: Serve HTTP (/v1, /health), 8080: metrics, 8265: dashboard, 6379: GCS, 10001: Ray client
EXPOSE 8000 8080 8265 6379 10001
