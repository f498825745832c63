package apikey

import (
	"context"
	"log/slog"
	"slices"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtls"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// Guard decides which tenant a call to a public API acts for; its Tenant is the server
// chain's mesh.ServerConfig.Authenticate. The rules, in order:
//
//  1. A method outside Methods (health, reflection) keeps its claim: it reads no
//     tenant's data.
//  2. A call with `authorization: Bearer <key>` acts for the tenant of that key, verified
//     against the store; a curfew-tenant header beside it is ignored (and logged at
//     debug level), so a key of tenant A can never act for B. The one exception is an
//     operator's key, when OperatorTenants is set: a key with the admin scope acts for
//     the tenant its curfew-tenant header names on every guarded method, and a key with
//     the read-only scope on the methods ReadOnly reports (the web console's operators
//     see every tenant's runs; a CLI on the mesh's certificate can already).
//  3. A call without a key from a trusted mesh peer (an mTLS client certificate whose
//     identity is in Peers: another orchestrator forwarding a call, the curfew CLI) acts
//     for the tenant its curfew-tenant header names, md.DefaultTenant when none.
//  4. Anything else is UNAUTHENTICATED. That includes every caller of a plaintext
//     (--insecure) server, where no caller is a mesh peer: turning mTLS off does not turn
//     tenant authentication off.
type Guard struct {
	// Keys checks bearer keys; nil (a server without a store) refuses every key.
	Keys *Authenticator
	// Methods are the full-method prefixes ("/curfew.orchestrator.v1.OrchestratorService/")
	// the guard authenticates.
	Methods []string
	// Peers are the mesh identities (meshtls.Orchestrator, meshtls.CLI) trusted to name
	// the tenant they act for.
	Peers []string
	// Limit, when set, is asked once the tenant of a guarded call is known (after rules
	// 2 and 3): a non-nil error, a status, refuses the call (the orchestrator's per-tenant
	// request rate, admission.Controller.AllowRequest).
	Limit func(tenant string) error
	// OperatorTenants lets operators' keys name the tenant they act for (rule 2).
	OperatorTenants bool
	// ReadOnly reports the guarded methods that change nothing, which a read-only key
	// may call for another tenant; nil: none.
	ReadOnly func(fullMethod string) bool
	// Log receives forged-header notes at debug level; nil: slog.Default().
	Log *slog.Logger
}

// Tenant returns the tenant the call of ctx to fullMethod acts for, given the tenant its
// curfew-tenant header claims, or a status error (see Guard).
func (g *Guard) Tenant(ctx context.Context, fullMethod, claimed string) (string, error) {
	if !slices.ContainsFunc(g.Methods, func(p string) bool { return strings.HasPrefix(fullMethod, p) }) {
		return claimed, nil
	}
	if len(metadata.ValueFromIncomingContext(ctx, Header)) > 0 {
		if g.Keys == nil {
			return "", status.Error(codes.Unauthenticated, "this server keeps no API keys (it runs without a store); call it as a mesh peer")
		}
		k, err := g.Keys.Key(ctx)
		if err != nil {
			return "", err
		}
		if claimed != k.Tenant && len(metadata.ValueFromIncomingContext(ctx, md.Tenant)) > 0 {
			if g.operatorFor(k, fullMethod) {
				return g.limit(claimed)
			}
			g.log().DebugContext(ctx, "curfew-tenant header ignored: the API key names the tenant", "method", fullMethod, "tenant", k.Tenant)
		}
		return g.limit(k.Tenant)
	}
	if id, ok := meshtls.PeerIdentity(ctx); ok && slices.Contains(g.Peers, id) {
		return g.limit(claimed)
	}
	return "", status.Errorf(codes.Unauthenticated, "missing API key: send metadata authorization: Bearer <key> (curfew tenant create makes one)")
}

// operatorFor reports whether key k may act for another tenant on fullMethod (rule 2).
func (g *Guard) operatorFor(k store.APIKey, fullMethod string) bool {
	if !g.OperatorTenants {
		return false
	}
	return slices.Contains(k.Scopes, store.ScopeAdmin) ||
		(slices.Contains(k.Scopes, store.ScopeReadOnly) && g.ReadOnly != nil && g.ReadOnly(fullMethod))
}

func (g *Guard) limit(tenant string) (string, error) {
	if g.Limit != nil {
		if err := g.Limit(tenant); err != nil {
			return "", err
		}
	}
	return tenant, nil
}

func (g *Guard) log() *slog.Logger {
	if g.Log != nil {
		return g.Log
	}
	return slog.Default()
}
