package sqlcore

import (
	"context"
	"errors"
	"strings"

	"github.com/curfew-mesh/curfew/mesh/store"
)

const keyCols = `id, tenant, hash, created_ms, revoked_ms, scopes`

func scanKey(r Row) (store.APIKey, error) {
	var (
		k                store.APIKey
		created, revoked int64
		scopes           string
	)
	if err := r.Scan(&k.ID, &k.Tenant, &k.Hash, &created, &revoked, &scopes); err != nil {
		return store.APIKey{}, err
	}
	if scopes != "" {
		k.Scopes = strings.Split(scopes, ",")
	}
	k.CreatedAt, k.RevokedAt = tm(created), tm(revoked)
	return k, nil
}

// CreateAPIKey implements store.APIKeys.
func (s *Store) CreateAPIKey(ctx context.Context, k store.APIKey, revokeOthers bool) (store.APIKey, int64, error) {
	if k.ID == "" || k.Tenant == "" || len(k.Hash) == 0 {
		return store.APIKey{}, 0, invalid("API key needs id, tenant and hash")
	}
	for _, sc := range k.Scopes {
		if sc != store.ScopeAdmin && sc != store.ScopeReadOnly {
			return store.APIKey{}, 0, invalid("API key scope %q is not %s or %s", sc, store.ScopeAdmin, store.ScopeReadOnly)
		}
	}
	var (
		out     store.APIKey
		revoked int64
	)
	err := s.d.Tx(ctx, func(q Querier) error {
		// Lock the tenant's row: a concurrent rotation waits here, and then sees this
		// transaction's key, which it revokes.
		if _, err := q.Exec(ctx, `INSERT INTO api_key_tenants (tenant) VALUES ($1)
			ON CONFLICT (tenant) DO UPDATE SET tenant = excluded.tenant`, k.Tenant); err != nil {
			return err
		}
		now := s.nowMs()
		var err error
		out, err = scanKey(q.QueryRow(ctx, `INSERT INTO api_keys (id, tenant, hash, created_ms, scopes) VALUES ($1, $2, $3, $4, $5)
			ON CONFLICT (id) DO NOTHING RETURNING `+keyCols, k.ID, k.Tenant, blob(k.Hash), now, strings.Join(k.Scopes, ",")))
		if errors.Is(err, ErrNoRows) {
			return store.ErrAlreadyExists
		}
		if err != nil || !revokeOthers {
			return err
		}
		revoked, err = q.Exec(ctx, `UPDATE api_keys SET revoked_ms = $1 WHERE tenant = $2 AND id <> $3 AND revoked_ms = 0`,
			now, k.Tenant, k.ID)
		return err
	})
	if err != nil {
		return store.APIKey{}, 0, err
	}
	return out, revoked, nil
}

// GetAPIKey implements store.APIKeys.
func (s *Store) GetAPIKey(ctx context.Context, id string) (store.APIKey, error) {
	k, err := scanKey(s.d.Read().QueryRow(ctx, `SELECT `+keyCols+` FROM api_keys WHERE id = $1`, id))
	if err != nil {
		return store.APIKey{}, notFound(err, "API key %s", id)
	}
	return k, nil
}

// RevokeAPIKey implements store.APIKeys.
func (s *Store) RevokeAPIKey(ctx context.Context, id string) (store.APIKey, error) {
	if _, err := s.d.Exec(ctx, `UPDATE api_keys SET revoked_ms = $1 WHERE id = $2 AND revoked_ms = 0`, s.nowMs(), id); err != nil {
		return store.APIKey{}, err
	}
	return s.GetAPIKey(ctx, id)
}

// ListAPIKeys implements store.APIKeys.
func (s *Store) ListAPIKeys(ctx context.Context, tenant string) ([]store.APIKey, error) {
	rows, err := s.d.Read().Query(ctx, `SELECT `+keyCols+` FROM api_keys WHERE ($1 = '' OR tenant = $1)
		ORDER BY tenant, created_ms, id`, tenant)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []store.APIKey
	for rows.Next() {
		k, err := scanKey(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, k)
	}
	return out, rows.Err()
}
