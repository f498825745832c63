package sqlcore

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/curfew-mesh/curfew/mesh/store"
)

// PutCheckpoint implements store.Checkpoints.
func (s *Store) PutCheckpoint(ctx context.Context, l store.Lease, c store.Checkpoint) error {
	if c.Step < 0 {
		return invalid("checkpoint of run %s with step %d", l.RunID, c.Step)
	}
	// Fast path, one statement and one round trip: insert only if the lease is
	// current, locking the run row (FOR UPDATE re-checks the WHERE after a concurrent
	// claim commits, so a claim either waits for this insert or fences it off).
	n, err := s.d.Exec(ctx, `WITH r AS (SELECT 1 FROM runs
			WHERE tenant = $1 AND run_id = $2 AND owner = $3 AND epoch = $4 AND ended_ms = 0`+s.dl.ForUpdate+`)
		INSERT INTO checkpoints (run_id, step, tenant, epoch, model_output, tool_results, tokens, created_ms)
		SELECT $2, CAST($5 AS INTEGER), $1, $4, CAST($6 AS `+s.dl.Blob+`), CAST($7 AS `+s.dl.Blob+`),
			CAST($8 AS BIGINT), CAST($9 AS BIGINT) FROM r WHERE true
		ON CONFLICT (run_id, step) DO NOTHING`,
		l.Tenant, l.RunID, l.Owner, l.Epoch, c.Step, blob(c.ModelOutput), blob(c.ToolResults), c.Tokens, s.nowMs())
	if err != nil || n == 1 {
		return err
	}
	// Nothing inserted: the lease is stale or the step exists. Find out which, under
	// the lock, in a transaction.
	return s.d.Tx(ctx, func(q Querier) error {
		// Lock the run row for the transaction: a concurrent claim (which bumps the
		// epoch) waits for this commit, or this read sees its new epoch.
		var (
			owner        string
			epoch, ended int64
		)
		err := q.QueryRow(ctx, `SELECT owner, epoch, ended_ms FROM runs WHERE tenant = $1 AND run_id = $2`+s.dl.ForUpdate,
			l.Tenant, l.RunID).Scan(&owner, &epoch, &ended)
		if err != nil {
			return notFound(err, "run %s", l.RunID)
		}
		if owner != l.Owner || epoch != l.Epoch {
			return fmt.Errorf("%w: checkpoint %d of run %s: run is at epoch %d (owner %q), writer has %d (owner %q)",
				store.ErrStaleEpoch, c.Step, l.RunID, epoch, owner, l.Epoch, l.Owner)
		}
		if ended != 0 {
			return fmt.Errorf("%w: checkpoint %d of run %s", store.ErrRunFinished, c.Step, l.RunID)
		}
		n, err := q.Exec(ctx, `INSERT INTO checkpoints (run_id, step, tenant, epoch, model_output, tool_results, tokens, created_ms)
			VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT (run_id, step) DO NOTHING`,
			l.RunID, c.Step, l.Tenant, l.Epoch, blob(c.ModelOutput), blob(c.ToolResults), c.Tokens, s.nowMs())
		if err != nil || n == 1 {
			return err
		}
		var (
			old     store.Checkpoint
			oldEpch int64
		)
		if err := q.QueryRow(ctx, `SELECT epoch, model_output, tool_results, tokens FROM checkpoints WHERE run_id = $1 AND step = $2`,
			l.RunID, c.Step).Scan(&oldEpch, &old.ModelOutput, &old.ToolResults, &old.Tokens); err != nil {
			return err
		}
		if oldEpch == l.Epoch && bytes.Equal(old.ModelOutput, c.ModelOutput) &&
			bytes.Equal(old.ToolResults, c.ToolResults) && old.Tokens == c.Tokens {
			return nil // the same write again: a retried commit
		}
		return fmt.Errorf("%w: checkpoint %d of run %s was already written under epoch %d",
			store.ErrConflict, c.Step, l.RunID, oldEpch)
	})
}

// ListCheckpoints implements store.Checkpoints.
func (s *Store) ListCheckpoints(ctx context.Context, tenant, runID string) ([]store.Checkpoint, error) {
	rows, err := s.d.Read().Query(ctx, `SELECT step, model_output, tool_results, tokens, epoch, created_ms
		FROM checkpoints WHERE tenant = $1 AND run_id = $2 ORDER BY step`, tenant, runID)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var cps []store.Checkpoint
	for rows.Next() {
		var (
			c       store.Checkpoint
			created int64
		)
		if err := rows.Scan(&c.Step, &c.ModelOutput, &c.ToolResults, &c.Tokens, &c.Epoch, &created); err != nil {
			return nil, err
		}
		c.CreatedAt = tm(created)
		cps = append(cps, c)
	}
	return cps, rows.Err()
}

const toolCols = `tenant, tool_key, run_id, tool, status, owner, epoch, lease_expires_ms, result,
	error_type, error, created_ms, updated_ms`

