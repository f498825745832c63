package apikey_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"path/filepath"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/curfew-mesh/curfew/mesh/apikey"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtls"
	"github.com/curfew-mesh/curfew/mesh/store"
	"github.com/curfew-mesh/curfew/mesh/store/storetest"
)

// peerCtx returns ctx as a server sees a call from the mesh identity id: a verified
// client certificate issued by the mesh CA.
func peerCtx(ctx context.Context, t testing.TB, dir, id string) context.Context {
	t.Helper()
	ca, err := meshtls.EnsureCA(dir)
	if err != nil {
		t.Fatal(err)
	}
	if err := ca.Issue(dir, id, 0); err != nil {
		t.Fatal(err)
	}
	pair, err := tls.LoadX509KeyPair(filepath.Join(dir, id+".crt"), filepath.Join(dir, id+".key"))
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := x509.ParseCertificate(pair.Certificate[0])
	if err != nil {
		t.Fatal(err)
	}
	info := credentials.TLSInfo{State: tls.ConnectionState{VerifiedChains: [][]*x509.Certificate{{leaf, ca.Certificate()}}}}
	return peer.NewContext(ctx, &peer.Peer{AuthInfo: info})
}

func TestGuard(t *testing.T) {
	ctx := t.Context()
	st := openStore(t, "")
	k := makeKey(t, st, "acme", false)
	const api = "/curfew.orchestrator.v1.OrchestratorService/"
	g := &apikey.Guard{Keys: &apikey.Authenticator{Keys: st}, Methods: []string{api}, Peers: []string{meshtls.CLI, meshtls.Orchestrator}}
	withKey := func(ctx context.Context, key string) context.Context {
		return metadata.NewIncomingContext(ctx, metadata.Pairs("authorization", "Bearer "+key, md.Tenant, "globex"))
	}
	tlsDir := filepath.Join(t.TempDir(), "tls")
	cli := peerCtx(ctx, t, tlsDir, meshtls.CLI)
	toolrunner := peerCtx(ctx, t, tlsDir, meshtls.ToolRunner)

	for _, c := range []struct {
		name    string
		ctx     context.Context
		method  string
		claimed string
		want    string
		code    codes.Code
	}{
		{"key: its tenant, the forged header ignored", withKey(ctx, k.Secret), api + "GetRun", "globex", "acme", codes.OK},
		{"key from a mesh peer: still the key's tenant", withKey(cli, k.Secret), api + "GetRun", "globex", "acme", codes.OK},
		{"no key, external caller", ctx, api + "GetRun", md.DefaultTenant, "", codes.Unauthenticated},
		{"no key, forged header, external caller", metadata.NewIncomingContext(ctx, metadata.Pairs(md.Tenant, "acme")), api + "Run", "acme", "", codes.Unauthenticated},
		{"wrong key", withKey(ctx, k.Secret[:len(k.Secret)-2]+"AA"), api + "Run", "globex", "", codes.Unauthenticated},
		{"trusted peer names the tenant", cli, api + "CancelRun", "globex", "globex", codes.OK},
		{"untrusted mesh peer", toolrunner, api + "CancelRun", "globex", "", codes.Unauthenticated},
		{"unguarded method keeps the claim", ctx, "/grpc.health.v1.Health/Check", md.DefaultTenant, md.DefaultTenant, codes.OK},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, err := g.Tenant(c.ctx, c.method, c.claimed)
			if status.Code(err) != c.code || got != c.want {
				t.Fatalf("Tenant = %q, %v; want %q, %v", got, err, c.want, c.code)
			}
		})
	}

	// Limit is asked for the authenticated tenant, on both paths, and only for guarded
	// methods; its refusal is the call's.
	var asked []string
	g.Limit = func(tenant string) error {
		asked = append(asked, tenant)
		if tenant == "acme" {
			return status.Error(codes.ResourceExhausted, "acme is over its request rate")
		}
		return nil
	}
	if _, err := g.Tenant(withKey(ctx, k.Secret), api+"GetRun", "globex"); status.Code(err) != codes.ResourceExhausted {
		t.Errorf("a limited tenant's key: %v, want the limit's RESOURCE_EXHAUSTED", err)
	}
	if got, err := g.Tenant(cli, api+"GetRun", "globex"); err != nil || got != "globex" {
		t.Errorf("an unlimited peer's tenant: %q, %v", got, err)
	}
	if _, err := g.Tenant(ctx, "/grpc.health.v1.Health/Check", "acme"); err != nil {
		t.Errorf("an unguarded method was limited: %v", err)
	}
	if len(asked) != 2 || asked[0] != "acme" || asked[1] != "globex" {
		t.Errorf("Limit asked for %q, want the key's tenant then the peer's", asked)
	}
	g.Limit = nil

	// A server without a store refuses keys, and still trusts its peers.
	noStore := &apikey.Guard{Methods: []string{api}, Peers: []string{meshtls.CLI}}
	if _, err := noStore.Tenant(withKey(ctx, k.Secret), api+"Run", "globex"); status.Code(err) != codes.Unauthenticated {
		t.Errorf("no store, a key: %v, want UNAUTHENTICATED", err)
	}
	if got, err := noStore.Tenant(cli, api+"Run", "globex"); err != nil || got != "globex" {
		t.Errorf("no store, the CLI: %q, %v", got, err)
	}
}

