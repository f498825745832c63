package storetest

import (
	"bytes"
	"errors"
	"sync/atomic"
	"time"

	"github.com/curfew-mesh/curfew/mesh/store"
)

func (e *env) addKey(id, tenant string, rotate bool) (store.APIKey, int64) {
	e.t.Helper()
	k, n, err := e.s.CreateAPIKey(e.ctx, store.APIKey{ID: id, Tenant: tenant, Hash: []byte("hash-of-" + id)}, rotate)
	if err != nil {
		e.t.Fatalf("create key %s: %v", id, err)
	}
	return k, n
}

var apiKeyTests = map[string]func(*env){
	"CreateGetList": func(e *env) {
		k, n := e.addKey("k1", tenantA, false)
		if n != 0 || k.ID != "k1" || k.Tenant != tenantA || !bytes.Equal(k.Hash, []byte("hash-of-k1")) ||
			!k.CreatedAt.Equal(e.clock.Now()) || k.Revoked() {
			e.t.Fatalf("created %+v (revoked %d)", k, n)
		}
		e.clock.Advance(time.Second)
		e.addKey("k2", tenantA, false)
		e.addKey("k3", tenantB, false)
		got, err := e.s.GetAPIKey(e.ctx, "k1")
		if err != nil || got.Tenant != tenantA || !bytes.Equal(got.Hash, k.Hash) {
			e.t.Fatalf("get k1: %+v, %v", got, err)
		}
		// Another replica sees them.
		if got, err := e.open().GetAPIKey(e.ctx, "k3"); err != nil || got.Tenant != tenantB {
			e.t.Fatalf("get k3 from another store: %+v, %v", got, err)
		}
		a, err := e.s.ListAPIKeys(e.ctx, tenantA)
		if err != nil || len(a) != 2 || a[0].ID != "k1" || a[1].ID != "k2" {
			e.t.Fatalf("list %s: %+v, %v", tenantA, a, err)
		}
		all, err := e.s.ListAPIKeys(e.ctx, "")
		if err != nil || len(all) != 3 {
			e.t.Fatalf("list all: %d keys, %v", len(all), err)
		}
		if none, err := e.s.ListAPIKeys(e.ctx, "nobody"); err != nil || len(none) != 0 {
			e.t.Fatalf("list of a tenant without keys: %+v, %v", none, err)
		}
	},
	"NotFoundAndInvalid": func(e *env) {
		if _, err := e.s.GetAPIKey(e.ctx, "missing"); !errors.Is(err, store.ErrNotFound) {
			e.t.Fatalf("get missing: %v, want ErrNotFound", err)
		}
		if _, err := e.s.RevokeAPIKey(e.ctx, "missing"); !errors.Is(err, store.ErrNotFound) {
			e.t.Fatalf("revoke missing: %v, want ErrNotFound", err)
		}
		for _, k := range []store.APIKey{{Tenant: tenantA, Hash: []byte("h")}, {ID: "x", Hash: []byte("h")}, {ID: "x", Tenant: tenantA}} {
			if _, _, err := e.s.CreateAPIKey(e.ctx, k, false); !errors.Is(err, store.ErrInvalidArgument) {
				e.t.Fatalf("create %+v: %v, want ErrInvalidArgument", k, err)
			}
		}
	},
	"DuplicateIDRefused": func(e *env) {
		e.addKey("dup", tenantA, false)
		_, _, err := e.s.CreateAPIKey(e.ctx, store.APIKey{ID: "dup", Tenant: tenantB, Hash: []byte("other")}, false)
		if !errors.Is(err, store.ErrAlreadyExists) {
			e.t.Fatalf("second key with the same id: %v, want ErrAlreadyExists", err)
		}
		if k, _ := e.s.GetAPIKey(e.ctx, "dup"); k.Tenant != tenantA || string(k.Hash) != "hash-of-dup" {
			e.t.Fatalf("the first key changed: %+v", k)
		}
	},
	"RotateRevokesTheTenantsOtherKeysOnly": func(e *env) {
		e.addKey("a1", tenantA, false)
		e.addKey("a2", tenantA, false)
		e.addKey("b1", tenantB, false)
		e.clock.Advance(time.Minute)
		k, n := e.addKey("a3", tenantA, true)
		if n != 2 || k.Revoked() {
			e.t.Fatalf("rotation revoked %d keys (new key %+v), want 2", n, k)
		}
		for id, want := range map[string]bool{"a1": true, "a2": true, "a3": false, "b1": false} {
			got, err := e.s.GetAPIKey(e.ctx, id)
			if err != nil || got.Revoked() != want {
				e.t.Errorf("%s revoked %v (%v), want %v", id, got.Revoked(), err, want)
			}
			if want && !got.RevokedAt.Equal(e.clock.Now()) {
				e.t.Errorf("%s revoked at %v, want the rotation's time %v", id, got.RevokedAt, e.clock.Now())
			}
		}
		// A second rotation revokes only the key still valid.
		if _, n := e.addKey("a4", tenantA, true); n != 1 {
			e.t.Fatalf("second rotation revoked %d, want 1", n)
		}
	},
	"RevokeKeepsTheFirstTime": func(e *env) {
		e.addKey("r", tenantA, false)
		k, err := e.s.RevokeAPIKey(e.ctx, "r")
		first := e.clock.Now()
		if err != nil || !k.RevokedAt.Equal(first) {
			e.t.Fatalf("revoke: %+v, %v", k, err)
		}
		e.clock.Advance(time.Hour)
		if k, err := e.s.RevokeAPIKey(e.ctx, "r"); err != nil || !k.RevokedAt.Equal(first) {
			e.t.Fatalf("second revoke: %+v, %v; want revoked at %v", k, err, first)
		}
	},
	"ConcurrentRotationsLeaveOneValidKey": func(e *env) {
		var failed atomic.Int64
		parallel(8, func(i int) {
			if _, _, err := e.s.CreateAPIKey(e.ctx, store.APIKey{ID: "c" + string(rune('0'+i)), Tenant: tenantA, Hash: []byte("h")}, true); err != nil {
				failed.Add(1)
			}
		})
		if failed.Load() != 0 {
			e.t.Fatalf("%d rotations failed", failed.Load())
		}
		keys, err := e.s.ListAPIKeys(e.ctx, tenantA)
		valid := 0
		for _, k := range keys {
			if !k.Revoked() {
				valid++
			}
		}
		if err != nil || len(keys) != 8 || valid != 1 {
			e.t.Fatalf("after 8 concurrent rotations: %d keys, %d valid (%v); want 8 and 1", len(keys), valid, err)
		}
	},
}
