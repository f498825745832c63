#!/usr/bin/env bash
# Cuts a release: records the public API as a buf image in proto/releases/VERSION.binpb,
# commits it, and tags the commit VERSION (annotated). Run on a clean main whose
# CHANGELOG.md already has the release's section ("## [VERSION] - DATE").
#
#   scripts/release.sh v0.2.0
#
# The API is checked against the previous release first: a break is refused unless the
# major version grows (docs/api.md, "Compatibility"). Push the commit and the tag yourself.
# Binaries and images are stamped with the tag: `make build` uses `git describe`, the
# Dockerfiles take --build-arg VERSION.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.tools/bin:/usr/local/go/bin:$PATH"

version="${1:-}"
if [[ ! "$version" =~ ^v(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)$ ]]; then
  echo "usage: scripts/release.sh vMAJOR.MINOR.PATCH (got \"$version\")" >&2
  exit 2
fi
image="proto/releases/$version.binpb"
if [[ -e "$image" ]]; then
  echo "release: $image exists already" >&2
  exit 1
fi
if [[ -n "$(git status --porcelain)" ]]; then
  echo "release: the working tree is not clean" >&2
  exit 1
fi
if git rev-parse -q --verify "refs/tags/$version" >/dev/null; then
  echo "release: tag $version exists already" >&2
  exit 1
fi
if ! grep -q "^## \[$version\]" CHANGELOG.md; then
  echo "release: CHANGELOG.md has no section \"## [$version] - $(date -u +%F)\"" >&2
  exit 1
fi

bash scripts/tools.sh >/dev/null
previous="$(ls proto/releases/*.binpb 2>/dev/null | sed 's#.*/##; s#\.binpb$##' | sort -V | tail -n 1 || true)"
if [[ -n "$previous" ]]; then
  if ! buf breaking --against "proto/releases/$previous.binpb"; then
    if [[ "${version%%.*}" == "${previous%%.*}" ]]; then
      echo "release: $version breaks the API of $previous; only a new major version may" >&2
      exit 1
    fi
    echo "release: $version breaks the API of $previous (a new major version)" >&2
  fi
fi

mkdir -p proto/releases
buf build -o "$image"
# The image's name, its CHANGELOG section, the checks (not the test of this script).
go test -count=1 -run '^Test(CompatibleWithLatestRelease|RemovedFieldIsCaught|ChangelogNamesEveryRelease)$' ./internal/release/
git add "$image"
git commit -q -m "release: $version" -m "The API of $version, recorded for the breaking-change check."
git tag -a "$version" -m "curfew $version"
echo "released $version: push with  git push origin main $version"
