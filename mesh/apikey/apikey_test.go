package apikey_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/curfew-mesh/curfew/mesh/apikey"
	"github.com/curfew-mesh/curfew/mesh/store"
)

func TestNewAndParse(t *testing.T) {
	k, err := apikey.New("acme")
	if err != nil {
		t.Fatal(err)
	}
	id, secret, err := apikey.Parse(k.Secret)
	if err != nil || id != k.Record.ID || len(id) != 16 || len(secret) != 43 {
		t.Fatalf("Parse(%q) = %q, %q, %v", k.Secret, id, secret, err)
	}
	if k.Record.Tenant != "acme" || len(k.Record.Hash) != 32 || strings.Contains(string(k.Record.Hash), secret) {
		t.Fatalf("record %+v", k.Record)
	}
	if apikey.ID(k.Secret) != id {
		t.Errorf("ID = %q, want %q", apikey.ID(k.Secret), id)
	}
	k2, _ := apikey.New("acme")
	if k2.Record.ID == k.Record.ID || k2.Secret == k.Secret {
		t.Error("two keys are the same")
	}
	if _, err := apikey.New(""); err == nil {
		t.Error("a key without a tenant was made")
	}
	for _, bad := range []string{"", "cfk_", k.Secret[4:], "xyz_" + k.Secret[4:], k.Secret + "x", k.Secret[:len(k.Secret)-1],
		strings.Replace(k.Secret, "_", "-", 2), "cfk_" + strings.ToUpper(id) + k.Secret[20:], k.Secret[:25] + "!" + k.Secret[26:]} {
		if _, _, err := apikey.Parse(bad); err == nil {
			t.Errorf("Parse(%q) accepted a malformed key", bad)
		}
	}
}

func TestAuthenticator(t *testing.T) {
	ctx := t.Context()
	st := openStore(t, "")
	mk := func(tenant string, rotate bool) apikey.Key { return makeKey(t, st, tenant, rotate) }
	acme, other := mk("acme", false), mk("globex", false)
	a := &apikey.Authenticator{Keys: st}
	call := func(vals ...string) (string, error) {
		md := metadata.MD{}
		for _, v := range vals {
			md.Append("authorization", v)
		}
		return a.Tenant(metadata.NewIncomingContext(ctx, md))
	}
	if tenant, err := call("Bearer " + acme.Secret); err != nil || tenant != "acme" {
		t.Fatalf("acme's key: %q, %v", tenant, err)
	}
	if tenant, err := call("bearer " + other.Secret); err != nil || tenant != "globex" {
		t.Fatalf("globex's key (lowercase scheme): %q, %v", tenant, err)
	}

	id, _, _ := apikey.Parse(acme.Secret)
	forged, _ := apikey.New("acme")
	wrongSecret := apikey.Prefix + id + forged.Secret[len(apikey.Prefix)+16:] // acme's id, another secret
	unknown, _ := apikey.New("acme")                                          // never stored

	rotated := mk("acme", true) // revokes acme's first key
	if tenant, err := call("Bearer " + rotated.Secret); err != nil || tenant != "acme" {
		t.Fatalf("the rotated key: %q, %v", tenant, err)
	}
	var msgs []string
	for name, vals := range map[string][]string{
		"no header":      nil,
		"basic":          {"Basic " + acme.Secret},
		"no scheme":      {acme.Secret},
		"malformed":      {"Bearer cfk_nope"},
		"unknown":        {"Bearer " + unknown.Secret},
		"wrong secret":   {"Bearer " + wrongSecret},
		"revoked":        {"Bearer " + acme.Secret},
		"two headers":    {"Bearer " + rotated.Secret, "Bearer " + other.Secret},
		"empty key":      {"Bearer "},
		"other key type": {"Bearer sk-abc"},
	} {
		tenant, err := call(vals...)
		if status.Code(err) != codes.Unauthenticated || tenant != "" {
			t.Errorf("%s: %q, %v; want UNAUTHENTICATED", name, tenant, err)
			continue
		}
		if strings.Contains(err.Error(), acme.Secret) || strings.Contains(err.Error(), rotated.Secret) {
			t.Errorf("%s: the error %q holds key material", name, err)
		}
		switch name {
		case "unknown", "wrong secret", "revoked", "malformed":
			msgs = append(msgs, status.Convert(err).Message())
		}
	}
	for _, m := range msgs[1:] {
		if m != msgs[0] {
			t.Errorf("refusals differ (%q vs %q): a caller could tell an unknown key from a revoked one", m, msgs[0])
		}
	}
	_ = st.Close()
	if _, err := call("Bearer " + rotated.Secret); status.Code(err) != codes.Unavailable {
		t.Errorf("with the store closed: %v, want UNAVAILABLE", err)
	}
}

