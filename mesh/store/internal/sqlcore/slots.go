package sqlcore

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/curfew-mesh/curfew/mesh/store"
)

// maxSlots bounds a scope's size: the slots are rows, created when the scope is sized.
const maxSlots = 100_000

// slotCols are a slot's columns for scanSlot, from a table aliased s or named slots.
func slotCols(table string) string {
	return table + `.scope, ` + table + `.n, ` + table + `.holder, ` + table + `.epoch, ` + table + `.expires_ms,
		CASE WHEN ` + table + `.n < COALESCE((SELECT z.size FROM slot_scopes z WHERE z.scope = ` + table + `.scope), 0) THEN 1 ELSE 0 END`
}

func scanSlot(r Row) (store.Slot, error) {
	var (
		sl      store.Slot
		expires int64
		active  int
	)
	if err := r.Scan(&sl.Scope, &sl.N, &sl.Holder, &sl.Epoch, &expires, &active); err != nil {
		return store.Slot{}, err
	}
	sl.Expiry, sl.Active = tm(expires), active == 1
	return sl, nil
}

func scanSlots(rows Rows, err error) ([]store.Slot, error) {
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []store.Slot
	for rows.Next() {
		sl, err := scanSlot(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, sl)
	}
	return out, rows.Err()
}

// SizeSlots implements store.Slots: the size, then the missing rows below it, in one
// transaction. Rows at or above the size are kept (see the migration 0010).
func (s *Store) SizeSlots(ctx context.Context, scope string, n int) error {
	if scope == "" {
		return invalid("slot scope is empty")
	}
	if n < 0 || n > maxSlots {
		return invalid("slot scope %q: size %d not in [0, %d]", scope, n, maxSlots)
	}
	return s.d.Tx(ctx, func(q Querier) error {
		if _, err := q.Exec(ctx, `INSERT INTO slot_scopes (scope, size) VALUES ($1, $2)
			ON CONFLICT (scope) DO UPDATE SET size = excluded.size`, scope, n); err != nil {
			return err
		}
		_, err := q.Exec(ctx, `WITH RECURSIVE seq(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM seq WHERE n + 1 < CAST($2 AS INTEGER))
			INSERT INTO slots (scope, n) SELECT CAST($1 AS TEXT), n FROM seq WHERE n < CAST($2 AS INTEGER)
			ON CONFLICT (scope, n) DO NOTHING`, scope, n)
		return err
	})
}

// ClaimSlot implements store.Slots in one statement. The sub-select picks the lowest
// active slot that is free or expired and whose class (the inactive slots above the
// size that map onto it, n mod size) holds nothing live; on PostgreSQL it locks that row
// with SKIP LOCKED, so concurrent claimers each take a different row instead of queueing
// on one, and under READ COMMITTED the lock re-checks the row's conditions against the
// latest committed version. The outer WHERE repeats the condition for SQLite, whose
// single writer runs the whole statement alone.
func (s *Store) ClaimSlot(ctx context.Context, scope, holder string, ttl time.Duration) (store.Slot, bool, error) {
	if scope == "" || holder == "" {
		return store.Slot{}, false, invalid("claim slot needs a scope and a holder")
	}
	now := s.nowMs()
	got, err := scanSlots(s.d.Write(ctx, `UPDATE slots SET holder = $2, epoch = epoch + 1, expires_ms = $3
		WHERE (scope, n) = (SELECT s.scope, s.n FROM slots s
			WHERE s.scope = $1 AND s.n < (SELECT z.size FROM slot_scopes z WHERE z.scope = $1)
			AND (s.holder = '' OR s.expires_ms <= $4)
			AND NOT EXISTS (SELECT 1 FROM slots o WHERE o.scope = $1
				AND o.n >= (SELECT z.size FROM slot_scopes z WHERE z.scope = $1)
				AND o.n % NULLIF((SELECT z.size FROM slot_scopes z WHERE z.scope = $1), 0) = s.n
				AND o.holder <> '' AND o.expires_ms > $4)
			ORDER BY s.n LIMIT 1`+s.dl.SkipLocked+`)
		AND (holder = '' OR expires_ms <= $4)
		RETURNING `+slotCols("slots"), scope, holder, now+ttlMs(ttl), now))
	if err != nil || len(got) == 0 {
		return store.Slot{}, false, err
	}
	return got[0], true, nil
}

// RenewSlots implements store.Slots in one statement.
func (s *Store) RenewSlots(ctx context.Context, holder string, ttl time.Duration) ([]store.Slot, error) {
	if holder == "" {
		return nil, invalid("renew slots needs a holder")
	}
	return scanSlots(s.d.Write(ctx, `UPDATE slots SET expires_ms = $2 WHERE holder = $1 AND holder <> '' RETURNING `+slotCols("slots"),
		holder, s.nowMs()+ttlMs(ttl)))
}

