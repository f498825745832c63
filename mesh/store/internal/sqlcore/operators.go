package sqlcore

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/curfew-mesh/curfew/mesh/store"
)

const controlCols = `kind, target, tenant, reason, actor, created_ms, until_ms`

func scanControl(r Row) (store.Control, error) {
	var (
		c              store.Control
		kind           string
		created, until int64
	)
	if err := r.Scan(&kind, &c.Target, &c.Tenant, &c.Reason, &c.Actor, &created, &until); err != nil {
		return store.Control{}, err
	}
	c.Kind, c.CreatedAt, c.Until = store.ControlKind(kind), tm(created), tm(until)
	return c, nil
}

// PutControl implements store.Operators.
func (s *Store) PutControl(ctx context.Context, c store.Control) (store.Control, bool, error) {
	if c.Kind == "" || c.Target == "" {
		return store.Control{}, false, invalid("control needs kind and target")
	}
	var (
		out     store.Control
		created bool
	)
	err := s.d.Tx(ctx, func(q Querier) error {
		var err error
		out, err = scanControl(q.QueryRow(ctx, `INSERT INTO operator_controls (`+controlCols+`)
			VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (kind, target) DO NOTHING RETURNING `+controlCols,
			string(c.Kind), c.Target, c.Tenant, c.Reason, c.Actor, s.nowMs(), ms(c.Until)))
		if err == nil {
			created = true
			return nil
		}
		if !errors.Is(err, ErrNoRows) {
			return err
		}
		out, err = scanControl(q.QueryRow(ctx, `UPDATE operator_controls SET reason = $3, until_ms = $4
			WHERE kind = $1 AND target = $2 RETURNING `+controlCols, string(c.Kind), c.Target, c.Reason, ms(c.Until)))
		return err
	})
	if err != nil {
		return store.Control{}, false, err
	}
	return out, created, nil
}

// DeleteControl implements store.Operators.
func (s *Store) DeleteControl(ctx context.Context, kind store.ControlKind, target string) (store.Control, bool, error) {
	c, err := scanControl(s.d.Read().QueryRow(ctx, `SELECT `+controlCols+` FROM operator_controls WHERE kind = $1 AND target = $2`,
		string(kind), target))
	if errors.Is(err, ErrNoRows) {
		return store.Control{}, false, nil
	}
	if err != nil {
		return store.Control{}, false, err
	}
	n, err := s.d.Exec(ctx, `DELETE FROM operator_controls WHERE kind = $1 AND target = $2`, string(kind), target)
	if err != nil {
		return store.Control{}, false, err
	}
	return c, n > 0, nil
}

