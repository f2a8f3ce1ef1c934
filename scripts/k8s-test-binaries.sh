#!/usr/bin/env bash
# Builds the kube-apiserver and etcd that Baton's Kubernetes tests run against, and the helm
# that renders its chart, from the Go module proxy into a cache directory; a second run finds
# them there and does nothing.
#
#   scripts/k8s-test-binaries.sh            # build (about 5-9 minutes on 2 cores, once; helm 3)
#   scripts/k8s-test-binaries.sh --print    # print the directory (for KUBE_TEST_ASSETS)
#
# k8s.io/kubernetes is published without its staging/ directory, so its go.mod's
# "k8s.io/x => ./staging/src/k8s.io/x" replacements point nowhere: they are dropped and the
# published k8s.io/x modules of the same release required instead. etcd is built from the same
# module graph (kube-apiserver already depends on go.etcd.io/etcd/server/v3), which matches the
# apiserver's etcd client. Debian's etcd 3.4 is too old (watches fail), so none is taken from
# PATH.
set -euo pipefail

# Keep these in step with internal/k8stest (Version, HelmVersion).
K8S_VERSION="${K8S_VERSION:-v1.35.4}"
HELM_VERSION="${HELM_VERSION:-v3.22.0}"
STAGING="v0.${K8S_VERSION#v1.}"
BASE="${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/baton"
CACHE="${KUBE_TEST_CACHE:-$BASE/k8s-test/$K8S_VERSION}"
HELM_DIR="$BASE/helm/$HELM_VERSION"

if [[ "${1:-}" == "--print" ]]; then
  echo "$CACHE"
  exit 0
fi

if [[ -x "$HELM_DIR/helm" ]]; then
  echo "helm $HELM_VERSION already built in $HELM_DIR"
else
  start=$SECONDS
  mkdir -p "$HELM_DIR"
  hcache=$(mktemp -d)
  GOCACHE="$hcache" GOBIN="$HELM_DIR" GOFLAGS="-mod=mod" CGO_ENABLED=0 nice -n 10 \
    go install -trimpath -ldflags "-s -w" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
  rm -rf "$hcache"
  echo "built helm $HELM_VERSION in $HELM_DIR in $((SECONDS - start)) s"
fi

if [[ -x "$CACHE/kube-apiserver" && -x "$CACHE/etcd" ]]; then
  echo "kube-apiserver and etcd $K8S_VERSION already built in $CACHE"
  exit 0
fi

start=$SECONDS
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$CACHE"
# A private build cache: the compiled Kubernetes packages (about 2 GB) go away with $work.
export GOCACHE="$work/gocache" GOFLAGS="-mod=mod"
src=$(cd "$work" && go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
cp -r "$src" "$work/kubernetes"
chmod -R u+w "$work/kubernetes"
cd "$work/kubernetes"
rm -f go.work go.work.sum
edits=()
for m in $(sed -n 's|^[[:space:]]*\(k8s.io/[a-z0-9-]*\) => ./staging/.*|\1|p' go.mod | sort -u); do
  edits+=("-dropreplace=$m")
  if grep -Eq "^[[:space:]]*$m v0\.0\.0\$" go.mod; then
    if (cd "$work" && go list -m "$m@$STAGING" >/dev/null 2>&1); then
      edits+=("-require=$m@$STAGING")
    else
      edits+=("-droprequire=$m")
    fi
  fi
done
go mod edit "${edits[@]}"
minor=$(echo "$K8S_VERSION" | cut -d. -f2)
ld="-s -w -X k8s.io/component-base/version.gitVersion=$K8S_VERSION -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor"
CGO_ENABLED=0 nice -n 10 go build -trimpath -ldflags "$ld" -o "$CACHE/kube-apiserver.tmp" ./cmd/kube-apiserver
CGO_ENABLED=0 nice -n 10 go build -trimpath -ldflags "-s -w" -o "$CACHE/etcd.tmp" go.etcd.io/etcd/server/v3
mv "$CACHE/kube-apiserver.tmp" "$CACHE/kube-apiserver"
mv "$CACHE/etcd.tmp" "$CACHE/etcd"
echo "built kube-apiserver and etcd $K8S_VERSION in $CACHE in $((SECONDS - start)) s"
