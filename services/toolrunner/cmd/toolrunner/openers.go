package main

import (
	"github.com/curfew-mesh/curfew/services/toolrunner/internal/registry"
)

// openers returns how each kind of tool source is opened. A kind without an opener
// stops toolrunner at start when --tools-config names a source of it.
func openers() map[string]registry.Opener {
	return map[string]registry.Opener{}
}
