package registry

import (
	"crypto/sha256"
	"encoding/hex"
	"regexp"
	"strings"
)

// Separator joins a source's name and its tool's name.
const Separator = "__"

// MaxNameLen is the longest model-visible tool name (the limit of the model APIs).
const MaxNameLen = 64

// hashLen is the length of the hex hash that ends a shortened name.
const hashLen = 8

// nameRule is the rule of a model-visible tool name.
var nameRule = regexp.MustCompile(`^[a-zA-Z0-9_-]{1,64}$`)

// ValidName reports whether name is a valid model-visible tool name.
func ValidName(name string) bool { return nameRule.MatchString(name) }

// Name returns the model-visible name of a source's tool: source__tool, with every
// character outside [a-zA-Z0-9_-] replaced by "_". A name longer than MaxNameLen is cut to
// MaxNameLen−9 characters and ends in "_" and the first 8 hex digits of the SHA-256 of the
// whole unreplaced source__tool, so that two long names that share their start stay
// apart.
func Name(source, tool string) string {
	full := source + Separator + tool
	name := strings.Map(func(r rune) rune {
		if r == '_' || r == '-' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' {
			return r
		}
		return '_'
	}, full)
	if len(name) <= MaxNameLen {
		return name
	}
	sum := sha256.Sum256([]byte(full))
	return name[:MaxNameLen-hashLen-1] + "_" + hex.EncodeToString(sum[:])[:hashLen]
}

// SourceOf returns the source part of a model-visible name (before the first "__"), or
// "" when it has none.
func SourceOf(name string) string {
	s, _, ok := strings.Cut(name, Separator)
	if !ok {
		return ""
	}
	return s
}
