package store

import (
	"context"
	"time"
)

// Store is curfew's durable state: runs and their leases, checkpoints, tool idempotency
// records with their side effects, dead letters, the token ledger, tenants' API keys,
// cluster-wide admission slots and token budget reservations. It is the union of
// the narrower interfaces below; a component should depend on the narrowest one it uses.
// Implementations are safe for concurrent use by many goroutines and by many processes
// sharing one database.
type Store interface {
	Runs
	Checkpoints
	Tools
	Outbox
	DeadLetters
	Ledger
	APIKeys
	Operators
	Approvals
	Replicas
	Slots
	Budgets
	Sharing
	// Close releases the connections. Calls after Close fail.
	Close() error
}

// Sharing says who else sees a store's data. Ask it where behaviour differs between a
// store that other processes share and one private to this process, rather than
// branching on whether a store exists.
type Sharing interface {
	// Shared reports whether other processes can open the same data: true for a
	// SQLite file and PostgreSQL (another orchestrator can take a run over, the CLI
	// reads what a service wrote), false for memory (the data lives and dies with
	// this process).
	Shared() bool
}

// Runs holds run records and the leases that say which orchestrator advances a run.
//
// A lease is (owner, epoch, expiry). Every claim increments the run's epoch; every write
// made on behalf of a run (checkpoint, heartbeat, finish, release) carries the writer's
// Lease and is rejected with ErrStaleEpoch once the epoch has moved on. Expiry only
// decides when a run may be claimed by someone else (liveness); the epoch alone decides
// whether a write is accepted (safety), so clock skew between hosts can delay a takeover
// but never lets two owners advance one run.
type Runs interface {
	// CreateRun inserts a run in StatusPending, or, with NewRun.Owner set, already
	// claimed by that owner at epoch 1 in StatusRunning. With a non-empty
	// IdempotencyKey that already names a run of the tenant it inserts nothing and
	// returns that run with created=false, atomically: concurrent calls with one key
	// create one run. The caller should compare the returned run's Task, Model and Input
	// with its own to detect a key reused for a different request.
	CreateRun(ctx context.Context, r NewRun) (run Run, created bool, err error)
	// GetRun returns the tenant's run, or ErrNotFound (also for another tenant's run).
	GetRun(ctx context.Context, tenant, runID string) (Run, error)
	// ListRuns pages through the runs q selects (a tenant's, or with q.AllTenants every
	// tenant's), newest first by run ID (UUIDv7, minted at creation). next is the
	// cursor of the following page, "" after the last one. Passing it back with the
	// same filters continues without duplicates or gaps, also while runs are created,
	// end or are deleted meanwhile (a run's ID never changes; those created since sort
	// before the cursor). ErrInvalidArgument for a query that names no tenant without
	// AllTenants (or one with both), an unknown status, a negative limit, or a window
	// whose CreatedAfter is after its CreatedBefore.
	ListRuns(ctx context.Context, q RunQuery) (runs []Run, next string, err error)
	// FinishRun ends the run with a terminal status, fenced by the lease: ErrStaleEpoch
	// if the lease is no longer current, ErrRunFinished if the run had already ended
	// with another result. Repeating the same finish under the same lease returns the
	// stored run (a commit whose answer was lost can be retried).
	FinishRun(ctx context.Context, l Lease, res RunResult) (Run, error)

	// ClaimRun takes the lease of a run that is unowned, whose lease has expired, or
	// that this owner already holds, incrementing its epoch; a pending run becomes
	// running. It fails with ErrLeaseHeld (a *LeaseHeldError) while another owner's lease
	// is live, ErrRunFinished for an ended run, ErrNotFound.
	ClaimRun(ctx context.Context, tenant, runID, owner string, ttl time.Duration) (Run, error)
	// ClaimExpiredRuns claims, across all tenants, up to limit unfinished runs that are
	// unowned or whose lease expired, oldest first, for takeover after an owner died.
	// Runs claimed concurrently by someone else are skipped, not reported.
	ClaimExpiredRuns(ctx context.Context, owner string, ttl time.Duration, limit int) ([]Run, error)
	// HeartbeatRun extends a live lease to now+ttl and returns it. ErrStaleEpoch if the
	// run was claimed by someone else meanwhile, ErrRunFinished if it ended. A lease
	// that expired but was not claimed by anyone is still current and is extended.
	HeartbeatRun(ctx context.Context, l Lease, ttl time.Duration) (Lease, error)
	// ReleaseRun gives the lease up so that another owner can claim the run at once
	// (graceful shutdown). The epoch is kept. ErrStaleEpoch if it was no longer ours.
	ReleaseRun(ctx context.Context, l Lease) error
	// RunOwners returns the owners of the runs in flight whose lease has not expired,
	// each once, sorted: the orchestrators alive now, as far as their runs say.
	RunOwners(ctx context.Context) ([]string, error)
	// DeleteRun deletes the tenant's ended run with its checkpoints, in one transaction;
	// afterwards GetRun and ListRuns no longer see it and its idempotency key names no
	// run. A store private to one process uses it to stay bounded. ErrConflict if the run
	// has not ended (a live run is never deleted), ErrNotFound if there is no such run
	// (also another tenant's).
	DeleteRun(ctx context.Context, tenant, runID string) error
}

