# vacancyd container image: the Kubernetes companion (`vacancyd companion`) and containerized
# lenders (`vacancyd run`). Multi-stage: the wheel is built in a throwaway stage, and the
# runtime stage holds only the installed package, running as an unprivileged user.
#
#   docker build -t vacancyd:dev .
#   docker run --rm vacancyd:dev --version

FROM python:3.12-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY vacancyd ./vacancyd
RUN python -m pip install --no-cache-dir build \
 && python -m build --wheel --outdir /dist

FROM python:3.12-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
COPY --from=build /dist/*.whl /tmp/
RUN python -m pip install --no-cache-dir "$(ls /tmp/vacancyd-*.whl)[kubernetes,json-logs]" \
 && rm -f /tmp/*.whl \
 && useradd --system --uid 65532 --no-create-home --shell /usr/sbin/nologin vacancyd
USER 65532:65532
EXPOSE 9470
ENTRYPOINT ["vacancyd"]
CMD ["run"]
