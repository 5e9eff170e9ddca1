# neuronfleet images, one Dockerfile with two targets (README "Container images"):
#   docker build --target operator    -t ghcr.io/neuronfleet/operator:0.1.0 .
#   docker build --target runtime-cpu -t ghcr.io/neuronfleet/runtime-cpu:0.1.0 .
# Nothing of ours runs on a Neuron device: the routers (every engine's) run runtime-cpu on any node, our own
# engine serves instanceType cpu only, and the models on Neuron run their engine's pinned image (vLLM, TGI,
# SGLang: operator/engines/). There is no Neuron image of ours until our runtime has a Neuron backend.
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
