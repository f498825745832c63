package sqlcore

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/curfew-mesh/curfew/mesh/store"
)

// Store implements store.Store over a Driver.
type Store struct {
	d   Driver
	dl  Dialect
	now func() time.Time
}

var _ store.Store = (*Store)(nil)

// New returns a Store over d. The caller has already run Migrate.
func New(d Driver, dl Dialect, o store.Options) *Store {
	return &Store{d: d, dl: dl, now: o.Clock}
}

// Shared implements store.Sharing: a SQL database is one other processes can open.
// The memory backend, private to its process, overrides it.
func (s *Store) Shared() bool { return true }

// Close closes the driver.
func (s *Store) Close() error { return s.d.Close() }

// nowMs is the store clock in Unix milliseconds, never 0 (0 means unset).
func (s *Store) nowMs() int64 { return max(s.now().UnixMilli(), 1) }

func ms(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixMilli()
}

func tm(v int64) time.Time {
	if v == 0 {
		return time.Time{}
	}
	return time.UnixMilli(v).UTC()
}

func ttlMs(d time.Duration) int64 { return max(d.Milliseconds(), 1) }

// blob turns nil into an empty slice: the columns are NOT NULL.
func blob(b []byte) []byte {
	if b == nil {
		return []byte{}
	}
	return b
}

// nullable turns "" into NULL, for columns whose uniqueness ignores NULLs.
func nullable(s string) any {
	if s == "" {
		return nil
	}
	return s
}

func invalid(format string, args ...any) error {
	return fmt.Errorf("%w: %s", store.ErrInvalidArgument, fmt.Sprintf(format, args...))
}

func newID() string { return uuid.Must(uuid.NewV7()).String() }

func pageLimit(n int) int {
	switch {
	case n <= 0:
		return 100
	case n > 1000:
		return 1000
	}
	return n
}

const runCols = `run_id, tenant, COALESCE(idempotency_key, ''), task, model, deadline_ms, status,
	cause, error, answer, created_ms, ended_ms, owner, epoch, lease_expires_ms, summary, input, started_by`

func scanRun(r Row) (store.Run, error) {
	var (
		run                                    store.Run
		status                                 string
		deadline, created, ended, leaseExpires int64
	)
	err := r.Scan(&run.RunID, &run.Tenant, &run.IdempotencyKey, &run.Task, &run.Model, &deadline, &status,
		&run.Cause, &run.Error, &run.Answer, &created, &ended, &run.Owner, &run.Epoch, &leaseExpires, &run.Summary, &run.Input, &run.StartedBy)
	if err != nil {
		return store.Run{}, err
	}
	run.Status = store.RunStatus(status)
	run.Deadline, run.CreatedAt, run.EndedAt, run.LeaseExpires = tm(deadline), tm(created), tm(ended), tm(leaseExpires)
	return run, nil
}

// notFound maps ErrNoRows to store.ErrNotFound with what was looked for.
func notFound(err error, format string, args ...any) error {
	if errors.Is(err, ErrNoRows) {
		return fmt.Errorf("%w: %s", store.ErrNotFound, fmt.Sprintf(format, args...))
	}
	return err
}

// CreateRun implements store.Runs.
func (s *Store) CreateRun(ctx context.Context, r store.NewRun) (store.Run, bool, error) {
	if r.Tenant == "" {
		return store.Run{}, false, invalid("run without tenant")
	}
	if r.Deadline.IsZero() {
		return store.Run{}, false, invalid("run without deadline")
	}
	if r.Owner != "" && r.LeaseTTL <= 0 {
		return store.Run{}, false, invalid("run created with owner %q but no lease TTL", r.Owner)
	}
	id := r.RunID
	if id == "" {
		id = newID()
	}
	now := s.nowMs()
	status, epoch, expires := store.StatusPending, int64(0), int64(0)
	if r.Owner != "" {
		status, epoch, expires = store.StatusRunning, 1, now+ttlMs(r.LeaseTTL)
	}
	var (
		run     store.Run
		created bool
	)
	err := s.d.Tx(ctx, func(q Querier) error {
		var err error
		run, err = scanRun(q.QueryRow(ctx, `INSERT INTO runs (run_id, tenant, idempotency_key, task, model,
			deadline_ms, status, created_ms, owner, epoch, lease_expires_ms, input, started_by)
			VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)
			ON CONFLICT DO NOTHING RETURNING `+runCols,
			id, r.Tenant, nullable(r.IdempotencyKey), blob(r.Task), r.Model, ms(r.Deadline), string(status),
			now, r.Owner, epoch, expires, blob(r.Input), r.StartedBy))
		if err == nil {
			created = true
			return nil
		}
		if !errors.Is(err, ErrNoRows) {
			return err
		}
		if r.IdempotencyKey != "" {
			run, err = scanRun(q.QueryRow(ctx, `SELECT `+runCols+` FROM runs WHERE tenant = $1 AND idempotency_key = $2`,
				r.Tenant, r.IdempotencyKey))
			if err == nil {
				return nil
			}
			if !errors.Is(err, ErrNoRows) {
				return err
			}
		}
		return fmt.Errorf("%w: run %s", store.ErrAlreadyExists, id)
	})
	if err != nil {
		return store.Run{}, false, err
	}
	return run, created, nil
}

