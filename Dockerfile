# One image for the three ignis services: ignis-engine, ignis-tierstore, ignis-gateway
# (or python -m engine|tierstore|gateway). docker-compose.yml runs it; see docs/docker.md.
#
#   docker build -t ignis:cuda .                         # torch for CUDA (default)
#   docker build --build-arg VARIANT=cpu -t ignis:cpu .  # torch for CPU only, no GPU needed
#
# Build arguments: VARIANT (cuda|cpu), TORCH_CUDA (the PyTorch wheel index of the CUDA
# build, e.g. cu130 or cu128), TORCH_INDEX_URL (any other index; wins over both).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------- build: a venv in /opt/venv
FROM ${PYTHON_IMAGE} AS build
ARG VARIANT=cuda
ARG TORCH_CUDA=cu130
ARG TORCH_INDEX_URL=
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src

# Dependencies first, in layers that survive source edits. torch comes from the PyTorch index of
# the variant at the version pyproject.toml pins (2.13.0+cu130 satisfies ==2.13.0), so the
# second install keeps it.
COPY pyproject.toml ./
RUN set -e; \
    case "$VARIANT" in \
      cuda) index="https://download.pytorch.org/whl/$TORCH_CUDA" ;; \
      cpu) index="https://download.pytorch.org/whl/cpu" ;; \
      *) echo "VARIANT must be cuda or cpu, got '$VARIANT'" >&2; exit 1 ;; \
    esac; \
    torch_pin="$(grep -o '"torch==[^"]*"' pyproject.toml | tr -d '"')"; \
    test -n "$torch_pin"; \
    pip install --index-url "${TORCH_INDEX_URL:-$index}" "$torch_pin"
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
      > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt

# The gRPC stubs (the ignis package) are generated here, never copied from a work tree.
COPY protos protos
COPY scripts/gen_protos.py scripts/gen_protos.py
COPY common common
COPY engine engine
COPY gateway gateway
COPY tierstore tierstore
COPY kernels kernels
RUN python scripts/gen_protos.py --force \
 && pip install --no-deps .

# ---------------------------------------------------------------- runtime
FROM ${PYTHON_IMAGE} AS runtime
ARG VARIANT=cuda
# Triton (which CUDA torch brings) compiles a small launcher with the system C compiler on first use.
RUN if [ "$VARIANT" = cuda ]; then \
      apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
      && rm -rf /var/lib/apt/lists/*; \
    fi
# One fixed uid for every service: the tierstore's arena file (mode 0600) must be opened by the engine.
# The folders exist owned by it, so named volumes mounted on them start out writable by it (Docker copies
# a folder's owner and mode into an empty volume). /var/lib/ignis/engine, the engine's stored responses
# and integrity key, is 0700: the key file the engine makes there is 0600 in a folder of its own.
RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin ignis \
 && mkdir -p /var/lib/ignis/kv-disk /var/lib/ignis/engine /var/cache/ignis /models \
 && chown ignis:ignis /var/lib/ignis/kv-disk /var/lib/ignis/engine /var/cache/ignis \
 && chmod 0700 /var/lib/ignis/engine
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    IGNIS_CACHE_DIR=/var/cache/ignis \
    IGNIS_KV_DISK__PATH=/var/lib/ignis/kv-disk \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER ignis
WORKDIR /home/ignis
# Every entry point starts (imports resolve, the stubs are installed) before the image is called built.
RUN ignis-engine --help >/dev/null \
 && ignis-tierstore --help >/dev/null \
 && ignis-gateway --help >/dev/null \
 && python -m common.healthcheck --help >/dev/null
# engine gRPC, tierstore gRPC, gateway HTTP; metrics (engine, tierstore) where compose puts them
EXPOSE 50051 50061 8000 9400 9401
# No ENTRYPOINT: the command is the whole argv, e.g. `ignis-gateway --host 0.0.0.0 --engine engine:50051`.
# The default, an engine serving ignis-tiny, binds the container's loopback: the engine has no
# authentication, so listening beyond it (`--host 0.0.0.0`) is the operator's explicit choice.
CMD ["ignis-engine"]
