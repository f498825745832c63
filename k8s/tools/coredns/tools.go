//go:build tools

// Package tools pins github.com/coredns/coredns for scripts/coredns.sh.
package tools

import (
	_ "github.com/coredns/coredns"
)