func TestRedact(t *testing.T) {
	k, _ := apikey.New("acme")
	id := apikey.ID(k.Secret)
	in := "call failed: authorization: Bearer " + k.Secret + " (and again " + k.Secret + "); cfk_ alone; cfk_short"
	out := apikey.Redact(in)
	_, secret, _ := apikey.Parse(k.Secret)
	if strings.Contains(out, secret) {
		t.Fatalf("Redact left the secret: %q", out)
	}
	if strings.Count(out, "cfk_"+id+"_[REDACTED]") != 2 || !strings.HasSuffix(out, "cfk_ alone; cfk_short") {
		t.Errorf("Redact = %q", out)
	}
	if got := apikey.Redact("nothing here"); got != "nothing here" {
		t.Errorf("Redact changed text without a key: %q", got)
	}
}

// What Bearer sends is what Authenticator reads, over plaintext too.
func TestBearerRoundTrip(t *testing.T) {
	st := openStore(t, "")
	k := makeKey(t, st, "acme", false)
	creds := apikey.Bearer(k.Secret)
	if creds.RequireTransportSecurity() {
		t.Error("Bearer requires TLS; a plaintext (--insecure) mesh's callers could not send keys")
	}
	md, err := creds.GetRequestMetadata(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	tenant, err := (&apikey.Authenticator{Keys: st}).Tenant(metadata.NewIncomingContext(t.Context(), metadata.New(md)))
	if err != nil || tenant != "acme" {
		t.Fatalf("the key Bearer sends: %q, %v", tenant, err)
	}
}

// flaky is a key store that can be taken down: GetAPIKey then fails as a PostgreSQL out
// of reach does (store.ErrUnavailable); or broken: it answers with another error.
type flaky struct {
	store.APIKeys
	down, broken atomic.Bool
}

func (f *flaky) GetAPIKey(ctx context.Context, id string) (store.APIKey, error) {
	switch {
	case f.down.Load():
		return store.APIKey{}, fmt.Errorf("%w: connection refused", store.ErrUnavailable)
	case f.broken.Load(): // the store answers, with an error of its own
		return store.APIKey{}, errors.New("store: disk I/O error")
	}
	return f.APIKeys.GetAPIKey(ctx, id)
}

// While the store is unavailable, a key seen and verified recently is checked against
// its last record; a key not seen, a wrong secret, a key refused before the outage, a
// record older than StaleIfUnavailable, or a store that answered with an error is not
// taken.
func TestAuthenticatorThroughAStoreOutage(t *testing.T) {
	ctx := t.Context()
	st := openStore(t, "")
	keys := &flaky{APIKeys: st}
	seen, unseen, revoked := makeKey(t, st, "acme", false), makeKey(t, st, "acme", false), makeKey(t, st, "acme", false)
	a := &apikey.Authenticator{Keys: keys}
	tenantOf := func(a *apikey.Authenticator, key string) (string, error) {
		return a.Tenant(metadata.NewIncomingContext(ctx, metadata.Pairs("authorization", "Bearer "+key)))
	}
	for _, k := range []apikey.Key{seen, revoked} {
		if _, err := tenantOf(a, k.Secret); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := st.RevokeAPIKey(ctx, revoked.Record.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := tenantOf(a, revoked.Secret); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("the revoked key with the store up: %v, want UNAUTHENTICATED", err)
	}

	keys.down.Store(true)
	if tenant, err := tenantOf(a, seen.Secret); err != nil || tenant != "acme" {
		t.Errorf("a key verified before the outage: %q, %v; want acme", tenant, err)
	}
	if _, err := tenantOf(a, unseen.Secret); status.Code(err) != codes.Unavailable {
		t.Errorf("a key not seen before the outage: %v, want UNAVAILABLE", err)
	}
	if _, err := tenantOf(a, revoked.Secret); status.Code(err) != codes.Unavailable {
		t.Errorf("a key refused before the outage: %v, want UNAVAILABLE", err)
	}
	forged, _ := apikey.New("acme")
	wrong := apikey.Prefix + seen.Record.ID + forged.Secret[len(apikey.Prefix)+16:]
	if _, err := tenantOf(a, wrong); status.Code(err) != codes.Unauthenticated {
		t.Errorf("a seen key's id with another secret: %v, want UNAUTHENTICATED", err)
	}
	// A store that answers with an error is not an outage: no record stands in for it.
	keys.down.Store(false)
	keys.broken.Store(true)
	if _, err := tenantOf(a, seen.Secret); status.Code(err) != codes.Unavailable {
		t.Errorf("a seen key, the store answering an error: %v, want UNAVAILABLE", err)
	}
	keys.broken.Store(false)

	// The window: a record older than StaleIfUnavailable is not used; negative: never.
	for _, w := range []time.Duration{30 * time.Millisecond, -1} {
		keys.down.Store(false)
		b := &apikey.Authenticator{Keys: keys, StaleIfUnavailable: w}
		if _, err := tenantOf(b, seen.Secret); err != nil {
			t.Fatal(err)
		}
		keys.down.Store(true)
		time.Sleep(100 * time.Millisecond)
		if _, err := tenantOf(b, seen.Secret); status.Code(err) != codes.Unavailable {
			t.Errorf("StaleIfUnavailable %v, the record 100 ms old: %v, want UNAVAILABLE", w, err)
		}
	}
}