func scanTool(r Row) (store.ToolRecord, error) {
	var (
		t                     store.ToolRecord
		status                string
		expires, created, upd int64
	)
	err := r.Scan(&t.Tenant, &t.Key, &t.RunID, &t.Tool, &status, &t.Owner, &t.Epoch, &expires, &t.Result,
		&t.ErrorType, &t.Error, &created, &upd)
	if err != nil {
		return store.ToolRecord{}, err
	}
	t.Status = store.ToolStatus(status)
	t.LeaseExpires, t.CreatedAt, t.UpdatedAt = tm(expires), tm(created), tm(upd)
	return t, nil
}

func claimOf(t store.ToolRecord) store.ToolClaim {
	return store.ToolClaim{Tenant: t.Tenant, Key: t.Key, Owner: t.Owner, Epoch: t.Epoch}
}

// BeginTool implements store.Tools.
func (s *Store) BeginTool(ctx context.Context, b store.ToolBegin) (store.Begin, error) {
	if b.Tenant == "" || b.Key == "" || b.Owner == "" || b.TTL <= 0 {
		return store.Begin{}, invalid("begin tool needs tenant, key, owner and a positive TTL (key %q)", b.Key)
	}
	var out store.Begin
	err := s.d.Tx(ctx, func(q Querier) error {
		now := s.nowMs()
		until := now + ttlMs(b.TTL)
		rec, err := scanTool(q.QueryRow(ctx, `INSERT INTO tool_records (tenant, tool_key, run_id, tool, status, owner, epoch,
			lease_expires_ms, created_ms, updated_ms)
			VALUES ($1, $2, $3, $4, $5, $6, 1, $7, $8, $8)
			ON CONFLICT (tenant, tool_key) DO NOTHING RETURNING `+toolCols,
			b.Tenant, b.Key, b.RunID, b.Tool, string(store.ToolInProgress), b.Owner, until, now))
		if err == nil {
			out = store.Begin{Outcome: store.BeginStarted, Record: rec, Claim: claimOf(rec)}
			return nil
		}
		if !errors.Is(err, ErrNoRows) {
			return err
		}
		rec, err = scanTool(q.QueryRow(ctx, `SELECT `+toolCols+` FROM tool_records WHERE tenant = $1 AND tool_key = $2`+s.dl.ForUpdate,
			b.Tenant, b.Key))
		if err != nil {
			return err
		}
		switch rec.Status {
		case store.ToolDone:
			out = store.Begin{Outcome: store.BeginDone, Record: rec}
			return nil
		case store.ToolFailed:
			out = store.Begin{Outcome: store.BeginFailed, Record: rec}
			return nil
		}
		if ms(rec.LeaseExpires) > now {
			out = store.Begin{Outcome: store.BeginInProgress, Record: rec}
			return nil
		}
		// The lease expired (its owner died) or was released: take it over.
		rec, err = scanTool(q.QueryRow(ctx, `UPDATE tool_records SET owner = $1, epoch = epoch + 1, lease_expires_ms = $2,
			updated_ms = $3 WHERE tenant = $4 AND tool_key = $5 RETURNING `+toolCols,
			b.Owner, until, now, b.Tenant, b.Key))
		if err != nil {
			return err
		}
		out = store.Begin{Outcome: store.BeginStarted, Record: rec, Claim: claimOf(rec)}
		return nil
	})
	return out, err
}

// toolFence runs a write fenced by c on an in-progress record, explaining a miss.
func (s *Store) toolFence(ctx context.Context, q Querier, c store.ToolClaim, sql string, args ...any) error {
	n, err := q.Exec(ctx, sql, args...)
	if err != nil || n == 1 {
		return err
	}
	rec, err := scanTool(q.QueryRow(ctx, `SELECT `+toolCols+` FROM tool_records WHERE tenant = $1 AND tool_key = $2`,
		c.Tenant, c.Key))
	if err != nil {
		return notFound(err, "tool record %s", c.Key)
	}
	return fmt.Errorf("%w: tool record %s is %s at epoch %d (owner %q); the claim has epoch %d (owner %q)",
		store.ErrStaleEpoch, c.Key, rec.Status, rec.Epoch, rec.Owner, c.Epoch, c.Owner)
}

const toolFenced = ` WHERE tenant = $1 AND tool_key = $2 AND owner = $3 AND epoch = $4 AND status = 'in_progress'`

// HeartbeatTool implements store.Tools.
func (s *Store) HeartbeatTool(ctx context.Context, c store.ToolClaim, ttl time.Duration) error {
	if ttl <= 0 {
		return invalid("heartbeat tool %s with TTL %v", c.Key, ttl)
	}
	return s.d.Tx(ctx, func(q Querier) error {
		now := s.nowMs()
		return s.toolFence(ctx, q, c, `UPDATE tool_records SET lease_expires_ms = $5, updated_ms = $6`+toolFenced,
			c.Tenant, c.Key, c.Owner, c.Epoch, now+ttlMs(ttl), now)
	})
}

