// Package release knows curfew's releases: each release's public API, committed as a buf
// image in proto/releases/ by scripts/release.sh, and the form of a version's name.
//
// The images make the breaking-change check independent of git tags, which do not travel
// with every clone: the package's tests run `buf breaking` of the protos against the newest
// image on every change (CI runs them through `make test`), so a change that would break a
// caller built against the last release fails before it lands. The compatibility promise
// the check enforces is in docs/api.md ("Compatibility").
package release
