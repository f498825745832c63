package store

import (
	"context"
	"time"
)

// RunStatus is a run's lifecycle state.
type RunStatus string

// Run statuses. Pending and Running are live; the others are terminal.
const (
	StatusPending          RunStatus = "pending"   // created, never claimed
	StatusRunning          RunStatus = "running"   // claimed at least once
	StatusSucceeded        RunStatus = "succeeded" // answered
	StatusFailed           RunStatus = "failed"
	StatusCancelled        RunStatus = "cancelled"
	StatusDeadlineExceeded RunStatus = "deadline_exceeded"
)

// Known reports whether s is one of the statuses above.
func (s RunStatus) Known() bool {
	switch s {
	case StatusPending, StatusRunning, StatusSucceeded, StatusFailed, StatusCancelled, StatusDeadlineExceeded:
		return true
	}
	return false
}

// Terminal reports whether s ends a run.
func (s RunStatus) Terminal() bool {
	switch s {
	case StatusSucceeded, StatusFailed, StatusCancelled, StatusDeadlineExceeded:
		return true
	}
	return false
}

// NewRun is what CreateRun inserts.
type NewRun struct {
	Tenant string // required
	// RunID is normally left empty: the store mints a UUIDv7, so IDs sort by creation.
	// A caller-chosen ID that is taken fails with ErrAlreadyExists.
	RunID string
	// IdempotencyKey, when set, is unique per tenant (StartRun's key).
	IdempotencyKey string
	Task           []byte // the task or plan, opaque (the plan's JSON)
	Model          string // model alias the run was started with
	// Input is the rest of what the run was started with, opaque (the orchestrator's
	// encoded RunInput); empty when there is none.
	Input    []byte
	Deadline time.Time // absolute deadline, required
	// Owner, when set, creates the run already claimed (epoch 1) for LeaseTTL.
	Owner    string
	LeaseTTL time.Duration
	// StartedBy is who started it: "key:<API key id>" or "mesh:<identity>".
	StartedBy string
}

// Run is a run's record.
type Run struct {
	RunID          string
	Tenant         string
	IdempotencyKey string
	Task           []byte
	Model          string
	Input          []byte
	Deadline       time.Time
	Status         RunStatus
	Cause          string // why it ended early: deadline, client_disconnect, operator, ...
	Error          string // the error that ended it, for failed runs
	Answer         []byte
	CreatedAt      time.Time
	EndedAt        time.Time // zero while live
	Owner          string    // "" when unowned (never claimed, or released)
	Epoch          int64     // incremented by every claim; 0 before the first
	LeaseExpires   time.Time // zero when unowned
	// Summary is what the finisher stored with the result (the orchestrator's encoded
	// run summary), empty while live.
	Summary []byte
	// StartedBy is who started it (NewRun.StartedBy); "" for runs from before it was
	// recorded.
	StartedBy string
}

// Lease returns the run's current lease, to pass to fenced writes.
func (r Run) Lease() Lease {
	return Lease{Tenant: r.Tenant, RunID: r.RunID, Owner: r.Owner, Epoch: r.Epoch, Expires: r.LeaseExpires}
}

// Lease identifies the holder of a run for fenced writes.
type Lease struct {
	Tenant  string
	RunID   string
	Owner   string
	Epoch   int64
	Expires time.Time // informational; the epoch is what fences
}

// RunResult is how a run ended.
type RunResult struct {
	Status RunStatus // must be terminal
	Cause  string
	Error  string
	Answer []byte
	// Summary is opaque to the store: the finisher's full account of the run.
	Summary []byte
}

// RunQuery selects a page of runs: a tenant's, or every tenant's for an operator. The
// filters combine with AND; a zero field does not filter.
type RunQuery struct {
	// Tenant is the tenant whose runs are listed. It is required unless AllTenants is
	// set, and must then be empty: a query that names no tenant by mistake is refused
	// rather than answered with every tenant's runs.
	Tenant string
	// AllTenants lists the runs of every tenant: the operators' view. Never set it on
	// a tenant's behalf.
	AllTenants bool
	Status     RunStatus // one status; "" for any
	Model      string    // the model alias the run was started with (NewRun.Model); "" for any
	// CreatedAfter and CreatedBefore bound the run's creation time to the half-open
	// window [CreatedAfter, CreatedBefore): CreatedAfter is inclusive, CreatedBefore
	// exclusive, and a zero bound leaves its side open. Times compare at the store's
	// millisecond precision (CreatedAt as read back). CreatedAfter after CreatedBefore
	// is ErrInvalidArgument; equal bounds are an empty window.
	CreatedAfter, CreatedBefore time.Time
	After                       string // cursor from the previous page ("" for the first)
	Limit                       int    // 0: 100; at most 1000; negative: ErrInvalidArgument
}

