# One image for every pdserve service; compose.yaml picks the module per container.
# It installs exactly what the README's commands install: scripts/setup.sh.
FROM python:3.11-slim-bookworm
WORKDIR /app
# Optional: a package index that serves CPU-only torch wheels (a bare torch==2.13.0 from PyPI is the CUDA build).
ARG TORCH_INDEX_URL=""
ENV TORCH_INDEX_URL=${TORCH_INDEX_URL}
COPY . /app
RUN bash scripts/setup.sh && rm -rf /root/.cache/pip
ENV PATH="/app/.venv/bin:${PATH}" PYTHONUNBUFFERED=1
EXPOSE 50050 50051 50061 50071 9464
CMD ["pdserve", "--help"]