// CompleteTool implements store.Tools.
func (s *Store) CompleteTool(ctx context.Context, c store.ToolClaim, result []byte, effects ...store.Effect) error {
	return s.d.Tx(ctx, func(q Querier) error {
		now := s.nowMs()
		if err := s.toolFence(ctx, q, c, `UPDATE tool_records SET status = 'done', result = $5, lease_expires_ms = 0,
			updated_ms = $6`+toolFenced, c.Tenant, c.Key, c.Owner, c.Epoch, blob(result), now); err != nil {
			return err
		}
		seq := 0
		for i, e := range effects {
			switch e := e.(type) {
			case store.KVPut:
				if e.Key == "" {
					return invalid("effect %d of tool %s: kv put without key", i, c.Key)
				}
				// The WHERE makes the put idempotent per tool call even outside the
				// record's fence: the same call never counts twice.
				if _, err := q.Exec(ctx, `INSERT INTO kv (tenant, kv_key, value, version, idempotency_key, updated_ms)
					VALUES ($1, $2, $3, 1, $4, $5)
					ON CONFLICT (tenant, kv_key) DO UPDATE SET value = excluded.value, version = kv.version + 1,
						idempotency_key = excluded.idempotency_key, updated_ms = excluded.updated_ms
					WHERE kv.idempotency_key <> excluded.idempotency_key`,
					c.Tenant, e.Key, blob(e.Value), c.Key, now); err != nil {
					return err
				}
			case store.Notify:
				if e.Channel == "" {
					return invalid("effect %d of tool %s: notify without channel", i, c.Key)
				}
				if err := s.appendOutbox(ctx, q, c, seq, e, now); err != nil {
					return err
				}
				seq++
			default:
				return invalid("effect %d of tool %s: unknown effect %T", i, c.Key, e)
			}
		}
		return nil
	})
}

// FailTool implements store.Tools.
func (s *Store) FailTool(ctx context.Context, c store.ToolClaim, errType, errMsg string) error {
	return s.d.Tx(ctx, func(q Querier) error {
		return s.toolFence(ctx, q, c, `UPDATE tool_records SET status = 'failed', error_type = $5, error = $6,
			lease_expires_ms = 0, updated_ms = $7`+toolFenced,
			c.Tenant, c.Key, c.Owner, c.Epoch, errType, errMsg, s.nowMs())
	})
}

// ReleaseTool implements store.Tools.
func (s *Store) ReleaseTool(ctx context.Context, c store.ToolClaim) error {
	return s.d.Tx(ctx, func(q Querier) error {
		return s.toolFence(ctx, q, c, `UPDATE tool_records SET owner = '', lease_expires_ms = 0, updated_ms = $5`+toolFenced,
			c.Tenant, c.Key, c.Owner, c.Epoch, s.nowMs())
	})
}

// GetTool implements store.Tools.
func (s *Store) GetTool(ctx context.Context, tenant, key string) (store.ToolRecord, error) {
	rec, err := scanTool(s.d.Read().QueryRow(ctx, `SELECT `+toolCols+` FROM tool_records WHERE tenant = $1 AND tool_key = $2`,
		tenant, key))
	if err != nil {
		return store.ToolRecord{}, notFound(err, "tool record %s", key)
	}
	return rec, nil
}

// GetKV implements store.Tools.
func (s *Store) GetKV(ctx context.Context, tenant, key string) (store.KV, error) {
	kv := store.KV{Tenant: tenant, Key: key}
	var upd int64
	err := s.d.Read().QueryRow(ctx, `SELECT value, version, idempotency_key, updated_ms FROM kv WHERE tenant = $1 AND kv_key = $2`,
		tenant, key).Scan(&kv.Value, &kv.Version, &kv.IdempotencyKey, &upd)
	if err != nil {
		return store.KV{}, notFound(err, "kv %s", key)
	}
	kv.UpdatedAt = tm(upd)
	return kv, nil
}

// ListOutbox implements store.Tools.
func (s *Store) ListOutbox(ctx context.Context, tenant string, after int64, limit int) ([]store.OutboxEntry, error) {
	rows, err := s.d.Read().Query(ctx, `SELECT id, idempotency_key, seq, channel, channel_seq, payload, created_ms FROM outbox
		WHERE tenant = $1 AND id > $2 ORDER BY id LIMIT $3`, tenant, after, pageLimit(limit))
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []store.OutboxEntry
	for rows.Next() {
		e := store.OutboxEntry{Tenant: tenant}
		var created int64
		if err := rows.Scan(&e.ID, &e.IdempotencyKey, &e.Seq, &e.Channel, &e.ChannelSeq, &e.Payload, &created); err != nil {
			return nil, err
		}
		e.CreatedAt = tm(created)
		out = append(out, e)
	}
	return out, rows.Err()
}
