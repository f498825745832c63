package sqlcore

import (
	"context"
	"errors"
	"fmt"

	"github.com/curfew-mesh/curfew/mesh/store"
)

const dlCols = `id, tenant, run_id, step, error_type, attempts, last_error, payload, idempotency_key,
	created_ms, replayed_ms, replay_count`

func scanDL(r Row) (store.DeadLetter, error) {
	var (
		d                 store.DeadLetter
		created, replayed int64
	)
	err := r.Scan(&d.ID, &d.Tenant, &d.RunID, &d.Step, &d.ErrorType, &d.Attempts, &d.LastError, &d.Payload,
		&d.IdempotencyKey, &created, &replayed, &d.ReplayCount)
	if err != nil {
		return store.DeadLetter{}, err
	}
	d.CreatedAt, d.ReplayedAt = tm(created), tm(replayed)
	return d, nil
}

// AddDeadLetter implements store.DeadLetters.
func (s *Store) AddDeadLetter(ctx context.Context, d store.DeadLetter) (store.DeadLetter, bool, error) {
	if d.Tenant == "" || d.RunID == "" || d.Step == "" {
		return store.DeadLetter{}, false, invalid("dead letter needs tenant, run and step")
	}
	var (
		out   store.DeadLetter
		added bool
	)
	err := s.d.Tx(ctx, func(q Querier) error {
		now := s.nowMs()
		var err error
		out, err = scanDL(q.QueryRow(ctx, `INSERT INTO dead_letters (id, tenant, run_id, step, error_type, attempts,
			last_error, payload, idempotency_key, created_ms)
			VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
			ON CONFLICT (tenant, run_id, step) DO NOTHING RETURNING `+dlCols,
			newID(), d.Tenant, d.RunID, d.Step, d.ErrorType, d.Attempts, d.LastError, blob(d.Payload), d.IdempotencyKey, now))
		if err == nil {
			added = true
			return nil
		}
		if !errors.Is(err, ErrNoRows) {
			return err
		}
		out, err = scanDL(q.QueryRow(ctx, `SELECT `+dlCols+` FROM dead_letters WHERE tenant = $1 AND run_id = $2 AND step = $3`+s.dl.ForUpdate,
			d.Tenant, d.RunID, d.Step))
		if err != nil || out.ReplayedAt.IsZero() {
			return err // open already: unchanged
		}
		// The replay failed again: reopen it with the new context.
		out, err = scanDL(q.QueryRow(ctx, `UPDATE dead_letters SET error_type = $1, attempts = $2, last_error = $3,
			payload = $4, idempotency_key = $5, created_ms = $6, replayed_ms = 0
			WHERE id = $7 RETURNING `+dlCols,
			d.ErrorType, d.Attempts, d.LastError, blob(d.Payload), d.IdempotencyKey, now, out.ID))
		added = err == nil
		return err
	})
	if err != nil {
		return store.DeadLetter{}, false, err
	}
	return out, added, nil
}

// GetDeadLetter implements store.DeadLetters.
func (s *Store) GetDeadLetter(ctx context.Context, tenant, id string) (store.DeadLetter, error) {
	d, err := scanDL(s.d.Read().QueryRow(ctx, `SELECT `+dlCols+` FROM dead_letters WHERE id = $1 AND ($2 = '' OR tenant = $2)`,
		id, tenant))
	if err != nil {
		return store.DeadLetter{}, notFound(err, "dead letter %s", id)
	}
	return d, nil
}

// ListDeadLetters implements store.DeadLetters.
func (s *Store) ListDeadLetters(ctx context.Context, q store.DeadLetterQuery) ([]store.DeadLetter, string, error) {
	limit := pageLimit(q.Limit)
	all := 0
	if q.IncludeReplayed {
		all = 1
	}
	rows, err := s.d.Read().Query(ctx, `SELECT `+dlCols+` FROM dead_letters
		WHERE ($1 = '' OR tenant = $1) AND ($2 = '' OR run_id = $2) AND ($3 = 1 OR replayed_ms = 0)
		  AND ($4 = '' OR id < $4)
		ORDER BY id DESC LIMIT $5`, q.Tenant, q.RunID, all, q.After, limit+1)
	if err != nil {
		return nil, "", err
	}
	defer rows.Close()
	var out []store.DeadLetter
	for rows.Next() {
		d, err := scanDL(rows)
		if err != nil {
			return nil, "", err
		}
		out = append(out, d)
	}
	if err := rows.Err(); err != nil {
		return nil, "", err
	}
	next := ""
	if len(out) > limit {
		out = out[:limit]
		next = out[limit-1].ID
	}
	return out, next, nil
}

