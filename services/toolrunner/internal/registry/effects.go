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

// Why a tool's calls wait for a human's approval (Tool.Approval, Prepared.Approval; the
// approval request's and the ApprovalGate event's "why").
const (
	ApprovalRegistry        = "registry"         // the tools file says approval: true
	ApprovalDestructiveHint = "destructive_hint" // the source says destructiveHint: true
	ApprovalPlan            = "plan"             // the call asks for it (a plan's "approval": true)
)

// Approval resolves whether a tool's calls wait for a human's approval, and why. The
// configuration, when it says, wins. Else only a source's explicit destructiveHint true
// does: MCP's default for an absent destructiveHint is true, so an absent hint would gate
// every tool of every server that says nothing; an explicit claim is believed whether or
// not the source is trusted, since it can only make handling stricter.
func Approval(configured *bool, h source.Hints) string {
	switch {
	case configured != nil && *configured:
		return ApprovalRegistry
	case configured != nil:
		return ""
	case h.Destructive != nil && *h.Destructive:
		return ApprovalDestructiveHint
	}
	return ""
}
