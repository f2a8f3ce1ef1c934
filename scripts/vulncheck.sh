#!/usr/bin/env bash
# govulncheck over Baton, against a Go vulnerability database built from the golang.org/x/vulndb
# module (the machine reaches the Go module proxy, not vuln.go.dev). The database is cached by
# vulndb version under $XDG_CACHE_HOME/baton/vulndb.
#
# Fails on a vulnerability Baton's code calls in a module it requires. A called vulnerability of
# the standard library is printed, not failed on: its fix is a newer Go toolchain than the one the
# machine starts with (say so in the closing note, and move when the toolchain moves).
set -euo pipefail
cd "$(dirname "$0")/.."
VULNDB=golang.org/x/vulndb@v0.0.0-20261105234957-e22db6528018
GOVULNCHECK=golang.org/x/vuln/cmd/govulncheck@v1.9.0
cache="${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/baton/vulndb/${VULNDB##*@}"
if [ ! -f "$cache/index/db.json" ]; then
  src=$(GOFLAGS= go mod download -json "$VULNDB" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  cp -r "$src" "$work/repo" && chmod -R u+w "$work/repo"
  # gendb reads the reports from a git repository.
  git -C "$work/repo" init -q
  git -C "$work/repo" add -A
  git -C "$work/repo" -c user.email=ci@baton.invalid -c user.name=ci commit -qm vulndb
  rm -rf "$cache" && mkdir -p "$(dirname "$cache")"
  GOFLAGS= go run "${VULNDB/@/\/cmd\/gendb@}" -repo "$work/repo" -out "$cache.tmp" >/dev/null
  mv "$cache.tmp" "$cache"
fi
GOFLAGS= go run "$GOVULNCHECK" -db "file://$cache" -format json ./... > "${TMPDIR:-/tmp}/baton-vulncheck.json" || true
python3 - "${TMPDIR:-/tmp}/baton-vulncheck.json" <<'PY'
import json, sys
text = open(sys.argv[1]).read()
dec, i, called = json.JSONDecoder(), 0, {}
while True:
    while i < len(text) and text[i].isspace():
        i += 1
    if i >= len(text):
        break
    obj, i = dec.raw_decode(text, i)
    f = obj.get("finding")
    if f and f.get("trace") and f["trace"][0].get("function"):
        called[f["osv"]] = (f["trace"][0].get("module", "?"), f.get("fixed_version", "none"))
if "config" not in text:
    sys.exit("govulncheck produced no report")
stdlib = {k: v for k, v in called.items() if v[0] == "stdlib"}
mods = {k: v for k, v in called.items() if v[0] != "stdlib"}
for k, (m, fix) in sorted(stdlib.items()):
    print(f"govulncheck: standard library {k}, fixed in {fix} (a toolchain update)")
for k, (m, fix) in sorted(mods.items()):
    print(f"govulncheck: {m} {k} is called; fixed in {fix}", file=sys.stderr)
print(f"govulncheck: {len(mods)} called in required modules, {len(stdlib)} in the standard library")
sys.exit(1 if mods else 0)
PY
