# One image for every ordinal service: docker-compose.yml runs the executor, the scheduler and the smg gateway
# from it, each with its own command. Alone, it runs the whole stack in one container:
#   docker build -t ordinal . && docker run --rm -p 8000:8000 -p 30000:30000 ordinal
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    ORDINAL_CACHE_DIR=/cache

# torch goes in first, as in scripts/setup; the project asks only for torch>=2.4, so pip leaves it alone below.
# This is the CPU build. For NVIDIA GPUs swap this line for a CUDA build of the same version, e.g.
#   RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128
# (pick the index matching your driver on pytorch.org), then uncomment the GPU reservation of the executor in
# docker-compose.yml and pass `--device cuda` to it.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

WORKDIR /app
COPY pyproject.toml constraints.txt README.md ./
COPY protos ./protos
COPY engine ./engine
COPY services ./services
# The project at the tested versions (constraints.txt), plus the smg gateway (the version pyproject's test extra pins).
RUN pip install -c constraints.txt . smg==1.13.0

# Run unprivileged. /cache holds the model folder (the embedded model is built there on first start); compose
# mounts one volume there for all services so that they all see the same folder.
RUN useradd --create-home --uid 1000 ordinal && mkdir -p /cache && chown ordinal:ordinal /cache
USER ordinal
VOLUME /cache

EXPOSE 30000 8000
CMD ["ordinal", "serve", "--host", "0.0.0.0"]
