package decoderlease_test

import (
	"strings"
	"testing"
	"time"

	"github.com/curfew-mesh/curfew/mesh/decoderlease"
)

// A reload (SetTiming) shortens the period of a lease already held, and every renewal
// from then on asks for the new TTL: seed 003's 'restore the heartbeat period' without a
// restart.
func TestKeeperSetTimingAppliesToHeldLeases(t *testing.T) {
	p := &proxy{}
	k := decoderlease.New(serve(t, p), decoderlease.Options{Period: time.Hour})
	l := k.Hold(callCtx(t, "", "r-st", 0), decoderlease.Key{RunID: "r-st", NodeID: "root/m0", RetryID: "rid-st"})
	defer l.Release()
	time.Sleep(100 * time.Millisecond)
	if n := len(p.renewals()); n != 0 {
		t.Fatalf("%d renewals under an hour's period", n)
	}
	if err := k.SetTiming(100*time.Millisecond, 0); err != nil {
		t.Fatal(err)
	}
	if o := k.Options(); o.Period != 100*time.Millisecond || o.TTL != 300*time.Millisecond {
		t.Fatalf("Options after SetTiming: %+v", o)
	}
	if got := k.TTLProto().AsDuration(); got != 300*time.Millisecond {
		t.Fatalf("TTLProto %v, want 300ms", got)
	}
	for end := time.Now().Add(10 * time.Second); len(p.renewals()) < 2; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatalf("%d renewals 10 s after the period became 100ms", len(p.renewals()))
		}
	}
	for _, r := range p.renewals() {
		if r.ttl != 300*time.Millisecond {
			t.Fatalf("renewal asked for TTL %v, want 300ms", r.ttl)
		}
	}
	if err := k.SetTiming(time.Millisecond, 0); err == nil {
		t.Fatal("SetTiming below the minimum tick succeeded")
	}
	if err := k.SetTiming(time.Second, 500*time.Millisecond); err == nil {
		t.Fatal("SetTiming with a TTL below the period succeeded")
	}
	if o := k.Options(); o.Period != 100*time.Millisecond {
		t.Fatalf("a refused SetTiming changed the period to %v", o.Period)
	}
}

func TestDecodeTiming(t *testing.T) {
	for _, tc := range []struct {
		in      string
		want    decoderlease.Timing
		wantErr string
	}{
		{in: `{}`, want: decoderlease.Timing{Heartbeat: 4 * time.Second, LeaseTTL: 12 * time.Second}},
		{in: `{"heartbeat": "1s"}`, want: decoderlease.Timing{Heartbeat: time.Second, LeaseTTL: 3 * time.Second}},
		{in: `{"heartbeat": "1s", "lease_ttl": "5s"}`, want: decoderlease.Timing{Heartbeat: time.Second, LeaseTTL: 5 * time.Second}},
		{in: `{"heartbeat": "1ms"}`, wantErr: "at least"},
		{in: `{"heartbeat": "2s", "lease_ttl": "1s"}`, wantErr: "lease_ttl"},
		{in: `{"heartbeat": 4}`, wantErr: "decoding"},
		{in: `{"beat": "4s"}`, wantErr: "unknown field"},
		{in: `{} {}`, wantErr: "after"},
	} {
		got, err := decoderlease.DecodeTiming([]byte(tc.in))
		if tc.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("%s: error %v, want one with %q", tc.in, err, tc.wantErr)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("%s: %+v, %v; want %+v", tc.in, got, err, tc.want)
		}
	}
}
