# One image for every pdserve service; compose.yaml picks the module per container.
# It installs exactly what the README's commands install: scripts/setup.sh.
FROM python:3.11-slim-bookworm
WORKDIR /app
# Which torch build, chosen on purpose: TORCH=cpu (default: PyTorch's CPU-only wheel index, about
# 200 MB) or TORCH=cuda (PyPI's torch, the multi-GB CUDA build). TORCH_INDEX_URL overrides the index.
ARG TORCH=cpu
ARG TORCH_INDEX_URL=""
COPY . /app
RUN case "$TORCH" in \
      cpu) export TORCH_INDEX_URL="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}" ;; \
      cuda) export TORCH_INDEX_URL="${TORCH_INDEX_URL}" ;; \
      *) echo "TORCH must be cpu or cuda, got $TORCH" >&2; exit 1 ;; \
    esac && bash scripts/setup.sh && rm -rf /root/.cache/pip
ENV PATH="/app/.venv/bin:${PATH}" PYTHONUNBUFFERED=1
EXPOSE 8000 50050 50051 50061 50071 9464
CMD ["pdserve", "--help"]
