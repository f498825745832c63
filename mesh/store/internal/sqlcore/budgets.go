package sqlcore

import (
	"context"
	"errors"
	"time"

	"github.com/curfew-mesh/curfew/mesh/store"
)

// The budget statements (migration 0011) keep budget_tenants.reserved equal to the sum
// of the tenant's budget_holds: every statement that deletes holds subtracts exactly the
// tokens its DELETE … RETURNING returned (a row deleted concurrently by another
// statement is returned to one of them only), and a grant adds n and inserts its hold
// in the same statement or transaction. On PostgreSQL each operation is one statement
// (writable CTEs): the upsert of the tenant's row reads the DELETE's RETURNING, and, the
// row locked by ON CONFLICT DO UPDATE, judges the grant on its latest committed version
// (not on the statement's snapshot), so concurrent reservations queue on the row and
// each sees the others' grants. On SQLite the same statements run in one write
// transaction.

// windowStartMs is the start of the epoch-aligned window of length w containing t.
func windowStartMs(t, w int64) int64 { return t - t%w }

// sweptExpr is the tokens of the holds the statement's first part deleted: the CTE gone
// on PostgreSQL, or parameter p (computed by the transaction's DELETE) on SQLite.
func (s *Store) sweptExpr(p string) string {
	if s.dl.WritableCTEs {
		return `COALESCE((SELECT SUM(g.tokens) FROM gone g), 0)`
	}
	return `CAST(` + p + ` AS BIGINT)`
}

// deleteSum runs a DELETE … RETURNING tokens and returns their sum (SQLite's path).
func deleteSum(ctx context.Context, q Querier, sql string, args ...any) (int64, error) {
	rows, err := q.Query(ctx, sql, args...)
	if err != nil {
		return 0, err
	}
	defer rows.Close()
	var sum int64
	for rows.Next() {
		var n int64
		if err := rows.Scan(&n); err != nil {
			return 0, err
		}
		sum += n
	}
	return sum, rows.Err()
}

// ReserveTokens implements store.Budgets: one statement on PostgreSQL.
//
// Parameters: $1 tenant, $2 holder, $3 id, $4 n, $5 budget, $6 window ms, $7 the
// window's start by this store's clock, $8 now, $9 the hold's expiry, $10 (SQLite) the
// swept tokens. The tenant's row is always written (a refusal too), so that the expired
// holds the statement dropped are subtracted whatever the outcome.
func (s *Store) ReserveTokens(ctx context.Context, r store.TokenReservation) (store.TokenBudgetState, error) {
	if r.Tenant == "" || r.Holder == "" || r.ID == "" || r.Tokens <= 0 || r.Budget <= 0 || r.Window <= 0 || r.TTL <= 0 {
		return store.TokenBudgetState{}, invalid("token reservation needs a tenant, holder, id and positive tokens, budget, window and ttl")
	}
	now, w := s.nowMs(), ttlMs(r.Window)
	const (
		sameWindow = `t.window_ms = CAST($6 AS BIGINT) AND t.start_ms >= CAST($7 AS BIGINT)`
		n          = `CAST($4 AS BIGINT)`
		budget     = `CAST($5 AS BIGINT)`
	)
	spentNow := `(CASE WHEN ` + sameWindow + ` THEN t.spent ELSE 0 END)`
	reservedNow := `(t.reserved - ` + s.sweptExpr("$10") + `)`
	fits := spentNow + ` + ` + reservedNow + ` + ` + n + ` <= ` + budget
	upsert := `INSERT INTO budget_tenants AS t (tenant, window_ms, start_ms, spent, reserved, granted)
		SELECT CAST($1 AS TEXT), CAST($6 AS BIGINT), CAST($7 AS BIGINT), 0,
			CASE WHEN ` + n + ` <= ` + budget + ` THEN ` + n + ` ELSE 0 END, CASE WHEN ` + n + ` <= ` + budget + ` THEN 1 ELSE 0 END
		ON CONFLICT (tenant) DO UPDATE SET
			granted = CASE WHEN ` + fits + ` THEN 1 ELSE 0 END,
			reserved = ` + reservedNow + ` + CASE WHEN ` + fits + ` THEN ` + n + ` ELSE 0 END,
			spent = ` + spentNow + `,
			start_ms = CASE WHEN ` + sameWindow + ` THEN t.start_ms ELSE CAST($7 AS BIGINT) END,
			window_ms = CAST($6 AS BIGINT)
		RETURNING granted, spent, reserved, start_ms`
	insertHold := `INSERT INTO budget_holds (id, tenant, holder, tokens, expires_ms)
		SELECT CAST($3 AS TEXT), CAST($1 AS TEXT), CAST($2 AS TEXT), ` + n + `, CAST($9 AS BIGINT)`
	args := []any{r.Tenant, r.Holder, r.ID, r.Tokens, r.Budget, w, windowStartMs(now, w), now, now + ttlMs(r.TTL)}
	var (
		st      store.TokenBudgetState
		granted int
		start   int64
	)
	scan := func(row Row) error {
		if err := row.Scan(&granted, &st.Spent, &st.Reserved, &start); err != nil {
			return err
		}
		st.Granted, st.WindowStart = granted == 1, tm(start)
		return nil
	}
	if s.dl.WritableCTEs {
		// The expired holds are locked in id order before they are deleted, so that two
		// reservations sweeping the same holds queue instead of deadlocking.
		rows, err := s.d.Write(ctx, `WITH gone AS (DELETE FROM budget_holds WHERE id IN (SELECT x.id FROM budget_holds x
				WHERE x.tenant = $1 AND x.expires_ms <= $8 ORDER BY x.id FOR UPDATE) RETURNING tokens),
			up AS (`+upsert+`),
			h AS (`+insertHold+` FROM up WHERE up.granted = 1)
			SELECT granted, spent, reserved, start_ms FROM up`, args...)
		if err != nil {
			return store.TokenBudgetState{}, err
		}
		defer rows.Close()
		if !rows.Next() {
			if err := rows.Err(); err != nil {
				return store.TokenBudgetState{}, err
			}
			return store.TokenBudgetState{}, errors.New("sqlcore: reserve tokens returned no row")
		}
		if err := scan(rows); err != nil {
			return store.TokenBudgetState{}, err
		}
		return st, rows.Err()
	}
	err := s.d.Tx(ctx, func(q Querier) error {
		swept, err := deleteSum(ctx, q, `DELETE FROM budget_holds WHERE tenant = $1 AND expires_ms <= $2 RETURNING tokens`, r.Tenant, now)
		if err != nil {
			return err
		}
		if err := scan(q.QueryRow(ctx, upsert, append(args, swept)...)); err != nil {
			return err
		}
		if !st.Granted {
			return nil
		}
		_, err = q.Exec(ctx, insertHold, args...)
		return err
	})
	if err != nil {
		return store.TokenBudgetState{}, err
	}
	return st, nil
}