// BenchmarkGuardTenant is the cost a guarded call pays to learn its tenant: a bearer key
// checked against the store (one primary-key read and a SHA-256), SQLite and PostgreSQL
// (the test server, skipped when it is unreachable), and, for comparison, a mesh peer
// naming its tenant (a certificate already verified).
func BenchmarkGuardTenant(b *testing.B) {
	const api = "/curfew.orchestrator.v1.OrchestratorService/"
	run := func(b *testing.B, g *apikey.Guard, ctx context.Context) {
		b.Helper()
		for b.Loop() {
			if t, err := g.Tenant(ctx, api+"GetRun", "acme"); err != nil || t != "acme" {
				b.Fatal(t, err)
			}
		}
	}
	keyed := func(b *testing.B, dsn string) {
		st := openStore(b, dsn)
		k := makeKey(b, st, "acme", false)
		g := &apikey.Guard{Keys: &apikey.Authenticator{Keys: st}, Methods: []string{api}}
		run(b, g, metadata.NewIncomingContext(b.Context(), metadata.Pairs("authorization", "Bearer "+k.Secret)))
	}
	b.Run("api-key-sqlite", func(b *testing.B) { keyed(b, "") })
	b.Run("api-key-postgres", func(b *testing.B) { keyed(b, storetest.PostgresDSN(b)) })
	b.Run("mesh-peer", func(b *testing.B) {
		g := &apikey.Guard{Methods: []string{api}, Peers: []string{meshtls.CLI}}
		run(b, g, peerCtx(metadata.NewIncomingContext(b.Context(), metadata.Pairs(md.Tenant, "acme")), b, filepath.Join(b.TempDir(), "tls"), meshtls.CLI))
	})
}

// An operator's key acts for the tenant it names only when the guard allows it: an admin
// key on every method, a read-only key on the read-only ones; a plain key never.
func TestGuardOperatorKeys(t *testing.T) {
	ctx := t.Context()
	st := openStore(t, "")
	scoped := func(tenant string, scopes ...string) apikey.Key {
		k, err := apikey.New(tenant)
		if err != nil {
			t.Fatal(err)
		}
		k.Record.Scopes = scopes
		if _, _, err := st.CreateAPIKey(ctx, k.Record, false); err != nil {
			t.Fatal(err)
		}
		return k
	}
	admin, reader, plain := scoped("ops", store.ScopeAdmin), scoped("ops", store.ScopeReadOnly), scoped("acme")
	const api = "/curfew.orchestrator.v1.OrchestratorService/"
	g := &apikey.Guard{Keys: &apikey.Authenticator{Keys: st}, Methods: []string{api}, OperatorTenants: true,
		ReadOnly: func(m string) bool { return m == api+"GetRun" }}
	naming := func(key, tenant string) context.Context {
		return metadata.NewIncomingContext(ctx, metadata.Pairs("authorization", "Bearer "+key, md.Tenant, tenant))
	}
	for _, c := range []struct {
		name   string
		key    string
		method string
		want   string
	}{
		{"admin key, any method", admin.Secret, api + "CancelRun", "globex"},
		{"read-only key, a read", reader.Secret, api + "GetRun", "globex"},
		{"read-only key, a change: its own tenant", reader.Secret, api + "CancelRun", "ops"},
		{"tenant key: its own tenant", plain.Secret, api + "GetRun", "acme"},
	} {
		if got, err := g.Tenant(naming(c.key, "globex"), c.method, "globex"); err != nil || got != c.want {
			t.Errorf("%s: %q, %v; want %q", c.name, got, err, c.want)
		}
	}
	g.OperatorTenants = false
	if got, err := g.Tenant(naming(admin.Secret, "globex"), api+"CancelRun", "globex"); err != nil || got != "ops" {
		t.Errorf("admin key without OperatorTenants: %q, %v; want its own tenant", got, err)
	}
}
