package chaos

import (
	"context"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/curfew-mesh/curfew/mesh/md"
)

// Switch names.
const (
	Orphan        = "orphan"
	DropCancel    = "drop-cancel"
	SlowHeartbeat = "slow-heartbeat"
	NoRetryID     = "no-retry-id"
	WorkerLedger  = "worker-ledger"
	NoDedupe      = "no-dedupe"
)

// Settings are the switches of one request. The zero value is no chaos.
type Settings struct {
	Orphan, DropCancel, NoRetryID, WorkerLedger, NoDedupe bool
	// SlowHeartbeat, when > 0, is the fixed renewal period of the run's decoder leases.
	SlowHeartbeat time.Duration
}

// Parse reads a curfew-chaos value: switches separated by commas, spaces ignored. An
// unknown switch or a bad duration is an error; "" is no chaos.
func Parse(v string) (Settings, error) {
	var s Settings
	for _, f := range strings.Split(v, ",") {
		f = strings.TrimSpace(f)
		name, arg, hasArg := strings.Cut(f, "=")
		switch {
		case f == "":
		case name == SlowHeartbeat && hasArg:
			d, err := time.ParseDuration(arg)
			if err != nil || d <= 0 {
				return Settings{}, fmt.Errorf("chaos: %s=%q: want a positive duration", SlowHeartbeat, arg)
			}
			s.SlowHeartbeat = d
		case hasArg:
			return Settings{}, fmt.Errorf("chaos: %q takes no value", name)
		case name == Orphan:
			s.Orphan = true
		case name == DropCancel:
			s.DropCancel = true
		case name == NoRetryID:
			s.NoRetryID = true
		case name == WorkerLedger:
			s.WorkerLedger = true
		case name == NoDedupe:
			s.NoDedupe = true
		default:
			return Settings{}, fmt.Errorf("chaos: unknown switch %q (want %s, %s, %s=DUR, %s, %s or %s)",
				name, Orphan, DropCancel, SlowHeartbeat, NoRetryID, WorkerLedger, NoDedupe)
		}
	}
	return s, nil
}

// String is the header value of s ("" for no chaos).
func (s Settings) String() string {
	var out []string
	add := func(on bool, name string) {
		if on {
			out = append(out, name)
		}
	}
	add(s.Orphan, Orphan)
	add(s.DropCancel, DropCancel)
	if s.SlowHeartbeat > 0 {
		out = append(out, SlowHeartbeat+"="+s.SlowHeartbeat.String())
	}
	add(s.NoRetryID, NoRetryID)
	add(s.WorkerLedger, WorkerLedger)
	add(s.NoDedupe, NoDedupe)
	return strings.Join(out, ",")
}

// Any reports whether any switch is on.
func (s Settings) Any() bool { return s != Settings{} }

// From returns the settings of the request ctx serves: its identity's Chaos, which the
// server chain has cleared unless the service runs with --chaos. A value that does not
// parse counts as no chaos (Parse tells why).
func From(ctx context.Context) Settings {
	v := md.IdentityFrom(ctx).Chaos
	if v == "" {
		return Settings{}
	}
	s, err := Parse(v)
	if err != nil {
		return Settings{}
	}
	return s
}

// Worker names this process as a worker: what the worker-ledger fault keys tokens by.
func Worker() string {
	h, _ := os.Hostname()
	return fmt.Sprintf("worker:%s:%d", h, os.Getpid())
}