// Checkpoint is one completed agent step.
type Checkpoint struct {
	// Step is the checkpoint's 0-based position in the run's journal. The agent loop
	// (mesh/agent.Journal) writes two per agent step: the model step's output as soon as
	// the model step completes, then the step's tool results.
	Step int
	// ModelOutput is the assistant message of the step, including its tool calls,
	// serialized by the caller (JSON); ToolResults the results of those calls.
	ModelOutput []byte
	ToolResults []byte
	Tokens      int64     // tokens the model step spent
	Epoch       int64     // set by the store: the epoch it was written under
	CreatedAt   time.Time // set by the store
}

// ToolStatus is the state of a tool idempotency record.
type ToolStatus string

// Tool record statuses.
const (
	ToolInProgress ToolStatus = "in_progress"
	ToolDone       ToolStatus = "done"
	ToolFailed     ToolStatus = "failed"
)

// ToolBegin asks to start a tool call.
type ToolBegin struct {
	Tenant string // required
	// Key is the idempotency key, unique per tenant (the caller's own, or derived from
	// run, node, step, tool and a hash of the canonical arguments).
	Key   string
	Owner string        // the executing process (unique per process incarnation)
	TTL   time.Duration // lease; renew long calls with HeartbeatTool
	RunID string        // informational
	Tool  string        // informational: the tool's name
}

// BeginOutcome says what BeginTool found.
type BeginOutcome int

// BeginTool outcomes; see Tools.BeginTool.
const (
	BeginStarted BeginOutcome = iota + 1
	BeginInProgress
	BeginDone
	BeginFailed
)

func (o BeginOutcome) String() string {
	switch o {
	case BeginStarted:
		return "started"
	case BeginInProgress:
		return "in_progress"
	case BeginDone:
		return "done"
	case BeginFailed:
		return "failed"
	}
	return "unknown"
}

// Begin is BeginTool's answer.
type Begin struct {
	Outcome BeginOutcome
	Record  ToolRecord
	Claim   ToolClaim // valid for BeginStarted only
}

// ToolClaim identifies the owner of an in-progress record for fenced writes.
type ToolClaim struct {
	Tenant string
	Key    string
	Owner  string
	Epoch  int64
}

// ToolRecord is a tool idempotency record.
type ToolRecord struct {
	Tenant       string
	Key          string
	RunID        string
	Tool         string
	Status       ToolStatus
	Owner        string    // the owner of the last claim
	Epoch        int64     // 1 for the first execution, +1 per takeover
	LeaseExpires time.Time // meaningful while in progress
	Result       []byte    // done
	ErrorType    string    // failed
	Error        string    // failed
	CreatedAt    time.Time
	UpdatedAt    time.Time
}

// Effect is a side effect applied in CompleteTool's transaction: KVPut or Notify.
type Effect interface{ effect() }

// KVPut writes Value under Key in the tenant's kv table (the kv_put built-in).
type KVPut struct {
	Key   string
	Value []byte
}

// Notify appends to the tenant's outbox (the notify built-in).
type Notify struct {
	Channel string
	Payload []byte
}

func (KVPut) effect()  {}
func (Notify) effect() {}

// KV is a kv entry.
type KV struct {
	Tenant string
	Key    string
	Value  []byte
	// Version counts the writes that took effect (1 after the first put), so tests and
	// operators can check that a retried put took effect once.
	Version int64
	// IdempotencyKey is the key of the tool call that wrote it last.
	IdempotencyKey string
	UpdatedAt      time.Time
}

// OutboxEntry is a notify appended to the outbox.
type OutboxEntry struct {
	ID             int64 // increasing per database
	Tenant         string
	IdempotencyKey string // the tool call that appended it (unique with Seq)
	Seq            int    // index among the call's Notify effects
	Channel        string
	// ChannelSeq is the entry's position on its tenant's channel: 1, 2, ... without gaps,
	// in commit order (0 only for a row an older binary wrote during an upgrade).
	ChannelSeq int64
	Payload    []byte
	CreatedAt  time.Time
}

// OutboxCursor is how far a channel was relayed: the position of its last published
// entry, and the JetStream stream sequence and message id of that message (0 and ""
// before the first).
type OutboxCursor struct {
	RelayedSeq int64
	StreamSeq  uint64
	MsgID      string
	RelayedAt  time.Time
}

// PendingOutbox is an entry not yet relayed, with its channel's cursor.
type PendingOutbox struct {
	OutboxEntry
	Cursor OutboxCursor
}

// CursorAdvance moves a channel's cursor past one published entry.
type CursorAdvance struct {
	Tenant, Channel string
	From            int64 // the cursor's current RelayedSeq
	To              int64 // the published entry's ChannelSeq
	StreamSeq       uint64
	MsgID           string
}

// RelayLease identifies the holder of the outbox relay lease for fenced writes.
type RelayLease struct {
	Owner   string
	Epoch   int64
	Expires time.Time // informational; the epoch is what fences
}

// OutboxQuery selects outbox rows for operators.
type OutboxQuery struct {
	Tenant      string // "" for all tenants
	Channel     string // optional
	OnlyPending bool   // only rows not yet relayed
	After       int64  // rows with ID > After
	Limit       int    // 0: 100; at most 1000
}

