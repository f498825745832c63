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

// outageKeys is a real key store that is out of reach while down (the error a
// PostgreSQL store returns while the server restarts), or answers with a plain error
// while broken.
type outageKeys struct {
	store.APIKeys
	down, broken atomic.Bool
}

func (o *outageKeys) GetAPIKey(ctx context.Context, id string) (store.APIKey, error) {
	switch {
	case o.down.Load():
		return store.APIKey{}, fmt.Errorf("%w: dial tcp 127.0.0.1:5432: connect: connection refused", store.ErrUnavailable)
	case o.broken.Load():
		return store.APIKey{}, errors.New("store: disk I/O error")
	}
	return o.APIKeys.GetAPIKey(ctx, id)
}

// While the store is out of reach, a key the store verified at most StaleFor ago is
// checked against that record: its tenant goes on working, a wrong secret is still
// refused, and a key not verified lately, a record too old, or a store that answered
// with an error is UNAVAILABLE as before.
func TestAuthenticatorThroughAStoreOutage(t *testing.T) {
	st := openStore(t, "")
	keys := &outageKeys{APIKeys: st}
	acme, globex := makeKey(t, st, "acme", false), makeKey(t, st, "globex", false)
	now := time.Now()
	a := &apikey.Authenticator{Keys: keys}
	a.SetClock(func() time.Time { return now })
	call := func(key string) (string, error) {
		return a.Tenant(metadata.NewIncomingContext(t.Context(), metadata.Pairs("authorization", "Bearer "+key)))
	}
	if tenant, err := call(acme.Secret); err != nil || tenant != "acme" {
		t.Fatalf("acme's key with the store up: %q, %v", tenant, err)
	}

	keys.down.Store(true)
	now = now.Add(apikey.DefaultStaleFor - time.Second)
	if tenant, err := call(acme.Secret); err != nil || tenant != "acme" {
		t.Errorf("acme's key, verified %v ago, with the store down: %q, %v; want acme", apikey.DefaultStaleFor-time.Second, tenant, err)
	}
	id, _, _ := apikey.Parse(acme.Secret)
	forged, _ := apikey.New("acme")
	wrong := apikey.Prefix + id + forged.Secret[len(apikey.Prefix)+16:]
	if _, err := call(wrong); status.Code(err) != codes.Unauthenticated {
		t.Errorf("acme's id with another secret, store down: %v, want UNAUTHENTICATED", err)
	}
	if _, err := call(globex.Secret); status.Code(err) != codes.Unavailable {
		t.Errorf("globex's key, never verified, store down: %v, want UNAVAILABLE", err)
	}
	now = now.Add(2 * time.Second) // acme's record is now older than StaleFor
	if _, err := call(acme.Secret); status.Code(err) != codes.Unavailable {
		t.Errorf("acme's key, verified over %v ago, store down: %v, want UNAVAILABLE", apikey.DefaultStaleFor, err)
	}

	// Verified again once the store is back; a store that answers with an error is not
	// an outage, and a negative StaleFor turns the fallback off.
	keys.down.Store(false)
	if _, err := call(acme.Secret); err != nil {
		t.Fatalf("acme's key, store back: %v", err)
	}
	keys.broken.Store(true)
	if _, err := call(acme.Secret); status.Code(err) != codes.Unavailable {
		t.Errorf("acme's key, store answering an error: %v, want UNAVAILABLE", err)
	}
	keys.broken.Store(false)

	// A key the store says is revoked is not honoured by a later outage.
	if _, err := call(globex.Secret); err != nil {
		t.Fatal(err)
	}
	gid, _, _ := apikey.Parse(globex.Secret)
	if _, err := st.RevokeAPIKey(t.Context(), gid); err != nil {
		t.Fatal(err)
	}
	if _, err := call(globex.Secret); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("globex's revoked key, store up: %v, want UNAUTHENTICATED", err)
	}
	keys.down.Store(true)
	if _, err := call(globex.Secret); status.Code(err) != codes.Unavailable {
		t.Errorf("globex's key revoked before the outage, store down: %v, want UNAVAILABLE", err)
	}
	keys.down.Store(false)

	off := &apikey.Authenticator{Keys: keys, StaleFor: -1}
	offCall := func(key string) error {
		_, err := off.Tenant(metadata.NewIncomingContext(t.Context(), metadata.Pairs("authorization", "Bearer "+key)))
		return err
	}
	if err := offCall(acme.Secret); err != nil {
		t.Fatal(err)
	}
	keys.down.Store(true)
	if err := offCall(acme.Secret); status.Code(err) != codes.Unavailable {
		t.Errorf("StaleFor -1, store down: %v, want UNAVAILABLE", err)
	}
}
