# neuronfleet images, one Dockerfile with three targets (README "Container images"):
#   docker build --target operator       -t ghcr.io/neuronfleet/operator:0.1.0 .
#   docker build --target runtime-cpu    -t ghcr.io/neuronfleet/runtime-cpu:0.1.0 .
#   docker build --target runtime-neuron -t ghcr.io/neuronfleet/runtime-neuron:0.1.0 .
# The routers (every engine's) run runtime-cpu on any node, as does our own engine on instanceType cpu; our
# engine on trn2 and trn3 (experimental) runs runtime-neuron; the other models on Neuron run their engine's
# pinned image (vLLM, TGI, SGLang: operator/engines/).
# Every base is pinned by tag; Python packages are pinned by constraints.txt. No secrets are built in (model
# tokens come from Kubernetes Secrets at run time), and there is no HEALTHCHECK: Kubernetes probes do that.
# Every image runs as the unprivileged user 10001 (the operator's pods and the model pods it creates run with
# runAsNonRoot and a read-only root filesystem).

ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
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

# ---- runtime-neuron: our runtime over TorchNeuron, engine embedded on trn2 and trn3 (experimental) ---------
# Not yet built or run on a device (README "What runs where"). What it follows, from the Neuron docs:
# - TorchNeuron's standalone wheels support Ubuntu 26.04 (torch/get-started/quickstart-torch-neuron, SDK
#   2.33.1), and no TorchNeuron inference image is published (setup/pytorch/dlc, SDK 2.33.0). So the base is
#   Ubuntu 26.04, with Python 3.11 (our package's) installed by uv.
# - The Neuron runtime's libraries come from AWS's apt repository (aws-neuronx-runtime-lib,
#   aws-neuronx-collectives); the driver runs on the host, not in the container (setup/pytorch/update-dlc).
# - torch-neuronx, neuronx-cc and nki come from AWS's pip repository, torch from PyTorch's CPU index
#   (setup/pytorch/update-manual); the versions are pyproject.toml's `neuron` extra.
ARG NEURON_BASE_IMAGE=public.ecr.aws/docker/library/ubuntu:26.04
FROM ${NEURON_BASE_IMAGE} AS runtime-neuron
ARG TORCH_INDEX_URL
ARG NEURON_PIP_URL=https://pip.repos.neuron.amazonaws.com
ARG NEURON_APT_URL=https://apt.repos.neuron.amazonaws.com
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    UV_PYTHON_INSTALL_DIR=/opt/python VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH \
    LD_LIBRARY_PATH=/opt/aws/neuron/lib
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates curl gnupg python3-pip \
    && . /etc/os-release \
    && curl -fsSL "${NEURON_APT_URL}/GPG-PUB-KEY-AMAZON-AWS-NEURON.PUB" \
       | gpg --dearmor -o /usr/share/keyrings/neuron-archive-keyring.gpg \
    && echo "deb [signed-by=/usr/share/keyrings/neuron-archive-keyring.gpg] ${NEURON_APT_URL} ${VERSION_CODENAME} main" \
       > /etc/apt/sources.list.d/neuron.list \
    && apt-get update && apt-get install -y --no-install-recommends aws-neuronx-runtime-lib aws-neuronx-collectives \
    && rm -rf /var/lib/apt/lists/*
RUN pip install --break-system-packages uv==0.13.9 && uv python install 3.11 && uv venv --python 3.11 /opt/venv
WORKDIR /src
COPY --from=sources /src/ ./
RUN uv pip install -c constraints.txt --index-strategy unsafe-best-match \
    --extra-index-url "${TORCH_INDEX_URL}" --extra-index-url "${NEURON_PIP_URL}" '.[neuron]' && rm -rf /src
RUN useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin neuronfleet
USER 10001:10001
WORKDIR /
ENTRYPOINT ["neuronfleet"]
CMD ["serve", "--help"]
