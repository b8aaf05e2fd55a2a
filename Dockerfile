# syntax=docker/dockerfile:1
# kvpick's image: a cargo build stage, then a small non-root runtime with only the binary and
# CA certificates (distroless "cc": glibc, libgcc and /etc/ssl/certs, no shell, uid 65532).
#   docker build -t kvpick .                         # the endpoint picker (default target)
#   docker build --target kvpick-sim -t kvpick-sim . # the vLLM stand-in, for test clusters
# The build step is the README's release build, word for word (tests/it/deploy_files.rs
# checks that they stay the same). Linted by scripts/lint-dockerfile.sh (hadolint).

ARG RUST_VERSION=1.95

FROM docker.io/library/rust:${RUST_VERSION}-slim-bookworm AS build
WORKDIR /src
# Sources only (.dockerignore keeps target/, .venv/ and the benchmarks' data out).
COPY . .
# NOTE: cache mounts keep the registry and target/ between builds; the binaries are copied out
# of the cached target/ in the same step, since a cache mount is not part of the layer.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin kvpick --bin kvpick-sim \
    && mkdir -p /out \
    && cp target/release/kvpick target/release/kvpick-sim /out/

FROM gcr.io/distroless/cc-debian12:nonroot AS kvpick-sim
COPY --from=build /out/kvpick-sim /usr/local/bin/kvpick-sim
# The simulator's tokenizer (assets/tokenizer) for --tokenizer /assets/tokenizer.
COPY --from=build /src/assets/tokenizer /assets/tokenizer
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/kvpick-sim"]

# Last, so a plain `docker build` produces kvpick.
FROM gcr.io/distroless/cc-debian12:nonroot AS kvpick
COPY --from=build /out/kvpick /usr/local/bin/kvpick
USER 65532:65532
# ext-proc gRPC, gRPC health, /metrics (the debug port stays on loopback).
EXPOSE 9002 9003 9090
ENTRYPOINT ["/usr/local/bin/kvpick"]
CMD ["serve"]
