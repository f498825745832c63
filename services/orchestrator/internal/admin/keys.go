package admin

import (
	"context"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	adminv1 "github.com/curfew-mesh/curfew/gen/curfew/admin/v1"
	"github.com/curfew-mesh/curfew/mesh/apikey"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/store"
)

var scopeNames = map[adminv1.Scope]string{
	adminv1.Scope_SCOPE_ADMIN:     store.ScopeAdmin,
	adminv1.Scope_SCOPE_READ_ONLY: store.ScopeReadOnly,
}

func keyProto(k store.APIKey) *adminv1.APIKey {
	out := &adminv1.APIKey{Id: k.ID, Tenant: k.Tenant, CreatedAt: timestamppb.New(k.CreatedAt)}
	if k.Revoked() {
		out.RevokedAt = timestamppb.New(k.RevokedAt)
	}
	for _, sc := range k.Scopes {
		for p, name := range scopeNames {
			if name == sc {
				out.Scopes = append(out.Scopes, p)
			}
		}
	}
	return out
}

// CreateKey implements adminv1.AdminServiceServer.
func (s *Server) CreateKey(ctx context.Context, req *adminv1.CreateKeyRequest) (*adminv1.CreateKeyResponse, error) {
	if req.GetTenant() == "" {
		return nil, must("tenant")
	}
	if !md.ValidTenant(req.GetTenant()) {
		return nil, invalid("tenant %q must be 1 to %d characters of A-Z a-z 0-9 . _ -", req.GetTenant(), md.MaxTenantLen)
	}
	var scopes []string
	for _, sc := range req.GetScopes() {
		name, ok := scopeNames[sc]
		if !ok {
			return nil, invalid("scopes: %v is not a scope (SCOPE_ADMIN or SCOPE_READ_ONLY)", sc)
		}
		scopes = append(scopes, name)
	}
	k, err := apikey.New(req.GetTenant())
	if err != nil {
		return nil, invalid("%v", err)
	}
	k.Record.Scopes = scopes
	rec, revoked, err := s.cfg.Store.CreateAPIKey(ctx, k.Record, req.GetRevokeOthers())
	if err != nil {
		return nil, storeErr(err)
	}
	action := "CreateKey"
	if req.GetRevokeOthers() {
		action = "RotateKey"
	}
	if err := s.audit(ctx, action, "tenant "+req.GetTenant(), req.GetReason(), req); err != nil {
		return nil, err
	}
	return &adminv1.CreateKeyResponse{Key: keyProto(rec), Secret: k.Secret, Revoked: revoked}, nil
}

// RevokeKey implements adminv1.AdminServiceServer.
func (s *Server) RevokeKey(ctx context.Context, req *adminv1.RevokeKeyRequest) (*adminv1.RevokeKeyResponse, error) {
	if req.GetId() == "" {
		return nil, must("id")
	}
	k, err := s.cfg.Store.RevokeAPIKey(ctx, req.GetId())
	if err != nil {
		return nil, storeErr(err)
	}
	if err := s.audit(ctx, "RevokeKey", "key "+k.ID+" of tenant "+k.Tenant, req.GetReason(), req); err != nil {
		return nil, err
	}
	return &adminv1.RevokeKeyResponse{Key: keyProto(k)}, nil
}

// ListKeys implements adminv1.AdminServiceServer.
func (s *Server) ListKeys(ctx context.Context, req *adminv1.ListKeysRequest) (*adminv1.ListKeysResponse, error) {
	ks, err := s.cfg.Store.ListAPIKeys(ctx, req.GetTenant())
	if err != nil {
		return nil, storeErr(err)
	}
	out := &adminv1.ListKeysResponse{}
	for _, k := range ks {
		out.Keys = append(out.Keys, keyProto(k))
	}
	return out, nil
}

// Usage implements adminv1.AdminServiceServer.
func (s *Server) Usage(ctx context.Context, req *adminv1.UsageRequest) (*adminv1.UsageResponse, error) {
	var since time.Time // zero: everything
	if req.Since != nil {
		since = req.GetSince().AsTime()
	}
	us, err := s.cfg.Store.TenantUsage(ctx, req.GetTenant(), since)
	if err != nil {
		return nil, storeErr(err)
	}
	out := &adminv1.UsageResponse{}
	for _, u := range us {
		out.Tenants = append(out.Tenants, &adminv1.TenantUsage{
			Tenant: u.Tenant, PromptTokens: u.Prompt, OutputTokens: u.Output, OrphanTokens: u.Orphan, Runs: u.Runs, Sheds: u.Sheds,
		})
	}
	return out, nil
}