// GetRun implements store.Runs.
func (s *Store) GetRun(ctx context.Context, tenant, runID string) (store.Run, error) {
	run, err := scanRun(s.d.Read().QueryRow(ctx, `SELECT `+runCols+` FROM runs WHERE tenant = $1 AND run_id = $2`,
		tenant, runID))
	if err != nil {
		return store.Run{}, notFound(err, "run %s", runID)
	}
	return run, nil
}

// RunOwners implements store.Runs, on the index of unfinished runs by lease expiry.
func (s *Store) RunOwners(ctx context.Context) ([]string, error) {
	rows, err := s.d.Read().Query(ctx, `SELECT DISTINCT owner FROM runs
		WHERE ended_ms = 0 AND lease_expires_ms > $1 AND owner <> '' ORDER BY owner`, s.nowMs())
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var o string
		if err := rows.Scan(&o); err != nil {
			return nil, err
		}
		out = append(out, o)
	}
	return out, rows.Err()
}

// ListRuns implements store.Runs. The statement holds only the predicates of the
// filters q sets, so that each combination is planned on its own and can use its index
// (migration 0012): a predicate that disables itself when its parameter is empty
// (model = $1 OR $1 is empty) would keep PostgreSQL's generic plan, and SQLite's
// planner, from using any.
func (s *Store) ListRuns(ctx context.Context, q store.RunQuery) ([]store.Run, string, error) {
	where, args, err := runFilter(q)
	if err != nil {
		return nil, "", err
	}
	limit := pageLimit(q.Limit)
	args = append(args, limit+1)
	rows, err := s.d.Read().Query(ctx, `SELECT `+runCols+` FROM runs`+where+
		fmt.Sprintf(` ORDER BY run_id DESC LIMIT $%d`, len(args)), args...)
	if err != nil {
		return nil, "", err
	}
	defer rows.Close()
	var runs []store.Run
	for rows.Next() {
		run, err := scanRun(rows)
		if err != nil {
			return nil, "", err
		}
		runs = append(runs, run)
	}
	if err := rows.Err(); err != nil {
		return nil, "", err
	}
	next := ""
	if len(runs) > limit {
		runs = runs[:limit]
		next = runs[limit-1].RunID
	}
	return runs, next, nil
}

// runFilter validates q and returns its WHERE clause ("" for none) and arguments.
func runFilter(q store.RunQuery) (string, []any, error) {
	switch {
	case q.Tenant == "" && !q.AllTenants:
		return "", nil, invalid("list runs without tenant (set AllTenants for every tenant's)")
	case q.Tenant != "" && q.AllTenants:
		return "", nil, invalid("list runs of tenant %q and of all tenants", q.Tenant)
	case q.Status != "" && !q.Status.Known():
		return "", nil, invalid("list runs with unknown status %q", q.Status)
	case q.Limit < 0:
		return "", nil, invalid("list runs with limit %d", q.Limit)
	case !q.CreatedAfter.IsZero() && !q.CreatedBefore.IsZero() && q.CreatedAfter.After(q.CreatedBefore):
		return "", nil, invalid("list runs created after %s and before %s: an inverted window",
			q.CreatedAfter.Format(time.RFC3339Nano), q.CreatedBefore.Format(time.RFC3339Nano))
	}
	var (
		conds []string
		args  []any
	)
	add := func(cond string, arg any) {
		args = append(args, arg)
		conds = append(conds, fmt.Sprintf(cond, len(args)))
	}
	if q.Tenant != "" {
		add("tenant = $%d", q.Tenant)
	}
	if q.Status != "" {
		add("status = $%d", string(q.Status))
	}
	if q.Model != "" {
		add("model = $%d", q.Model)
	}
	// Both bounds round up to the millisecond: created_ms >= ceil(after) is created at or
	// after it, created_ms < ceil(before) is created before it.
	if !q.CreatedAfter.IsZero() {
		add("created_ms >= $%d", ceilMs(q.CreatedAfter))
	}
	if !q.CreatedBefore.IsZero() {
		add("created_ms < $%d", ceilMs(q.CreatedBefore))
	}
	if q.After != "" {
		add("run_id < $%d", q.After)
	}
	if len(conds) == 0 {
		return "", nil, nil
	}
	return " WHERE " + strings.Join(conds, " AND "), args, nil
}

