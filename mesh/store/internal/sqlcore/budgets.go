package sqlcore

import (
	"context"
	"errors"
	"time"

	"github.com/curfew-mesh/curfew/mesh/store"
)

// The budget statements (migrations 0011 and 0013) keep budget_tenants.reserved equal to
// the sum of the tenant's budget_holds.tokens: every statement that deletes a hold or
// lapses it (sets its tokens to 0) subtracts exactly the tokens it took from the rows it
// changed (a row changed concurrently by another statement is taken by one of them only,
// the other finding it gone or already lapsed), and a grant adds n and inserts its hold
// in the same statement or transaction. On PostgreSQL each operation is one statement
// (writable CTEs): the upsert of the tenant's row reads the other parts' RETURNING, and,
// the row locked by ON CONFLICT DO UPDATE, judges the grant on its latest committed
// version (not on the statement's snapshot), so concurrent reservations queue on the
// row and each sees the others' grants. On SQLite the same statements run in one write
// transaction.
//
// A hold lapses when a reservation of its tenant finds it expired: its tokens stop
// counting and its call's ledger spend (ledgerSpend) is charged to the current window;
// the row stays as a tombstone (lapsed_ms > 0, tokens 0, charged) until its expiry
// (store.LapsedHoldKeep on) passes. A settlement deletes the row, live or lapsed, and
// charges what the call spent less what its lapse charged. Settle and lapse both take
// the row under its lock (PostgreSQL re-reads a row changed while it waited for it), so
// whichever comes second sees what the first did: a call is charged once.

// windowStartMs is the start of the epoch-aligned window of length w containing t.
func windowStartMs(t, w int64) int64 { return t - t%w }

// sweptExpr is the tokens of the holds the statement's first part deleted or lapsed: the
// CTE gone on PostgreSQL, or parameter p (computed by the transaction) on SQLite.
func (s *Store) sweptExpr(p string) string {
	if s.dl.WritableCTEs {
		return `COALESCE((SELECT SUM(g.tokens) FROM gone g), 0)`
	}
	return `CAST(` + p + ` AS BIGINT)`
}

// chargedExpr is the ledger spend the statement's lapsed holds were charged (gone's
// charged column on PostgreSQL, parameter p on SQLite).
func (s *Store) chargedExpr(p string) string {
	if s.dl.WritableCTEs {
		return `CAST(COALESCE((SELECT SUM(g.charged) FROM gone g), 0) AS BIGINT)`
	}
	return `CAST(` + p + ` AS BIGINT)`
}

// ledgerSpend is the tokens the token ledger holds for the call of hold h (a table
// alias): the sum of its decoder's parts, the entries of its run keyed
// h.ledger_key/<k>… (output, orphan and prompt alike, as the call's settlement would
// have charged them); 0 for a hold that names none. The run's index (token_ledger_run)
// finds the run's entries, the key's prefix the decoder's among them; a prefix compared
// with substr, not LIKE, so that no character of a key is a wildcard.
func ledgerSpend(h string) string {
	return `CAST(COALESCE((SELECT SUM(l.tokens) FROM token_ledger l WHERE l.tenant = ` + h + `.tenant AND l.run_id = ` + h + `.run_id
		AND ` + h + `.ledger_key <> '' AND substr(l.entry_key, 1, length(` + h + `.ledger_key) + 1) = ` + h + `.ledger_key || '/'), 0) AS BIGINT)`
}

// sums runs a statement returning two integer columns and returns their sums (SQLite's
// path: a DELETE or UPDATE … RETURNING, or a SELECT).
func sums(ctx context.Context, q Querier, sql string, args ...any) (a, b int64, err error) {
	rows, err := q.Query(ctx, sql, args...)
	if err != nil {
		return 0, 0, err
	}
	defer rows.Close()
	for rows.Next() {
		var x, y int64
		if err := rows.Scan(&x, &y); err != nil {
			return 0, 0, err
		}
		a, b = a+x, b+y
	}
	return a, b, rows.Err()
}