// Checkpoints holds one row per completed agent step of a run.
type Checkpoints interface {
	// PutCheckpoint stores a completed step, fenced by the lease in the same
	// transaction: ErrStaleEpoch if the run's epoch or owner moved on, ErrRunFinished if
	// it ended. The row keeps the epoch it was written under. A step is written once:
	// writing an existing step again with identical content under the same epoch
	// succeeds (retry of a lost commit); anything else is ErrConflict.
	PutCheckpoint(ctx context.Context, l Lease, c Checkpoint) error
	// ListCheckpoints returns the run's checkpoints by ascending step, for resume.
	ListCheckpoints(ctx context.Context, tenant, runID string) ([]Checkpoint, error)
}

// Tools holds idempotency records of tool calls and the state of the side-effect
// built-ins (kv, outbox), which are written only together with a record's completion.
type Tools interface {
	// BeginTool starts a tool call under its idempotency key, or tells the caller why
	// not. The returned Begin says which of the four outcomes it is:
	//   - BeginStarted: the caller owns the record (Claim) and must Complete, Fail or
	//     Release it; Claim.Epoch > 1 means an expired record was taken over.
	//   - BeginInProgress: another owner holds a live lease; Record.LeaseExpires says
	//     until when. Wait with [WaitTool], then Begin again.
	//   - BeginDone: Record.Result is the stored result; do not execute.
	//   - BeginFailed: Record.Error is the stored permanent failure; do not execute.
	BeginTool(ctx context.Context, b ToolBegin) (Begin, error)
	// HeartbeatTool extends the claim's lease to now+ttl. ErrStaleEpoch if the record
	// was taken over or finished.
	HeartbeatTool(ctx context.Context, c ToolClaim, ttl time.Duration) error
	// CompleteTool marks the record done with result and applies effects, all in one
	// transaction: either the record is done and every effect took place, or nothing
	// changed. Fenced by the claim: ErrStaleEpoch if the record was taken over or is no
	// longer in progress.
	CompleteTool(ctx context.Context, c ToolClaim, result []byte, effects ...Effect) error
	// FailTool marks the record failed for good (a non-retryable error): later Begins
	// return BeginFailed. Fenced like CompleteTool. For a retryable failure use
	// ReleaseTool instead.
	FailTool(ctx context.Context, c ToolClaim, errType, errMsg string) error
	// ReleaseTool abandons an in-progress record without a result (the call failed
	// before any side effect, or was cancelled), so the next Begin starts at once
	// instead of waiting for the lease to expire. Fenced like CompleteTool.
	ReleaseTool(ctx context.Context, c ToolClaim) error
	// GetTool returns the record, or ErrNotFound.
	GetTool(ctx context.Context, tenant, key string) (ToolRecord, error)

	// GetKV returns the tenant's kv entry written by a KVPut effect, or ErrNotFound.
	GetKV(ctx context.Context, tenant, key string) (KV, error)
	// ListOutbox returns the tenant's outbox entries (Notify effects) with ID > after,
	// by ascending ID, at most limit (0: 100).
	ListOutbox(ctx context.Context, tenant string, after int64, limit int) ([]OutboxEntry, error)
}

// Outbox is the relay's side of the outbox (Notify effects, written by Tools.CompleteTool):
// the relay lease, one holder at a time across replicas, and a cursor per tenant and
// channel that says how far the channel was published (docs/outbox.md).
//
// Every notify has a position on its channel (OutboxEntry.ChannelSeq, from 1), assigned in
// the writer's transaction under the channel's row lock: positions are gap-free and in
// commit order, so "published up to N" is a complete account of a channel.
//
// The lease is (owner, epoch, expiry) like a run's: every claim increments the epoch and
// AdvanceOutbox is fenced by it, so a relay that lost the lease cannot move a cursor.
type Outbox interface {
	// ClaimOutboxRelay takes the relay lease when it is free, expired, or already this
	// owner's, incrementing its epoch; *LeaseHeldError (ErrLeaseHeld) while another
	// owner's lease is live.
	ClaimOutboxRelay(ctx context.Context, owner string, ttl time.Duration) (RelayLease, error)
	// HeartbeatOutboxRelay extends the lease to now+ttl: ErrStaleEpoch if it was claimed
	// by someone else meanwhile (an expired lease nobody claimed is still current).
	HeartbeatOutboxRelay(ctx context.Context, l RelayLease, ttl time.Duration) (RelayLease, error)
	// ReleaseOutboxRelay gives the lease up (graceful stop). ErrStaleEpoch if it was no
	// longer ours.
	ReleaseOutboxRelay(ctx context.Context, l RelayLease) error
	// PendingOutbox returns, across tenants, up to limit (0: 100) rows not yet relayed,
	// by ascending ID (so by ascending position on each channel), each with its
	// channel's cursor as it was when read.
	PendingOutbox(ctx context.Context, limit int) ([]PendingOutbox, error)
	// AdvanceOutbox moves the channel's cursor from c.From to c.To, recording the stream
	// sequence and message id of the message published for position To: fenced by the
	// lease (ErrStaleEpoch) and compare-and-set on the cursor (ErrConflict when it is not
	// at From, or To is not past it).
	AdvanceOutbox(ctx context.Context, l RelayLease, c CursorAdvance) error
	// ListOutboxRows is the operator's view: rows of one tenant or all (""), with their
	// relay state, by ascending ID.
	ListOutboxRows(ctx context.Context, q OutboxQuery) ([]OutboxRow, error)
	// OutboxLag counts the rows not yet relayed, across tenants (curfew_outbox_lag).
	OutboxLag(ctx context.Context) (int64, error)
}