// ListControls implements store.Operators.
func (s *Store) ListControls(ctx context.Context) ([]store.Control, error) {
	rows, err := s.d.Read().Query(ctx, `SELECT `+controlCols+` FROM operator_controls ORDER BY kind, target`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []store.Control
	for rows.Next() {
		c, err := scanControl(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, c)
	}
	return out, rows.Err()
}

const auditCols = `id, at_ms, actor, action, target, reason, request`

func scanAudit(r Row) (store.AuditEntry, error) {
	var (
		a  store.AuditEntry
		at int64
	)
	if err := r.Scan(&a.ID, &at, &a.Actor, &a.Action, &a.Target, &a.Reason, &a.Request); err != nil {
		return store.AuditEntry{}, err
	}
	a.At = tm(at)
	return a, nil
}

// AddAudit implements store.Operators.
func (s *Store) AddAudit(ctx context.Context, a store.AuditEntry) (store.AuditEntry, error) {
	if a.Actor == "" || a.Action == "" {
		return store.AuditEntry{}, invalid("audit entry needs actor and action")
	}
	var out store.AuditEntry
	err := s.d.Tx(ctx, func(q Querier) error {
		var err error
		out, err = scanAudit(q.QueryRow(ctx, `INSERT INTO audit_log (at_ms, actor, action, target, reason, request)
			VALUES ($1, $2, $3, $4, $5, $6) RETURNING `+auditCols, s.nowMs(), a.Actor, a.Action, a.Target, a.Reason, a.Request))
		return err
	})
	return out, err
}

// ListAudit implements store.Operators.
func (s *Store) ListAudit(ctx context.Context, q store.AuditQuery) ([]store.AuditEntry, string, error) {
	limit := pageLimit(q.Limit)
	var after int64
	if q.After != "" {
		v, err := strconv.ParseInt(q.After, 10, 64)
		if err != nil || v <= 0 {
			return nil, "", invalid("audit page token %q is not one ListAudit gave", q.After)
		}
		after = v
	}
	rows, err := s.d.Read().Query(ctx, `SELECT `+auditCols+` FROM audit_log
		WHERE at_ms >= $1 AND ($2 = 0 OR id < $2) ORDER BY id DESC LIMIT $3`, ms(q.Since), after, limit+1)
	if err != nil {
		return nil, "", err
	}
	defer rows.Close()
	var out []store.AuditEntry
	for rows.Next() {
		a, err := scanAudit(rows)
		if err != nil {
			return nil, "", err
		}
		out = append(out, a)
	}
	if err := rows.Err(); err != nil {
		return nil, "", err
	}
	next := ""
	if len(out) > limit {
		out = out[:limit]
		next = strconv.FormatInt(out[limit-1].ID, 10)
	}
	return out, next, nil
}

// AddSheds implements store.Operators.
func (s *Store) AddSheds(ctx context.Context, tenant string, at time.Time, n int64) error {
	if tenant == "" || n <= 0 {
		return invalid("sheds need a tenant and a positive count")
	}
	if at.IsZero() {
		at = s.now()
	}
	minute := at.Truncate(time.Minute).UnixMilli()
	_, err := s.d.Exec(ctx, `INSERT INTO tenant_sheds (tenant, minute_ms, sheds) VALUES ($1, $2, $3)
		ON CONFLICT (tenant, minute_ms) DO UPDATE SET sheds = tenant_sheds.sheds + excluded.sheds`, tenant, minute, n)
	return err
}

// TenantUsage implements store.Operators.
func (s *Store) TenantUsage(ctx context.Context, tenant string, since time.Time) ([]store.TenantUsage, error) {
	from := ms(since)
	byTenant := map[string]*store.TenantUsage{}
	get := func(t string) *store.TenantUsage {
		u, ok := byTenant[t]
		if !ok {
			u = &store.TenantUsage{Tenant: t}
			byTenant[t] = u
		}
		return u
	}
	read := s.d.Read()
	rows, err := read.Query(ctx, `SELECT tenant, kind, CAST(SUM(tokens) AS BIGINT) FROM token_ledger
		WHERE ($1 = '' OR tenant = $1) AND at_ms >= $2 GROUP BY tenant, kind`, tenant, from)
	if err != nil {
		return nil, err
	}
	for rows.Next() {
		var (
			t, kind string
			n       int64
		)
		if err := rows.Scan(&t, &kind, &n); err != nil {
			rows.Close()
			return nil, err
		}
		u := get(t)
		switch kind {
		case store.KindPrompt:
			u.Prompt += n
		case store.KindOrphan:
			u.Orphan += n
			u.Output += n
		default:
			u.Output += n
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, err
	}
	counts := []struct {
		sql string
		add func(u *store.TenantUsage, n int64)
	}{
		{`SELECT tenant, COUNT(*) FROM runs WHERE ($1 = '' OR tenant = $1) AND created_ms >= $2 GROUP BY tenant`,
			func(u *store.TenantUsage, n int64) { u.Runs += n }},
		{`SELECT tenant, CAST(SUM(sheds) AS BIGINT) FROM tenant_sheds WHERE ($1 = '' OR tenant = $1) AND minute_ms >= $2 GROUP BY tenant`,
			func(u *store.TenantUsage, n int64) { u.Sheds += n }},
	}
	minute := int64(0)
	if !since.IsZero() {
		minute = since.Truncate(time.Minute).UnixMilli()
	}
	for i, c := range counts {
		arg := from
		if i == 1 {
			arg = minute
		}
		rows, err := read.Query(ctx, c.sql, tenant, arg)
		if err != nil {
			return nil, err
		}
		for rows.Next() {
			var (
				t string
				n int64
			)
			if err := rows.Scan(&t, &n); err != nil {
				rows.Close()
				return nil, err
			}
			c.add(get(t), n)
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return nil, err
		}
	}
	out := make([]store.TenantUsage, 0, len(byTenant))
	for _, u := range byTenant {
		out = append(out, *u)
	}
	slices.SortFunc(out, func(a, b store.TenantUsage) int { return strings.Compare(a.Tenant, b.Tenant) })
	return out, nil
}

// SumTokens implements store.Operators.
func (s *Store) SumTokens(ctx context.Context, q store.TokenQuery) (int64, error) {
	var n int64
	err := s.d.Read().QueryRow(ctx, `SELECT CAST(COALESCE(SUM(tokens), 0) AS BIGINT) FROM token_ledger
		WHERE ($1 = '' OR tenant = $1) AND ($2 = '' OR run_id = $2)
		AND (($3 = '' AND kind <> $4) OR kind = $3) AND at_ms > $5`,
		q.Tenant, q.RunID, q.Kind, store.KindPrompt, ms(q.Since)).Scan(&n)
	return n, err
}