// ReserveTokens implements store.Budgets: one statement on PostgreSQL.
//
// Parameters: $1 tenant, $2 holder, $3 id, $4 n, $5 budget, $6 window ms, $7 the
// window's start by this store's clock, $8 now, $9 the hold's expiry, $10 its run, $11
// its ledger key, $12 a tombstone's expiry (now + store.LapsedHoldKeep), and on SQLite
// $13 the tokens of the holds lapsed, $14 the ledger spend charged for them. The
// tenant's row is always written (a refusal too), so that the holds the statement lapsed
// are subtracted and charged whatever the outcome.
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
	// The lapsed holds' ledger spend is charged to the current window.
	spentNow := `(CASE WHEN ` + sameWindow + ` THEN t.spent ELSE 0 END + ` + s.chargedExpr("$14") + `)`
	reservedNow := `(t.reserved - ` + s.sweptExpr("$13") + `)`
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
	insertHold := `INSERT INTO budget_holds (id, tenant, holder, tokens, expires_ms, run_id, ledger_key)
		SELECT CAST($3 AS TEXT), CAST($1 AS TEXT), CAST($2 AS TEXT), ` + n + `, CAST($9 AS BIGINT), CAST($10 AS TEXT), CAST($11 AS TEXT)`
	// A lapse keeps the row as a tombstone: tokens 0 (no longer reserved), what the
	// ledger has of its call charged, kept until its new expiry.
	lapse := `SET tokens = 0, lapsed_ms = CAST($8 AS BIGINT), expires_ms = CAST($12 AS BIGINT), charged = ` + ledgerSpend("budget_holds")
	args := []any{r.Tenant, r.Holder, r.ID, r.Tokens, r.Budget, w, windowStartMs(now, w), now, now + ttlMs(r.TTL),
		r.RunID, r.LedgerKey, now + ttlMs(store.LapsedHoldKeep)}
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
		// The expired rows (live holds and tombstones) are locked in id order first, so
		// that two reservations sweeping the same rows queue instead of deadlocking; a
		// row settled, renewed or lapsed while this one waited for it is read again
		// (READ COMMITTED) and left out when it no longer qualifies. gone lapses the live
		// ones, returning the tokens they held and the spend they were charged; purged
		// drops the expired tombstones.
		rows, err := s.d.Write(ctx, `WITH expired AS MATERIALIZED (SELECT x.id, x.tokens, x.lapsed_ms FROM budget_holds x
				WHERE x.tenant = $1 AND x.expires_ms <= $8 ORDER BY x.id FOR UPDATE),
			gone AS (UPDATE budget_holds `+lapse+` FROM expired e
				WHERE budget_holds.id = e.id AND e.lapsed_ms = 0 RETURNING e.tokens AS tokens, budget_holds.charged AS charged),
			purged AS (DELETE FROM budget_holds USING expired e WHERE budget_holds.id = e.id AND e.lapsed_ms > 0),
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
		// One read finds what is expired (the tokens of the live holds among it: SQLite's
		// RETURNING would read a lapsed row's tokens as updated, 0); the writes run only
		// when there is some, so the common reservation costs what it did before 0013.
		const expired = `WHERE tenant = $1 AND expires_ms <= $8`
		swept, rows, err := sums(ctx, q, `SELECT COALESCE(SUM(tokens), 0), COUNT(*) FROM budget_holds `+expired, args...)
		if err != nil {
			return err
		}
		var charged int64
		if rows > 0 {
			if _, err := q.Exec(ctx, `DELETE FROM budget_holds `+expired+` AND lapsed_ms > 0`, args...); err != nil {
				return err
			}
			if _, charged, err = sums(ctx, q, `UPDATE budget_holds `+lapse+` `+expired+` AND lapsed_ms = 0 RETURNING 0, charged`, args...); err != nil {
				return err
			}
		}
		if err := scan(q.QueryRow(ctx, upsert, append(args, swept, charged)...)); err != nil {
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
// containing At, and on SQLite $6 the tokens the deleted hold held and $7 the ledger
// spend its lapse charged (0 for a live hold).
func (s *Store) SettleTokens(ctx context.Context, c store.TokenSettlement) error {
	if c.Tenant == "" || c.Actual < 0 || c.Window <= 0 {
		return invalid("token settlement needs a tenant, a window and actual >= 0")
	}
	at, w := s.nowMs(), ttlMs(c.Window)
	if !c.At.IsZero() {
		at = ms(c.At)
	}
	// What the call spent beyond what its lapse charged (all of it for a live hold).
	charged := s.chargedExpr("$7")
	charge := `(CASE WHEN CAST($3 AS BIGINT) > ` + charged + ` THEN CAST($3 AS BIGINT) - ` + charged + ` ELSE 0 END)`
	// The insert's values do not read gone: on PostgreSQL gone then runs once the
	// tenant's row is locked (by ON CONFLICT DO UPDATE, whose SET reads it), in the order
	// ReserveTokens takes the same locks (the tenant's row, then holds), so the two never
	// deadlock. A tenant without a row has no hold to charge against.
	upsert := `INSERT INTO budget_tenants AS t (tenant, window_ms, start_ms, spent, reserved)
		VALUES (CAST($1 AS TEXT), CAST($4 AS BIGINT), CAST($5 AS BIGINT), CAST($3 AS BIGINT), 0)
		ON CONFLICT (tenant) DO UPDATE SET
			reserved = t.reserved - ` + s.sweptExpr("$6") + `,
			spent = CASE WHEN t.window_ms <> CAST($4 AS BIGINT) OR t.start_ms < CAST($5 AS BIGINT) THEN ` + charge + `
				WHEN t.start_ms = CAST($5 AS BIGINT) THEN t.spent + ` + charge + `
				ELSE t.spent END,
			start_ms = CASE WHEN t.window_ms <> CAST($4 AS BIGINT) OR t.start_ms < CAST($5 AS BIGINT) THEN CAST($5 AS BIGINT)
				ELSE t.start_ms END,
			window_ms = CAST($4 AS BIGINT)`
	// The hold, live or lapsed: a lapsed one's tokens are 0 already.
	const del = `DELETE FROM budget_holds WHERE id = $2 AND tenant = $1 RETURNING tokens, charged`
	args := []any{c.Tenant, c.ID, c.Actual, w, windowStartMs(at, w)}
	if s.dl.WritableCTEs {
		_, err := s.d.Exec(ctx, `WITH gone AS (`+del+`) `+upsert, args...)
		return err
	}
	return s.d.Tx(ctx, func(q Querier) error {
		gone, lapsed, err := sums(ctx, q, del, args[:2]...)
		if err != nil {
			return err
		}
		_, err = q.Exec(ctx, upsert, append(args, gone, lapsed)...)
		return err
	})
}

// RenewTokenHolds implements store.Budgets in one statement. The holder's tombstones are
// renewed too, for store.LapsedHoldKeep: while it lives, its late settlement of a lapsed
// hold finds what the lapse charged.
func (s *Store) RenewTokenHolds(ctx context.Context, holder string, ttl time.Duration) ([]string, error) {
	if holder == "" {
		return nil, invalid("renew token holds needs a holder")
	}
	now := s.nowMs()
	rows, err := s.d.Write(ctx, `UPDATE budget_holds SET expires_ms = CASE WHEN lapsed_ms = 0 THEN CAST($2 AS BIGINT) ELSE CAST($3 AS BIGINT) END
		WHERE holder = $1 RETURNING id, lapsed_ms`, holder, now+ttlMs(ttl), now+ttlMs(store.LapsedHoldKeep))
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var ids []string
	for rows.Next() {
		var (
			id     string
			lapsed int64
		)
		if err := rows.Scan(&id, &lapsed); err != nil {
			return nil, err
		}
		if lapsed == 0 {
			ids = append(ids, id)
		}
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
		rw, start, spent, reserved, lapsing int64
	)
	// The holds expired but not lapsed yet count as the next reservation will count
	// them: not reserved, and their ledger spend charged to the current window.
	err := s.d.Read().QueryRow(ctx, `SELECT t.window_ms, t.start_ms, t.spent,
		t.reserved - COALESCE((SELECT SUM(h.tokens) FROM budget_holds h WHERE h.tenant = t.tenant AND h.expires_ms <= $2), 0),
		CAST(COALESCE((SELECT SUM(`+ledgerSpend("h")+`) FROM budget_holds h
			WHERE h.tenant = t.tenant AND h.lapsed_ms = 0 AND h.expires_ms <= $2), 0) AS BIGINT)
		FROM budget_tenants t WHERE t.tenant = $1`, tenant, now).Scan(&rw, &start, &spent, &reserved, &lapsing)
	if errors.Is(err, ErrNoRows) {
		return store.TokenBudgetState{WindowStart: tm(cur)}, nil
	}
	if err != nil {
		return store.TokenBudgetState{}, err
	}
	st := store.TokenBudgetState{Spent: lapsing, Reserved: reserved, WindowStart: tm(cur)}
	if rw == w && start >= cur {
		st.Spent, st.WindowStart = spent+lapsing, tm(start)
	}
	return st, nil
}
