package store

import (
	"context"
	"time"
)

// Operators holds what operators decide and what they did: the controls every replica
// obeys (a pool closed, a ledger frozen, decoders drained), the audit log of every call
// that changed something, and the figures operators read (usage per tenant, the orphan
// delta). Replicas poll ListControls, so a control written through one replica holds on
// all of them within their poll interval.
type Operators interface {
	// PutControl sets a control. When (Kind, Target) is already set, the row keeps its
	// CreatedAt and Actor (the first decision stands, so repeating a command is a no-op)
	// and takes c's Reason and Until; created says which it was. Kind and Target are
	// required; CreatedAt is the store's clock.
	PutControl(ctx context.Context, c Control) (out Control, created bool, err error)
	// DeleteControl lifts a control and returns it as it was, or deleted=false when it
	// was not set.
	DeleteControl(ctx context.Context, kind ControlKind, target string) (old Control, deleted bool, err error)
	// ListControls returns every control, by kind then target.
	ListControls(ctx context.Context) ([]Control, error)

	// AddAudit appends an entry (At is the store's clock, ID assigned) and returns it.
	// Actor and Action are required.
	AddAudit(ctx context.Context, a AuditEntry) (AuditEntry, error)
	// ListAudit pages the audit log newest first.
	ListAudit(ctx context.Context, q AuditQuery) (entries []AuditEntry, next string, err error)

	// AddSheds counts n sheds of tenant's runs in the minute of at.
	AddSheds(ctx context.Context, tenant string, at time.Time, n int64) error
	// TenantUsage sums, per tenant, the ledger entries and runs created at or after since
	// (zero: all) and the sheds counted in the minutes from since's, for one tenant or
	// every tenant (""), by tenant.
	TenantUsage(ctx context.Context, tenant string, since time.Time) ([]TenantUsage, error)
	// SumTokens sums the ledger entries q selects.
	SumTokens(ctx context.Context, q TokenQuery) (int64, error)
}

// ControlKind names what a control does.
type ControlKind string

// Control kinds. Target is what the control applies to.
const (
	// ControlPoolClosed: admission pool Target sheds new runs (pool_closed, condition
	// operator) until the control is deleted.
	ControlPoolClosed ControlKind = "pool_closed"
	// ControlPoolForcedOpen: pool Target admits despite its automatic fail-closed
	// window, until Until.
	ControlPoolForcedOpen ControlKind = "pool_forced_open"
	// ControlFreezeRun: run Target (of Tenant) has its decoders stopped and starts no
	// new one.
	ControlFreezeRun ControlKind = "freeze_run"
	// ControlFreezeTenant: every run of tenant Target, likewise.
	ControlFreezeTenant ControlKind = "freeze_tenant"
	// ControlDrain: no new decoder starts for runs of pool Target (DrainAll: every
	// run); decoders still running at Until (when set) are cancelled.
	ControlDrain ControlKind = "drain"
	// ControlConsoleSignedOut: the web console's session Target (its id) was signed out
	// before it expired, at Until; every replica refuses it from its next poll on.
	ControlConsoleSignedOut ControlKind = "console_signed_out"
)

// DrainAll is the Target of a ControlDrain that covers every run.
const DrainAll = "*"

// Control is one operator decision in force.
type Control struct {
	Kind   ControlKind
	Target string
	Tenant string // the run's tenant, for ControlFreezeRun
	Reason string
	Actor  string
	// CreatedAt is when it was first set (the store's clock).
	CreatedAt time.Time
	// Until bounds it, for kinds that say so; zero: unbounded.
	Until time.Time
}

// AuditEntry is one operator call that changed something.
type AuditEntry struct {
	ID     int64
	At     time.Time
	Actor  string // "key:<id>" or "mesh:<identity>"
	Action string // the method ("ClosePool")
	Target string // what it acted on ("pool overflow")
	Reason string
	// Request is the call's request as JSON, never a secret.
	Request string
}

// AuditQuery selects a page of the audit log.
type AuditQuery struct {
	Since time.Time // at or after; zero: all
	After string    // cursor from the previous page
	Limit int       // 0: 100; at most 1000
}

// TenantUsage is what a tenant spent.
type TenantUsage struct {
	Tenant string
	Prompt int64 // KindPrompt entries
	Output int64 // every other entry, orphans included
	Orphan int64 // entries of kind KindOrphan: tokens decoded after a cancel
	Runs   int64
	Sheds  int64
}

// KindOrphan is the Kind of ledger entries that count tokens decoded after their run's
// cancel.
const KindOrphan = "orphan"

// TokenQuery selects ledger entries for SumTokens.
type TokenQuery struct {
	Tenant string    // "" for every tenant
	RunID  string    // "" for every run (of Tenant)
	Kind   string    // "" for every kind but KindPrompt
	Since  time.Time // entries recorded after this instant; zero: all
}