// SettleTokens implements store.Budgets: one statement on PostgreSQL.
//
// Parameters: $1 tenant, $2 id, $3 actual, $4 window ms, $5 the start of the window
// containing At, $6 (SQLite) the tokens of the deleted hold.
func (s *Store) SettleTokens(ctx context.Context, c store.TokenSettlement) error {
	if c.Tenant == "" || c.Actual < 0 || c.Window <= 0 {
		return invalid("token settlement needs a tenant, a window and actual >= 0")
	}
	at, w := s.nowMs(), ttlMs(c.Window)
	if !c.At.IsZero() {
		at = ms(c.At)
	}
	upsert := `INSERT INTO budget_tenants AS t (tenant, window_ms, start_ms, spent, reserved)
		VALUES (CAST($1 AS TEXT), CAST($4 AS BIGINT), CAST($5 AS BIGINT), CAST($3 AS BIGINT), 0)
		ON CONFLICT (tenant) DO UPDATE SET
			reserved = t.reserved - ` + s.sweptExpr("$6") + `,
			spent = CASE WHEN t.window_ms <> CAST($4 AS BIGINT) OR t.start_ms < CAST($5 AS BIGINT) THEN CAST($3 AS BIGINT)
				WHEN t.start_ms = CAST($5 AS BIGINT) THEN t.spent + CAST($3 AS BIGINT)
				ELSE t.spent END,
			start_ms = CASE WHEN t.window_ms <> CAST($4 AS BIGINT) OR t.start_ms < CAST($5 AS BIGINT) THEN CAST($5 AS BIGINT)
				ELSE t.start_ms END,
			window_ms = CAST($4 AS BIGINT)`
	const del = `DELETE FROM budget_holds WHERE id = $2 AND tenant = $1 RETURNING tokens`
	args := []any{c.Tenant, c.ID, c.Actual, w, windowStartMs(at, w)}
	if s.dl.WritableCTEs {
		_, err := s.d.Exec(ctx, `WITH gone AS (`+del+`) `+upsert, args...)
		return err
	}
	return s.d.Tx(ctx, func(q Querier) error {
		gone, err := deleteSum(ctx, q, `DELETE FROM budget_holds WHERE id = $1 AND tenant = $2 RETURNING tokens`, c.ID, c.Tenant)
		if err != nil {
			return err
		}
		_, err = q.Exec(ctx, upsert, append(args, gone)...)
		return err
	})
}

// RenewTokenHolds implements store.Budgets in one statement.
func (s *Store) RenewTokenHolds(ctx context.Context, holder string, ttl time.Duration) ([]string, error) {
	if holder == "" {
		return nil, invalid("renew token holds needs a holder")
	}
	rows, err := s.d.Write(ctx, `UPDATE budget_holds SET expires_ms = $2 WHERE holder = $1 RETURNING id`, holder, s.nowMs()+ttlMs(ttl))
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var ids []string
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			return nil, err
		}
		ids = append(ids, id)
	}
	return ids, rows.Err()
}

// TokenBudgetUsage implements store.Budgets.
func (s *Store) TokenBudgetUsage(ctx context.Context, tenant string, window time.Duration) (store.TokenBudgetState, error) {
	if tenant == "" || window <= 0 {
		return store.TokenBudgetState{}, invalid("token budget usage needs a tenant and a window")
	}
	now, w := s.nowMs(), ttlMs(window)
	cur := windowStartMs(now, w)
	var (
		rw, start, spent, reserved int64
	)
	err := s.d.Read().QueryRow(ctx, `SELECT t.window_ms, t.start_ms, t.spent,
		t.reserved - COALESCE((SELECT SUM(h.tokens) FROM budget_holds h WHERE h.tenant = t.tenant AND h.expires_ms <= $2), 0)
		FROM budget_tenants t WHERE t.tenant = $1`, tenant, now).Scan(&rw, &start, &spent, &reserved)
	if errors.Is(err, ErrNoRows) {
		return store.TokenBudgetState{WindowStart: tm(cur)}, nil
	}
	if err != nil {
		return store.TokenBudgetState{}, err
	}
	st := store.TokenBudgetState{Reserved: reserved, WindowStart: tm(cur)}
	if rw == w && start >= cur {
		st.Spent, st.WindowStart = spent, tm(start)
	}
	return st, nil
}