// MarkReplayed implements store.DeadLetters.
func (s *Store) MarkReplayed(ctx context.Context, tenant, id string) (store.DeadLetter, error) {
	var d store.DeadLetter
	err := s.d.Tx(ctx, func(q Querier) error {
		var err error
		d, err = scanDL(q.QueryRow(ctx, `UPDATE dead_letters SET replayed_ms = $1, replay_count = replay_count + 1
			WHERE id = $2 AND ($3 = '' OR tenant = $3) AND replayed_ms = 0 RETURNING `+dlCols,
			s.nowMs(), id, tenant))
		if !errors.Is(err, ErrNoRows) {
			return err
		}
		d, err = scanDL(q.QueryRow(ctx, `SELECT `+dlCols+` FROM dead_letters WHERE id = $1 AND ($2 = '' OR tenant = $2)`,
			id, tenant))
		if err != nil {
			return notFound(err, "dead letter %s", id)
		}
		return fmt.Errorf("%w: %s at %s", store.ErrAlreadyReplayed, id, d.ReplayedAt.Format("2006-01-02T15:04:05.000Z07:00"))
	})
	return d, err
}

// PurgeDeadLetters implements store.DeadLetters.
func (s *Store) PurgeDeadLetters(ctx context.Context, q store.PurgeQuery) (int64, error) {
	if q.ID == "" && q.Before.IsZero() && !q.OnlyReplayed {
		return 0, invalid("purge needs an ID, a time or OnlyReplayed")
	}
	only := 0
	if q.OnlyReplayed {
		only = 1
	}
	before := int64(0) // no time filter
	if !q.Before.IsZero() {
		// At or before the Unix epoch nothing was created; -1 keeps the filter on (0
		// would read as "no filter" and purge everything).
		if before = ms(q.Before); before <= 0 {
			before = -1
		}
	}
	var n int64
	err := s.d.Tx(ctx, func(qr Querier) error {
		var err error
		n, err = qr.Exec(ctx, `DELETE FROM dead_letters
			WHERE ($1 = '' OR tenant = $1) AND ($2 = '' OR id = $2)
			  AND (CAST($3 AS BIGINT) = 0 OR created_ms < $3) AND ($4 = 0 OR replayed_ms <> 0)`,
			q.Tenant, q.ID, before, only)
		return err
	})
	return n, err
}

// DeadLetterDepth implements store.DeadLetters.
func (s *Store) DeadLetterDepth(ctx context.Context, tenant string) (int64, error) {
	var n int64
	err := s.d.Read().QueryRow(ctx, `SELECT COUNT(*) FROM dead_letters WHERE replayed_ms = 0 AND ($1 = '' OR tenant = $1)`,
		tenant).Scan(&n)
	return n, err
}

// AddTokens implements store.Ledger.
func (s *Store) AddTokens(ctx context.Context, es ...store.LedgerEntry) (int, error) {
	for i, e := range es {
		if e.Tenant == "" || e.RunID == "" {
			return 0, invalid("ledger entry %d needs tenant and run", i)
		}
	}
	if len(es) == 0 {
		return 0, nil
	}
	now := s.nowMs()
	var added int
	err := s.d.Tx(ctx, func(q Querier) error {
		added = 0
		for _, e := range es {
			at := ms(e.At)
			if at == 0 {
				at = now
			}
			n, err := q.Exec(ctx, `INSERT INTO token_ledger (tenant, run_id, node_id, tokens, kind, entry_key, at_ms, retry_id, provider)
			VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT (tenant, entry_key) DO NOTHING`,
				e.Tenant, e.RunID, e.NodeID, e.Tokens, e.Kind, nullable(e.Key), at, e.RetryID, e.Provider)
			if err != nil {
				return err
			}
			added += int(n)
		}
		return nil
	})
	if err != nil {
		return 0, err
	}
	return added, nil
}

// TokenUsage implements store.Ledger.
func (s *Store) TokenUsage(ctx context.Context, tenant, runID string) (store.Usage, error) {
	rows, err := s.d.Read().Query(ctx, `SELECT node_id, provider, kind, CAST(SUM(tokens) AS BIGINT) FROM token_ledger
		WHERE tenant = $1 AND run_id = $2 GROUP BY node_id, provider, kind`, tenant, runID)
	if err != nil {
		return store.Usage{}, err
	}
	defer rows.Close()
	u := store.Usage{ByNode: map[string]int64{}, ByProvider: map[string]int64{}, PromptByNode: map[string]int64{}}
	for rows.Next() {
		var (
			node, provider, kind string
			n                    int64
		)
		if err := rows.Scan(&node, &provider, &kind, &n); err != nil {
			return store.Usage{}, err
		}
		if kind == store.KindPrompt {
			u.PromptByNode[node] += n
			u.Prompt += n
			continue
		}
		u.ByNode[node] += n
		u.ByProvider[provider] += n
		u.Total += n
	}
	return u, rows.Err()
}
