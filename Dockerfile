# neuronfleet images, one Dockerfile with three targets (README "Container images"):
#   docker build --target operator       -t ghcr.io/neuronfleet/operator:0.1.0 .
#   docker build --target runtime-cpu    -t ghcr.io/neuronfleet/runtime-cpu:0.1.0 .
#   docker build --target runtime-neuron -t ghcr.io/neuronfleet/runtime-neuron:0.1.0 \
#       --build-arg NEURON_SDK_VERSION=2.26.1 .
# Every base is pinned by tag; Python packages are pinned by constraints.txt. No secrets are built in (model
# tokens come from Kubernetes Secrets at run time), and there is no HEALTHCHECK: Kubernetes probes do that.
# Every image runs as the unprivileged user 10001 (the operator's pods and the model pods it creates run with
# runAsNonRoot and a read-only root filesystem).

ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
# The AWS Neuron SDK release of the runtime-neuron image; its base is the Neuron deep learning container for
# PyTorch inference of that release (NxDI is in it up to SDK 2.31).
ARG NEURON_SDK_VERSION=2.26.1
ARG NEURON_TORCH_VERSION=2.8.0
ARG NEURON_PYTHON=py311
ARG NEURON_BASE_IMAGE=public.ecr.aws/neuron/pytorch-inference-neuronx:${NEURON_TORCH_VERSION}-neuronx-${NEURON_PYTHON}-sdk${NEURON_SDK_VERSION}-ubuntu22.04
# Where the CPU build of the pinned torch comes from (the default index has only CUDA builds for Linux).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

# ---- sources: what every image installs (the package and the pins) -----------------------------------
FROM ${PYTHON_IMAGE} AS sources
WORKDIR /src
COPY constraints.txt pyproject.toml README.md ./
COPY docker/ docker/
COPY neuronfleet/ neuronfleet/
COPY operator/ operator/
COPY runtime/ runtime/
COPY localcluster/ localcluster/
COPY crds/ crds/

# ---- operator: the kopf operator, no model code --------------------------------------------------------
FROM ${PYTHON_IMAGE} AS operator
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY --from=sources /src/ ./
RUN pip install -c constraints.txt -r docker/operator-requirements.txt \
    && pip install --no-deps . \
    && rm -rf /src
RUN useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin neuronfleet
USER 10001:10001
WORKDIR /
ENTRYPOINT ["neuronfleet"]
CMD ["operator", "--standalone", "--all-namespaces"]

# ---- runtime-cpu: our runtime on CPU (routers, instanceType cpu, the local mode) --------------------------
FROM ${PYTHON_IMAGE} AS runtime-cpu
ARG TORCH_INDEX_URL
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY --from=sources /src/ ./
# the nixl extra: NIXL (nixl-cu12, UCX and the LIBFABRIC plugin bundled) for --kv-transport nixl
RUN pip install -c constraints.txt --extra-index-url "${TORCH_INDEX_URL}" '.[nixl]' && rm -rf /src
RUN useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin neuronfleet
USER 10001:10001
WORKDIR /
ENTRYPOINT ["neuronfleet"]
CMD ["serve", "--help"]

# ---- runtime-neuron: our runtime on Neuron devices (NxDI from the base image) ----------------------------
FROM ${NEURON_BASE_IMAGE} AS runtime-neuron
ARG NEURON_SDK_VERSION
LABEL dev.neuronfleet.neuron-sdk="${NEURON_SDK_VERSION}"
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY --from=sources /src/ ./
# torch and the Neuron stack come with the base image: only our package and its pure-Python dependencies, and
# NIXL (without deps: its torch and numpy are the base image's). NIXL 1.5.1's LIBFABRIC plugin
# (--kv-transport efa) loads a libfabric newer than 2.6.0 (ABI FABRIC_1.10: AWS's EFA installer 1.51.0 or
# later), libhwloc.so.15, libcudart.so.12 and libcuda.so.1 (a stub serves: docker/libcuda-stub.c). The base
# image runs AWS's EFA installer (the newest at its build) and installs libhwloc-dev
# (aws-neuron/deep-learning-containers, pytorch/inference/2.8.0/Dockerfile.neuronx); whether its libfabric
# is new enough is not verified here (no Docker): `neuronfleet serve` names whatever is missing at start
# (docs/disaggregation.md). The embedded engine serves on instanceType cpu only, with runtime-cpu, for now.
RUN pip install --no-deps . \
    && pip install -c constraints.txt aiohttp prometheus-client pydantic PyYAML safetensors tokenizers jinja2 \
       xxhash \
    && pip install --no-deps -c constraints.txt nixl-cu12 \
    && rm -rf /src
RUN useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin neuronfleet
USER 10001:10001
WORKDIR /
ENTRYPOINT ["neuronfleet"]
CMD ["serve", "--help"]
