package catalog

import (
	"strconv"

	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
)

// SideEffects says what running a tool does to the world beyond returning its result.
type SideEffects uint8

const (
	// Irreversible means each run changes the world again (it starts a job, sends a
	// message). It is the zero value: a tool that does not say is taken to repeat its
	// effect.
	Irreversible SideEffects = iota
	// Idempotent means a run changes the world, but a second run with the same arguments
	// changes nothing more.
	Idempotent
	// None means a run only reads, waits or computes.
	None
)

// String returns "irreversible", "idempotent" or "none".
func (e SideEffects) String() string {
	switch e {
	case Irreversible:
		return "irreversible"
	case Idempotent:
		return "idempotent"
	case None:
		return "none"
	}
	return "SideEffects(" + strconv.Itoa(int(e)) + ")"
}

// Tool is one tool a model may call.
type Tool struct {
	// Name is what models and plans call the tool.
	Name string
	// Spec describes the tool to a model. nil for a tool no model is told about.
	Spec *modelproxyv1.ToolSpec
	// SideEffects says what a run of the tool does to the world; Irreversible when unset.
	SideEffects SideEffects
	// Durable says toolrunner keeps the tool's effect in its store under an idempotency
	// key: the caller's, or one toolrunner derives from run, node, tool and the canonical
	// arguments, which every attempt of a call shares.
	Durable bool
	// RunsModels says a run of the tool makes model calls of its own (spawn_subagent's
	// nested loop): a second run of it runs a second decoder, so it is never hedged.
	RunsModels bool
}

// NeedsKey reports whether a call of t may run a second time only when it carries the
// caller's idempotency key: its effect would repeat, and nothing below the caller keys it.
// Such a call is retried, and resumed after a takeover, only with a key.
func (t Tool) NeedsKey() bool { return t.SideEffects == Irreversible && !t.Durable }

// Hedgeable reports whether a call of t may get a hedged backup (package mesh/hedge): a
// second run beside the first, whose loser is cancelled. Only a tool that reads or is
// idempotent, keeps no record under a key (a durable tool's backup would only join its
// twin's), and runs no model calls (a backup must never run a second decoder).
func (t Tool) Hedgeable() bool {
	return t.SideEffects != Irreversible && !t.Durable && !t.RunsModels
}