// ceilMs is t in Unix milliseconds, rounded up.
func ceilMs(t time.Time) int64 {
	m := t.UnixMilli()
	if t.Sub(time.UnixMilli(m)) > 0 {
		m++
	}
	return m
}

// runFenceErr explains why a write fenced by l matched no row.
func (s *Store) runFenceErr(ctx context.Context, q Querier, l store.Lease) error {
	var (
		owner        string
		epoch, ended int64
	)
	err := q.QueryRow(ctx, `SELECT owner, epoch, ended_ms FROM runs WHERE tenant = $1 AND run_id = $2`,
		l.Tenant, l.RunID).Scan(&owner, &epoch, &ended)
	if err != nil {
		return notFound(err, "run %s", l.RunID)
	}
	if owner != l.Owner || epoch != l.Epoch {
		return fmt.Errorf("%w: run %s is at epoch %d (owner %q); the lease has epoch %d (owner %q)",
			store.ErrStaleEpoch, l.RunID, epoch, owner, l.Epoch, l.Owner)
	}
	if ended != 0 {
		return fmt.Errorf("%w: run %s", store.ErrRunFinished, l.RunID)
	}
	return fmt.Errorf("%w: run %s: fenced write matched no row", store.ErrConflict, l.RunID)
}

// FinishRun implements store.Runs.
func (s *Store) FinishRun(ctx context.Context, l store.Lease, res store.RunResult) (store.Run, error) {
	if !res.Status.Terminal() {
		return store.Run{}, invalid("finish run %s with non-terminal status %q", l.RunID, res.Status)
	}
	var run store.Run
	err := s.d.Tx(ctx, func(q Querier) error {
		var err error
		run, err = scanRun(q.QueryRow(ctx, `UPDATE runs SET status = $1, cause = $2, error = $3, answer = $4,
			ended_ms = $5, lease_expires_ms = 0, summary = $10
			WHERE tenant = $6 AND run_id = $7 AND owner = $8 AND epoch = $9 AND ended_ms = 0
			RETURNING `+runCols,
			string(res.Status), res.Cause, res.Error, blob(res.Answer), s.nowMs(), l.Tenant, l.RunID, l.Owner, l.Epoch, blob(res.Summary)))
		if !errors.Is(err, ErrNoRows) {
			return err
		}
		ferr := s.runFenceErr(ctx, q, l)
		if !errors.Is(ferr, store.ErrRunFinished) {
			return ferr
		}
		// Ended under this very lease: a retried finish with the same result succeeds.
		run, err = scanRun(q.QueryRow(ctx, `SELECT `+runCols+` FROM runs WHERE tenant = $1 AND run_id = $2`,
			l.Tenant, l.RunID))
		if err != nil {
			return err
		}
		if run.Status != res.Status {
			return fmt.Errorf("%w: already ended %s", ferr, run.Status)
		}
		return nil
	})
	if err != nil {
		return store.Run{}, err
	}
	return run, nil
}

// ClaimRun implements store.Runs.
func (s *Store) ClaimRun(ctx context.Context, tenant, runID, owner string, ttl time.Duration) (store.Run, error) {
	if owner == "" || ttl <= 0 {
		return store.Run{}, invalid("claim run %s needs an owner and a positive TTL", runID)
	}
	var run store.Run
	err := s.d.Tx(ctx, func(q Querier) error {
		var err error
		run, err = s.claim(ctx, q, tenant, runID, owner, ttl)
		return err
	})
	return run, err
}

func (s *Store) claim(ctx context.Context, q Querier, tenant, runID, owner string, ttl time.Duration) (store.Run, error) {
	now := s.nowMs()
	run, err := scanRun(q.QueryRow(ctx, `UPDATE runs SET owner = $1, epoch = epoch + 1, lease_expires_ms = $2,
		status = $3
		WHERE tenant = $4 AND run_id = $5 AND ended_ms = 0
		  AND (owner = '' OR owner = $1 OR lease_expires_ms <= $6)
		RETURNING `+runCols,
		owner, now+ttlMs(ttl), string(store.StatusRunning), tenant, runID, now))
	if !errors.Is(err, ErrNoRows) {
		return run, err
	}
	var (
		holder              string
		epoch, ended, until int64
	)
	err = q.QueryRow(ctx, `SELECT owner, epoch, ended_ms, lease_expires_ms FROM runs WHERE tenant = $1 AND run_id = $2`,
		tenant, runID).Scan(&holder, &epoch, &ended, &until)
	if err != nil {
		return store.Run{}, notFound(err, "run %s", runID)
	}
	if ended != 0 {
		return store.Run{}, fmt.Errorf("%w: run %s", store.ErrRunFinished, runID)
	}
	return store.Run{}, &store.LeaseHeldError{RunID: runID, Owner: holder, Epoch: epoch, Expires: tm(until)}
}