// ReleaseSlot implements store.Slots in one statement. On PostgreSQL the trigger of
// migration 0010 notifies waiting replicas (store.SlotReleases).
func (s *Store) ReleaseSlot(ctx context.Context, sl store.Slot) error {
	if sl.Scope == "" || sl.Holder == "" {
		return invalid("release slot needs a scope and a holder")
	}
	n, err := s.d.Exec(ctx, `UPDATE slots SET holder = '', expires_ms = 0
		WHERE scope = $1 AND n = $2 AND holder = $3 AND epoch = $4`, sl.Scope, sl.N, sl.Holder, sl.Epoch)
	if err != nil {
		return err
	}
	if n == 0 {
		return fmt.Errorf("%w: slot %s/%d epoch %d is no longer held by %s", store.ErrStaleEpoch, sl.Scope, sl.N, sl.Epoch, sl.Holder)
	}
	return nil
}

// ListSlots implements store.Slots.
func (s *Store) ListSlots(ctx context.Context, scope string) ([]store.Slot, error) {
	return scanSlots(s.d.Read().Query(ctx, `SELECT `+slotCols("s")+` FROM slots s
		WHERE s.scope = $1 AND (s.holder <> '' OR s.n < COALESCE((SELECT z.size FROM slot_scopes z WHERE z.scope = $1), 0))
		ORDER BY s.n`, scope))
}

// maxClaimScopes bounds ClaimSlots: a run needs a pool's slot and a tenant's.
const maxClaimScopes = 8

// pickSlot is the sub-select of ClaimSlot for the scope in parameter p: the lowest
// claimable slot, locked (PostgreSQL: skipping the rows others lock).
func (s *Store) pickSlot(p string) string {
	size := `(SELECT z.size FROM slot_scopes z WHERE z.scope = ` + p + `)`
	return `SELECT s.scope, s.n FROM slots s
		WHERE s.scope = ` + p + ` AND s.n < ` + size + `
		AND (s.holder = '' OR s.expires_ms <= $3)
		AND NOT EXISTS (SELECT 1 FROM slots o WHERE o.scope = ` + p + `
			AND o.n >= ` + size + ` AND o.n % NULLIF(` + size + `, 0) = s.n
			AND o.holder <> '' AND o.expires_ms > $3)
		ORDER BY s.n LIMIT 1` + s.dl.SkipLocked
}

// ClaimSlots implements store.SlotsMulti in one statement: one locked pick per scope
// (materialized CTEs), and the UPDATE only if every pick found a slot.
func (s *Store) ClaimSlots(ctx context.Context, scopes []string, holder string, ttl time.Duration) ([]store.Slot, bool, error) {
	if holder == "" || len(scopes) == 0 || len(scopes) > maxClaimScopes {
		return nil, false, invalid("claim slots needs a holder and 1 to %d scopes", maxClaimScopes)
	}
	seen := map[string]bool{}
	for _, sc := range scopes {
		if sc == "" || seen[sc] {
			return nil, false, invalid("claim slots: scope %q empty or repeated", sc)
		}
		seen[sc] = true
	}
	now := s.nowMs()
	args := []any{holder, now + ttlMs(ttl), now}
	var ctes, union []string
	for i, sc := range scopes {
		args = append(args, sc)
		p := fmt.Sprintf("p%d", i)
		ctes = append(ctes, p+` AS MATERIALIZED (`+s.pickSlot(fmt.Sprintf("$%d", len(args)))+`)`)
		union = append(union, `SELECT scope, n FROM `+p)
	}
	got, err := scanSlots(s.d.Write(ctx, `WITH `+strings.Join(ctes, ", ")+`,
		pick AS MATERIALIZED (`+strings.Join(union, " UNION ALL ")+`)
		UPDATE slots SET holder = $1, epoch = epoch + 1, expires_ms = $2
		WHERE (scope, n) IN (SELECT scope, n FROM pick)
		AND (SELECT COUNT(*) FROM pick) = `+fmt.Sprint(len(scopes))+`
		AND (holder = '' OR expires_ms <= $3)
		RETURNING `+slotCols("slots"), args...))
	if err != nil {
		return nil, false, err
	}
	if len(got) != len(scopes) {
		if len(got) > 0 { // cannot happen (the picks are locked); never keep a part
			_, _ = s.ReleaseSlots(ctx, got)
		}
		return nil, false, nil
	}
	byScope := make(map[string]store.Slot, len(got))
	for _, sl := range got {
		byScope[sl.Scope] = sl
	}
	out := make([]store.Slot, len(scopes))
	for i, sc := range scopes {
		out[i] = byScope[sc]
	}
	return out, true, nil
}

// ReleaseSlots implements store.SlotsMulti in one statement.
func (s *Store) ReleaseSlots(ctx context.Context, slots []store.Slot) (int, error) {
	if len(slots) == 0 {
		return 0, nil
	}
	var (
		conds []string
		args  []any
	)
	for _, sl := range slots {
		if sl.Scope == "" || sl.Holder == "" {
			return 0, invalid("release slots needs a scope and a holder for each")
		}
		i := len(args)
		conds = append(conds, fmt.Sprintf("(scope = $%d AND n = $%d AND holder = $%d AND epoch = $%d)", i+1, i+2, i+3, i+4))
		args = append(args, sl.Scope, sl.N, sl.Holder, sl.Epoch)
	}
	n, err := s.d.Exec(ctx, `UPDATE slots SET holder = '', expires_ms = 0 WHERE `+strings.Join(conds, " OR "), args...)
	return int(n), err
}
