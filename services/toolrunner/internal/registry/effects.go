package registry

import (
	"github.com/curfew-mesh/curfew/mesh/catalog"
	"github.com/curfew-mesh/curfew/services/toolrunner/internal/source"
)

// Effects resolves a tool's side effects. The configuration, when it says, wins. Else a
// trusted source's hints are believed: read-only is none, idempotent is idempotent,
// anything else (no hints, destructive or not) irreversible. An untrusted source's hints
// could only make handling stricter, and irreversible, what it gets without them, is
// already the strictest: a server that says it only reads is not believed, because a
// wrong "read-only" would let toolrunner and its callers repeat an effect.
func Effects(configured *catalog.SideEffects, trusted bool, h source.Hints) catalog.SideEffects {
	switch {
	case configured != nil:
		return *configured
	case !trusted:
		return catalog.Irreversible
	case h.ReadOnly != nil && *h.ReadOnly:
		return catalog.None
	case h.Idempotent != nil && *h.Idempotent:
		return catalog.Idempotent
	}
	return catalog.Irreversible
}