// ClaimExpiredRuns implements store.Runs.
func (s *Store) ClaimExpiredRuns(ctx context.Context, owner string, ttl time.Duration, limit int) ([]store.Run, error) {
	if owner == "" || ttl <= 0 {
		return nil, invalid("claim expired runs needs an owner and a positive TTL")
	}
	rows, err := s.d.Read().Query(ctx, `SELECT tenant, run_id FROM runs
		WHERE ended_ms = 0 AND (owner = '' OR lease_expires_ms <= $1)
		ORDER BY lease_expires_ms, run_id LIMIT $2`, s.nowMs(), pageLimit(limit))
	if err != nil {
		return nil, err
	}
	type ref struct{ tenant, id string }
	var refs []ref
	for rows.Next() {
		var r ref
		if err := rows.Scan(&r.tenant, &r.id); err != nil {
			rows.Close()
			return nil, err
		}
		refs = append(refs, r)
	}
	err = rows.Err()
	rows.Close()
	if err != nil {
		return nil, err
	}
	var claimed []store.Run
	for _, r := range refs {
		run, err := s.ClaimRun(ctx, r.tenant, r.id, owner, ttl)
		switch {
		case err == nil:
			claimed = append(claimed, run)
		case errors.Is(err, store.ErrLeaseHeld), errors.Is(err, store.ErrRunFinished), errors.Is(err, store.ErrNotFound):
			// Taken, finished or deleted since the scan: not ours.
		default:
			return claimed, err
		}
	}
	return claimed, nil
}

// HeartbeatRun implements store.Runs.
func (s *Store) HeartbeatRun(ctx context.Context, l store.Lease, ttl time.Duration) (store.Lease, error) {
	if ttl <= 0 {
		return l, invalid("heartbeat run %s with TTL %v", l.RunID, ttl)
	}
	err := s.d.Tx(ctx, func(q Querier) error {
		var until int64
		err := q.QueryRow(ctx, `UPDATE runs SET lease_expires_ms = $1
			WHERE tenant = $2 AND run_id = $3 AND owner = $4 AND epoch = $5 AND ended_ms = 0
			RETURNING lease_expires_ms`,
			s.nowMs()+ttlMs(ttl), l.Tenant, l.RunID, l.Owner, l.Epoch).Scan(&until)
		if errors.Is(err, ErrNoRows) {
			return s.runFenceErr(ctx, q, l)
		}
		l.Expires = tm(until)
		return err
	})
	return l, err
}

// ReleaseRun implements store.Runs.
func (s *Store) ReleaseRun(ctx context.Context, l store.Lease) error {
	return s.d.Tx(ctx, func(q Querier) error {
		n, err := q.Exec(ctx, `UPDATE runs SET owner = '', lease_expires_ms = 0
			WHERE tenant = $1 AND run_id = $2 AND owner = $3 AND epoch = $4 AND ended_ms = 0`,
			l.Tenant, l.RunID, l.Owner, l.Epoch)
		if err != nil || n == 1 {
			return err
		}
		ferr := s.runFenceErr(ctx, q, l)
		if errors.Is(ferr, store.ErrRunFinished) {
			return nil // finished under this lease: nothing left to release
		}
		return ferr
	})
}

// DeleteRun implements store.Runs. The checkpoints are deleted explicitly rather than
// by the foreign key's cascade, so that the query does not depend on it being enforced.
func (s *Store) DeleteRun(ctx context.Context, tenant, runID string) error {
	return s.d.Tx(ctx, func(q Querier) error {
		n, err := q.Exec(ctx, `DELETE FROM runs WHERE tenant = $1 AND run_id = $2 AND ended_ms <> 0`, tenant, runID)
		if err != nil {
			return err
		}
		if n == 0 {
			var ended int64
			err := q.QueryRow(ctx, `SELECT ended_ms FROM runs WHERE tenant = $1 AND run_id = $2`, tenant, runID).Scan(&ended)
			if err != nil {
				return notFound(err, "run %s", runID)
			}
			return fmt.Errorf("%w: run %s has not ended", store.ErrConflict, runID)
		}
		_, err = q.Exec(ctx, `DELETE FROM checkpoints WHERE run_id = $1`, runID)
		return err
	})
}