// OutboxRow is an outbox entry with its relay state.
type OutboxRow struct {
	OutboxEntry
	Relayed bool // published to JetStream (its channel's cursor is at or past it)
}

// DeadLetter is a step or run that failed for good, with the context to reproduce it.
type DeadLetter struct {
	ID             string // UUIDv7, set by the store
	Tenant         string
	RunID          string
	Step           string // the step: its index, or a node path for a tool or subagent
	ErrorType      string // a class: "deadline_exceeded", "tool_error", a gRPC code, ...
	Attempts       int
	LastError      string
	Payload        []byte // the step's input, to reproduce it
	IdempotencyKey string
	CreatedAt      time.Time // set by the store (the timestamp)
	ReplayedAt     time.Time // zero until replayed
	ReplayCount    int
}

// DeadLetterQuery selects a page of dead letters.
type DeadLetterQuery struct {
	Tenant          string // "" for all tenants (operators)
	RunID           string // optional
	IncludeReplayed bool
	After           string // cursor
	Limit           int    // 0: 100; at most 1000
}

// PurgeQuery selects dead letters to delete. At least one of ID, Before or
// OnlyReplayed must be set, so that a zero query cannot delete everything.
type PurgeQuery struct {
	Tenant       string // "" for all tenants
	ID           string
	Before       time.Time // created before
	OnlyReplayed bool
}

// LedgerEntry is one token spend.
type LedgerEntry struct {
	Tenant string
	RunID  string
	NodeID string
	Tokens int64
	Kind   string // optional: "output", "orphan", KindPrompt, ...
	// RetryID and Provider attribute the tokens further: the logical call (its
	// curfew-retry-id) and the provider that decoded them ("sim" for the built-in model).
	RetryID  string
	Provider string
	Key      string    // optional idempotency key of the append
	At       time.Time // zero: the store's clock
}

// KindPrompt is the Kind of ledger entries that count prompt (input) tokens. Usage sums
// them apart: Total, ByNode and ByProvider count the other (output) entries.
const KindPrompt = "prompt"

// Usage is a run's token spend.
type Usage struct {
	Total      int64
	ByNode     map[string]int64
	ByProvider map[string]int64 // "" for entries that named none
	// Prompt and PromptByNode sum the entries of kind KindPrompt.
	Prompt       int64
	PromptByNode map[string]int64
}

// WaitTool polls the record under key until it is no longer in progress with a live
// lease, and returns it: done, failed, or in progress with an expired lease (the caller
// should BeginTool to take it over). It polls with exponential backoff from 5 ms to
// maxPoll (0: 250 ms) and never sleeps past the lease's expiry by more than one poll;
// it returns ctx's error when ctx ends first. now is the clock the store was opened
// with (nil: time.Now). Polling keeps the backends alike; the worst-case extra wait
// after completion is one poll interval.
func WaitTool(ctx context.Context, s Tools, tenant, key string, maxPoll time.Duration, now func() time.Time) (ToolRecord, error) {
	if maxPoll <= 0 {
		maxPoll = 250 * time.Millisecond
	}
	if now == nil {
		now = time.Now
	}
	poll := 5 * time.Millisecond
	for {
		rec, err := s.GetTool(ctx, tenant, key)
		if err != nil {
			return ToolRecord{}, err
		}
		if rec.Status != ToolInProgress || !now().Before(rec.LeaseExpires) {
			return rec, nil
		}
		t := time.NewTimer(poll)
		select {
		case <-ctx.Done():
			t.Stop()
			return ToolRecord{}, ctx.Err()
		case <-t.C:
		}
		poll = min(2*poll, maxPoll)
	}
}

// APIKey is a tenant's API key as the store keeps it.
type APIKey struct {
	ID        string // the key's public part, which a presented key names
	Tenant    string
	Hash      []byte // of the key's secret
	CreatedAt time.Time
	RevokedAt time.Time // zero while the key is valid
	// Scopes are the key's operator scopes (ScopeAdmin, ScopeReadOnly); none for a key
	// that only runs its tenant's work.
	Scopes []string
}

// Operator scopes of an API key.
const (
	ScopeAdmin    = "admin"     // every operator call
	ScopeReadOnly = "read-only" // the operator calls that change nothing
)

// Revoked reports whether the key has been revoked.
func (k APIKey) Revoked() bool { return !k.RevokedAt.IsZero() }

// ReplicaConfig is the configuration one replica of a service runs from one file.
type ReplicaConfig struct {
	// Service is the service's name ("orchestrator"); Replica names the replica (its
	// host and listen address); Config names the file ("admission", "retry", ...).
	Service, Replica, Config string
	// Version is the running configuration's version (a short hash of the file).
	Version string
	// LoadedAt is when the running configuration was loaded.
	LoadedAt time.Time
	// LastError is why the last reload failed ("" when it did not), at LastErrorAt.
	LastError   string
	LastErrorAt time.Time
	// SeenAt is when the replica last wrote the row (the store's clock).
	SeenAt time.Time
}