// DeadLetters holds steps and runs that failed for good, for operators. Tenant "" in
// ListDeadLetters, DeadLetterDepth, PurgeDeadLetters, GetDeadLetter and MarkReplayed is
// the operator's view across all tenants; any other tenant sees only its own.
type DeadLetters interface {
	// AddDeadLetter records d, idempotent on (tenant, run, step): if an open dead
	// letter exists for them it is returned unchanged with added=false. If the
	// existing one was replayed (the replay failed again), it is reopened with d's
	// error, attempts and payload, ReplayedAt cleared and ReplayCount kept, added=true.
	// ID and CreatedAt are assigned by the store.
	AddDeadLetter(ctx context.Context, d DeadLetter) (dl DeadLetter, added bool, err error)
	// GetDeadLetter returns one dead letter, or ErrNotFound.
	GetDeadLetter(ctx context.Context, tenant, id string) (DeadLetter, error)
	// ListDeadLetters pages newest first.
	ListDeadLetters(ctx context.Context, q DeadLetterQuery) (dls []DeadLetter, next string, err error)
	// MarkReplayed records that the dead letter is being replayed and returns it; call
	// it before re-running the step. A second call fails with ErrAlreadyReplayed (and
	// returns the record), so replaying twice runs the step once.
	MarkReplayed(ctx context.Context, tenant, id string) (DeadLetter, error)
	// PurgeDeadLetters deletes the dead letters q selects and returns how many.
	PurgeDeadLetters(ctx context.Context, q PurgeQuery) (int64, error)
	// DeadLetterDepth counts the dead letters not yet replayed (curfew_dlq_depth).
	DeadLetterDepth(ctx context.Context, tenant string) (int64, error)
}

// Ledger persists token spend per run and node.
type Ledger interface {
	// AddTokens appends the entries in one transaction and returns how many were added.
	// With a non-empty Key an entry is idempotent per tenant: an entry whose key is
	// already present (or earlier in es) is skipped. An invalid entry appends none of
	// them (ErrInvalidArgument).
	AddTokens(ctx context.Context, es ...LedgerEntry) (added int, err error)
	// TokenUsage sums the run's entries, in total and per node, the prompt entries
	// (KindPrompt) apart.
	TokenUsage(ctx context.Context, tenant, runID string) (Usage, error)
}

// APIKeys holds tenants' API keys: each key's public id, its tenant and a hash of its
// secret, never the secret itself (package mesh/apikey makes and checks keys).
type APIKeys interface {
	// CreateAPIKey stores k (ID, Tenant and a Hash required; CreatedAt is the store's
	// clock) and returns it. With revokeOthers, the tenant's other keys are revoked in
	// the same transaction (a rotation) and how many is returned. An ID that exists is
	// ErrAlreadyExists.
	CreateAPIKey(ctx context.Context, k APIKey, revokeOthers bool) (created APIKey, revoked int64, err error)
	// GetAPIKey returns the key with id, revoked or not, or ErrNotFound.
	GetAPIKey(ctx context.Context, id string) (APIKey, error)
	// RevokeAPIKey revokes one key and returns it (a revoked key stays revoked, at its
	// first revocation time), or ErrNotFound.
	RevokeAPIKey(ctx context.Context, id string) (APIKey, error)
	// ListAPIKeys returns the tenant's keys, or every tenant's for "", by tenant, then
	// oldest first.
	ListAPIKeys(ctx context.Context, tenant string) ([]APIKey, error)
}

// Replicas records which configuration each replica of each service runs: one row per
// (service, replica, config file), written by the replica when it starts, on each
// reload, and periodically, so that any replica can report every replica's version and
// tell the live ones (recent SeenAt) from the gone.
type Replicas interface {
	// PutReplicaConfig inserts or replaces the row of (Service, Replica, Config), which
	// are required, and sets its SeenAt to the store's clock.
	PutReplicaConfig(ctx context.Context, c ReplicaConfig) error
	// ListReplicaConfigs returns the rows of service, or of every service for "", by
	// service, config, then replica.
	ListReplicaConfigs(ctx context.Context, service string) ([]ReplicaConfig, error)
	// PruneReplicaConfigs deletes the rows last seen before before, and returns how many:
	// replicas that stopped long ago (a Kubernetes pod's name is new on each start).
	PruneReplicaConfigs(ctx context.Context, before time.Time) (int64, error)
}
