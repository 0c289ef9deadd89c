# syntax=docker/dockerfile:1
# The Detour image: `python -m service` on a slim Python, as a non-root user.
#
#   docker build -t detour:0.1.0 --build-arg REVISION=$(git rev-parse HEAD) .
#   docker run --rm -p 8080:8080 -e DETOUR_REDIS_URL=redis://redis:6379/0 detour:0.1.0
#
# Only the runtime dependencies go in: requirements.lock, the exact pins of pyproject.toml's
# `server` dependency group and theirs (the dev, test and Spark packages are in
# requirements-dev.lock, which never reaches the build). Binary wheels only, so no compiler
# is needed in either stage. See docs/deploy.md.

ARG PYTHON_VERSION=3.11

# ---------------------------------------------------------------------------- build stage
FROM python:${PYTHON_VERSION}-slim-bookworm AS build

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

# The dependency layer first: it changes only with the lock, so a code change rebuilds
# nothing but the last layers.
COPY requirements.lock /src/
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --only-binary=:all: -r /src/requirements.lock \
 && /opt/venv/bin/pip check \
 && /opt/venv/bin/pip uninstall -y pip setuptools

COPY detour /app/detour
COPY service /app/service
# Compile now: the root filesystem is read-only at run time.
RUN /opt/venv/bin/python -m compileall -q /app/detour /app/service /opt/venv

# ---------------------------------------------------------------------------- final stage
FROM python:${PYTHON_VERSION}-slim-bookworm

ARG VERSION=0.1.0
ARG REVISION=unknown
# Where the source lives (--build-arg SOURCE=<repository URL>); empty when not given.
ARG SOURCE=""
LABEL org.opencontainers.image.title="detour" \
      org.opencontainers.image.description="A shared broker fault-avoidance service for RocketMQ-style producers" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="Apache-2.0"

# A fixed numeric uid/gid, so Kubernetes' runAsNonRoot can check it without /etc/passwd.
RUN groupadd --system --gid 10001 detour \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin detour

COPY --from=build /opt/venv /opt/venv
COPY --from=build /app /app

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/app \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    DETOUR_HOST=0.0.0.0 \
    DETOUR_PORT=8080

WORKDIR /app
USER 10001:10001
EXPOSE 8080

# Docker's own check (Kubernetes ignores it and uses the manifests' probes). No curl in the
# slim image, so Python asks; it follows DETOUR_PORT.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('DETOUR_PORT', '8080'), timeout=2)"]

# ENTRYPOINT rather than CMD so flags append: `docker run detour:0.1.0 --workers 2`.
# Exec form: Python is PID 1 and gets SIGTERM itself (it finishes requests in flight and
# hands its journal to Redis before exiting 0).
ENTRYPOINT ["python", "-m", "service"]
