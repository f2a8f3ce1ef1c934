# Baton as a static binary on distroless, running as a non-root user.
#   docker build -t baton:dev --build-arg VERSION=v0.2.0 .
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=""
RUN CGO_ENABLED=0 go build -trimpath \
      -ldflags "-s -w -X github.com/baton-llm/baton/internal/app.version=${VERSION}" \
      -o /out/baton ./cmd/baton

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/baton /usr/local/bin/baton
USER 65532:65532
EXPOSE 30000 29000
ENTRYPOINT ["/usr/local/bin/baton"]
CMD ["serve"]
